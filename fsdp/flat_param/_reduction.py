"""Turning the unsharded gradient autograd produced into the reduced sharded gradient.

The gradient concern of :class:`~fsdp.flat_param.flat_param.FlatParamHandle` (see [Note:
Gradient flow] in docs/flat_param_lifecycle.md): an existing sharded gradient is stashed before
autograd accumulates, the new unsharded gradient is pre-divided, reduce-scattered (all-reduced
for NO_SHARD, then across replicas for hybrid strategies), post-divided and added to the stash
at the end of backward; inside ``no_sync`` it is only kept. With CPU offload the reduced
gradient is copied into a host buffer.

:class:`HandleGrads` holds the gradient state of one handle; the functions take the handle
(:class:`_Handle` names what they use of it); the handle's methods of the same names call them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional, Protocol

import torch
import torch.distributed as dist
from torch import nn

from fsdp._comm import _collectives as comm
from fsdp._common import p_assert
from fsdp.flat_param._layout import ParamInfo, ShardLayout
from fsdp.flat_param._precision import HandlePrecision
from fsdp.flat_param._storage import on_stream, record_event
from fsdp.flat_param._views import assign_grad

__all__ = ["HandleGrads", "reduction_stays_in_flight"]


class _InflightReduction(NamedTuple):
    """A launched reduction: its work (CPU) or completion event (CUDA), the sharded output it
    writes, whether that still needs the post-divide, and what must stay alive until the
    collective has read it."""

    work: Any
    event: Any
    sharded_grad: torch.Tensor
    post_divide: bool
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
        inflight: A reduction still in flight.
    """

    sharded_grad_stash: Optional[torch.Tensor] = None
    prior_grad_to_reduce: Optional[torch.Tensor] = None
    unsynced_unsharded_grad: Optional[torch.Tensor] = None
    pending_sharded_grad: Optional[torch.Tensor] = None
    inflight: Optional[_InflightReduction] = None

    def in_progress(self) -> bool:
        """Whether a reduction of this backward is under way (in flight or pending)."""
        return self.inflight is not None or self.pending_sharded_grad is not None


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


def reduce_grad(
    handle: _Handle,
    sync: bool,
    comm_hook: Optional[Callable[..., Any]],
    comm_hook_state: Any,
    full_precision: bool,
) -> None:
    """Launches the reduction of the unsharded gradient autograd just accumulated (see
    ``FlatParamHandle.reduce_grad`` for the arguments and the postcondition).

    [Note: One reduction path]
    Every strategy, backend and world size takes this path: reduce-scatter (all-reduce for
    NO_SHARD), then all-reduce across replicas for hybrid strategies, or the comm hook, and
    :func:`wait_reduction` finishes it (post-divide, cast, offload copy, accumulation). On CUDA
    the collectives run on the post-backward stream (``storage.post_backward_stream``), after
    the compute stream's work so far, and the compute stream waits on an event only in
    :func:`wait_reduction` (torch FSDP1's post-backward stream); tests/test_cuda_lane.py's
    training parity runs it (NO_SHARD and HYBRID_SHARD on the two-rank pool, offload on the
    one-rank NCCL pool). On CPU there is no stream: a lone reduce-scatter is an asynchronous
    collective (gloo's thread), anything else completes before this returns.
    """
    unsharded_grad = _take_unsharded_grad(handle)
    if not sync:
        handle.grads.unsynced_unsharded_grad = unsharded_grad
        return
    if unsharded_grad.dtype != handle.precision.reduce_dtype and not full_precision:
        # (full_precision: a backward of a full-precision eval forward keeps its dtype.)
        unsharded_grad = unsharded_grad.to(handle.precision.reduce_dtype)
    p_assert(handle.grads.inflight is None, f"unit '{handle.unit_name}': two reductions in flight")
    stream = handle.storage.post_backward_stream
    in_flight = reduction_stays_in_flight(
        stream is not None, handle.uses_sharding, handle.replicate_world_size, comm_hook is not None
    )
    with on_stream(stream, handle.device):
        if comm_hook is not None:
            sharded_grad = _reduce_with_hook(handle, unsharded_grad, comm_hook, comm_hook_state)
            work, post_divide = None, False
        else:
            sharded_grad, work, post_divide = _reduce_default(handle, unsharded_grad, in_flight and stream is None)
        event = record_event(stream) if stream is not None else None
    if not in_flight:  # complete already (CPU)
        _accumulate_reduced(handle, sharded_grad)
        return
    # The unsharded gradient must stay alive until the collective has read it.
    handle.grads.inflight = _InflightReduction(work, event, sharded_grad, post_divide, unsharded_grad)


def reduction_stays_in_flight(
    has_stream: bool, uses_sharding: bool, replicate_world_size: int, comm_hook: bool
) -> bool:
    """Whether a reduction stays in flight past the post-backward hook (its buffers alive until
    it is waited for): all of them on a post-backward stream (CUDA), else a lone default
    reduce-scatter (gloo's asynchronous collective). The runtime and the planner both ask this.
    """
    return has_stream or (uses_sharding and replicate_world_size == 1 and not comm_hook)


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


def wait_reduction(handle: _Handle) -> None:
    """Completes a reduction in flight: wait, post-divide, accumulate. Else a no-op."""
    inflight = handle.grads.inflight
    if inflight is None:
        return
    handle.grads.inflight = None
    sharded_grad = inflight.sharded_grad
    if inflight.work is not None:
        inflight.work.wait()
    if inflight.event is not None:
        current = torch.cuda.current_stream(handle.device)
        current.wait_event(inflight.event)
        # Made on the post-backward stream, used on this one: keep it from being reused early.
        sharded_grad.record_stream(current)
    if inflight.post_divide and handle.post_divide > 1:
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
        # Copied into a host buffer (pinned with an accelerator); finalize_grad waits for the
        # copies (end of backward).
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


def _reduce_default(
    handle: _Handle, unsharded_grad: torch.Tensor, async_op: bool
) -> tuple[torch.Tensor, Optional[Any], bool]:
    """Pre-divide, reduce-scatter (all-reduce for NO_SHARD), all-reduce across replicas.

    Returns ``(sharded gradient, work, post-divide pending)``: with ``async_op`` a lone
    reduce-scatter only launches (its work is returned and the post-divide waits for it);
    otherwise the reduction is issued in full and post-divided here.
    """
    if handle.pre_divide > 1:
        unsharded_grad.div_(handle.pre_divide)
    sharded_grad = unsharded_grad
    if handle.uses_sharding:
        sharded_grad = torch.empty(
            handle.shard_layout.sharded_numel, dtype=unsharded_grad.dtype, device=unsharded_grad.device
        )
        lone = async_op and handle.replicate_world_size == 1
        work = comm.reduce_scatter_flat(sharded_grad, unsharded_grad, handle.process_group, async_op=lone)
        if lone:
            return sharded_grad, work, True
    elif handle.shard_layout.world_size > 1:
        comm.all_reduce_sum(unsharded_grad, handle.process_group)
    if handle.replicate_world_size > 1:
        comm.all_reduce_sum(sharded_grad, handle.replicate_group)
    if handle.post_divide > 1:
        sharded_grad.div_(handle.post_divide)
    return sharded_grad, None, False


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
