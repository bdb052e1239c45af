"""Auto-wrap planning: which submodules an ``auto_wrap_policy`` makes units, and their kwargs.

The policies themselves are public and live in :mod:`fsdp.wrap` (see its docstring for the two
kinds and how the walk asks a functional policy). This module runs them for the constructor,
without wrapping anything: :func:`policy_targets` returns the modules to wrap with the kwargs
each unit is built with, :func:`fsdp.init._validate.plan_units` checks every planned unit, and
only then does the constructor wrap, bottom-up. ``fsdp.plan`` (the memory planner) and the tests
call the same ``plan_units``, so there is one planner.

If ``root_kwargs["mixed_precision"]`` is set and lists ``_module_classes_to_ignore`` (by default
``_BatchNorm``), every instance of those classes also becomes its own unit with
``mixed_precision=None``, as in torch FSDP1; the constructor then registers the float32 forward
hooks on them (:func:`fsdp.runtime._mixed_precision.apply_mixed_precision_overrides`).
"""

from __future__ import annotations

import functools
import inspect
from typing import AbstractSet, Any, Callable, Dict, Optional, Tuple, Union

from torch import nn

from fsdp.runtime._state import is_fsdp
from fsdp.wrap import _is_class_wrap_decision, _module_name, _Policy

#: A functional policy: ``policy(module=..., recurse=..., nonwrapped_numel=...) -> bool``.
FunctionalPolicy = Callable[..., bool]
#: Anything the planner accepts as a policy.
AutoWrapPolicy = Union[FunctionalPolicy, _Policy]

# Keyword arguments a functional policy is called with by the planner.
_FUNCTIONAL_POLICY_PROBE: Dict[str, Any] = {"module": None, "recurse": True, "nonwrapped_numel": 0}
# Policies that need an extra argument bound with functools.partial, and that argument's name.
_POLICIES_NEEDING_BINDING: Dict[str, str] = {
    "transformer_auto_wrap_policy": "transformer_layer_cls",
    "lambda_auto_wrap_policy": "lambda_fn",
}


def _policy_function_name(policy: Any) -> Optional[str]:
    """Return the ``__name__`` of the function under any ``functools.partial`` layers."""
    func = policy
    while isinstance(func, functools.partial):
        func = func.func
    return getattr(func, "__name__", None)


def validate_auto_wrap_policy(policy: Any) -> None:
    """Check that :func:`policy_targets` can use ``policy``, before any work is done.

    Args:
        policy: The ``auto_wrap_policy`` argument.

    Raises:
        TypeError: If ``policy`` is neither a :class:`_Policy` nor a callable accepting
            ``(module=..., recurse=..., nonwrapped_numel=...)``; in particular if it is the bare
            ``transformer_auto_wrap_policy`` / ``lambda_auto_wrap_policy`` function (or a
            ``functools.partial`` of it) without its required argument bound, or a class.
    """
    if isinstance(policy, _Policy):
        return
    example = (
        "ModuleWrapPolicy({MyBlock}) or "
        "functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={MyBlock})"
    )
    if not callable(policy):
        raise TypeError(
            "auto_wrap_policy must be a ModuleWrapPolicy/CustomPolicy or a callable "
            "policy(module, recurse, nonwrapped_numel) -> bool, but got an object of type "
            f"{type(policy).__name__}. Pass e.g. {example}."
        )
    if isinstance(policy, type):
        suggestion = (
            f"ModuleWrapPolicy({{{policy.__name__}}})"
            if issubclass(policy, nn.Module)
            else "an instance of the policy"
        )
        raise TypeError(
            f"auto_wrap_policy must be a policy, but got the class {policy.__name__} itself; "
            f"did you mean {suggestion}? Pass e.g. {example}."
        )
    try:
        signature = inspect.signature(policy)
    except (TypeError, ValueError):  # builtins and some C callables have no signature
        return
    try:
        signature.bind(**_FUNCTIONAL_POLICY_PROBE)
    except TypeError as exc:
        name = _policy_function_name(policy)
        if name in _POLICIES_NEEDING_BINDING:
            arg = _POLICIES_NEEDING_BINDING[name]
            raise TypeError(
                f"{name} needs its {arg!r} argument bound before it can be used as "
                f"auto_wrap_policy: bind it with functools.partial, e.g. "
                f"functools.partial({name}, {arg}=...)"
                + (
                    " (or use ModuleWrapPolicy({MyBlock}))."
                    if arg == "transformer_layer_cls"
                    else "."
                )
            ) from None
        raise TypeError(
            "A functional auto_wrap_policy is called as policy(module=..., recurse=..., "
            f"nonwrapped_numel=...), but {policy!r} cannot accept those arguments ({exc}). "
            f"Bind any extra arguments with functools.partial, or pass e.g. {example}."
        ) from None


