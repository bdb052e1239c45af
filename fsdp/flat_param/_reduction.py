"""Turning the unsharded gradient autograd produced into the reduced sharded gradient.

:class:`GradReduction` is the gradient part of :class:`~fsdp.flat_param.flat_param.FlatParamHandle`
(see [Note: Gradient flow] in docs/flat_param_lifecycle.md): it receives the layout, the storage,
the groups and the views at construction and owns the gradient state. An existing sharded
gradient is stashed before autograd accumulates, the new unsharded gradient is pre-divided,
reduce-scattered (all-reduced for NO_SHARD, then across replicas for hybrid strategies),
post-divided and added to the stash at the end of backward; inside ``no_sync`` it is only kept.
With CPU offload the reduced gradient is copied into a host buffer. With use_orig_params the
original Parameters' ``.grad`` view the sharded gradient, and a ``.grad`` the user replaced is
taken back.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from fsdp._comm import _collectives as comm
from fsdp._comm._phase import collective_phase
from fsdp._common import group_size, p_assert
from fsdp.flat_param._layout import ShardLayout
from fsdp.flat_param._policy import UnitPolicy
from fsdp.flat_param._sharding import gradient_divide_factors
from fsdp.flat_param import _streams
from fsdp.flat_param._storage import FlatParamStorage
from fsdp.flat_param._views import ParamViews, assign_grad

__all__ = ["GradReduction"]


class _InflightReduction(NamedTuple):
    """A reduction launched on the post-backward stream (the all-reduce stream finishes a
    hybrid one): its completion event, the sharded gradient it makes (in its kept form), the
    reduction's input as the compute stream made it, alive until the compute stream has waited
    for ``input_read`` (None once released, or when the kept form holds the same memory), and
    that event, recorded on the post-backward stream after its last read of the input ([Note:
    The reduction's input outlives its readers])."""

    event: Any  # torch.cuda.Event (the stream layer's)
    sharded_grad: torch.Tensor
    keep_alive: Optional[torch.Tensor]
    input_read: Any


class GradReduction:
    """The gradients one handle holds between autograd and the optimizer, and their reduction.

    Args:
        storage: The handle's storage (the FlatParameter, the local shard, the precision, the
            post-backward stream).
        layout: The handle's shard layout.
        process_group: The group the gradient is reduce-scattered (NO_SHARD: all-reduced) over.
        replicate_group: Hybrid strategies: the group it is then all-reduced over.
        views: The handle's views (the original Parameters, the unit's name).

    Attributes:
        sharded_grad_stash: The reduced sharded ``.grad`` of earlier backwards, moved aside
            before autograd accumulates and added back at the end of backward.
        prior_grad_to_reduce: NO_SHARD: an existing gradient the new one is added to *before*
            the reduction (as torch FSDP1).
        holds_unsynced: Inside ``no_sync`` (a strategy that shards): the FlatParameter's
            ``.grad`` is the accumulated unsharded gradient, not a reduced sharded one
            ([Note: The gradient no_sync accumulates]).
        unsynced_unsharded_grad: That gradient, moved aside from ``.grad`` while a backward
            accumulates a new one (from :meth:`stash` to :meth:`reduce`).
        pending_sharded_grad: This backward's reduced sharded gradient, until :meth:`finalize`.
        inflight: A reduction still in flight.
        stepped_in_backward: This backward's gradient was finalized early and stepped by
            optimizers in backward ([Note: Optimizers in backward] in ``runtime/_hooks.py``).
        pre_divide, post_divide: torch FSDP1's gradient divide factors over every
            data-parallel replica (shard group x replicate group).

    Postcondition of :meth:`reduce`: ``.grad`` is None; the reduced sharded gradient waits in
    ``pending_sharded_grad`` (or in flight) until :meth:`finalize`.
    """

    def __init__(
        self,
        storage: FlatParamStorage,
        layout: ShardLayout,
        process_group: dist.ProcessGroup,
        replicate_group: Optional[dist.ProcessGroup],
        views: ParamViews,
    ) -> None:
        self.storage = storage
        self.layout = layout
        self.process_group = process_group
        self.replicate_group = replicate_group
        self.replicate_world_size = group_size(replicate_group) if replicate_group else 1
        self.views = views
        self.pre_divide, self.post_divide = gradient_divide_factors(
            group_size(process_group) * self.replicate_world_size
        )
        self.sharded_grad_stash: Optional[torch.Tensor] = None
        self.prior_grad_to_reduce: Optional[torch.Tensor] = None
        self.holds_unsynced = False
        self.unsynced_unsharded_grad: Optional[torch.Tensor] = None
        self.pending_sharded_grad: Optional[torch.Tensor] = None
        self.inflight: Optional[_InflightReduction] = None
        self.stepped_in_backward = False

    @property
    def unit_name(self) -> str:
        """The unit's name (the views hold it); also what a failed collective's message names
        ([Note: Collective phase]: :meth:`reduce` gives itself as the unit)."""
        return self.views.unit_name

    def in_progress(self) -> bool:
        """Whether a reduction of this backward is under way (in flight or pending)."""
        return self.inflight is not None or self.pending_sharded_grad is not None

    def stash(self) -> None:
        """Moves an existing (already reduced) ``.grad`` aside before autograd accumulates.

        Called from a hook on the FlatParameter just before AccumulateGrad, so the new
        unsharded gradient never mixes with the reduced sharded one; the stash is added back
        after the reduction (gradient accumulation without ``no_sync``).
        """
        grad = self.sync_from_orig()
        if grad is not None and self.holds_unsynced:
            # The unsharded gradient no_sync accumulated: the new one is added to it in
            # :meth:`reduce` ([Note: The gradient no_sync accumulates]).
            self.unsynced_unsharded_grad = grad
            self.holds_unsynced = False
            self.storage.flat_param.grad = None
            return
        if grad is not None and not self.layout.uses_sharding:
            # The existing gradient is already the whole (averaged) gradient: like torch FSDP1,
            # add the new one to it and reduce the sum, in the existing gradient's dtype.
            self.prior_grad_to_reduce = grad
            self.storage.flat_param.grad = None
            return
        if grad is not None:
            p_assert(
                self.sharded_grad_stash is None,
                f"unit '{self.unit_name}': gradient stashed twice in one backward",
            )
            # keep_low_precision_grads: accumulate in full precision (as torch FSDP1 does).
            self.sharded_grad_stash = grad.to(self.storage.precision.full_dtype)
            self.storage.flat_param.grad = None

    def reduce(
        self,
        sync: bool,
        comm_hook: Optional[Callable[..., object]],
        comm_hook_state: object,
        full_precision: bool,
    ) -> None:
        """Launches the reduction of the unsharded gradient autograd just accumulated (see
        the class docstring for the postcondition). It stays in flight past this call where
        ``UnitPolicy.reduction_stays_in_flight`` says so for this handle's post-backward stream
        (or its absence): [Note: One schedule], the rule the planner replays.

        [Note: One reduction path]
        Every strategy, backend and world size takes this path: the cast to ``reduce_dtype``,
        reduce-scatter (all-reduce for NO_SHARD) or the comm hook, then for hybrid strategies the
        all-reduce across replicas, post-divide and the kept form (cast back, offload copy), and
        :meth:`wait` accumulates it. On CUDA the cast and the collective run on the
        post-backward stream (``storage.post_backward_stream``), after the compute stream's work
        so far, the all-reduce across replicas on the all-reduce stream ([Note: The all-reduce
        across replicas runs on its own stream]); the compute stream waits for the reduction
        only where its input's memory is given back (:meth:`release_input`, at the next unit's
        gradient assembly) and for its result at the end of backward (:meth:`wait`), as torch
        FSDP1's compute stream waits for its post-backward stream only there ([Note: Stream
        edges] in ``_streams.py``; [Note: Overlapped gradient reduction] in docs/hook_order.md).
        tests/test_cuda_lane.py's training parity runs it (NO_SHARD and HYBRID_SHARD on the
        two-rank pool, offload on the one-rank NCCL pool) and its overlap tests time it;
        tests/test_streams.py checks every edge on CPU. On CPU there is no stream: the
        reduction completes before this returns ([Note: On CPU a collective completes where it
        is launched] in ``_policy.py``).
        """
        unsharded_grad = self._take_unsharded_grad()
        if not sync:
            self._hold_unsynced(unsharded_grad)
            return
        p_assert(self.inflight is None, f"unit '{self.unit_name}': two reductions in flight")
        stream = self.storage.post_backward_stream
        in_flight = UnitPolicy.reduction_stays_in_flight(stream is not None)
        p_assert(not in_flight or stream is not None, f"unit '{self.unit_name}': a reduction in flight needs a stream")
        # The input as the compute stream made it stays referenced while the post-backward
        # stream may read it ([Note: The reduction's input outlives its readers], release_input).
        # (Without a stream the reduction completes here: no second reference, so a cast frees
        # the input at once, as it always has on CPU.)
        reduction_input = unsharded_grad.detach() if in_flight else None
        if stream is not None:
            stream.wait_stream(_streams.current_stream(self.storage.device))  # [Note: Stream edges], 3
        with _streams.use_stream(stream), collective_phase(None, self):
            cast = unsharded_grad.dtype != self.storage.precision.reduce_dtype and not full_precision
            if cast:
                # On the post-backward stream, as torch FSDP1 casts (full_precision: a backward
                # of a full-precision eval forward keeps its dtype).
                unsharded_grad = unsharded_grad.to(self.storage.precision.reduce_dtype)
                input_read = _streams.record_event(stream) if stream is not None else None
            if comm_hook is not None:
                sharded_grad = self._reduce_with_hook(unsharded_grad, comm_hook, comm_hook_state)
            else:
                sharded_grad = self._reduce_in_group(unsharded_grad)
            reduced = _streams.record_event(stream) if stream is not None else None
            if not cast:
                input_read = reduced
        sharded_grad, event = self._finish(sharded_grad, comm_hook is None, stream, reduced)
        if reduction_input is None:  # complete already (no stream)
            self._accumulate_reduced(sharded_grad)
            return
        if reduction_input.untyped_storage().data_ptr() == sharded_grad.untyped_storage().data_ptr():
            keep: Optional[torch.Tensor] = None  # the kept form holds it (NO_SHARD in place)
        else:
            keep = reduction_input
        self.inflight = _InflightReduction(event, sharded_grad, keep, input_read)

    def _finish(
        self, sharded_grad: torch.Tensor, default: bool, stream: Optional[Any], reduced_event: Any
    ) -> tuple[torch.Tensor, Any]:
        """The rest of a reduction after the collective over the shard group: the all-reduce
        across replicas (hybrid strategies, default reduction) and post-divide, then the kept
        form ([Note: A reduction finishes on its stream]). Returns the kept form and the event
        the compute stream waits on for it (None without streams).

        [Note: The all-reduce across replicas runs on its own stream]
        A hybrid unit's all-reduce runs on the all-reduce stream, after the reduce-scatter's
        event (``reduced_event``, recorded on the post-backward stream right after it), so the
        next unit's reduce-scatter on the post-backward stream is not queued behind it, as in
        torch FSDP1. The reduce-scatter's output was allocated on the
        post-backward stream: held by the in-flight record where it is the kept form, else
        ``record_stream``ed on the all-reduce stream before it is dropped, so the post-backward
        stream's next allocations reuse it only once the all-reduce stream is done with it.
        tests/test_cuda_lane.py's overlap test times it; tests/test_streams.py checks the edges.
        """
        finish_stream = stream
        replicated = default and self.replicate_world_size > 1
        if replicated and stream is not None:
            finish_stream = self.storage.all_reduce_stream
            p_assert(finish_stream is not None, f"unit '{self.unit_name}': no all-reduce stream")
            assert finish_stream is not None  # for type checkers
            finish_stream.wait_event(reduced_event)  # [Note: Stream edges], 4
        with _streams.use_stream(finish_stream), collective_phase(None, self):
            reduced = sharded_grad
            if replicated:
                comm.all_reduce_sum(reduced, self.replicate_group)
            if default and self.post_divide > 1:
                reduced.div_(self.post_divide)
            kept = self._kept_form(reduced)
            if finish_stream is not stream and kept is not reduced:
                _streams.record_stream(reduced, finish_stream)
            event = _streams.record_event(finish_stream) if finish_stream is not None else None
        return kept, event

    def _take_unsharded_grad(self) -> torch.Tensor:
        """Takes the FlatParameter's unsharded gradient (``.grad`` becomes None), with any prior
        NO_SHARD gradient and any ``no_sync`` accumulation added to it."""
        unsharded_grad = self.storage.flat_param.grad
        self.storage.flat_param.grad = None
        p_assert(unsharded_grad is not None, f"unit '{self.unit_name}': no gradient to reduce")
        assert unsharded_grad is not None  # for type checkers
        padded_unsharded_numel = self.layout.padded_unsharded_numel
        p_assert(
            unsharded_grad.numel() == padded_unsharded_numel,
            f"unit '{self.unit_name}': expected an unsharded gradient of "
            f"{padded_unsharded_numel} elements, got {unsharded_grad.numel()}",
        )
        if self.prior_grad_to_reduce is not None:
            unsharded_grad = self.prior_grad_to_reduce.add(unsharded_grad.to(self.prior_grad_to_reduce.dtype))
            self.prior_grad_to_reduce = None
        held, self.unsynced_unsharded_grad = self.unsynced_unsharded_grad, None
        if held is not None:
            # Added into autograd's new gradient in place (torch FSDP1 adds the new one into the
            # held one in place: the same two gradients alive, the same sums).
            dtype = torch.promote_types(unsharded_grad.dtype, held.dtype)
            if dtype != unsharded_grad.dtype:
                unsharded_grad = unsharded_grad.to(dtype)
            unsharded_grad[: held.numel()].add_(held.reshape(-1))
        return unsharded_grad

    def release_input(self) -> None:
        """Gives the compute stream back the memory of a reduction in flight's input: the
        compute stream waits for the event after the post-backward stream's last read of it and
        drops the reference. The rest of the reduction (a hybrid all-reduce, the cast to full
        precision, the offload copy) stays in flight. A no-op without a reduction in flight or
        when nothing is held.

        [Note: The reduction's input outlives its readers]
        On CUDA the compute stream made the reduction's input (``unsharded_grad`` in
        :meth:`reduce`) and the post-backward stream reads it. The caching allocator ties a
        block to the stream that allocated it: once the last reference dies, the compute
        stream's next allocation (the previous unit's backward) may reuse the block while the
        post-backward stream still reads it. A comm hook may
        drop that reference itself: torch's ``fp16_compress_hook``/``bf16_compress_hook`` (and
        ours) replace ``grad.data`` with a cast copy whose kernel is queued on the
        post-backward stream, so the fp32 block would be free while the cast has not run.
        ``reduction_input`` is a second reference to the same storage, held by the in-flight
        record until the compute stream has waited for ``input_read``, the event after the
        post-backward stream's last read of it (the cast to ``reduce_dtype`` where there is
        one, else the collective): :meth:`release_input` at the next unit's gradient
        assembly, or :meth:`wait`. After that the compute stream frees it, in order: at most
        one input is alive at a time, as before. Without a cast it costs nothing the reduction
        would not hold anyway (the collective reads the same tensor). With one, the input kept
        is the ``param_dtype`` gradient (its ``reduce_dtype`` copy, made on the post-backward
        stream, is freed there once the collective is issued): smaller than the copy the
        compute stream kept while it cast, except while the reduced shard is allocated, when
        both the gradient and its copy are alive (one reduced shard, 1/N of the copy, more
        than the cast on the compute stream held; the planner replays it, plan/_schedule.py).
        tests/test_cuda_lane.py's compress-hook race runs a hook that holds the post-backward
        stream (``torch.cuda._sleep``) before ``bf16_compress_hook`` casts.
        """
        inflight = self.inflight
        if inflight is None or inflight.keep_alive is None:
            return
        _streams.current_stream(self.storage.device).wait_event(inflight.input_read)  # [Note: Stream edges], 5
        self.inflight = inflight._replace(keep_alive=None)

    def _hold_unsynced(self, unsharded_grad: torch.Tensor) -> None:
        """Inside ``no_sync``: the accumulated unsharded gradient becomes ``.grad``.

        [Note: The gradient no_sync accumulates]
        torch FSDP1 leaves the accumulated unsharded gradient on the FlatParameter's ``.grad``,
        unpadded (``_unpadded_unsharded_size``), whatever the FlatParameter's ``.data`` is then
        (the local shard once resharded), and the original Parameters' ``.grad`` (use_orig_params)
        view it in their original shapes. So does fsdp: ``.grad`` is the unpadded view of the
        padded gradient autograd made, and the only reference to it, so ``zero_grad
        (set_to_none=True)`` frees it as it frees torch's. A strategy that shards marks it
        (:attr:`holds_unsynced`): the next backward moves it aside (:meth:`stash`) and adds the
        new gradient to it, and a synchronized one reduces the sum; a sharded gradient of an
        earlier synchronized backward stays in :attr:`sharded_grad_stash` until then, as torch
        keeps its ``_saved_grad_shard``. NO_SHARD's gradient is whole either way, so there it
        is the existing gradient a synchronized backward adds to (:attr:`prior_grad_to_reduce`).
        tests/test_torch_fsdp1_cases.py compares ``.grad`` with torch FSDP1's at each point.
        """
        numel = self.layout.unpadded_unsharded_numel
        shown = unsharded_grad if unsharded_grad.numel() == numel else unsharded_grad[:numel]
        assign_grad(self.storage.flat_param, shown)
        self.holds_unsynced = self.layout.uses_sharding

    def wait(self) -> None:
        """Completes a reduction in flight: wait, accumulate. Else a no-op."""
        inflight = self.inflight
        if inflight is None:
            return
        self.inflight = None
        sharded_grad = inflight.sharded_grad
        current = _streams.current_stream(self.storage.device)
        current.wait_event(inflight.event)  # [Note: Stream edges], 5
        if not self.storage.offload_params:  # (with offload it is a host buffer)
            # Made on a side stream, used on this one: keep it from being reused early.
            _streams.record_stream(sharded_grad, current)
        self._accumulate_reduced(sharded_grad)

    def _kept_form(self, sharded_grad: torch.Tensor) -> torch.Tensor:
        """A reduced (post-divided) gradient as it is kept: cast back to full precision
        (accumulation, the stash and the optimizer work on full-precision gradients, see [Note:
        Mixed precision dtypes]) and, with CPU offload, copied into a host buffer (pinned with
        an accelerator; :meth:`finalize` waits for the copies).

        [Note: A reduction finishes on its stream]
        On CUDA this runs on the stream of the reduction's last collective (the post-backward
        stream; the all-reduce stream for a hybrid unit), right after it and before the event
        the compute stream waits on, as torch FSDP1 offloads a gradient on its post-backward
        stream: the cast and the device-to-host copy (a unit's whole sharded
        gradient with offload) overlap the next units' backward instead of queuing on the
        compute stream in front of it. The reduced tensor it reads was made on a side stream and
        is used only there or kept alive ([Note: The all-reduce across replicas runs on its own
        stream]; NO_SHARD reduces the compute stream's gradient in place: that one
        stays referenced by the reduction in flight until the compute stream has waited on the
        event), so dropping it is safe; the host copy is complete once the event is.
        tests/test_cuda_lane.py's training parity runs it (offload on the one-rank NCCL pool,
        mixed precision on the two-rank pool). On CPU it runs when the reduction completes.
        """
        if sharded_grad.dtype != self.storage.precision.full_dtype:
            sharded_grad = sharded_grad.to(self.storage.precision.full_dtype)
        if self.storage.offload_params:
            offloaded = self.storage.new_host_buffer(sharded_grad)
            offloaded.copy_(sharded_grad, non_blocking=True)
            sharded_grad = offloaded
        return sharded_grad

    def _accumulate_reduced(self, sharded_grad: torch.Tensor) -> None:
        """Adds a reduced gradient, in its kept form, to this backward's pending sharded gradient."""
        pending = self.pending_sharded_grad
        if pending is not None:
            if self.storage.offload_params and self.storage.device.type == "cuda":
                # Both are pinned CPU tensors that non-blocking copies may still be writing; the
                # CPU add must not read them before the copies are done.
                _streams.current_stream(self.storage.device).synchronize()
            pending.add_(sharded_grad)
        else:
            self.pending_sharded_grad = sharded_grad

    def _reduce_with_hook(
        self, unsharded_grad: torch.Tensor, comm_hook: Callable[..., object], comm_hook_state: object
    ) -> torch.Tensor:
        """torch FSDP1's hook convention: ``hook(state, grad, output)`` sharded, else ``hook(state, grad)``."""
        if not self.layout.uses_sharding:
            comm_hook(comm_hook_state, unsharded_grad)
            return unsharded_grad
        output = torch.empty(
            self.layout.sharded_numel, dtype=unsharded_grad.dtype, device=unsharded_grad.device
        )
        comm_hook(comm_hook_state, unsharded_grad, output)
        return output

    def _reduce_in_group(self, unsharded_grad: torch.Tensor) -> torch.Tensor:
        """Pre-divide, reduce-scatter (all-reduce for NO_SHARD) over the shard group; returns
        the sharded gradient (issued on the current stream). :meth:`_finish` all-reduces it
        across replicas and post-divides."""
        if self.pre_divide > 1:
            unsharded_grad.div_(self.pre_divide)
        sharded_grad = unsharded_grad
        if self.layout.uses_sharding:
            sharded_grad = torch.empty(
                self.layout.sharded_numel, dtype=unsharded_grad.dtype, device=unsharded_grad.device
            )
            comm.reduce_scatter_flat(sharded_grad, unsharded_grad, self.process_group)
        elif self.layout.world_size > 1:
            comm.all_reduce_sum(unsharded_grad, self.process_group)
        return sharded_grad

    def finalize(self) -> None:
        """At the end of backward (or once its reduction is complete, for optimizers in
        backward): sets ``.grad`` to the sharded gradient (plus any stash).

        Precondition: the FlatParameter holds its sharded data (or never shards).
        """
        self.wait()
        if self.storage.offload_params and self.storage.device.type == "cuda":
            _streams.current_stream(self.storage.device).synchronize()  # offloaded gradient copies
        if self.holds_unsynced:
            # no_sync: ``.grad`` stays the accumulated unsharded gradient, any earlier sharded
            # one aside ([Note: The gradient no_sync accumulates]).
            self.use_sharded_grad_views()
            return
        pending, stash = self.pending_sharded_grad, self.sharded_grad_stash
        self.pending_sharded_grad = None
        self.sharded_grad_stash = None
        if pending is None and stash is None:
            self.use_sharded_grad_views()  # nothing reduced this backward: the views of .grad as it is
            return
        if self.storage.has_unsharded_buffer:
            p_assert(
                self.storage.flat_param.data.data_ptr() == self.storage.local_shard.data_ptr(),
                f"unit '{self.unit_name}': finalize_grad while the FlatParameter is unsharded",
            )
        grad: Optional[torch.Tensor] = pending if pending is not None else stash
        if pending is not None and stash is not None:
            stash.add_(pending)
            grad = stash
        self.set_sharded_grad(grad)

    def set_sharded_grad(self, grad: Optional[torch.Tensor]) -> None:
        """Sets the FlatParameter's ``.grad`` (in ``grad_dtype``) and the original params' views."""
        if grad is not None and grad.dtype != self.storage.precision.grad_dtype:
            grad = grad.to(self.storage.precision.grad_dtype)
        assign_grad(self.storage.flat_param, grad)
        self.use_sharded_grad_views()

    def drop_backward(self) -> None:
        """Drops what an interrupted backward left behind (first half of the handle's
        ``abandon_backward``): completes a reduction in flight, forgets its result and any
        unreduced unsharded gradient."""
        self.wait()  # never leave a collective in flight
        self.pending_sharded_grad = None
        self.stepped_in_backward = False
        grad = self.storage.flat_param.grad
        if grad is not None and not self.holds_unsynced and grad.shape != self.storage.local_shard.shape:
            self.storage.flat_param.grad = None  # an unreduced unsharded gradient

    def restore_prior_grad(self) -> None:
        """Gives the FlatParameter back the gradient from before the dropped backward (second
        half of ``abandon_backward``, once resharded)."""
        stash, self.sharded_grad_stash = self.sharded_grad_stash, None
        if self.prior_grad_to_reduce is not None:
            stash, self.prior_grad_to_reduce = self.prior_grad_to_reduce, None
        held, self.unsynced_unsharded_grad = self.unsynced_unsharded_grad, None
        if held is not None:  # no_sync's accumulation goes back; an earlier sharded one stays aside
            self.sharded_grad_stash = stash
            assign_grad(self.storage.flat_param, held)
            self.holds_unsynced = True
        elif stash is not None:
            assign_grad(self.storage.flat_param, stash.to(self.storage.precision.grad_dtype))
        self.use_sharded_grad_views()

    def use_sharded_grad_views(self) -> None:
        """use_orig_params: each original Parameter's ``.grad`` views the sharded gradient.

        Inside ``no_sync`` (:attr:`holds_unsynced`) they view that accumulated unsharded
        gradient instead, in their original shapes, as torch FSDP1 shows them; any sharded
        gradient from before stays aside until the next synchronized backward adds the reduced
        gradient to it ([Note: The gradient no_sync accumulates]).
        """
        if not self.views.use_orig_params:
            return
        unsynced = self.storage.flat_param.grad if self.holds_unsynced else None
        if unsynced is not None:
            for view, param in zip(self.layout.unsharded_views(unsynced), self.views.orig_params):
                assign_grad(param, view if param.requires_grad else None)
            return
        grad = self.storage.flat_param.grad
        for index, param in enumerate(self.views.orig_params):
            if (
                grad is None
                or grad.shape != self.storage.local_shard.shape
                or not param.requires_grad
                or self.layout.shard_slices[index] is None
            ):
                # A parameter this rank holds no part of gets no gradient (None, as torch
                # FSDP1 gives it), not an empty one: code that walks ``.grad`` (an inf-norm
                # over every gradient, say) must not meet empty tensors.
                param.grad = None
            else:
                assign_grad(param, self.layout.orig_sharded_view(grad, index))

    def sync_from_orig(self) -> Optional[torch.Tensor]:
        """Makes the sharded flat gradient agree with the original Parameters' ``.grad``.

        With use_orig_params the optimizer and the user see the original Parameters: after
        ``zero_grad(set_to_none=True)`` their grads are None (so is the flat gradient then),
        and a replaced ``.grad`` is copied into the flat gradient. Returns the flat gradient.
        """
        flat_grad = self.storage.flat_param.grad
        local_shard = self.storage.local_shard
        if flat_grad is None and self.holds_unsynced:
            self._drop_unsynced()  # zero_grad(set_to_none=True) on the FlatParameter
        if self.views.use_orig_params and self.holds_unsynced:
            self._sync_unsynced_from_orig([p.grad for p in self.views.orig_params])
            return self.storage.flat_param.grad
        if not self.views.use_orig_params or (flat_grad is not None and flat_grad.shape != local_shard.shape):
            return flat_grad
        grads = [p.grad for p in self.views.orig_params]
        if all(g is None for g in grads):
            self.storage.flat_param.grad = None
            return None
        layout = self.layout
        if flat_grad is not None and all(
            g is not None and g.data_ptr() == layout.orig_sharded_view(flat_grad, i).data_ptr()
            for i, g in enumerate(grads)
            if layout.sharded_ranges[i][1] > 0
        ):
            return flat_grad
        rebuilt = torch.zeros_like(local_shard, dtype=self.storage.precision.grad_dtype)
        for index, grad in enumerate(grads):
            if grad is not None and layout.sharded_ranges[index][1] > 0:
                layout.orig_sharded_view(rebuilt, index).copy_(grad.reshape(layout.orig_sharded_view(rebuilt, index).shape))
        self.set_sharded_grad(rebuilt)
        # A parameter whose gradient was None keeps None (its part of the flat gradient is
        # zero), as torch FSDP1 keeps it: code that skips None gradients still skips it.
        for param, grad in zip(self.views.orig_params, grads):
            if grad is None:
                param.grad = None
        return rebuilt

    def _drop_unsynced(self) -> None:
        """The user dropped the gradients inside ``no_sync`` (``zero_grad(set_to_none=True)``):
        forgets the accumulated unsharded gradient and an earlier sharded one kept aside.
        (torch FSDP1 keeps that sharded one in ``_saved_grad_shard`` and adds it to the next
        synchronized gradient: a gradient the user dropped would come back.)"""
        self.holds_unsynced = False
        self.sharded_grad_stash = None
        self.storage.flat_param.grad = None

    def _sync_unsynced_from_orig(self, grads: Sequence[Optional[torch.Tensor]]) -> None:
        """Inside ``no_sync``: makes the held unsharded gradient agree with the original grads.

        They normally still view it (then nothing changes). All None (``zero_grad`` with
        ``set_to_none=True``): the accumulated gradients are dropped, the held unsharded one
        and any sharded one from before. Otherwise each replaced gradient is copied in (zeros
        for a None one).

        Raises:
            ValueError: A replaced gradient has neither the parameter's original shape nor
                its number of elements.
        """
        unsynced = self.storage.flat_param.grad
        assert unsynced is not None
        if all(g is None for g in grads):
            self._drop_unsynced()
            return
        views = self.layout.unsharded_views(unsynced)
        for grad, view, info in zip(grads, views, self.views.param_infos):
            if grad is not None and grad.data_ptr() == view.data_ptr() and grad.shape == view.shape:
                continue
            if grad is None:
                view.zero_()
            elif grad.numel() != view.numel():
                raise ValueError(
                    f"fsdp: the gradient of parameter '{info.fqn}' (FSDP unit "
                    f"'{self.unit_name}') was replaced inside no_sync() by one of shape "
                    f"{tuple(grad.shape)}; it must have the parameter's shape {tuple(info.shape)}."
                )
            else:
                view.copy_(grad.reshape(view.shape))
