"""Turning the unsharded gradient autograd produced into the reduced sharded gradient.

The gradient concern of :class:`~fsdp.flat_param.flat_param.FlatParamHandle` (see [Note:
Gradient flow] in docs/flat_param_lifecycle.md): an existing sharded gradient is stashed before
autograd accumulates, the new unsharded gradient is pre-divided, reduce-scattered (all-reduced
for NO_SHARD, then across replicas for hybrid strategies), post-divided and added to the stash
at the end of backward; inside ``no_sync`` it is only kept. On two gloo ranks the reduction
can start from the per-parameter gradients instead ([Note: Per-parameter gradient reduction]
in ``_views.py``). With CPU offload the reduced gradient is copied back to pinned CPU memory.

:class:`HandleGrads` holds the gradient state of one handle; the functions take the handle
(:class:`_Handle` names what they use of it); the handle's methods of the same names call them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional, Protocol, Sequence

import torch
import torch.distributed as dist
from torch import nn

from fsdp._comm import _collectives as comm
from fsdp._common import p_assert
from fsdp.flat_param._early_grads import can_take_early, settle_open_run
from fsdp.flat_param._layout import ParamInfo, ShardLayout
from fsdp.flat_param._precision import HandlePrecision
from fsdp.flat_param._views import assign_grad

__all__ = ["HandleGrads"]


class _InflightReduction(NamedTuple):
    """A launched reduce-scatter: its work, the sharded output it writes, and what must stay
    alive until the collective has read it."""

    work: Any
    sharded_grad: torch.Tensor
    keep_alive: Any


@dataclass(eq=False)
class HandleGrads:
    """The gradients one handle holds between autograd and the optimizer.

    Attributes:
        sharded_grad_stash: The reduced sharded ``.grad`` of earlier backwards, moved aside
            before autograd accumulates and added back at the end of backward.
        prior_grad_to_reduce: NO_SHARD: an existing gradient the new one is added to *before*
            the reduction (as torch FSDP1).
        unsynced_unsharded_grad: Inside ``no_sync``: the accumulated unsharded gradient.
        pending_sharded_grad: This backward's reduced sharded gradient, until finalize_grad.
        inflight: A reduce-scatter still in flight.
        param_grads: Per-parameter gradients of this backward, when reduced from the pieces
            ([Note: Per-parameter gradient reduction]).
        open_run_grads: Early gradients of the forward call being backpropagated, not yet in
            ``param_grads`` (``_early_grads.py``: ``take_param_grad``).
        open_run: Which forward call ``open_run_grads`` belong to.
    """

    sharded_grad_stash: Optional[torch.Tensor] = None
    prior_grad_to_reduce: Optional[torch.Tensor] = None
    unsynced_unsharded_grad: Optional[torch.Tensor] = None
    pending_sharded_grad: Optional[torch.Tensor] = None
    inflight: Optional[_InflightReduction] = None
    param_grads: Optional[list[Optional[torch.Tensor]]] = None
    open_run_grads: Optional[list[Optional[torch.Tensor]]] = None
    open_run: Optional[int] = None

    def in_progress(self) -> bool:
        """Whether a reduction of this backward is under way (in flight, pending, or kept
        per parameter)."""
        return self.inflight is not None or self.pending_sharded_grad is not None or self.param_grads is not None


class _Handle(Protocol):
    """What this module uses of a ``FlatParamHandle`` (a structural type: ``flat_param.py``
    imports this module, so importing the class here would be a cycle)."""

    unit_name: str
    device: torch.device
    flat_param: nn.Parameter
    grads: HandleGrads
    storage: Any
    shard_layout: ShardLayout
    param_infos: list[ParamInfo]
    process_group: dist.ProcessGroup
    replicate_group: Optional[dist.ProcessGroup]
    replicate_world_size: int
    pre_divide: float
    post_divide: float
    piecewise_reduction_allowed: bool

    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def precision(self) -> HandlePrecision: ...
    @property
    def uses_sharding(self) -> bool: ...
    @property
    def offload_params(self) -> bool: ...
    @property
    def has_unsharded_buffer(self) -> bool: ...
    @property
    def _local_shard(self) -> torch.Tensor: ...
    def sync_flat_grad_from_orig(self) -> Optional[torch.Tensor]: ...
    def use_sharded_grad_views(self) -> None: ...
    def _set_sharded_grad(self, grad: Optional[torch.Tensor]) -> None: ...
    def _reduce_pieces(self) -> None: ...
    def wait_reduction(self) -> None: ...
    def reshard(self) -> None: ...


def stash_sharded_grad(handle: _Handle) -> None:
    """Moves an existing (already reduced) ``.grad`` aside before autograd accumulates.

    Called from a hook on the FlatParameter just before AccumulateGrad, so the new
    unsharded gradient never mixes with the reduced sharded one; the stash is added back
    after the reduction (gradient accumulation without ``no_sync``).
    """
    grad = handle.sync_flat_grad_from_orig()
    if grad is not None and not handle.uses_sharding:
        # The existing gradient is already the whole (averaged) gradient: like torch FSDP1,
        # add the new one to it and reduce the sum, in the existing gradient's dtype.
        handle.grads.prior_grad_to_reduce = grad
        handle.flat_param.grad = None
        return
    if grad is not None:
        p_assert(
            handle.grads.sharded_grad_stash is None,
            f"unit '{handle.unit_name}': gradient stashed twice in one backward",
        )
        # keep_low_precision_grads: accumulate in full precision (as torch FSDP1 does).
        handle.grads.sharded_grad_stash = grad.to(handle.dtype)
        handle.flat_param.grad = None


def collect_param_grads(handle: _Handle, grads: list[Optional[torch.Tensor]]) -> bool:
    """Keeps this backward's per-parameter gradients for a reduction from the pieces.

    Returns False (nothing kept) where that reduction does not apply; the caller then
    hands autograd the concatenated gradient. A unit used twice in one forward gets its
    gradients summed here, as autograd would sum them.
    """
    reduce_dtype = handle.precision.reduce_dtype
    reduces_from_pieces = (
        can_take_early(handle)  # the reduction itself takes the pieces this backward
        and any(g is not None for g in grads)
        and all(g is None or (g.dtype == reduce_dtype and g.is_contiguous()) for g in grads)
    )
    if not reduces_from_pieces:
        return False
    kept = handle.grads.param_grads
    if kept is None:
        handle.grads.param_grads = list(grads)
    else:
        handle.grads.param_grads = [b if a is None else a if b is None else a + b for a, b in zip(kept, grads)]
    return True


def reduce_pieces(handle: _Handle) -> None:
    """Launches the two-rank reduce-scatter from the per-parameter gradients (async)."""
    grads, handle.grads.param_grads = handle.grads.param_grads, None
    assert grads is not None
    layout = handle.shard_layout
    reference = next(g for g in grads if g is not None)
    numel = layout.sharded_numel
    own_start = layout.rank * numel
    peer_start = (1 - layout.rank) * numel
    peer_half = reference.new_zeros(numel) if _has_gaps(handle, grads, peer_start) else reference.new_empty(numel)
    own_parts: list[tuple[int, torch.Tensor]] = []
    for grad, info, param_start in zip(grads, handle.param_infos, layout.flat.param_offsets):
        param_end = param_start + info.numel
        if grad is not None:
            flat_grad = grad.reshape(-1)
            lo, hi = max(param_start, peer_start), min(param_end, peer_start + numel)
            if lo < hi:
                torch.div(
                    flat_grad[lo - param_start : hi - param_start],
                    handle.pre_divide,
                    out=peer_half[lo - peer_start : hi - peer_start],
                )
            lo, hi = max(param_start, own_start), min(param_end, own_start + numel)
            if lo < hi:
                own_parts.append((lo - own_start, flat_grad[lo - param_start : hi - param_start]))
    sharded_grad = torch.empty(numel, dtype=reference.dtype, device=reference.device)
    work = comm.reduce_scatter_halves(
        sharded_grad, peer_half, own_parts, 1.0 / handle.pre_divide, handle.process_group
    )
    handle.grads.inflight = _InflightReduction(work, sharded_grad, (peer_half, own_parts))


def _has_gaps(handle: _Handle, grads: Sequence[Optional[torch.Tensor]], half_start: int) -> bool:
    """Whether part of ``[half_start, half_start + sharded_numel)`` gets no gradient
    (padding, alignment padding included, or a parameter without one): it must then be
    sent as zeros."""
    layout = handle.shard_layout
    half_end = half_start + layout.sharded_numel
    if half_end > layout.unpadded_unsharded_numel:
        return True
    if any(offset < half_end and offset + numel > half_start for offset, numel in layout.flat.padding_runs()):
        return True
    for grad, info, param_start in zip(grads, handle.param_infos, layout.flat.param_offsets):
        param_end = param_start + info.numel
        if grad is None and param_start < half_end and param_end > half_start:
            return True
    return False


def reduce_grad(
    handle: _Handle,
    sync: bool,
    comm_hook: Optional[Callable[..., Any]],
    comm_hook_state: Any,
    async_op: bool,
    full_precision: bool,
) -> None:
    """Reduces the unsharded gradient autograd just accumulated (see
    ``FlatParamHandle.reduce_grad`` for the arguments and the postcondition)."""
    settle_open_run(handle)
    if handle.grads.param_grads is not None:
        p_assert(
            sync and comm_hook is None and async_op,
            f"unit '{handle.unit_name}': per-parameter gradients kept for a reduction that "
            f"cannot take them",
        )
        handle._reduce_pieces()
        return
    unsharded_grad = _take_unsharded_grad(handle)
    if not sync:
        handle.grads.unsynced_unsharded_grad = unsharded_grad
        return
    if unsharded_grad.dtype != handle.precision.reduce_dtype and not full_precision:
        # (full_precision: a backward of a full-precision eval forward keeps its dtype.)
        unsharded_grad = unsharded_grad.to(handle.precision.reduce_dtype)
    if async_op and comm_hook is None and handle.uses_sharding and handle.replicate_world_size == 1:
        _launch_reduce_scatter(handle, unsharded_grad)
        return
    if comm_hook is not None:
        sharded_grad = _reduce_with_hook(handle, unsharded_grad, comm_hook, comm_hook_state)
    else:
        sharded_grad = _reduce_default(handle, unsharded_grad)
    _accumulate_reduced(handle, sharded_grad)


def _take_unsharded_grad(handle: _Handle) -> torch.Tensor:
    """Takes the FlatParameter's unsharded gradient (``.grad`` becomes None), with any prior
    NO_SHARD gradient and any ``no_sync`` accumulation added to it."""
    unsharded_grad = handle.flat_param.grad
    handle.flat_param.grad = None
    p_assert(unsharded_grad is not None, f"unit '{handle.unit_name}': no gradient to reduce")
    assert unsharded_grad is not None  # for type checkers
    padded_unsharded_numel = handle.shard_layout.padded_unsharded_numel
    p_assert(
        unsharded_grad.numel() == padded_unsharded_numel,
        f"unit '{handle.unit_name}': expected an unsharded gradient of "
        f"{padded_unsharded_numel} elements, got {unsharded_grad.numel()}",
    )
    grads = handle.grads
    if grads.prior_grad_to_reduce is not None:
        unsharded_grad = grads.prior_grad_to_reduce.add(unsharded_grad.to(grads.prior_grad_to_reduce.dtype))
        grads.prior_grad_to_reduce = None
    if grads.unsynced_unsharded_grad is not None:
        unsharded_grad = unsharded_grad + grads.unsynced_unsharded_grad
        grads.unsynced_unsharded_grad = None
    return unsharded_grad


def _launch_reduce_scatter(handle: _Handle, unsharded_grad: torch.Tensor) -> None:
    """Pre-divides and launches the reduce-scatter; :func:`wait_reduction` completes it."""
    p_assert(handle.grads.inflight is None, f"unit '{handle.unit_name}': two reductions in flight")
    if handle.pre_divide > 1:
        unsharded_grad.div_(handle.pre_divide)
    sharded_grad = torch.empty(
        handle.shard_layout.sharded_numel, dtype=unsharded_grad.dtype, device=unsharded_grad.device
    )
    work = comm.reduce_scatter_flat(sharded_grad, unsharded_grad, handle.process_group, async_op=True)
    # The unsharded gradient must stay alive until the collective has read it.
    handle.grads.inflight = _InflightReduction(work, sharded_grad, unsharded_grad)


def wait_reduction(handle: _Handle) -> None:
    """Completes an in-flight reduce-scatter: wait, post-divide, accumulate. Else a no-op."""
    inflight = handle.grads.inflight
    if inflight is None:
        return
    handle.grads.inflight = None
    if inflight.work is not None:
        inflight.work.wait()
    sharded_grad = inflight.sharded_grad
    if handle.post_divide > 1:
        sharded_grad.div_(handle.post_divide)
    _accumulate_reduced(handle, sharded_grad)


def _accumulate_reduced(handle: _Handle, sharded_grad: torch.Tensor) -> None:
    """Adds a reduced (post-divided) gradient to this backward's pending sharded gradient.

    The gradient is cast back to full precision first: accumulation, the stash and the
    optimizer work on full-precision gradients (see [Note: Mixed precision dtypes]).
    """
    if sharded_grad.dtype != handle.dtype:
        sharded_grad = sharded_grad.to(handle.dtype)
    if handle.offload_params:
        # Copied back to pinned CPU memory; finalize_grad waits for it (end of backward).
        offloaded = handle.storage.new_host_buffer(sharded_grad)
        offloaded.copy_(sharded_grad, non_blocking=True)
        sharded_grad = offloaded
    pending = handle.grads.pending_sharded_grad
    if pending is not None:
        if handle.offload_params and handle.device.type == "cuda":
            # Both are pinned CPU tensors that non-blocking copies may still be writing; the
            # CPU add must not read them before the copies are done.
            torch.cuda.current_stream(handle.device).synchronize()
        pending.add_(sharded_grad)
    else:
        handle.grads.pending_sharded_grad = sharded_grad


def _reduce_with_hook(
    handle: _Handle, unsharded_grad: torch.Tensor, comm_hook: Callable[..., Any], comm_hook_state: Any
) -> torch.Tensor:
    """torch FSDP1's hook convention: ``hook(state, grad, output)`` sharded, else ``hook(state, grad)``."""
    if not handle.uses_sharding:
        comm_hook(comm_hook_state, unsharded_grad)
        return unsharded_grad
    output = torch.empty(
        handle.shard_layout.sharded_numel, dtype=unsharded_grad.dtype, device=unsharded_grad.device
    )
    comm_hook(comm_hook_state, unsharded_grad, output)
    return output


