"""FlatParameter and FlatParamHandle: one unit's parameters as one sharded 1-D tensor.

See docs/flat_param_lifecycle.md, [Note: Flat parameter storage lifecycle], for the states a
handle moves through and what memory each one holds.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from fsdp._common import FLAT_PARAM, group_rank, group_size, p_assert
from fsdp.flat_param._early_grads import can_take_early, settle_open_run, takes_early_grads_at_forward
from fsdp.flat_param._precision import HandlePrecision
from fsdp.flat_param._layout import (
    ALIGNMENT_PADDING_VALUE as ALIGNMENT_PADDING_VALUE,
    FLATTENED_ATTR as FLATTENED_ATTR,
    FSDP_FLATTENED as FSDP_FLATTENED,
    ParamInfo,
    SharedParamInfo,
    ShardLayout,
    ShardParamInfo,
    collect_params,
    itemsize,
    mark_flattened,
    set_torch_metadata,
)
from fsdp.flat_param._sharding import FlatLayout, ParamShardSlice, aligned_numel, gradient_divide_factors
from fsdp.flat_param._storage import FlatParameter, FlatParamStorage, HandleState
from fsdp.flat_param import _views
from fsdp.flat_param._views import (
    _ShardedParamPlaceholder as _ShardedParamPlaceholder,
    _UnflattenParams as _UnflattenParams,
    assign_grad,
)
from fsdp._comm import _collectives as comm

__all__ = [
    "FlatParameter",
    "FlatParamHandle",
    "HandleState",
    "ParamInfo",
    "SharedParamInfo",
    "ShardParamInfo",
    "assign_grad",
]

class FlatParamHandle:
    """Owns one unit's FlatParameter and does everything to it.

    Flattens the unit's parameters at construction, keeps this rank's shard, unshards
    (all-gathers) and reshards (frees) it, points the original parameter names at views or
    placeholders, and turns the unsharded gradient into the reduced sharded gradient.

    Args:
        params: ``(module_name, module, param_name, param)`` for every parameter name of the
            unit, in ``named_parameters`` order; a Parameter that appears twice (tied weights)
            is stored once.
        wrapped_module: The unit's wrapped module; the FlatParameter is registered on it as
            ``_flat_param``.
        device: The compute device.
        process_group: The group the parameter is sharded over.
        uses_sharding: False for NO_SHARD and for world size 1 (nothing is ever freed).
        unit_name: Name of the unit for messages (refined at lazy init).
        replicate_group: Hybrid strategies: the group sharded gradients are all-reduced over.
        sync_module_states: Broadcast the flat parameter from rank 0 before sharding it.
        use_orig_params: Keep the original Parameters registered (see
            [Note: Original parameters] in docs/flat_param_lifecycle.md).
        offload_params: Keep the local shard and its gradient on CPU (pinned when the compute
            device is CUDA) between uses; see [Note: CPU offload].
        mixed_precision: A ``MixedPrecision`` config or None (see [Note: Mixed precision
            dtypes] in ``_precision.py``).
    """

    def __init__(
        self,
        params: Sequence[tuple[str, nn.Module, str, nn.Parameter]],
        wrapped_module: nn.Module,
        device: torch.device,
        process_group: dist.ProcessGroup,
        uses_sharding: bool,
        unit_name: str,
        replicate_group: Optional[dist.ProcessGroup] = None,
        sync_module_states: bool = False,
        use_orig_params: bool = False,
        offload_params: bool = False,
        mixed_precision: Optional[Any] = None,
    ) -> None:
        self.device = device
        # torch FSDP1's handle attribute: the owning unit's HandleTrainingState
        # (fsdp/runtime/_state.py), kept in step by UnitState.training_state.
        self._training_state: Any = None
        self.process_group = process_group
        self.replicate_group = replicate_group
        self.replicate_world_size = group_size(replicate_group) if replicate_group else 1
        self.unit_name = unit_name
        self.use_orig_params = use_orig_params
        unit_params = collect_params(params)
        self.param_infos: list[ParamInfo] = unit_params.param_infos
        self.shared_param_infos: list[SharedParamInfo] = unit_params.shared_param_infos
        mark_flattened(self, unit_params)
        unique_params = unit_params.unique_params
        precision = HandlePrecision.resolve(mixed_precision, unique_params[0].dtype)
        # use_orig_params: each parameter starts 16-byte aligned in the flat parameter, as in
        # torch FSDP1 (see [Note: Aligned flat parameter layout] in _sharding.py).
        align_numel = aligned_numel(itemsize(precision.param_dtype)) if use_orig_params else 0
        # [Note: Only the unit's group]
        self.shard_layout: ShardLayout = ShardLayout.build(
            self.param_infos, group_rank(process_group), group_size(process_group), uses_sharding, align_numel
        )
        # Averaging is over every data-parallel replica: shard group x replicate group.
        self.pre_divide, self.post_divide = gradient_divide_factors(
            self.world_size * self.replicate_world_size
        )

        with torch.no_grad():
            flat = self.shard_layout.flatten(unique_params, precision.full_dtype, device)
            if sync_module_states:
                from fsdp._comm._groups import ShardingGroups, broadcast_from_group_rank0

                broadcast_from_group_rank0(flat, ShardingGroups(process_group, replicate_group))
            local_shard = self.shard_layout.cut_local_shard(flat, precision.full_dtype, device)
        self.storage = FlatParamStorage(
            local_shard,
            unique_params[0].requires_grad,
            precision,
            device,
            process_group,
            self.shard_layout.uses_sharding,
            self.shard_layout.padded_unsharded_numel,
            offload_params,
        )
        self.flat_param: FlatParameter = self.storage.flat_param  # the same object for good

        # Gradient bookkeeping (see [Note: Gradient flow] in docs/flat_param_lifecycle.md).
        self._sharded_grad_stash: Optional[torch.Tensor] = None
        # NO_SHARD: an existing gradient the new one is added to *before* the reduction.
        self._prior_grad_to_reduce: Optional[torch.Tensor] = None
        self._unsynced_unsharded_grad: Optional[torch.Tensor] = None
        self._pending_sharded_grad: Optional[torch.Tensor] = None
        # (work, sharded output, what must stay alive) of a reduce-scatter still in flight.
        self._inflight: Optional[tuple[Any, torch.Tensor, Any]] = None
        # Per-parameter gradients of this backward, when reduced from the pieces
        # ([Note: Per-parameter gradient reduction]); set by the runtime: whether the next
        # backward's reduction may take that form (synchronized, default reduction).
        self._param_grads: Optional[list[Optional[torch.Tensor]]] = None
        # Early gradients of the forward call being backpropagated, not yet in _param_grads
        # (fsdp/flat_param/_early_grads.py: take_param_grad).
        self._open_run_grads: Optional[list[Optional[torch.Tensor]]] = None
        self._open_run: Optional[int] = None
        self.early_grads_runs = 0  # forward calls whose views' consumers were hooked
        self.piecewise_reduction_allowed = False
        # The views node of this forward when the runtime may take its gradients early
        # ([Note: Early per-parameter gradients]), else None.
        self.early_grads_views_node: Optional[Any] = None

        self._placeholders: Optional[list[_ShardedParamPlaceholder]] = None
        self.wrapped_module = wrapped_module
        # Casts after wrapping ([Note: Casting after wrapping] in _recast.py): how many, and how
        # many had happened when the last forward that autograd may backpropagate took views.
        self.cast_generation = 0
        self.forward_cast_generation = 0
        self.mixed_precision_config = mixed_precision
        # With use_orig_params the original Parameters stay registered (optimizers hold them);
        # otherwise the FlatParameter replaces them on the wrapped module.
        self._orig_params: list[nn.Parameter] = list(unique_params) if use_orig_params else []
        set_torch_metadata(self.flat_param, unit_params, self.shard_layout, self._orig_params if use_orig_params else None)
        if use_orig_params:
            self.use_sharded_views()
            return
        for info in self.param_infos:
            info.module._parameters.pop(info.param_name, None)
        for shared in self.shared_param_infos:
            shared.module._parameters.pop(shared.param_name, None)
        wrapped_module.register_parameter(FLAT_PARAM, self.flat_param)
        if self.uses_sharding or self.has_unsharded_buffer:
            self.use_sharded_views()
        else:
            with torch.no_grad():
                self.use_unsharded_views()

    # ------------------------------------------------------------------ layout (read-only)
    @property
    def layout(self) -> FlatLayout:
        """Where each parameter and each run of alignment padding sits."""
        return self.shard_layout.flat

    @property
    def rank(self) -> int:
        """This rank in the shard group ([Note: Only the unit's group])."""
        return self.shard_layout.rank

    @property
    def world_size(self) -> int:
        """The shard group's size."""
        return self.shard_layout.world_size

    @property
    def uses_sharding(self) -> bool:
        """False for NO_SHARD and for world size 1 (the local shard is the whole parameter)."""
        return self.shard_layout.uses_sharding

    @property
    def unpadded_unsharded_numel(self) -> int:
        return self.shard_layout.unpadded_unsharded_numel

    @property
    def padded_unsharded_numel(self) -> int:
        return self.shard_layout.padded_unsharded_numel

    @property
    def sharded_numel(self) -> int:
        return self.shard_layout.sharded_numel

    @property
    def shard_slices(self) -> list[Optional[ParamShardSlice]]:
        """Each parameter's part of the local shard (None where this rank holds none of it)."""
        return self.shard_layout.shard_slices

    @property
    def _orig_sharded_ranges(self) -> list[tuple[int, int]]:
        """``(offset in the local shard, numel)`` of each parameter's part on this rank."""
        return self.shard_layout.sharded_ranges

    def local_slice(self, padded_unsharded: torch.Tensor) -> torch.Tensor:
        """This rank's shard-sized slice of a padded unsharded flat tensor."""
        return self.shard_layout.local_slice(padded_unsharded)

    def _unsharded_views(self, source: torch.Tensor) -> list[torch.Tensor]:
        return self.shard_layout.unsharded_views(source)

    def unsharded_views(self, source: torch.Tensor) -> list[torch.Tensor]:
        """Views of a padded unsharded flat tensor shaped like the original parameters."""
        return self.shard_layout.unsharded_views(source)

    @property
    def _orig_param_dtype(self) -> torch.dtype:
        """torch FSDP1's name for the original parameters' dtype (accelerate reads it)."""
        return self.dtype

    @property
    def _fully_sharded_module(self) -> nn.Module:
        """torch FSDP1's name for the module whose parameters this handle flattens."""
        return self.wrapped_module

    @property
    def _use_orig_params(self) -> bool:
        """torch FSDP1's name for ``use_orig_params``."""
        return self.use_orig_params

    @property
    def _fwd_bwd_param_dtype(self) -> torch.dtype:
        """The dtype forward and backward compute in (torch FSDP1's name)."""
        return self.precision.param_dtype

    # ------------------------------------------------------------------ storage
    @property
    def precision(self) -> HandlePrecision:
        """The dtypes the handle keeps, computes and reduces in (changed only by a recast)."""
        return self.storage.precision

    @property
    def dtype(self) -> torch.dtype:
        """The original (full) dtype: the local shard's and the sharded gradient's."""
        return self.storage.precision.full_dtype

    @property
    def state(self) -> HandleState:
        return self.storage.state

    @property
    def is_unsharded(self) -> bool:
        """Whether ``.data`` is a padded unsharded tensor (of either precision)."""
        return self.storage.state is not HandleState.SHARDED

    @property
    def has_unsharded_buffer(self) -> bool:
        """Whether the handle ever frees an unsharded copy (else it stays UNSHARDED for good)."""
        return self.storage.has_unsharded_buffer

    @property
    def offload_params(self) -> bool:
        """The local shard and its gradient live on CPU ([Note: CPU offload])."""
        return self.storage.offload_params

    @property
    def _local_shard(self) -> torch.Tensor:
        return self.storage.local_shard

    @property
    def unshard_stream(self) -> Optional[Any]:
        """CUDA: the side stream prefetched all-gathers run on (set at lazy init); None on CPU."""
        return self.storage.unshard_stream

    @unshard_stream.setter
    def unshard_stream(self, stream: Optional[Any]) -> None:
        self.storage.unshard_stream = stream

    @property
    def padded_unsharded(self) -> torch.Tensor:
        """The padded unsharded flat tensor forward and backward use (storage may be freed)."""
        return self.storage.padded_unsharded_for(full_precision=False)

    def unsharded_storage_nbytes(self) -> int:
        """Bytes the padded unsharded buffers hold right now (0 when freed)."""
        return self.storage.unsharded_storage_nbytes()

    def unshard(self, full_precision: bool = False, async_op: bool = False) -> None:
        """Makes the padded unsharded parameter the FlatParameter's ``.data``.

        Args:
            full_precision: Gather the full-precision values (summon_full_params, state dicts)
                instead of the ``param_dtype`` copy forward and backward use.
            async_op: Prefetch: only launch the all-gather (on CPU an asynchronous collective,
                on CUDA on the unshard stream); the next plain ``unshard()`` waits for it.

        Postcondition: state is UNSHARDED (UNSHARDED_FULL_PRECISION when ``full_precision`` and
        the parameters run in low precision) with ``.data`` on the compute device, its values
        valid unless ``async_op``. If already in that state only a pending prefetch is waited
        for; a handle unsharded in the other precision is resharded first.
        """
        target = self.storage.target_state(full_precision)
        if self.state is target:
            if not async_op:
                self.wait_unshard()
            return
        if self.state is not HandleState.SHARDED:
            self.reshard()
        self.storage.gather(target, full_precision, async_op)

    @property
    def unshard_pending(self) -> bool:
        """A prefetched all-gather has been launched and not yet waited for."""
        return self.storage.pending_unshard is not None

    def wait_unshard(self) -> None:
        """Completes a prefetched all-gather (a no-op without one)."""
        self.storage.wait_unshard()

    def reshard(self) -> None:
        """Frees the padded unsharded tensors and points every name at a placeholder.

        Postcondition: state is SHARDED, ``.data`` is the local shard (full precision) and the
        unsharded storages have size 0. For a handle that never frees anything (NO_SHARD or
        world size 1 without mixed precision) only the original Parameters are registered back
        (use_orig_params).
        """
        if not self.has_unsharded_buffer:
            if self.use_orig_params:
                self.use_sharded_views()  # registers the original Parameters back
            return
        if self.state is HandleState.SHARDED:
            return
        self.wait_unshard()  # never free memory a collective is still writing
        self.storage.free_unsharded()
        self.use_sharded_views()

    def write_back_shard(self, padded_unsharded: torch.Tensor) -> None:
        """Copies this rank's slice of ``padded_unsharded`` into the local shard."""
        local_shard = self.storage.local_shard
        if padded_unsharded.data_ptr() != local_shard.data_ptr():
            local_shard.copy_(self.local_slice(padded_unsharded))

    # ------------------------------------------------------------------ views
    def use_unsharded_views(self, as_params: bool = False) -> None:
        """Points each original parameter name at a view into the unsharded FlatParameter.

        Views are taken from the FlatParameter itself, so when grad mode is on, autograd routes
        their gradients into the FlatParameter's (padded unsharded) gradient.

        Args:
            as_params: Register the views as ``nn.Parameter`` (for summon_full_params) rather
                than as plain tensors (for forward).
        """
        p_assert(
            self.is_unsharded,
            f"unit '{self.unit_name}': use_unsharded_views needs UNSHARDED, state is {self.state}",
        )
        recorded = not as_params and torch.is_grad_enabled() and self.flat_param.requires_grad
        early = recorded and takes_early_grads_at_forward(self)  # [Note: Early per-parameter gradients]
        _views.use_unsharded_views(self, as_params, recorded, early)

    def use_sharded_views(self) -> None:
        """Points each original parameter name at what it holds while the unit is sharded
        (see ``_views.use_sharded_views``)."""
        _views.use_sharded_views(self)

    def module_tensors(self) -> list[torch.Tensor]:
        """The tensors the original parameter names currently hold (in ``param_infos`` order)."""
        return [getattr(info.module, info.param_name) for info in self.param_infos]

    def managed_orig_params(self) -> list[nn.Parameter]:
        """The original Parameters this handle keeps registered (use_orig_params), else []."""
        return list(self._orig_params)

    def use_sharded_grad_views(self) -> None:
        """use_orig_params: each original Parameter's ``.grad`` views the sharded gradient (see
        ``_views.use_sharded_grad_views``)."""
        _views.use_sharded_grad_views(self)

    def sync_flat_grad_from_orig(self) -> Optional[torch.Tensor]:
        """Makes the sharded flat gradient agree with the original Parameters' ``.grad`` and
        returns it (see ``_views.sync_flat_grad_from_orig``)."""
        return _views.sync_flat_grad_from_orig(self)

    def check_params_not_replaced_since_forward(self) -> None:
        """use_orig_params: raises RuntimeError if a parameter was replaced between forward and
        backward (see ``_views.check_params_not_replaced_since_forward``)."""
        _views.check_params_not_replaced_since_forward(self)

    def writeback_orig_params(self) -> None:
        """use_orig_params: adopts ``.data`` or Parameters the user replaced since the last step
        (see ``_views.writeback_orig_params``; raises ValueError for a wrong shape)."""
        _views.writeback_orig_params(self)

    # ------------------------------------------------------------------ gradients
    def stash_sharded_grad(self) -> None:
        """Moves an existing (already reduced) ``.grad`` aside before autograd accumulates.

        Called from a hook on the FlatParameter just before AccumulateGrad, so the new
        unsharded gradient never mixes with the reduced sharded one; the stash is added back
        after the reduction (gradient accumulation without ``no_sync``).
        """
        grad = self.sync_flat_grad_from_orig()
        if grad is not None and not self.uses_sharding:
            # The existing gradient is already the whole (averaged) gradient: like torch FSDP1,
            # add the new one to it and reduce the sum, in the existing gradient's dtype.
            self._prior_grad_to_reduce = grad
            self.flat_param.grad = None
            return
        if grad is not None:
            p_assert(
                self._sharded_grad_stash is None,
                f"unit '{self.unit_name}': gradient stashed twice in one backward",
            )
            # keep_low_precision_grads: accumulate in full precision (as torch FSDP1 does).
            self._sharded_grad_stash = grad.to(self.dtype)
            self.flat_param.grad = None

    def _reduces_from_pieces(self, grads: Sequence[Optional[torch.Tensor]]) -> bool:
        return (
            can_take_early(self)  # the reduction itself takes the pieces this backward
            and any(g is not None for g in grads)
            and all(g is None or (g.dtype == self.precision.reduce_dtype and g.is_contiguous()) for g in grads)
        )

    def collect_param_grads(self, grads: list[Optional[torch.Tensor]]) -> bool:
        """Keeps this backward's per-parameter gradients for a reduction from the pieces.

        Returns False (nothing kept) where that reduction does not apply; the caller then
        hands autograd the concatenated gradient. A unit used twice in one forward gets its
        gradients summed here, as autograd would sum them.
        """
        if not self._reduces_from_pieces(grads):
            return False
        if self._param_grads is None:
            self._param_grads = list(grads)
        else:
            self._param_grads = [
                b if a is None else a if b is None else a + b for a, b in zip(self._param_grads, grads)
            ]
        return True

    def flatten_param_grads(self, grads: list[Optional[torch.Tensor]]) -> torch.Tensor:
        """The padded unsharded gradient from per-parameter gradients (``split``'s backward)."""
        return self.shard_layout.padded_unsharded_grad(grads, self.flat_param)

    def _reduce_pieces(self) -> None:
        """Launches the two-rank reduce-scatter from the per-parameter gradients (async)."""
        grads, self._param_grads = self._param_grads, None
        assert grads is not None
        reference = next(g for g in grads if g is not None)
        numel = self.sharded_numel
        own_start = self.rank * numel
        peer_start = (1 - self.rank) * numel
        peer_half = reference.new_zeros(numel) if self._has_gaps(grads, peer_start) else reference.new_empty(numel)
        own_parts: list[tuple[int, torch.Tensor]] = []
        for grad, info, param_start in zip(grads, self.param_infos, self.layout.param_offsets):
            param_end = param_start + info.numel
            if grad is not None:
                flat_grad = grad.reshape(-1)
                lo, hi = max(param_start, peer_start), min(param_end, peer_start + numel)
                if lo < hi:
                    torch.div(
                        flat_grad[lo - param_start : hi - param_start],
                        self.pre_divide,
                        out=peer_half[lo - peer_start : hi - peer_start],
                    )
                lo, hi = max(param_start, own_start), min(param_end, own_start + numel)
                if lo < hi:
                    own_parts.append((lo - own_start, flat_grad[lo - param_start : hi - param_start]))
        sharded_grad = torch.empty(numel, dtype=reference.dtype, device=reference.device)
        work = comm.reduce_scatter_halves(
            sharded_grad, peer_half, own_parts, 1.0 / self.pre_divide, self.process_group
        )
        self._inflight = (work, sharded_grad, (peer_half, own_parts))

    def _has_gaps(self, grads: Sequence[Optional[torch.Tensor]], half_start: int) -> bool:
        """Whether part of ``[half_start, half_start + sharded_numel)`` gets no gradient
        (padding, alignment padding included, or a parameter without one): it must then be
        sent as zeros."""
        half_end = half_start + self.sharded_numel
        if half_end > self.unpadded_unsharded_numel:
            return True
        if any(offset < half_end and offset + numel > half_start for offset, numel in self.layout.padding_runs()):
            return True
        for grad, info, param_start in zip(grads, self.param_infos, self.layout.param_offsets):
            param_end = param_start + info.numel
            if grad is None and param_start < half_end and param_end > half_start:
                return True
        return False

    def reduce_grad(
        self,
        sync: bool,
        comm_hook: Optional[Callable[..., Any]] = None,
        comm_hook_state: Any = None,
        async_op: bool = False,
        full_precision: bool = False,
    ) -> None:
        """Reduces the unsharded gradient autograd just accumulated.

        With ``sync`` False (inside ``no_sync``) the unsharded gradient is kept locally and
        added to the next one. Otherwise it is divided by the pre-divide factor, reduce-scattered
        (all-reduced for NO_SHARD) and divided by the post-divide factor, which averages over
        ranks exactly as torch FSDP1 does.

        With ``async_op`` (default reduction of a sharded handle) the reduce-scatter is only
        launched: it overlaps the backward of the next units, and :meth:`wait_reduction`
        completes it (see [Note: Overlapped gradient reduction] in docs/hook_order.md).

        Postcondition: ``.grad`` is None; the reduced sharded gradient waits in
        ``_pending_sharded_grad`` (or in flight) until :meth:`finalize_grad`.
        """
        settle_open_run(self)
        if self._param_grads is not None:
            p_assert(
                sync and comm_hook is None and async_op,
                f"unit '{self.unit_name}': per-parameter gradients kept for a reduction that "
                f"cannot take them",
            )
            self._reduce_pieces()
            return
        unsharded_grad = self.flat_param.grad
        self.flat_param.grad = None
        p_assert(unsharded_grad is not None, f"unit '{self.unit_name}': no gradient to reduce")
        assert unsharded_grad is not None  # for type checkers
        p_assert(
            unsharded_grad.numel() == self.padded_unsharded_numel,
            f"unit '{self.unit_name}': expected an unsharded gradient of "
            f"{self.padded_unsharded_numel} elements, got {unsharded_grad.numel()}",
        )
        if self._prior_grad_to_reduce is not None:
            unsharded_grad = self._prior_grad_to_reduce.add(unsharded_grad.to(self._prior_grad_to_reduce.dtype))
            self._prior_grad_to_reduce = None
        if self._unsynced_unsharded_grad is not None:
            unsharded_grad = unsharded_grad + self._unsynced_unsharded_grad
            self._unsynced_unsharded_grad = None
        if not sync:
            self._unsynced_unsharded_grad = unsharded_grad
            return
        if unsharded_grad.dtype != self.precision.reduce_dtype and not full_precision:
            # (full_precision: a backward of a full-precision eval forward keeps its dtype.)
            unsharded_grad = unsharded_grad.to(self.precision.reduce_dtype)
        if async_op and comm_hook is None and self.uses_sharding and self.replicate_world_size == 1:
            p_assert(self._inflight is None, f"unit '{self.unit_name}': two reductions in flight")
            if self.pre_divide > 1:
                unsharded_grad.div_(self.pre_divide)
            sharded_grad = torch.empty(
                self.sharded_numel, dtype=unsharded_grad.dtype, device=unsharded_grad.device
            )
            work = comm.reduce_scatter_flat(
                sharded_grad, unsharded_grad, self.process_group, async_op=True
            )
            # The unsharded gradient must stay alive until the collective has read it.
            self._inflight = (work, sharded_grad, unsharded_grad)
            return
        if comm_hook is not None:
            sharded_grad = self._reduce_with_hook(unsharded_grad, comm_hook, comm_hook_state)
        else:
            sharded_grad = self._reduce_default(unsharded_grad)
        self._accumulate_reduced(sharded_grad)

    def wait_reduction(self) -> None:
        """Completes an in-flight reduce-scatter: wait, post-divide, accumulate. Else a no-op."""
        if self._inflight is None:
            return
        work, sharded_grad, _unsharded_grad = self._inflight
        self._inflight = None
        if work is not None:
            work.wait()
        if self.post_divide > 1:
            sharded_grad.div_(self.post_divide)
        self._accumulate_reduced(sharded_grad)

    def _accumulate_reduced(self, sharded_grad: torch.Tensor) -> None:
        """Adds a reduced (post-divided) gradient to this backward's pending sharded gradient.

        The gradient is cast back to full precision first: accumulation, the stash and the
        optimizer work on full-precision gradients (see [Note: Mixed precision dtypes]).
        """
        if sharded_grad.dtype != self.dtype:
            sharded_grad = sharded_grad.to(self.dtype)
        if self.offload_params:
            # Copied back to pinned CPU memory; finalize_grad waits for it (end of backward).
            offloaded = torch.empty(sharded_grad.shape, dtype=sharded_grad.dtype, pin_memory=True)
            offloaded.copy_(sharded_grad, non_blocking=True)
            sharded_grad = offloaded
        if self._pending_sharded_grad is not None:
            if self.offload_params and self.device.type == "cuda":
                # Both are pinned CPU tensors that non-blocking copies may still be writing; the
                # CPU add must not read them before the copies are done.
                torch.cuda.current_stream(self.device).synchronize()
            self._pending_sharded_grad.add_(sharded_grad)
        else:
            self._pending_sharded_grad = sharded_grad

    def _reduce_with_hook(
        self, unsharded_grad: torch.Tensor, comm_hook: Callable[..., Any], comm_hook_state: Any
    ) -> torch.Tensor:
        """torch FSDP1's hook convention: ``hook(state, grad, output)`` sharded, else ``hook(state, grad)``."""
        if not self.uses_sharding:
            comm_hook(comm_hook_state, unsharded_grad)
            return unsharded_grad
        output = torch.empty(self.sharded_numel, dtype=unsharded_grad.dtype, device=unsharded_grad.device)
        comm_hook(comm_hook_state, unsharded_grad, output)
        return output

    def _reduce_default(self, unsharded_grad: torch.Tensor) -> torch.Tensor:
        """Pre-divide, reduce-scatter (all-reduce for NO_SHARD), all-reduce across replicas, post-divide."""
        sharded_grad = unsharded_grad
        if self.pre_divide > 1:
            unsharded_grad.div_(self.pre_divide)
        if self.uses_sharding:
            sharded_grad = torch.empty(
                self.sharded_numel, dtype=unsharded_grad.dtype, device=unsharded_grad.device
            )
            comm.reduce_scatter_flat(sharded_grad, unsharded_grad, self.process_group)
        elif self.world_size > 1:
            comm.all_reduce_sum(unsharded_grad, self.process_group)
        if self.replicate_world_size > 1:
            comm.all_reduce_sum(sharded_grad, self.replicate_group)
        if self.post_divide > 1:
            sharded_grad.div_(self.post_divide)
        return sharded_grad

    def finalize_grad(self) -> None:
        """At the end of backward: sets ``.grad`` to the sharded gradient (plus any stash).

        Precondition: the FlatParameter holds its sharded data (or never shards).
        """
        self.wait_reduction()
        if self.offload_params and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # offloaded gradient copies
        pending, stash = self._pending_sharded_grad, self._sharded_grad_stash
        self._pending_sharded_grad = None
        self._sharded_grad_stash = None
        if pending is None and stash is None:
            self.use_sharded_grad_views()  # no_sync: the held unsharded gradient's views
            return
        if self.has_unsharded_buffer:
            p_assert(
                self.flat_param.data.data_ptr() == self._local_shard.data_ptr(),
                f"unit '{self.unit_name}': finalize_grad while the FlatParameter is unsharded",
            )
        grad: Optional[torch.Tensor] = pending if pending is not None else stash
        if pending is not None and stash is not None:
            stash.add_(pending)
            grad = stash
        self._set_sharded_grad(grad)

    def _set_sharded_grad(self, grad: Optional[torch.Tensor]) -> None:
        """Sets the FlatParameter's ``.grad`` (in ``grad_dtype``) and the original params' views."""
        if grad is not None and grad.dtype != self.precision.grad_dtype:
            grad = grad.to(self.precision.grad_dtype)
        assign_grad(self.flat_param, grad)
        self.use_sharded_grad_views()

    def abandon_backward(self) -> None:
        """Drops what an interrupted backward left behind; restores the gradient from before it.

        Postcondition: sharded (if the handle shards), no pending reduction, ``.grad`` as it
        was before that backward.
        """
        self.wait_reduction()  # never leave a collective in flight
        self._pending_sharded_grad = None
        self._param_grads = None
        self._open_run_grads, self._open_run = None, None
        grad = self.flat_param.grad
        if grad is not None and grad.shape != self._local_shard.shape:
            self.flat_param.grad = None  # an unreduced unsharded gradient
        if self.has_unsharded_buffer:
            self.reshard()
        stash, self._sharded_grad_stash = self._sharded_grad_stash, None
        if self._prior_grad_to_reduce is not None:
            stash, self._prior_grad_to_reduce = self._prior_grad_to_reduce, None
        if stash is not None:
            assign_grad(self.flat_param, stash.to(self.precision.grad_dtype))
        self.use_sharded_grad_views()

    def has_unsynced_grad(self) -> bool:
        """Whether a ``no_sync`` gradient is waiting to be synchronized."""
        return self._unsynced_unsharded_grad is not None
