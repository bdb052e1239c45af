"""torch's private wrap helpers, with torch's signatures, for torch's own code under the alias.

With :func:`fsdp.redirect_torch_fsdp` installed, torch's wrap module name answers with fsdp's
wrap module. torch's own code outside FSDP1 imports a few *private* helpers from it:
``apply_activation_checkpointing`` (``torch.distributed.algorithms._checkpoint``) imports
``_Policy``, ``_recursive_wrap`` and ``lambda_auto_wrap_policy`` from it and, through torch's
private ``_wrap_utils``, ``_construct_wrap_fn``, ``_or_policy``, ``_post_order_apply``,
``_run_mixed_precision_override_policy`` and ``_wrap_module_cls_individually``. fsdp's own wrap
module keeps only its public names (fsdp's planner walk, ``fsdp.init._auto_wrap.recursive_wrap``,
has another signature), so the alias's wrap module is :func:`build_wrap_alias`'s module: fsdp's wrap names (the same objects)
plus the helpers below, which behave as torch's do when called with torch's arguments.
"""

from __future__ import annotations

import types
from typing import Any, Callable, Dict, Iterable, Optional, Sequence, Set, Tuple

from torch import nn

import fsdp.wrap as _fsdp_wrap
from fsdp._common import p_assert
from fsdp.init._auto_wrap import recursive_wrap

__all__ = ["build_wrap_alias"]


def _post_order_apply(root_module: nn.Module, fn: Callable[[nn.Module], Optional[nn.Module]]) -> None:
    """Calls ``fn`` on every module below and at ``root_module``, children first.

    A module reached twice (shared) is visited once. Where ``fn`` returns a module, it replaces
    the visited one on its parent (under the name it was reached by).

    Args:
        root_module: The tree's root (``fn`` must return ``None`` for it: it has no parent).
        fn: Called with each module; returns ``None`` or the replacement.
    """
    visited: Set[nn.Module] = {root_module}

    def visit(module: nn.Module, name: str, parent: Optional[nn.Module]) -> None:
        for child_name, child in module.named_children():
            if child is not None and child not in visited:
                visited.add(child)
                visit(child, child_name, module)  # noqa: F821 (deleted below)
        replacement = fn(module)
        if replacement is None:
            return
        p_assert(parent is not None and name != "", f"the root module {module} cannot be replaced")
        p_assert(isinstance(replacement, nn.Module), f"fn returned {replacement!r}, not a module")
        setattr(parent, name, replacement)

    try:
        visit(root_module, "", None)
    finally:
        del visit  # breaks the closure's self-reference (a cycle that would hold the modules)


# Any (Dict[str, Any]): FSDP constructor keyword arguments, as fsdp.wrap's policies type them.
def _construct_wrap_fn(
    root_module: nn.Module,
    target_module_to_kwargs: Dict[nn.Module, Dict[str, Any]],
    fsdp_fn: Callable[..., nn.Module],
) -> Callable[[nn.Module], Optional[nn.Module]]:
    """The function for :func:`_post_order_apply` that wraps each policy target but the root.

    Args:
        root_module: The root (never wrapped here: its caller wraps it).
        target_module_to_kwargs: ``{module: kwargs}`` from a policy's ``_run_policy``.
        fsdp_fn: The wrapper, called as ``fsdp_fn(module, **kwargs)``.

    Returns:
        ``fn(module)``: the wrapped module for a target, else ``None``.
    """

    def wrap_target(module: nn.Module) -> Optional[nn.Module]:
        if module is root_module or module not in target_module_to_kwargs:
            return None
        return fsdp_fn(module, **target_module_to_kwargs[module])

    return wrap_target


def _run_mixed_precision_override_policy(
    root_module: nn.Module,
    module_classes: Iterable[type],
    ignored_modules: Set[nn.Module],
    root_kwargs: Dict[str, Any],
    target_module_to_kwargs: Dict[nn.Module, Dict[str, Any]],
) -> Dict[nn.Module, Dict[str, Any]]:
    """Makes every (non-ignored) instance of ``module_classes`` a target with no mixed precision.

    A module not yet a target takes ``root_kwargs`` (the same dict, as torch's does).

    Returns:
        ``target_module_to_kwargs``, updated in place.
    """
    classes = tuple(set(module_classes))
    for module in root_module.modules():
        if module in ignored_modules or not isinstance(module, classes):
            continue
        target_module_to_kwargs.setdefault(module, root_kwargs)["mixed_precision"] = None
    return target_module_to_kwargs