def _reduce_default(handle: _Handle, unsharded_grad: torch.Tensor) -> torch.Tensor:
    """Pre-divide, reduce-scatter (all-reduce for NO_SHARD), all-reduce across replicas, post-divide."""
    sharded_grad = unsharded_grad
    if handle.pre_divide > 1:
        unsharded_grad.div_(handle.pre_divide)
    if handle.uses_sharding:
        sharded_grad = torch.empty(
            handle.shard_layout.sharded_numel, dtype=unsharded_grad.dtype, device=unsharded_grad.device
        )
        comm.reduce_scatter_flat(sharded_grad, unsharded_grad, handle.process_group)
    elif handle.shard_layout.world_size > 1:
        comm.all_reduce_sum(unsharded_grad, handle.process_group)
    if handle.replicate_world_size > 1:
        comm.all_reduce_sum(sharded_grad, handle.replicate_group)
    if handle.post_divide > 1:
        sharded_grad.div_(handle.post_divide)
    return sharded_grad


def finalize_grad(handle: _Handle) -> None:
    """At the end of backward: sets ``.grad`` to the sharded gradient (plus any stash).

    Precondition: the FlatParameter holds its sharded data (or never shards).
    """
    handle.wait_reduction()
    if handle.offload_params and handle.device.type == "cuda":
        torch.cuda.current_stream(handle.device).synchronize()  # offloaded gradient copies
    grads = handle.grads
    pending, stash = grads.pending_sharded_grad, grads.sharded_grad_stash
    grads.pending_sharded_grad = None
    grads.sharded_grad_stash = None
    if pending is None and stash is None:
        handle.use_sharded_grad_views()  # no_sync: the held unsharded gradient's views
        return
    if handle.has_unsharded_buffer:
        p_assert(
            handle.flat_param.data.data_ptr() == handle._local_shard.data_ptr(),
            f"unit '{handle.unit_name}': finalize_grad while the FlatParameter is unsharded",
        )
    grad: Optional[torch.Tensor] = pending if pending is not None else stash
    if pending is not None and stash is not None:
        stash.add_(pending)
        grad = stash
    handle._set_sharded_grad(grad)


