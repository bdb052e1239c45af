"""Auto-wrap policies, the ``enable_wrap`` / ``wrap`` annotations and the auto-wrap driver.

A *wrap policy* decides which submodules of a model become their own sharded unit (their own
wrapper instance, and so their own flat parameter). Two kinds of policy are accepted, exactly
as in PyTorch FSDP1's wrap module:

* **Functional policies**: callables ``policy(module=..., recurse=..., nonwrapped_numel=...)``
  returning a bool. The driver walks the module tree depth-first. For every module it first asks
  ``policy(recurse=True)`` whether to descend into it; after the children have been handled it
  asks ``policy(recurse=False, nonwrapped_numel=remainder)`` whether to wrap the module itself,
  where ``remainder`` is the numel of the module's parameters not already owned by a wrapped
  descendant. :func:`always_wrap_policy`, :func:`size_based_auto_wrap_policy` and (bound with
  :func:`functools.partial`) :func:`lambda_auto_wrap_policy` and
  :func:`transformer_auto_wrap_policy` are functional policies.
* **Policy objects** (subclasses of :class:`_Policy`, i.e. :class:`ModuleWrapPolicy` and
  :class:`CustomPolicy`): they return, in one pass, a map from each module to wrap to the
  keyword arguments its wrapper is constructed with, so different units may be configured
  differently.

The driver, :func:`_auto_wrap`, is what the ``FullyShardedDataParallel`` constructor calls when it
is given ``auto_wrap_policy``. It wraps the chosen submodules bottom-up and in place, and leaves
the root module for the caller to wrap.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from abc import ABC, abstractmethod
from collections import deque
from typing import (
    AbstractSet,
    Any,
    Callable,
    Dict,
    Iterable,
    Iterator,
    List,
    Optional,
    Set,
    Tuple,
    Type,
    Union,
)

import torch
from torch import nn

__all__ = [
    "always_wrap_policy",
    "lambda_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "enable_wrap",
    "wrap",
    "CustomPolicy",
    "ModuleWrapPolicy",
]

#: A functional policy: ``policy(module=..., recurse=..., nonwrapped_numel=...) -> bool``.
FunctionalPolicy = Callable[..., bool]
#: Anything :func:`_auto_wrap` accepts as a policy.
AutoWrapPolicy = Union[FunctionalPolicy, "_Policy"]

# Keyword arguments a functional policy is called with by the driver.
_FUNCTIONAL_POLICY_PROBE: Dict[str, Any] = {"module": None, "recurse": True, "nonwrapped_numel": 0}
# Policies that need an extra argument bound with functools.partial, and that argument's name.
_POLICIES_NEEDING_BINDING: Dict[str, str] = {
    "transformer_auto_wrap_policy": "transformer_layer_cls",
    "lambda_auto_wrap_policy": "lambda_fn",
}
_ROOT_NAME = "<root>"


# ---------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------


def _as_class_tuple(classes: Any, arg_name: str) -> Tuple[type, ...]:
    """Return ``classes`` (an iterable of classes) as a tuple usable with ``isinstance``.

    Args:
        classes: The user-supplied collection of classes.
        arg_name: The argument's name, used in the error message.

    Returns:
        The classes as a tuple (duplicates removed).

    Raises:
        TypeError: If ``classes`` is a single class or not an iterable of classes.
    """
    if isinstance(classes, type):
        raise TypeError(
            f"{arg_name} must be a collection of module classes, but got the single class "
            f"{classes.__name__}; pass {{{classes.__name__}}} instead."
        )
    try:
        items = tuple(dict.fromkeys(classes))
    except TypeError:
        raise TypeError(
            f"{arg_name} must be a collection of module classes such as {{MyBlock}}, "
            f"but got an object of type {type(classes).__name__}."
        ) from None
    for item in items:
        if not isinstance(item, type):
            raise TypeError(
                f"{arg_name} must contain only classes, but it contains {item!r} "
                f"(of type {type(item).__name__})."
            )
    return items


def _module_name(name: str) -> str:
    """Return a printable qualified name (the root module's empty name becomes ``<root>``)."""
    return name if name else _ROOT_NAME


def _is_class_wrap_decision(module: nn.Module, recurse: bool, classes: Tuple[type, ...]) -> bool:
    """Shared logic of the class-based policies: always descend; wrap instances of ``classes``."""
    if recurse:
        return True
    return isinstance(module, classes)


# ---------------------------------------------------------------------------------------------
# Functional policies
# ---------------------------------------------------------------------------------------------


def always_wrap_policy(*args: Any, **kwargs: Any) -> bool:
    """Wrap every submodule.

    Always returns ``True``: the driver descends into every module and wraps every submodule
    (the root is wrapped by the caller), so each module becomes its own sharded unit.

    Args:
        *args: Ignored (``module``, ``recurse``, ``nonwrapped_numel`` positionally).
        **kwargs: Ignored (the same, by keyword).

    Returns:
        ``True``.
    """
    return True


def lambda_auto_wrap_policy(
    module: nn.Module, recurse: bool, nonwrapped_numel: int, lambda_fn: Callable[[nn.Module], bool]
) -> bool:
    """Wrap every module for which a user function returns a truthy value.

    Bind ``lambda_fn`` with :func:`functools.partial` before passing it as a policy, e.g.
    ``functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, MyBlock))``.

    Args:
        module: The module being considered.
        recurse: ``True`` while the driver decides whether to descend into ``module``; ``False``
            when it decides whether to wrap ``module`` itself.
        nonwrapped_numel: Numel of ``module``'s parameters not yet owned by a wrapped descendant
            (unused by this policy).
        lambda_fn: Called with ``module``; the module is wrapped if it returns a truthy value.

    Returns:
        ``True`` when ``recurse`` is ``True`` (always descend); otherwise ``lambda_fn(module)``.
    """
    if recurse:
        return True
    return lambda_fn(module)


def transformer_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    transformer_layer_cls: Set[Type[nn.Module]],
) -> bool:
    """Wrap every instance of the given (transformer block) classes.

    Bind ``transformer_layer_cls`` with :func:`functools.partial` before passing it as a policy,
    e.g. ``functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={MyBlock})``.
    Parameters outside every block (embeddings, final norm, a tied output head) stay with the
    enclosing unit, which keeps shared parameters in the same unit.

    Args:
        module: The module being considered.
        recurse: ``True`` while the driver decides whether to descend into ``module``; ``False``
            when it decides whether to wrap ``module`` itself.
        nonwrapped_numel: Numel of ``module``'s parameters not yet owned by a wrapped descendant
            (unused by this policy).
        transformer_layer_cls: The module classes to wrap.

    Returns:
        ``True`` when ``recurse`` is ``True`` (always descend); otherwise whether ``module`` is
        an instance of one of ``transformer_layer_cls``.

    Raises:
        TypeError: If ``transformer_layer_cls`` is not a collection of classes.
    """
    if recurse:
        return True
    return isinstance(module, _as_class_tuple(transformer_layer_cls, "transformer_layer_cls"))