def check_no_existing_wrappers(root_module: nn.Module) -> None:
    """Raise if any module in ``root_module``'s tree is already an FSDP instance.

    Raises:
        ValueError: Naming the first such module (torch FSDP1's type for this mistake).
    """
    for name, module in root_module.named_modules():
        if is_fsdp(module):
            raise ValueError(
                "fsdp: FSDP auto wrapping requires modules to not already have FSDP applied "
                f"but found {_module_name(name)} in {type(root_module).__name__} (the module "
                "passed to FullyShardedDataParallel): it is already a FullyShardedDataParallel "
                "instance. Either wrap that subtree manually or use auto_wrap_policy, not both "
                "on the same subtree."
            )


def mixed_precision_classes(root_kwargs: Dict[str, Any]) -> Tuple[type, ...]:
    """Return the module classes mixed precision must skip (empty if mixed precision is off)."""
    mixed_precision = root_kwargs.get("mixed_precision")
    if mixed_precision is None:
        return ()
    classes = getattr(mixed_precision, "_module_classes_to_ignore", ()) or ()
    return tuple(dict.fromkeys(classes))


def full_precision_kwargs(
    module: nn.Module, kwargs: Dict[str, Any], classes: Tuple[type, ...]
) -> Dict[str, Any]:
    """``kwargs``, with ``mixed_precision=None`` if ``module`` is of a class mixed precision skips."""
    if classes and isinstance(module, classes):
        return {**kwargs, "mixed_precision": None}
    return kwargs


def add_full_precision_units(
    root_module: nn.Module,
    targets: Dict[nn.Module, Dict[str, Any]],
    classes: Tuple[type, ...],
    ignored_modules: AbstractSet[nn.Module],
    base_kwargs: Dict[str, Any],
) -> None:
    """Adds every (non-ignored) instance of ``classes`` to ``targets`` with ``mixed_precision=None``."""
    if not classes:
        return
    for module in root_module.modules():
        if module not in ignored_modules and isinstance(module, classes):
            targets[module] = full_precision_kwargs(module, targets.get(module, base_kwargs), classes)


def or_class_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    policy: FunctionalPolicy,
    classes: Tuple[type, ...],
) -> bool:
    """``policy`` OR "wrap every instance of ``classes``" (which always descends)."""
    return policy(
        module=module, recurse=recurse, nonwrapped_numel=nonwrapped_numel
    ) or _is_class_wrap_decision(module, recurse, classes)


