"""Casting a wrapped model after wrapping: ``model.half()``, ``.to(dtype)``, ``.double()``, ...

[Note: Casting after wrapping]
Every dtype cast of ``nn.Module`` (``half``, ``float``, ``double``, ``bfloat16``, ``to(dtype)``,
``type``) runs ``nn.Module._apply(fn)``, which swaps the ``.data`` of each registered Parameter
for ``fn(param)``. On an FSDP unit that is not enough: the handle keeps the local shard, the
padded unsharded buffers, the dtypes it computes and reduces in, the placeholders and, with
use_orig_params, the original Parameters as views into the local shard. torch FSDP1 re-reads
the FlatParameter's dtype once, at lazy initialization (before the first forward); a cast
after that is silently undone (the next reshard points ``.data`` back at the old local shard)
or fails in the next forward or backward.

fsdp honours the cast at any time between training steps, as a plain module does:

- the wrapper's ``_apply`` hides the unit's managed Parameters from ``nn.Module._apply``
  (:func:`hidden_from_module_apply`), lets it cast buffers, unmanaged parameters and nested
  units, then applies ``fn`` to each handle's local shard and rebuilds the handle around the
  result (:func:`recast_handle`). Parameter objects keep their identity, so an optimizer
  created before the cast steps them (its existing state keeps its old dtype, as with a plain
  module);
- dtypes follow torch FSDP1's rule at lazy init: the original (full) dtype becomes the new
  one; ``param_dtype`` and ``reduce_dtype`` follow it unless ``MixedPrecision`` set them (an
  unset ``reduce_dtype`` follows a set ``param_dtype``);
- gradients held between steps (the sharded ``.grad``, a ``no_sync`` accumulation) are cast
  along, to the dtypes the handle gives them after a backward.

A cast that goes around the wrapper (``model.module.half()``, or a cast of a submodule inside
a unit) reaches the Parameters through ``nn.Module._apply`` alone; the handle notices it before
its next use (pre-forward, summon_full_params, state dicts) and adopts it the same way
(:func:`adopt_external_cast`).

What cannot be honoured raises before anything changes: a cast inside forward, backward or
``summon_full_params`` (the wrapper checks the training states), a result that is not a
floating-point tensor on the device the handle keeps it on (:func:`planned_local_shard`), a
cast of only some of a unit's parameters (one FlatParameter has one dtype), and a backward
through a forward that ran before the cast (:func:`check_not_recast_since_forward`, called by
the pre-backward hook before the stale views are read).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable, Generator, Optional, Sequence

import torch
from torch import nn

from fsdp._common import FLAT_PARAM, p_assert
from fsdp.api import MixedPrecision
from fsdp.flat_param._precision import HandlePrecision
from fsdp.flat_param._views import assign_grad

if TYPE_CHECKING:
    from fsdp.flat_param.flat_param import FlatParamHandle

__all__ = [
    "adopt_external_cast",
    "check_not_recast_since_forward",
    "hidden_from_module_apply",
    "planned_local_shard",
    "recast_handle",
]

ApplyFn = Callable[[torch.Tensor], torch.Tensor]


def _expected_device(handle: "FlatParamHandle") -> torch.device:
    """Where the local shard lives: CPU with parameter offload, else the compute device."""
    return torch.device("cpu") if handle.storage.offload_params else handle.device


def planned_local_shard(handle: "FlatParamHandle", fn: ApplyFn) -> Optional[tuple[torch.dtype, torch.device]]:
    """The ``(dtype, device)`` ``fn`` would give the handle's local shard, or None if unchanged.

    ``fn`` runs on an empty tensor of the local shard's dtype and device (no data is touched).

    Raises:
        TypeError: The result would not be floating point (e.g. ``module.type(torch.IntTensor)``).
        RuntimeError: The result would be on another device than the one the handle keeps its
            local shard on (torch FSDP1 raises this type at lazy init).
    """
    local = handle._local_shard
    probe_in = torch.empty(0, dtype=local.dtype, device=local.device)
    probe_out = fn(probe_in)
    if probe_out is probe_in or (probe_out.dtype == local.dtype and probe_out.device == local.device):
        return None
    if not probe_out.is_floating_point():
        raise TypeError(
            f"fsdp: FSDP unit '{handle.unit_name}' keeps its parameters in one floating-point "
            f"FlatParameter; casting it to {probe_out.dtype} is not supported. Cast the model to "
            f"a floating-point dtype (half(), bfloat16(), float(), double(), to(dtype))."
        )
    expected = _expected_device(handle)
    if probe_out.device != expected:
        where = (
            "with parameter CPU offloading enabled keeps its parameters on cpu"
            if handle.storage.offload_params
            else f"computes on {expected}"
        )
        raise RuntimeError(
            f"fsdp: FSDP unit '{handle.unit_name}' {where}; moving it to {probe_out.device} after "
            f"wrapping is not supported. Move the module before wrapping it, or pass device_id= "
            f"to FullyShardedDataParallel."
        )
    return probe_out.dtype, probe_out.device


def _managed_slots(handle: "FlatParamHandle") -> list[tuple[nn.Module, str]]:
    """The ``(module, name)`` entries of ``_parameters`` that hold the handle's Parameters."""
    if not handle.use_orig_params:
        return [(handle.wrapped_module, FLAT_PARAM)]
    slots = [(info.module, info.param_name) for info in handle.param_infos]
    slots += [(shared.module, shared.param_name) for shared in handle.shared_param_infos]
    return slots


