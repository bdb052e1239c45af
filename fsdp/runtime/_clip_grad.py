"""``clip_grad_norm_`` over sharded gradients: the norm of the whole model, across all ranks."""

from __future__ import annotations

import math

import torch
from torch import nn

from fsdp.runtime import _collectives as comm
from fsdp.runtime._state import UnitState


def clip_grad_norm_(
    root: nn.Module, state: UnitState, max_norm: float, norm_type: float
) -> torch.Tensor:
    """Clips the gradients of every parameter under ``root`` to a total norm of ``max_norm``.

    Sharded gradients contribute their local part and are summed (max for ``inf``) across the
    group; replicated gradients (NO_SHARD units, parameters FSDP does not manage) are counted
    once. The result equals ``torch.nn.utils.clip_grad_norm_`` on the unsharded model.

    Returns:
        The total norm before clipping (fp32 or the gradients' common dtype).
    """
    assert state.ctx is not None
    norm_type = float(norm_type)
    if norm_type < 0 or math.isnan(norm_type):
        raise ValueError(f"fsdp: clip_grad_norm_ needs norm_type >= 0 or inf, got {norm_type}")
    sharded: list[torch.Tensor] = []
    replicated: list[torch.Tensor] = []
    managed: set[int] = set()
    for unit in state.ctx.states:
        for handle in unit.handles:
            managed.add(id(handle.flat_param))
            managed.update(id(p) for p in handle.managed_orig_params())
            grad = handle.sync_flat_grad_from_orig()
            if grad is None:
                continue
            (sharded if handle.uses_sharding else replicated).append(grad)
    for param in root.parameters():
        if id(param) not in managed and param.grad is not None:
            replicated.append(param.grad)
    grads = sharded + replicated
    device = state.compute_device
    dtype = torch.float32
    if grads:
        dtype = _promoted_dtype(grads)
    if math.isinf(norm_type):
        local = _max_abs(sharded, device)
        comm.all_reduce_max(local, state.process_group)
        total = torch.maximum(local, _max_abs(replicated, device))
    else:
        local = _sum_pow(sharded, norm_type, device)
        comm.all_reduce_sum(local, state.process_group)
        total = local + _sum_pow(replicated, norm_type, device)
        if norm_type != 0:  # the 0-"norm" counts non-zero elements: no root
            total = total ** (1.0 / norm_type)
    clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in grads:
        grad.mul_(clip_coef.to(grad.dtype))
    return total.to(dtype)


def _promoted_dtype(grads: list[torch.Tensor]) -> torch.dtype:
    dtype = grads[0].dtype
    for grad in grads[1:]:
        dtype = torch.promote_types(dtype, grad.dtype)
    return dtype


def _max_abs(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    result = torch.zeros((), dtype=torch.float32, device=device)
    for grad in grads:
        if grad.numel():  # gradients may live on CPU (CPU offload)
            result = torch.maximum(result, grad.detach().abs().max().float().to(device))
    return result


def _sum_pow(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    result = torch.zeros((), dtype=torch.float32, device=device)
    for grad in grads:
        norm = torch.linalg.vector_norm(grad.detach(), norm_type, dtype=torch.float32).to(device)
        result = result + (norm if norm_type == 0 else norm**norm_type)
    return result