def size_based_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    min_num_params: int = int(1e8),
    force_leaf_modules: Optional[Set[Type[nn.Module]]] = None,
    exclude_wrap_modules: Optional[Set[Type[nn.Module]]] = None,
) -> bool:
    """Wrap a module once at least ``min_num_params`` of its parameters are still unwrapped.

    Bind the threshold with :func:`functools.partial`, e.g.
    ``functools.partial(size_based_auto_wrap_policy, min_num_params=int(1e6))``.

    Args:
        module: The module being considered.
        recurse: ``True`` while the driver decides whether to descend into ``module``; ``False``
            when it decides whether to wrap ``module`` itself.
        nonwrapped_numel: Numel of ``module``'s parameters not yet owned by a wrapped
            descendant (when ``recurse`` is ``True``: all of its parameters).
        min_num_params: The numel threshold (kept under this name for compatibility; it counts
            elements, not tensors).
        force_leaf_modules: Module classes whose children are never considered (the driver does
            not descend into them). ``None`` means
            ``size_based_auto_wrap_policy.FORCE_LEAF_MODULES`` (``{nn.MultiheadAttention}``).
        exclude_wrap_modules: Module classes that are never wrapped themselves. ``None`` means
            ``size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES``
            (``{nn.ModuleList, nn.ModuleDict}``).

    Returns:
        When ``recurse`` is ``True``: whether ``module`` is large enough and not a forced leaf.
        Otherwise: whether ``module`` is large enough and not an excluded class.
    """
    defaults: Any = size_based_auto_wrap_policy
    if force_leaf_modules is None:
        force_leaf_modules = defaults.FORCE_LEAF_MODULES
    if exclude_wrap_modules is None:
        exclude_wrap_modules = defaults.EXCLUDE_WRAP_MODULES
    is_large = nonwrapped_numel >= min_num_params
    if recurse:
        return is_large and not isinstance(module, tuple(force_leaf_modules))
    return is_large and not isinstance(module, tuple(exclude_wrap_modules))