@contextlib.contextmanager
def hidden_from_module_apply(handles: Sequence["FlatParamHandle"]) -> Generator[None, None, None]:
    """Hides the handles' Parameters from ``nn.Module._apply`` (their entries read None).

    ``nn.Module._apply`` skips None entries of ``_parameters``; replacing the value, not
    removing the key, keeps the registration order (``named_parameters`` order) intact. The
    original entries are put back on exit, also when the apply raised.
    """
    saved: list[tuple[nn.Module, str, Optional[nn.Parameter]]] = []
    try:
        for handle in handles:
            for module, name in _managed_slots(handle):
                if module._parameters.get(name) is not None:
                    saved.append((module, name, module._parameters[name]))
                    module._parameters[name] = None
        yield
    finally:
        for module, name, param in saved:
            if module._parameters.get(name, None) is None:
                module._parameters[name] = param


def recast_handle(
    handle: "FlatParamHandle", fn: ApplyFn, mixed_precision: Optional[MixedPrecision]
) -> None:
    """Applies ``fn`` to the handle's local shard and rebuilds the handle around the result.

    Precondition: the unit is idle (no forward, backward or summon in progress) and
    :func:`planned_local_shard` accepted ``fn``.

    Postcondition: the local shard, ``.data`` of the FlatParameter (and, with use_orig_params,
    of the original Parameters), the padded unsharded buffers, the placeholders and the held
    gradients are in the new dtype; ``handle.dtype`` and ``handle.storage.precision`` are resolved from
    it and ``mixed_precision`` as at construction; the handle is SHARDED (UNSHARDED if it never
    frees anything); ``handle.views.cast_generation`` is increased.
    """
    p_assert(
        not handle.grads.in_progress(),
        f"unit '{handle.unit_name}': recast with a gradient reduction in progress",
    )
    adopt_external_cast(handle)  # a cast made around the wrapper first (returns at once if none)
    handle.writeback_orig_params()  # changes made to the original Parameters since the last step
    flat_grad = handle.grads.sync_from_orig()
    if handle.has_unsharded_buffer:
        handle.reshard()  # frees the unsharded buffers (their dtype is about to change)
    handle.storage.wait_unshard()
    old_local = handle._local_shard
    new_local = fn(old_local)
    p_assert(
        new_local.dim() == 1 and new_local.numel() == old_local.numel(),
        f"unit '{handle.unit_name}': the cast gave a local shard of shape {tuple(new_local.shape)}",
    )
    if handle.storage.offload_params and handle.device.type != "cpu" and not new_local.is_pinned():
        new_local = new_local.pin_memory()
    new_dtype = new_local.dtype
    precision = HandlePrecision.resolve(mixed_precision, new_dtype)

    # The FlatParameter: its gradient aside first (``.data`` of another dtype must not meet it).
    handle.flat_param.grad = None
    # The local shard, and the padded unsharded buffers rebuilt (freed) in the new dtypes.
    handle.storage.rebuild(new_local, precision)
    handle.views.drop_placeholders()  # made again, in the new dtype, by use_sharded

    # Held gradients, in the dtypes a backward would give them now.
    grads = handle.grads
    if grads.sharded_grad_stash is not None:
        grads.sharded_grad_stash = grads.sharded_grad_stash.to(new_dtype)
    if grads.holds_unsynced and flat_grad is not None:  # no_sync's unsharded gradient, in param_dtype
        assign_grad(handle.flat_param, flat_grad.to(precision.param_dtype))
        flat_grad = None

    # The names on the modules, as at construction.
    if handle.use_orig_params or handle.has_unsharded_buffer:
        handle.views.use_sharded()
    else:
        with torch.no_grad():
            handle.use_unsharded_views()
    if flat_grad is not None:
        handle.grads.set_sharded_grad(flat_grad)  # cast to precision.grad_dtype; orig grads re-viewed
    else:
        handle.grads.use_sharded_grad_views()
    handle.views.cast_generation += 1


