"""Deferred (meta-device) initialization: materialize the model unit by unit.

[Note: Meta-device materialization order]
Modules built on the meta device hold no data. FSDP materializes them on the compute device
with ``param_init_fn(module)`` when given, else ``module.to_empty(recurse=False)`` followed by
``module.reset_parameters()``, module by module in *pre-order* (the order in which an eager
``__init__`` typically creates them, so random initialization draws the same numbers as eager
init with the same seed). Units are still wrapped bottom-up: a nested unit is flattened and
sharded as soon as the pre-order walk leaves its subtree, so at any time only the units on the
current root-to-leaf path hold unsharded parameters, never the whole model.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

import torch
from torch import nn


def has_meta_states(module: nn.Module, recurse: bool = True) -> bool:
    """Whether ``module`` (or, with ``recurse``, its subtree) has parameters or buffers on meta."""
    tensors: list[Optional[torch.Tensor]]
    if recurse:
        tensors = [*module.parameters(), *module.buffers()]
    else:
        tensors = [*module._parameters.values(), *module._buffers.values()]
    return any(t is not None and t.is_meta for t in tensors)


def validate_param_init_fn(param_init_fn: Any) -> None:
    """Raises ValueError (torch FSDP1's type) for a ``param_init_fn`` that is not callable."""
    if param_init_fn is not None and not callable(param_init_fn):
        raise ValueError(
            f"fsdp: Expected {param_init_fn} to be callable but got {type(param_init_fn)}: "
            f"param_init_fn must be a callable taking a module (e.g. "
            f"lambda m: m.to_empty(device='cpu', recurse=False))."
        )


class NoResetParametersError(ValueError, AttributeError):
    """A meta module without ``reset_parameters()`` and no ``param_init_fn``: torch FSDP1 raises
    the ``AttributeError`` of calling it; a ``ValueError`` too (a wrong argument)."""


def _no_reset_error(label: str, module: nn.Module) -> NoResetParametersError:
    missing = f"'{type(module).__name__}' object has no attribute 'reset_parameters'"  # torch's error
    _warn_reset_failed(module, missing)
    return NoResetParametersError(
        f"{missing}. fsdp: module '{label}' ({type(module).__name__}) has parameters or buffers "
        f"on the meta device but no reset_parameters() to initialize them; pass "
        f"param_init_fn=... to FullyShardedDataParallel, or build the module on a real device."
    )


def _warn_reset_failed(module: nn.Module, error: object) -> None:
    """torch FSDP1's UserWarning when a meta module's ``reset_parameters()`` cannot run or
    raises (torch's text, its missing space included), before the error is raised."""
    warnings.warn(
        f"Unable to call `reset_parameters()` for module on meta device with error {error}. "
        f"Please ensure that your module oftype {type(module)} implements a `reset_parameters()` method.",
        stacklevel=2,
    )


def check_materializable(
    root: nn.Module,
    param_init_fn: Optional[Callable[[nn.Module], None]],
    is_skipped: Callable[[nn.Module], bool],
) -> None:
    """Raises before anything changes if a meta module could not be materialized."""
    if param_init_fn is not None:
        return
    for name, module in root.named_modules():
        if is_skipped(module) or not has_meta_states(module, recurse=False):
            continue
        if not callable(getattr(module, "reset_parameters", None)):
            raise _no_reset_error(name or f"<root {type(module).__name__}>", module)


def materialize_module(
    name: str,
    module: nn.Module,
    device: torch.device,
    param_init_fn: Optional[Callable[[nn.Module], None]],
) -> None:
    """Materializes ``module``'s own meta parameters and buffers (not its children's).

    Raises:
        ValueError: The module has meta states but no ``reset_parameters()`` and no
            ``param_init_fn`` was given, or ``param_init_fn`` left meta states behind.
    """
    if not has_meta_states(module, recurse=False):
        return
    label = name or f"<root {type(module).__name__}>"
    if param_init_fn is not None:
        param_init_fn(module)
        if has_meta_states(module, recurse=False):
            raise ValueError(
                f"fsdp: param_init_fn left parameters or buffers of module '{label}' "
                f"({type(module).__name__}) on the meta device; it must materialize them (e.g. "
                f"module.to_empty(device=..., recurse=False) then initialize)."
            )
        return
    reset = getattr(module, "reset_parameters", None)
    if not callable(reset):
        raise _no_reset_error(label, module)
    module.to_empty(device=device, recurse=False)
    try:
        reset()
    except BaseException as error:
        _warn_reset_failed(module, error)
        raise


def materialize_and_wrap(
    root: nn.Module,
    targets: dict[nn.Module, dict[str, Any]],
    wrapper_cls: type,
    device: torch.device,
    param_init_fn: Optional[Callable[[nn.Module], None]],
    is_skipped: Callable[[nn.Module], bool],
) -> None:
    """Materializes ``root``'s subtree in pre-order, wrapping each target when its subtree is done.

    A module reachable through several parents is visited and wrapped once; every parent then
    points at the same wrapper.

    Args:
        root: The root module (materialized, not wrapped here).
        targets: Modules to wrap with their wrapper kwargs.
        wrapper_cls: The FSDP class.
        device: Where to materialize.
        param_init_fn: The user's init function, if any.
        is_skipped: Modules not to descend into (already wrapped units, ignored modules).
    """
    visited: set[int] = set()
    wrappers: dict[int, nn.Module] = {}

    def visit(prefix: str, module: nn.Module) -> None:
        visited.add(id(module))
        materialize_module(prefix, module, device, param_init_fn)
        for child_name, child in list(module.named_children()):
            if child is None or is_skipped(child):
                continue
            if id(child) in wrappers:  # shared, wrapped through another parent: use that wrapper
                setattr(module, child_name, wrappers[id(child)])
                continue
            if id(child) in visited:
                continue
            visit(f"{prefix}.{child_name}" if prefix else child_name, child)  # noqa: F821 (deleted below)
            if child in targets:
                wrappers[id(child)] = wrapper_cls(child, **targets[child])
                setattr(module, child_name, wrappers[id(child)])

    try:
        visit("", root)
    finally:
        del visit  # breaks the closure's self-reference (a cycle that would hold ``targets``)