def set_sharded_grad(handle: _Handle, grad: Optional[torch.Tensor]) -> None:
    """Sets the FlatParameter's ``.grad`` (in ``grad_dtype``) and the original params' views."""
    if grad is not None and grad.dtype != handle.precision.grad_dtype:
        grad = grad.to(handle.precision.grad_dtype)
    assign_grad(handle.flat_param, grad)
    handle.use_sharded_grad_views()


def abandon_backward(handle: _Handle) -> None:
    """Drops what an interrupted backward left behind; restores the gradient from before it.

    Postcondition: sharded (if the handle shards), no pending reduction, ``.grad`` as it
    was before that backward.
    """
    handle.wait_reduction()  # never leave a collective in flight
    grads = handle.grads
    grads.pending_sharded_grad = None
    grads.param_grads = None
    grads.open_run_grads, grads.open_run = None, None
    grad = handle.flat_param.grad
    if grad is not None and grad.shape != handle._local_shard.shape:
        handle.flat_param.grad = None  # an unreduced unsharded gradient
    if handle.has_unsharded_buffer:
        handle.reshard()
    stash, grads.sharded_grad_stash = grads.sharded_grad_stash, None
    if grads.prior_grad_to_reduce is not None:
        stash, grads.prior_grad_to_reduce = grads.prior_grad_to_reduce, None
    if stash is not None:
        assign_grad(handle.flat_param, stash.to(handle.precision.grad_dtype))
    handle.use_sharded_grad_views()