# Defaults for ``size_based_auto_wrap_policy`` (importable and overridable, as in torch).
_size_policy_defaults: Any = size_based_auto_wrap_policy
_size_policy_defaults.FORCE_LEAF_MODULES = {nn.MultiheadAttention}
_size_policy_defaults.EXCLUDE_WRAP_MODULES = {nn.ModuleList, nn.ModuleDict}


# ---------------------------------------------------------------------------------------------
# Policy objects
# ---------------------------------------------------------------------------------------------


class _Policy(ABC):
    """Base class of policies that pick all modules to wrap (and their kwargs) in one pass."""

    @abstractmethod
    def _run_policy(
        self,
        root_module: nn.Module,
        ignored_modules: Set[nn.Module],
        root_kwargs: Dict[str, Any],
    ) -> Dict[nn.Module, Dict[str, Any]]:
        """Return a map from each module to wrap to the kwargs its wrapper is built with.

        Args:
            root_module: The root of the module tree (it may appear in the result; the driver
                never wraps it, the caller does).
            ignored_modules: Modules that must not appear in the result.
            root_kwargs: The root wrapper's keyword arguments, the default for every unit.

        Returns:
            ``{module: kwargs}`` for every module to wrap.
        """


class ModuleWrapPolicy(_Policy):
    """Wrap every module that is an instance of one of the given classes.

    Each wrapped module gets (a shallow copy of) the root's keyword arguments. The instance is
    also usable as a functional policy ``policy(module, recurse, nonwrapped_numel)``.

    Args:
        module_classes: The module classes to wrap, e.g. ``{MyTransformerBlock}``.

    Raises:
        TypeError: If ``module_classes`` is a single class or not a collection of classes.
    """

    def __init__(self, module_classes: Iterable[Type[nn.Module]]) -> None:
        module_classes_set = set(_as_class_tuple(module_classes, "module_classes"))
        self._module_classes: Set[Type[nn.Module]] = module_classes_set
        self._module_classes_str = str(module_classes_set)

    def _run_policy(
        self,
        root_module: nn.Module,
        ignored_modules: Set[nn.Module],
        root_kwargs: Dict[str, Any],
    ) -> Dict[nn.Module, Dict[str, Any]]:
        """Return ``{module: copy of root_kwargs}`` for every instance of the policy's classes.

        Args:
            root_module: The root of the module tree.
            ignored_modules: Modules to skip.
            root_kwargs: The root wrapper's keyword arguments.

        Returns:
            The modules to wrap, each with its own shallow copy of ``root_kwargs``.
        """
        classes = tuple(self._module_classes)
        return {
            module: dict(root_kwargs)
            for module in root_module.modules()
            if module not in ignored_modules and isinstance(module, classes)
        }

    def __call__(self, module: nn.Module, recurse: bool, *args: Any, **kwargs: Any) -> bool:
        """Functional-policy form: always descend; wrap instances of the policy's classes.

        Args:
            module: The module being considered.
            recurse: Whether the driver is deciding to descend (``True``) or to wrap (``False``).
            *args: Ignored (``nonwrapped_numel``).
            **kwargs: Ignored (``nonwrapped_numel``).

        Returns:
            ``True`` if ``recurse``; else whether ``module`` is an instance of the classes.
        """
        return _is_class_wrap_decision(module, recurse, tuple(self._module_classes))

    def __repr__(self) -> str:
        return super().__repr__() + f"({self._module_classes_str})"


