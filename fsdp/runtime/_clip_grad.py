"""``clip_grad_norm_`` over sharded gradients: the norm of the whole model, across all ranks.

[Note: Clip-norm arithmetic]
The returned norm and the clipped gradients are bit-identical to torch FSDP1's, because a norm
that differs in the last place is amplified by adaptive optimizers over a run. That fixes the
order of every operation:

* Every unit unsharded (NO_SHARD, or world size 1): the result is
  ``torch.nn.utils.clip_grad_norm_`` over the root's ``parameters()``, as torch FSDP1 does.
* Otherwise the gradients are split into *sharded* ones (units that shard) and *replicated*
  ones (NO_SHARD units, parameters no unit manages), in unit pre-order then ``parameters()``
  order. A gradient is the FlatParameter's, or with ``use_orig_params`` each original
  parameter's part on this rank (parameters without a part or without a gradient are left
  out). Each group's local norm is the p-norm of the stacked per-gradient p-norms, each taken
  in fp32 (in float64 for a float64 model, whose gradients torch FSDP1 fails to narrow to fp32
  there; every rank takes the dtype from the parameters, which it holds with or without
  gradients, so the ranks' reductions agree). For p = inf the two local norms' maximum is
  max-reduced over the group; otherwise the sharded norm's p-th power is sum-reduced, the
  replicated norm's p-th power added on each rank (it is the same everywhere) and the p-th root
  taken.
* The clip coefficient ``min(max_norm / (norm + 1e-6), 1)`` is cast to each gradient's dtype
  and multiplied in; the norm is returned in the gradients' promoted dtype.

The 0-"norm" of the sharded case has no p-th root (torch FSDP1 fails with a bare
``ZeroDivisionError`` after its all-reduce); ours raises the same type before communicating,
saying why.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import NamedTuple, Union

import torch
from torch import nn

from fsdp._comm import _collectives as comm
from fsdp._comm._phase import collective_phase
from fsdp.flat_param.flat_param import FlatParamHandle
from fsdp.runtime._lazy_init import require_root
from fsdp.runtime._state import UnitState


def clip_root_grad_norm_(
    root: nn.Module, max_norm: Union[float, int], norm_type: Union[float, int]
) -> torch.Tensor:
    """``FullyShardedDataParallel.clip_grad_norm_``: checks the call, then :func:`clip_grad_norm_`.

    Raises:
        RuntimeError: ``root`` is a nested unit.
        ValueError: A unit of the tree is in forward, backward or ``summon_full_params``
            (torch FSDP1's type).
    """
    state = require_root(
        root,
        "clip_grad_norm_()",
        torch_message="`clip_grad_norm_()` should only be called on the root FSDP instance",
        idle_error=ValueError,  # torch FSDP1's type
    )
    return clip_grad_norm_(root, state, float(max_norm), float(norm_type))


def clip_grad_norm_(
    root: nn.Module, state: UnitState, max_norm: float, norm_type: float
) -> torch.Tensor:
    """Clips the gradients of every parameter under ``root`` to a total norm of ``max_norm``.

    The norm covers the gradients of every rank, computed in the same order as torch FSDP1
    ([Note: Clip-norm arithmetic]), so the result is bit-identical to it.

    Args:
        root: The root FSDP instance.
        state: Its state (lazily initialized).
        max_norm: The largest total norm the gradients keep.
        norm_type: The p of the p-norm (``inf`` for the largest absolute value).

    Returns:
        The total norm before clipping, in the gradients' promoted dtype (fp32 without gradients).

    Raises:
        ZeroDivisionError: ``norm_type`` 0 with a sharded unit.
    """
    assert state.ctx is not None, "clip_grad_norm_ runs after lazy init"
    handles = [handle for unit in state.ctx.states for handle in unit.handles]
    if not any(handle.shard_layout.uses_sharding for handle in handles):
        return torch.nn.utils.clip_grad_norm_(root.parameters(), max_norm, norm_type)
    if norm_type == 0:
        raise ZeroDivisionError(
            "fsdp: clip_grad_norm_(norm_type=0) is not defined when gradients are sharded: the "
            "0-'norm' (a count) has no 0-th root to combine the ranks' parts (torch FSDP1 fails "
            "here with 'float division by zero'). Use norm_type 1, 2 or inf."
        )
    sharded, replicated, grads, norm_dtype = _collect_grads(root, handles)
    device = state.compute_device
    local_sharded = _local_norm(sharded, norm_type, device, norm_dtype)
    local_replicated = _local_norm(replicated, norm_type, device, norm_dtype) if replicated else None
    if norm_type == math.inf:
        total = local_sharded if local_replicated is None else torch.maximum(local_sharded, local_replicated)
        with collective_phase("clip_grad_norm_", state):
            comm.all_reduce_max(total, state.process_group)
    else:
        total = local_sharded**norm_type
        with collective_phase("clip_grad_norm_", state):
            comm.all_reduce_sum(total, state.process_group)
        if local_replicated is not None:
            total += local_replicated**norm_type
        total = total ** (1.0 / norm_type)
    if any(handle.storage.offload_params for handle in handles):
        total = total.cpu()

    clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in grads:
        grad.mul_(clip_coef.to(grad.device, grad.dtype))
    if not grads:
        warnings.warn(
            f"Called FSDP.clip_grad_norm_() on rank {state.rank} with no gradients -- returning "
            f"the total norm in the default dtype {total.dtype}",
            stacklevel=4,  # the caller of FullyShardedDataParallel.clip_grad_norm_
        )
        return total
    return total.to(functools.reduce(torch.promote_types, [grad.dtype for grad in grads]))


class _Grads(NamedTuple):
    sharded: list[torch.Tensor]  # from units that shard
    replicated: list[torch.Tensor]  # NO_SHARD units' and unmanaged parameters'
    all: list[torch.Tensor]  # every gradient, for the clipping and the result's dtype
    norm_dtype: torch.dtype  # fp32, or float64 for a float64 model (the same on every rank)


def _collect_grads(root: nn.Module, handles: list[FlatParamHandle]) -> _Grads:
    """The gradients in [Note: Clip-norm arithmetic]'s order and groups, and the norm dtype."""
    sharded: list[torch.Tensor] = []
    replicated: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    managed: set[int] = set()
    for handle in handles:
        target = sharded if handle.shard_layout.uses_sharding else replicated
        flat_grad = handle.grads.sync_from_orig()
        managed.add(id(handle.flat_param))
        if handle.use_orig_params:
            orig_params = handle.managed_orig_params()
            managed.update(id(p) for p in orig_params)
            for param in orig_params:
                if param.grad is not None and param.grad.numel() > 0:
                    target.append(param.grad)
        elif flat_grad is not None:
            target.append(flat_grad)
        if flat_grad is not None:
            grads.append(flat_grad)
    unmanaged = [param for param in root.parameters() if id(param) not in managed]
    for param in unmanaged:
        if param.grad is not None:
            replicated.append(param.grad)
            grads.append(param.grad)
    dtypes = [handle.flat_param.dtype for handle in handles] + [param.dtype for param in unmanaged]
    return _Grads(sharded, replicated, grads, functools.reduce(torch.promote_types, dtypes, torch.float32))


def _local_norm(grads: list[torch.Tensor], norm_type: float, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The p-norm of the stacked per-gradient p-norms, all taken in ``dtype`` (fp32, or float64
    for a float64 model), on ``device`` (0 without any).

    Gradients may live on CPU (CPU offload); each norm is taken where its gradient lives.
    """
    if not grads:
        return torch.zeros((), dtype=dtype, device=device)
    per_grad = [torch.linalg.vector_norm(grad.detach(), norm_type, dtype=dtype) for grad in grads]
    return torch.linalg.vector_norm(torch.stack(per_grad), norm_type, dtype=dtype).to(device=device)