def _wrap_module_cls_individually(
    module: nn.Module, module_classes: Sequence[type], recurse: bool, *args: object, **kwargs: object
) -> bool:
    """Functional policy: always descend; wrap instances of ``module_classes``."""
    return True if recurse else isinstance(module, tuple(module_classes))


def _or_policy(
    module: nn.Module, recurse: bool, nonwrapped_numel: int, policies: Iterable[Callable[..., bool]]
) -> bool:
    """Functional policy: whether any of ``policies`` says yes."""
    return any(
        policy(module=module, recurse=recurse, nonwrapped_numel=nonwrapped_numel) for policy in policies
    )


def _recursive_wrap(
    module: nn.Module,
    auto_wrap_policy: Callable[..., bool],
    wrapper_cls: Callable[..., nn.Module],
    ignored_modules: Set[nn.Module],
    ignored_params: Set[nn.Parameter],
    only_wrap_children: bool = False,
    **kwargs: object,
) -> Tuple[nn.Module, int]:
    """Wraps the modules a functional policy picks, bottom-up (torch's signature).

    Args:
        module: The tree to wrap.
        auto_wrap_policy: ``policy(module=, recurse=, nonwrapped_numel=) -> bool``.
        wrapper_cls: Called as ``wrapper_cls(module, **kwargs)`` for each pick.
        ignored_modules: Modules not descended into.
        ignored_params: Parameters not counted in ``nonwrapped_numel``.
        only_wrap_children: If true, ``module`` itself is never wrapped.
        **kwargs: Passed to ``wrapper_cls``.

    Returns:
        ``(module or its wrapper, numel now owned by wrappers)``.

    Raises:
        ValueError: If ``auto_wrap_policy`` or ``wrapper_cls`` is ``None``.
    """
    if auto_wrap_policy is None or wrapper_cls is None:
        raise ValueError("_recursive_wrap needs both an auto_wrap_policy and a wrapper_cls")
    return recursive_wrap(
        module,
        auto_wrap_policy,
        lambda target: wrapper_cls(target, **kwargs),
        ignored_modules,
        ignored_params,
        memo={},
        is_root=only_wrap_children,
    )


_TORCH_PRIVATE_HELPERS: Tuple[Callable[..., object], ...] = (
    _construct_wrap_fn,
    _or_policy,
    _post_order_apply,
    _recursive_wrap,
    _run_mixed_precision_override_policy,
    _wrap_module_cls_individually,
)


class _WrapAlias(types.ModuleType):
    """fsdp's wrap module as seen under torch's name: anything not set here is fsdp.wrap's."""

    __all__: list[str]
    _Policy: type

    def __getattr__(self, name: str) -> Any:  # Any: whatever fsdp.wrap holds, as ModuleType's
        return getattr(_fsdp_wrap, name)


def build_wrap_alias(module_name: str) -> types.ModuleType:
    """Builds the module that torch's wrap module name answers with under the alias.

    Args:
        module_name: torch's wrap module name.

    Returns:
        A module whose names are fsdp.wrap's (the same objects; ``enable_wrap`` and ``wrap``
        share fsdp.wrap's state) plus torch's private helpers listed in this module's docstring.
    """
    alias = _WrapAlias(module_name, _fsdp_wrap.__doc__)
    alias.__all__ = list(_fsdp_wrap.__all__)
    alias.__file__ = _fsdp_wrap.__file__
    for name in _fsdp_wrap.__all__:
        setattr(alias, name, getattr(_fsdp_wrap, name))
    alias._Policy = _fsdp_wrap._Policy
    for helper in _TORCH_PRIVATE_HELPERS:
        setattr(alias, helper.__name__, helper)
    return alias