class CustomPolicy(_Policy):
    """Wrap modules chosen by a user function, optionally with per-module kwargs.

    ``lambda_fn(module)`` is called for every (non-ignored) module and returns:

    * ``False`` or ``{}``: do not wrap the module;
    * ``True``: wrap it with the root's kwargs;
    * a non-empty ``dict``: wrap it with the root's kwargs updated by that dict, e.g.
      ``{"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP}``.

    The instance is also usable as a functional policy ``policy(module, recurse,
    nonwrapped_numel)`` (always descend; wrap when ``lambda_fn`` returns ``True`` or a non-empty
    dict).

    Args:
        lambda_fn: The per-module decision function.
    """

    def __init__(self, lambda_fn: Callable[[nn.Module], Union[bool, Dict[str, Any]]]) -> None:
        if not callable(lambda_fn):
            raise TypeError(
                "CustomPolicy expects a callable lambda_fn(module) -> bool | dict, but got an "
                f"object of type {type(lambda_fn).__name__}."
            )
        self._lambda_fn = lambda_fn

    def _decide(self, module: nn.Module, module_name: str) -> Union[bool, Dict[str, Any]]:
        """Call ``lambda_fn`` on ``module`` and validate what it returned."""
        result = self._lambda_fn(module)
        if not isinstance(result, (bool, dict)):
            raise ValueError(
                "The lambda_fn passed to CustomPolicy must return True/False or a dict of "
                f"keyword-argument overrides, but for module {_module_name(module_name)!r} "
                f"({type(module).__name__}) it returned {result!r} of type "
                f"{type(result).__name__}."
            )
        return result

    def _run_policy(
        self,
        root_module: nn.Module,
        ignored_modules: Set[nn.Module],
        root_kwargs: Dict[str, Any],
    ) -> Dict[nn.Module, Dict[str, Any]]:
        """Return the modules ``lambda_fn`` selects, each with its merged kwargs.

        Args:
            root_module: The root of the module tree.
            ignored_modules: Modules to skip (``lambda_fn`` is not called on them).
            root_kwargs: The root wrapper's keyword arguments.

        Returns:
            ``{module: {**root_kwargs, **overrides}}`` for every selected module.

        Raises:
            ValueError: If ``lambda_fn`` returns something other than a bool or a dict.
        """
        target_module_to_kwargs: Dict[nn.Module, Dict[str, Any]] = {}
        for name, module in root_module.named_modules():
            if module in ignored_modules:
                continue
            result = self._decide(module, name)
            if not result:
                continue
            kwargs = dict(root_kwargs)
            if isinstance(result, dict):
                kwargs.update(result)
            target_module_to_kwargs[module] = kwargs
        return target_module_to_kwargs

    def __call__(self, module: nn.Module, recurse: bool, *args: Any, **kwargs: Any) -> bool:
        """Functional-policy form: always descend; wrap when ``lambda_fn`` selects the module.

        Per-module kwargs overrides are not available in this form (a functional policy only
        says yes or no); pass the instance itself as the policy to get them.

        Args:
            module: The module being considered.
            recurse: Whether the driver is deciding to descend (``True``) or to wrap (``False``).
            *args: Ignored (``nonwrapped_numel``).
            **kwargs: Ignored (``nonwrapped_numel``).

        Returns:
            ``True`` if ``recurse``; else whether ``lambda_fn`` returned ``True`` or a non-empty
            dict.

        Raises:
            ValueError: If ``lambda_fn`` returns something other than a bool or a dict.
        """
        if recurse:
            return True
        return bool(self._decide(module, type(module).__name__))

    def __repr__(self) -> str:
        return super().__repr__() + f"({self._lambda_fn!r})"


# ---------------------------------------------------------------------------------------------
# enable_wrap / wrap
# ---------------------------------------------------------------------------------------------