def recursive_wrap(
    module: nn.Module,
    policy: FunctionalPolicy,
    wrap_one: Callable[[nn.Module], nn.Module],
    ignored_modules: AbstractSet[nn.Module],
    ignored_params: AbstractSet[nn.Parameter],
    memo: Dict[nn.Module, Tuple[nn.Module, int]],
    is_root: bool = False,
) -> Tuple[nn.Module, int]:
    """Apply a functional policy below ``module``; return ``(module or wrapper, numel wrapped)``.

    ``numel wrapped`` is the numel (excluding ``ignored_params``) now owned by wrappers in this
    subtree: all of the module's parameters if it was wrapped, else the sum over its children.
    """
    if module in memo:
        return memo[module]
    nonwrapped_numel = sum(p.numel() for p in module.parameters() if p not in ignored_params)
    result: Tuple[nn.Module, int] = (module, 0)
    if policy(module=module, recurse=True, nonwrapped_numel=nonwrapped_numel):
        wrapped_numel = 0
        for child_name, child in list(module.named_children()):
            if child is None or child in ignored_modules:
                continue
            new_child, child_wrapped_numel = recursive_wrap(
                child, policy, wrap_one, ignored_modules, ignored_params, memo
            )
            if new_child is not child:
                setattr(module, child_name, new_child)
            wrapped_numel += child_wrapped_numel
        remainder = nonwrapped_numel - wrapped_numel
        if not is_root and policy(module=module, recurse=False, nonwrapped_numel=remainder):
            result = (wrap_one(module), nonwrapped_numel)
        else:
            result = (module, wrapped_numel)
    memo[module] = result
    return result


def policy_targets(
    module: nn.Module,
    policy: Optional[Callable],
    root_kwargs: dict[str, Any],
    ignored_modules: set[nn.Module],
    ignored_params: set[nn.Parameter],
    include_root: bool = False,
) -> dict[nn.Module, dict[str, Any]]:
    """The modules ``policy`` picks (the root only with ``include_root``) with the kwargs each
    unit is built with.

    Nothing is wrapped or changed here: the constructor wraps the returned modules afterwards
    (:func:`fsdp.init._materialize.materialize_and_wrap`), bottom-up.

    Args:
        module: The module the root wrapper is built on.
        policy: The ``auto_wrap_policy`` (None: no nested units).
        root_kwargs: The root wrapper's keyword arguments, the default for every unit (each
            unit gets ``auto_wrap_policy=None`` so it never auto-wraps again).
        ignored_modules: Modules never wrapped nor descended into (closed under descendants).
        ignored_params: Parameters not counted in ``nonwrapped_numel``.
        include_root: Also return ``module`` itself (last) when a policy object picks it
            (torch FSDP1 checks frozen parameters on every module its policy object picks).

    Returns:
        ``{module: kwargs}`` for every nested unit (and the root, last, with ``include_root``).

    Raises:
        ValueError: A module in the tree is already an FSDP instance.
        TypeError: A policy object's ``_run_policy`` returned something other than a dict.
    """
    if policy is None:
        return {}
    check_no_existing_wrappers(module)
    child_kwargs = {**root_kwargs, "auto_wrap_policy": None}
    # Modules mixed precision skips (BatchNorm by default) become units of their own with
    # mixed_precision=None, as in torch FSDP1 (only under an auto-wrap policy).
    full_precision_classes = mixed_precision_classes(root_kwargs)
    if isinstance(policy, _Policy):
        picked = policy._run_policy(module, ignored_modules, dict(child_kwargs))
        if not isinstance(picked, dict):
            raise TypeError(
                f"{type(policy).__name__}._run_policy must return a dict mapping modules to "
                f"kwargs dicts, but returned an object of type {type(picked).__name__}."
            )
        add_full_precision_units(module, picked, full_precision_classes, ignored_modules, child_kwargs)
        # (Reversed: the root, which module.modules() lists first, comes last.)
        order = [m for m in module.modules() if m in picked and (m is not module or include_root)][::-1]
        return {m: {**picked[m], "auto_wrap_policy": None} for m in order}
    planned: dict[nn.Module, dict[str, Any]] = {}

    def record(m: nn.Module) -> nn.Module:
        kwargs = full_precision_kwargs(m, dict(child_kwargs), full_precision_classes)
        overrides = getattr(m, "_wrap_overrides", None)
        if isinstance(overrides, dict):  # honoured by functional policies, as torch FSDP1 does
            kwargs = {**kwargs, **overrides}
        planned[m] = kwargs
        return m  # returning the module itself leaves the tree unchanged

    if full_precision_classes:
        policy = functools.partial(or_class_policy, policy=policy, classes=full_precision_classes)
    recursive_wrap(module, policy, record, ignored_modules, ignored_params, {}, is_root=True)
    return planned