def adopt_external_cast(handle: "FlatParamHandle") -> None:
    """Honours a cast that reached the handle's Parameters around the FSDP wrapper.

    ``model.module.half()`` (the wrapped module rather than the wrapper) or a cast of a plain
    module holding the unit runs ``nn.Module._apply`` without the wrapper's override: it swaps
    the FlatParameter's ``.data`` (or, with use_orig_params, each original Parameter's) for a
    cast copy behind the handle's back. Called before the handle is next used (pre-forward,
    summon_full_params, state dicts), this rebuilds the handle around the cast values, as
    :func:`recast_handle` does for a cast through the wrapper.

    Raises:
        RuntimeError: Only some of a unit's original parameters were cast (a unit keeps its
            parameters in one FlatParameter of one dtype), or the cast moved them to another
            device. Nothing is changed.
        TypeError: They were cast to a non-floating-point dtype. Nothing is changed.
    """
    if handle.use_orig_params:
        _adopt_orig_params_cast(handle)
        return
    flat_param = handle.flat_param
    at_rest = handle.state.name == "SHARDED" or not handle.has_unsharded_buffer
    if not at_rest or flat_param.dtype == handle.dtype:
        return
    cast_data = flat_param.data
    planned_local_shard(handle, lambda _: cast_data)  # validates dtype and device
    flat_param.data = handle._local_shard  # the handle's view again, until recast
    recast_handle(handle, lambda _: cast_data, handle.mixed_precision_config)


def _adopt_orig_params_cast(handle: "FlatParamHandle") -> None:
    current = [info.module._parameters.get(info.param_name) for info in handle.param_infos]
    params = [p for p in current if isinstance(p, nn.Parameter)]
    if not params or all(p.dtype == handle.dtype for p in params):
        return
    cast_dtypes = {p.dtype for p in params}
    if len(cast_dtypes) > 1 or len(params) != len(handle.param_infos):
        names = ", ".join(
            f"'{info.fqn}' ({p.dtype})" for info, p in zip(handle.param_infos, current) if p is not None
        )
        raise RuntimeError(
            f"fsdp: the parameters of FSDP unit '{handle.unit_name}' no longer share one dtype: "
            f"{names}. A unit keeps its parameters in one FlatParameter, so it is cast as a "
            f"whole: cast the FSDP-wrapped module (model.half(), model.to(dtype)), or wrap the "
            f"submodule to cast as its own FSDP unit."
        )
    (new_dtype,) = cast_dtypes
    planned_local_shard(handle, lambda t: t.to(new_dtype))  # validates dtype and device
    with torch.no_grad():
        for index, param in enumerate(params):
            expected = handle.shard_layout.orig_sharded_view(handle._local_shard, index)
            if param.shape != expected.shape:
                return  # not the shape a cast keeps: writeback_orig_params reports it
            if param.data_ptr() != expected.data_ptr():
                expected.copy_(param.detach())  # exact: the values came from this dtype
            param.data = expected
    recast_handle(handle, lambda t: t.to(new_dtype), handle.mixed_precision_config)


def _cast_around_wrapper(handle: "FlatParamHandle") -> Optional[torch.dtype]:
    """The dtype a cast around the wrapper gave the handle's Parameters since it last used
    them, or None."""
    if handle.use_orig_params:
        for info in handle.param_infos:
            param = info.module._parameters.get(info.param_name)
            if isinstance(param, nn.Parameter) and param.dtype != handle.dtype:
                return param.dtype
        return None
    unsharded = handle.state.name == "UNSHARDED" and handle.has_unsharded_buffer and not handle.storage.shows_local_shard
    expected = handle.storage.precision.param_dtype if unsharded else handle.dtype
    return handle.flat_param.dtype if handle.flat_param.dtype != expected else None


def check_not_recast_since_forward(handle: "FlatParamHandle") -> None:
    """Raises if the handle was cast after the forward whose backward is starting.

    Either through the wrapper (the cast generation moved on) or around it (its Parameters'
    dtype is not the one the handle keeps them in).

    That forward's autograd graph holds views of the old unsharded parameter (old dtype, freed
    storage); running its backward would read freed memory or mix dtypes.

    Raises:
        RuntimeError: Names the unit and the remedy.
    """
    cast_dtype = _cast_around_wrapper(handle)
    if handle.views.forward_cast_generation == handle.views.cast_generation and cast_dtype is None:
        return
    raise RuntimeError(
        f"fsdp: FSDP unit '{handle.unit_name}' was cast to {cast_dtype or handle.dtype} (model.half(), "
        f".to(dtype), ...) between its forward and this backward; the backward would use the "
        f"parameters of before the cast. Cast the model between training steps (after "
        f"backward, or before the forward), then run the forward again."
    )