class _WrapContext:
    """Process-wide state of the active :func:`enable_wrap` context (at most one at a time)."""

    active: bool = False
    wrapper_cls: Optional[Callable[..., nn.Module]] = None
    kwargs: Dict[str, Any] = {}


@contextlib.contextmanager
def enable_wrap(*, wrapper_cls: Any, **wrapper_kwargs: Any) -> Iterator[None]:
    """Make :func:`wrap` wrap modules with ``wrapper_cls`` while the context is active.

    Useful to shard large layers as they are built, with one shared configuration::

        with enable_wrap(wrapper_cls=FullyShardedDataParallel, **fsdp_kwargs):
            self.layer = wrap(nn.Linear(4096, 4096))

    Args:
        wrapper_cls: The class (or callable) ``wrap`` calls as ``wrapper_cls(module, **kwargs)``.
        **wrapper_kwargs: Default keyword arguments for every ``wrap`` call in the context.

    Yields:
        Nothing; the configuration is active until the ``with`` block exits.

    Raises:
        NotImplementedError: If another ``enable_wrap`` context is already active (nesting is
            not supported).
        TypeError: If ``wrapper_cls`` is not callable.
    """
    if _WrapContext.active:
        raise NotImplementedError(
            "enable_wrap() contexts cannot be nested: an enable_wrap context is already active. "
            "Exit it first, or pass different settings to individual wrap(module, **overrides) "
            "calls instead."
        )
    if not callable(wrapper_cls):
        raise TypeError(
            "enable_wrap() needs a callable wrapper_cls such as FullyShardedDataParallel, but got "
            f"an object of type {type(wrapper_cls).__name__}."
        )
    _WrapContext.active = True
    _WrapContext.wrapper_cls = wrapper_cls
    _WrapContext.kwargs = dict(wrapper_kwargs)
    try:
        yield
    finally:
        _WrapContext.active = False
        _WrapContext.wrapper_cls = None
        _WrapContext.kwargs = {}


def _wrap(module: nn.Module, wrapper_cls: Callable[..., nn.Module], **kwargs: Any) -> nn.Module:
    """Construct ``wrapper_cls(module, **kwargs)``, honouring ``module._wrap_overrides``.

    A module may carry a ``_wrap_overrides`` dict whose entries take priority over ``kwargs``
    (as in torch; used e.g. to force ``mixed_precision=None`` on a module).
    """
    overrides = getattr(module, "_wrap_overrides", None)
    if isinstance(overrides, dict):
        kwargs = {**kwargs, **overrides}
    return wrapper_cls(module, **kwargs)


def wrap(module: nn.Module, **wrap_overrides: Any) -> nn.Module:
    """Wrap ``module`` if called inside :func:`enable_wrap`; otherwise return it unchanged.

    This lets a model be built with or without wrapping without changing its code.

    Args:
        module: The module to wrap.
        **wrap_overrides: Keyword arguments taking priority over the ``enable_wrap`` ones.

    Returns:
        ``wrapper_cls(module, **{**wrapper_kwargs, **wrap_overrides})`` inside an
        ``enable_wrap`` context, else ``module`` itself.
    """
    if not _WrapContext.active or _WrapContext.wrapper_cls is None:
        return module
    return _wrap(module, _WrapContext.wrapper_cls, **{**_WrapContext.kwargs, **wrap_overrides})


# ---------------------------------------------------------------------------------------------
# Auto-wrap driver
# ---------------------------------------------------------------------------------------------


def _policy_function_name(policy: Any) -> Optional[str]:
    """Return the ``__name__`` of the function under any ``functools.partial`` layers."""
    func = policy
    while isinstance(func, functools.partial):
        func = func.func
    return getattr(func, "__name__", None)


def _validate_auto_wrap_policy(policy: Any) -> None:
    """Check that ``policy`` is something :func:`_auto_wrap` can use, before any work is done.

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


def _check_no_existing_wrappers(root_module: nn.Module, wrapper_cls: Any) -> None:
    """Raise if any module in ``root_module``'s tree is already a ``wrapper_cls`` instance."""
    if not inspect.isclass(wrapper_cls):
        return
    for name, module in root_module.named_modules():
        if isinstance(module, wrapper_cls):
            raise ValueError(
                "Auto-wrapping requires modules that do not already have FSDP applied, but "
                f"{_module_name(name)!r} is already a {wrapper_cls.__name__} instance. Either "
                "wrap that subtree manually or use auto_wrap_policy, not both on the same "
                "subtree."
            )


