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

from typing import Callable, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from fsdp._comm import _collectives as comm
from fsdp._comm._phase import collective_phase
from fsdp._common import group_size, p_assert
from fsdp.flat_param._layout import ShardLayout
from fsdp.flat_param._sharding import gradient_divide_factors
from fsdp.flat_param._storage import FlatParamStorage, on_stream, record_event
from fsdp.flat_param._views import ParamViews, assign_grad

__all__ = ["GradReduction"]


class _InflightReduction(NamedTuple):
    """A reduction launched on the post-backward stream: its completion event, the sharded
    gradient it makes (in its kept form), and what must stay alive until the collective has
    read it: the reduction's input as the compute stream made it ([Note: The reduction's input
    outlives its readers])."""

    event: torch.cuda.Event
    sharded_grad: torch.Tensor
    keep_alive: torch.Tensor


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
        unsynced_unsharded_grad: Inside ``no_sync``: the accumulated unsharded gradient.
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
        in_flight: bool,
    ) -> None:
        """Launches the reduction of the unsharded gradient autograd just accumulated (see
        the class docstring for the postcondition). ``in_flight``: it stays in flight past this
        call (the unit's ``UnitPolicy.reduction_stays_in_flight``, [Note: One schedule]).

        [Note: One reduction path]
        Every strategy, backend and world size takes this path: reduce-scatter (all-reduce for
        NO_SHARD), then all-reduce across replicas for hybrid strategies, or the comm hook, and
        :meth:`wait` finishes it (post-divide, cast, offload copy, accumulation). On CUDA
        the collectives run on the post-backward stream (``storage.post_backward_stream``), after
        the compute stream's work so far, and the compute stream waits on an event only in
        :meth:`wait` (torch FSDP1's post-backward stream); tests/test_cuda_lane.py's
        training parity runs it (NO_SHARD and HYBRID_SHARD on the two-rank pool, offload on the
        one-rank NCCL pool). On CPU there is no stream: the reduction completes before this
        returns ([Note: On CPU a collective completes where it is launched] in ``_policy.py``).
        """
        unsharded_grad = self._take_unsharded_grad()
        if not sync:
            self.unsynced_unsharded_grad = unsharded_grad
            return
        if unsharded_grad.dtype != self.storage.precision.reduce_dtype and not full_precision:
            # (full_precision: a backward of a full-precision eval forward keeps its dtype.)
            unsharded_grad = unsharded_grad.to(self.storage.precision.reduce_dtype)
        p_assert(self.inflight is None, f"unit '{self.unit_name}': two reductions in flight")
        stream = self.storage.post_backward_stream
        # [Note: The reduction's input outlives its readers]
        # On CUDA the compute stream made ``unsharded_grad`` and the post-backward stream reads
        # it. The caching allocator ties a block to the stream that allocated it: once the last
        # reference dies, the compute stream's next allocation (the previous unit's backward)
        # may reuse the block while the post-backward stream still reads it. A comm hook may
        # drop that reference itself: torch's ``fp16_compress_hook``/``bf16_compress_hook`` (and
        # ours) replace ``grad.data`` with a cast copy whose kernel is queued on the
        # post-backward stream, so the fp32 block would be free while the cast has not run.
        # ``reduction_input`` is a second reference to the same storage, held by the in-flight
        # record until :meth:`wait` has made the compute stream wait for the reduction's event:
        # after that the compute stream frees it, in order. It costs no memory the reduction
        # would not hold anyway (without a hook the in-flight record holds the same tensor).
        # tests/test_cuda_lane.py's compress-hook race runs a hook that holds the post-backward
        # stream (``torch.cuda._sleep``) before ``bf16_compress_hook`` casts.
        reduction_input = unsharded_grad.detach()
        with on_stream(stream, self.storage.device), collective_phase(None, self):
            if comm_hook is not None:
                sharded_grad = self._reduce_with_hook(unsharded_grad, comm_hook, comm_hook_state)
            else:
                sharded_grad = self._reduce_default(unsharded_grad)
            # [Note: A reduction finishes on its stream]
            sharded_grad = self._kept_form(sharded_grad)
            event = record_event(stream) if stream is not None else None
        if not in_flight or event is None:  # complete already (no stream)
            self._accumulate_reduced(sharded_grad)
            return
        self.inflight = _InflightReduction(event, sharded_grad, reduction_input)

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
        if self.unsynced_unsharded_grad is not None:
            unsharded_grad = unsharded_grad + self.unsynced_unsharded_grad
            self.unsynced_unsharded_grad = None
        return unsharded_grad

    def wait(self) -> None:
        """Completes a reduction in flight: wait, post-divide, accumulate. Else a no-op."""
        inflight = self.inflight
        if inflight is None:
            return
        self.inflight = None
        sharded_grad = inflight.sharded_grad
        current = torch.cuda.current_stream(self.storage.device)
        current.wait_event(inflight.event)
        if sharded_grad.device.type == "cuda":  # (with offload it is already on the host)
            # Made on the post-backward stream, used on this one: keep it from being reused early.
            sharded_grad.record_stream(current)
        self._accumulate_reduced(sharded_grad)

    def _kept_form(self, sharded_grad: torch.Tensor) -> torch.Tensor:
        """A reduced (post-divided) gradient as it is kept: cast back to full precision
        (accumulation, the stash and the optimizer work on full-precision gradients, see [Note:
        Mixed precision dtypes]) and, with CPU offload, copied into a host buffer (pinned with
        an accelerator; :meth:`finalize` waits for the copies).

        [Note: A reduction finishes on its stream]
        On CUDA this runs on the post-backward stream, right after the collective and before
        the event the compute stream waits on, as torch FSDP1 offloads a gradient on its
        post-backward stream: the cast and the device-to-host copy (a unit's whole sharded
        gradient with offload) overlap the next units' backward instead of queuing on the
        compute stream in front of it. The reduced tensor it reads was made on that stream and
        is used only there (NO_SHARD reduces the compute stream's gradient in place: that one
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
                torch.cuda.current_stream(self.storage.device).synchronize()
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

    def _reduce_default(self, unsharded_grad: torch.Tensor) -> torch.Tensor:
        """Pre-divide, reduce-scatter (all-reduce for NO_SHARD), all-reduce across replicas,
        post-divide; returns the sharded gradient (issued in full on the current stream)."""
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
        if self.replicate_world_size > 1:
            comm.all_reduce_sum(sharded_grad, self.replicate_group)
        if self.post_divide > 1:
            sharded_grad.div_(self.post_divide)
        return sharded_grad

    def finalize(self) -> None:
        """At the end of backward (or once its reduction is complete, for optimizers in
        backward): sets ``.grad`` to the sharded gradient (plus any stash).

        Precondition: the FlatParameter holds its sharded data (or never shards).
        """
        self.wait()
        if self.storage.offload_params and self.storage.device.type == "cuda":
            torch.cuda.current_stream(self.storage.device).synchronize()  # offloaded gradient copies
        pending, stash = self.pending_sharded_grad, self.sharded_grad_stash
        self.pending_sharded_grad = None
        self.sharded_grad_stash = None
        if pending is None and stash is None:
            self.use_sharded_grad_views()  # no_sync: the held unsharded gradient's views
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
        if grad is not None and grad.shape != self.storage.local_shard.shape:
            self.storage.flat_param.grad = None  # an unreduced unsharded gradient

    def restore_prior_grad(self) -> None:
        """Gives the FlatParameter back the gradient from before the dropped backward (second
        half of ``abandon_backward``, once resharded)."""
        stash, self.sharded_grad_stash = self.sharded_grad_stash, None
        if self.prior_grad_to_reduce is not None:
            stash, self.prior_grad_to_reduce = self.prior_grad_to_reduce, None
        if stash is not None:
            assign_grad(self.storage.flat_param, stash.to(self.storage.precision.grad_dtype))
        self.use_sharded_grad_views()

    def use_sharded_grad_views(self) -> None:
        """use_orig_params: each original Parameter's ``.grad`` views the sharded gradient.

        Inside ``no_sync`` (an unsynchronized gradient is held) they view that accumulated
        unsharded gradient instead, in their original shapes, as torch FSDP1 shows them; any
        sharded gradient from before stays on the FlatParameter, hidden until the next
        synchronized backward adds the reduced gradient to it.
        """
        if not self.views.use_orig_params:
            return
        unsynced = self.unsynced_unsharded_grad
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
        if not self.views.use_orig_params or (flat_grad is not None and flat_grad.shape != local_shard.shape):
            return flat_grad
        grads = [p.grad for p in self.views.orig_params]
        if self.unsynced_unsharded_grad is not None:
            self._sync_unsynced_from_orig(grads)
            return flat_grad
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
        unsynced = self.unsynced_unsharded_grad
        assert unsynced is not None
        if all(g is None for g in grads):
            self.unsynced_unsharded_grad = None
            self.storage.flat_param.grad = None
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