def _expand_ignored(
    root_module: nn.Module,
    ignored_modules: AbstractSet[nn.Module],
    ignored_params: AbstractSet[nn.Parameter],
) -> Tuple[Set[nn.Module], Set[nn.Parameter]]:
    """Close ``ignored_modules`` under descendants and add their parameters to the ignored ones."""
    modules: Set[nn.Module] = set()
    for module in ignored_modules:
        modules.update(module.modules())
    params: Set[nn.Parameter] = set(ignored_params)
    for module in modules:
        params.update(module.parameters())
    return modules, params


def _mixed_precision_classes(root_kwargs: Dict[str, Any]) -> Tuple[type, ...]:
    """Return the module classes mixed precision must skip (empty if mixed precision is off)."""
    mixed_precision = root_kwargs.get("mixed_precision")
    if mixed_precision is None:
        return ()
    classes = getattr(mixed_precision, "_module_classes_to_ignore", ()) or ()
    return tuple(dict.fromkeys(classes))


def _map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    """Apply ``fn`` to every tensor inside nested lists / tuples / namedtuples / dicts."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_map_tensors(fn, item) for item in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(fn, item) for item in obj)
    if isinstance(obj, dict):
        mapped = {key: _map_tensors(fn, value) for key, value in obj.items()}
        try:
            out = type(obj)()
            out.update(mapped)
            return out
        except TypeError:
            return mapped
    return obj


def _register_full_precision_hooks(module: nn.Module) -> None:
    """Run ``module`` in float32 and hand its outputs back in its inputs' floating dtype.

    Modules that mixed precision skips keep float32 parameters but sit between low-precision
    modules, so their floating-point inputs are upcast before forward and the outputs are cast
    back to the inputs' dtype afterwards. The hooks are appended so they run after other hooks.
    """
    state: Dict[str, torch.dtype] = {}

    def cast_to(dtype: torch.dtype, tensor: torch.Tensor, record: bool) -> torch.Tensor:
        if not torch.is_floating_point(tensor) or tensor.dtype == dtype:
            return tensor
        if record:
            state["input_dtype"] = tensor.dtype
        return tensor.to(dtype)

    def pre_hook(_module: nn.Module, args: Any) -> Any:
        state.pop("input_dtype", None)
        return _map_tensors(lambda t: cast_to(torch.float32, t, True), args)

    def post_hook(_module: nn.Module, args: Any, output: Any) -> Any:
        input_dtype = state.pop("input_dtype", None)
        if input_dtype is None:  # no low-precision floating input: leave the output alone
            return None
        return _map_tensors(lambda t: cast_to(input_dtype, t, False), output)

    module.register_forward_pre_hook(pre_hook, prepend=False)
    module.register_forward_hook(post_hook, prepend=False)


def _apply_mixed_precision_overrides(
    root_module: nn.Module, classes: Tuple[type, ...]
) -> Set[Type[nn.Module]]:
    """Register full-precision hooks on every instance of ``classes``; return the found types."""
    found: Set[Type[nn.Module]] = set()
    for module in root_module.modules():
        if isinstance(module, classes):
            found.add(type(module))
            _register_full_precision_hooks(module)
    if found:
        warnings.warn(
            "Both mixed_precision and auto_wrap_policy were given, and the model contains "
            f"modules of types {sorted(cls.__name__ for cls in found)} that mixed precision "
            "skips (MixedPrecision._module_classes_to_ignore). Each of them is wrapped as its own "
            "unit with mixed_precision=None and runs in float32.",
            stacklevel=3,
        )
    return found


def _post_order_named_modules(root_module: nn.Module) -> List[Tuple[str, nn.Module]]:
    """Return ``(qualified name, module)`` pairs in post-order, children in registration order."""
    visited: Set[nn.Module] = {root_module}
    order: List[Tuple[str, nn.Module]] = []

    def visit(name: str, module: nn.Module) -> None:
        for child_name, child in module.named_children():
            if child is None or child in visited:
                continue
            visited.add(child)
            visit(f"{name}.{child_name}" if name else child_name, child)
        order.append((name, module))

    visit("", root_module)
    return order


def _check_uniform_requires_grad(
    root_module: nn.Module,
    modules_to_wrap: AbstractSet[nn.Module],
    ignored_params: AbstractSet[nn.Parameter],
    use_orig_params: bool,
) -> None:
    """Check that each unit would own only frozen or only trainable parameters.

    Units are processed bottom-up; each owns the parameters in its subtree not owned by an
    already-processed (descendant) unit. A mix is an error with ``use_orig_params=False`` (a flat
    parameter has a single ``requires_grad``) and a warning with ``use_orig_params=True``.
    """
    claimed: Set[nn.Module] = set()
    for name, unit in _post_order_named_modules(root_module):
        if unit not in modules_to_wrap:
            continue
        trainable: List[str] = []
        frozen: List[str] = []
        trainable_numel = 0
        frozen_numel = 0
        queue = deque([(unit, name)])
        claimed.add(unit)
        while queue:
            module, prefix = queue.popleft()
            for param_name, param in module.named_parameters(recurse=False):
                if param in ignored_params:
                    continue
                fqn = f"{prefix}.{param_name}" if prefix else param_name
                if param.requires_grad:
                    trainable.append(fqn)
                    trainable_numel += param.numel()
                else:
                    frozen.append(fqn)
                    frozen_numel += param.numel()
            for child_name, child in module.named_children():
                if child is None or child in claimed:
                    continue
                claimed.add(child)
                queue.append((child, f"{prefix}.{child_name}" if prefix else child_name))
        if not trainable or not frozen:
            continue
        msg = (
            f"Module {_module_name(name)!r} would be wrapped as one unit holding both parameters "
            "with requires_grad=True and requires_grad=False."
        )
        if use_orig_params:
            msg += (
                " This is supported with use_orig_params=True but wastes gradient memory "
                f"({trainable_numel + frozen_numel} numel instead of {trainable_numel} before "
                "sharding)."
            )
        else:
            msg += " This is not supported with use_orig_params=False."
        msg += " Wrap the frozen parameters in their own unit (adjust auto_wrap_policy)"
        msg += "." if use_orig_params else ", or pass use_orig_params=True."
        msg += f"\nrequires_grad=True: {trainable}\nrequires_grad=False: {frozen}"
        if use_orig_params:
            warnings.warn(msg, stacklevel=3)
        else:
            raise ValueError(msg)


def _auto_wrap(
    root_module: nn.Module,
    policy: AutoWrapPolicy,
    wrapper_cls: type,
    root_kwargs: Dict[str, Any],
    ignored_modules: AbstractSet[nn.Module] = frozenset(),
    ignored_params: AbstractSet[nn.Parameter] = frozenset(),
) -> None:
    """Wrap, in place and bottom-up, the submodules of ``root_module`` that ``policy`` picks.

    The root itself is never wrapped here (the caller wraps it). Chosen children are replaced on
    their parents with ``setattr(parent, name, wrapper_cls(child, **kwargs))``; descendants are
    wrapped before their ancestors. ``kwargs`` is ``root_kwargs`` for a functional policy and the
    per-module dict from ``policy._run_policy`` for a :class:`_Policy`; an ``auto_wrap_policy``
    entry is set to ``None`` (a :class:`_Policy` always adds it as ``None``, as torch does) so
    child wrappers never auto-wrap again. ``root_kwargs`` itself is not modified.

    If ``root_kwargs["mixed_precision"]`` is set and lists ``_module_classes_to_ignore`` (by
    default ``_BatchNorm``), every instance of those classes is additionally wrapped as its own
    unit with ``mixed_precision=None`` and gets forward hooks that run it in float32, as torch
    does.

    A module reachable through several parents is visited once; every parent is pointed at the
    same wrapper.

    Args:
        root_module: The module tree to wrap.
        policy: A functional policy or a :class:`_Policy` (see the module docstring).
        wrapper_cls: The wrapper class, constructed as ``wrapper_cls(module, **kwargs)``.
        root_kwargs: The root wrapper's keyword arguments (everything except the module).
        ignored_modules: Modules (with their subtrees) never wrapped and never descended into.
        ignored_params: Parameters not counted in ``nonwrapped_numel``; the parameters of
            ``ignored_modules`` are always added.

    Raises:
        TypeError: If ``policy`` is invalid (see :func:`_validate_auto_wrap_policy`).
        ValueError: If a module in the tree is already a ``wrapper_cls`` instance, or (with a
            :class:`_Policy` and ``use_orig_params=False``) a unit would mix frozen and
            trainable parameters. Both are raised before anything is changed.
    """
    _validate_auto_wrap_policy(policy)
    _check_no_existing_wrappers(root_module, wrapper_cls)
    ignored_modules, ignored_params = _expand_ignored(root_module, ignored_modules, ignored_params)
    base_kwargs = dict(root_kwargs)
    if "auto_wrap_policy" in base_kwargs or isinstance(policy, _Policy):
        base_kwargs["auto_wrap_policy"] = None
    mp_classes = _mixed_precision_classes(base_kwargs)

    if isinstance(policy, _Policy):
        targets = policy._run_policy(root_module, ignored_modules, base_kwargs)
        if not isinstance(targets, dict):
            raise TypeError(
                f"{type(policy).__name__}._run_policy must return a dict mapping modules to "
                f"kwargs dicts, but returned an object of type {type(targets).__name__}."
            )
        _add_full_precision_units(root_module, targets, mp_classes, ignored_modules, base_kwargs)
        _check_uniform_requires_grad(
            root_module, set(targets), ignored_params, bool(base_kwargs.get("use_orig_params"))
        )
        if mp_classes:
            _apply_mixed_precision_overrides(root_module, mp_classes)
        _wrap_targets_post_order(root_module, targets, wrapper_cls)
        return

    functional: FunctionalPolicy = policy
    if mp_classes:
        _apply_mixed_precision_overrides(root_module, mp_classes)
        functional = functools.partial(_or_class_policy, policy=policy, classes=mp_classes)

    def wrap_one(module: nn.Module) -> nn.Module:
        return _wrap(module, wrapper_cls, **_full_precision_kwargs(module, base_kwargs, mp_classes))

    _recursive_wrap(
        root_module, functional, wrap_one, ignored_modules, ignored_params, {}, is_root=True
    )


def _full_precision_kwargs(
    module: nn.Module, kwargs: Dict[str, Any], classes: Tuple[type, ...]
) -> Dict[str, Any]:
    """``kwargs``, with ``mixed_precision=None`` if ``module`` is of a class mixed precision skips."""
    if classes and isinstance(module, classes):
        return {**kwargs, "mixed_precision": None}
    return kwargs


def _add_full_precision_units(
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
            targets[module] = _full_precision_kwargs(module, targets.get(module, base_kwargs), classes)


def _or_class_policy(
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


def _wrap_targets_post_order(
    root_module: nn.Module,
    targets: Dict[nn.Module, Dict[str, Any]],
    wrapper_cls: Callable[..., nn.Module],
) -> None:
    """Wrap every module in ``targets`` except the root, bottom-up, replacing it on its parents."""
    visited: Set[nn.Module] = {root_module}
    replaced: Dict[nn.Module, nn.Module] = {}

    # Post-order: a module is wrapped once all its children are handled; each parent then swaps
    # in its children's wrappers (also for a shared child first reached through another parent).
    def visit_and_wrap(module: nn.Module) -> None:
        for child_name, child in list(module.named_children()):
            if child is None:
                continue
            if child not in visited:
                visited.add(child)
                visit_and_wrap(child)
            wrapper = replaced.get(child)
            if wrapper is not None:
                setattr(module, child_name, wrapper)
        if module is not root_module and module in targets:
            replaced[module] = wrapper_cls(module, **targets[module])

    visit_and_wrap(root_module)


def _recursive_wrap(
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
            new_child, child_wrapped_numel = _recursive_wrap(
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
