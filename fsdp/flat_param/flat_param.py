"""FlatParameter and FlatParamHandle: one unit's parameters as one sharded 1-D tensor.

:class:`FlatParamHandle` composes four parts, each an object that owns its state and receives
what it needs at construction (the split of FSDP2's ``FSDPParam`` / ``FSDPParamGroup`` /
collectives as the model):

- ``shard_layout`` (:class:`~fsdp.flat_param._layout.ShardLayout`, fixed at construction):
  where each original parameter sits in the flat parameter and which part this rank holds;
  flattening; torch FSDP1's metadata on the FlatParameter.
- ``storage`` (:class:`~fsdp.flat_param._storage.FlatParamStorage`): the local shard (in a
  host buffer with CPU offload), the padded unsharded buffers and the :class:`HandleState`
  machine between them; the one gather path (on the unshard stream on CUDA).
- ``views`` (:class:`~fsdp.flat_param._views.ParamViews`, given the layout and the storage):
  what the original parameter names hold (views, placeholders, the original Parameters with
  use_orig_params) and writing user changes back.
- ``grads`` (:class:`~fsdp.flat_param._reduction.GradReduction`, given the layout, the
  storage, the groups and the views): the gradient state and the one reduction path.

The runtime calls the parts directly (``handle.grads.reduce(...)``, ``handle.views.
module_tensors()``); the handle itself does what spans parts: unshard and reshard (storage,
then views), writeback (views, then a reshard), abandoning a backward (gradients, reshard,
gradients). Its remaining layout properties and ``use_sharded_views`` are the interface
``state_dict/`` still reads (it is cut by ownership in a later step).

See docs/flat_param_lifecycle.md, [Note: Flat parameter storage lifecycle], for the states a
handle moves through and what memory each one holds.
"""

from __future__ import annotations

import weakref
from enum import Enum, auto
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from fsdp._comm._phase import collective_phase
from fsdp._common import FLAT_PARAM, group_rank, group_size, p_assert
from fsdp.api import MixedPrecision, ShardingStrategy
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
)
from fsdp.flat_param._precision import HandlePrecision
from fsdp.flat_param._reduction import GradReduction
from fsdp.flat_param._sharding import (
    aligned_numel,
    handle_uses_sharding,
)
from fsdp.flat_param._storage import FlatParameter, FlatParamStorage, HandleState, set_torch_metadata
from fsdp.flat_param._views import ParamViews, assign_grad

__all__ = [
    "FlatParameter",
    "FlatParamHandle",
    "HandleShardingStrategy",
    "HandleState",
    "ParamInfo",
    "SharedParamInfo",
    "ShardParamInfo",
    "assign_grad",
]


class HandleShardingStrategy(Enum):
    """A handle's strategy, as torch FSDP1's handle attribute ``_sharding_strategy`` gives it.

    [Note: A handle's strategy equals torch's] Code written against torch FSDP1 compares it with
    torch's own private enum (``handle._sharding_strategy == HandleShardingStrategy.NO_SHARD``,
    imported from torch's ``_flat_param``), which fsdp may not import. A member equals the
    member of that name of any enum named ``HandleShardingStrategy`` and hashes as torch's
    members do (by name), so those comparisons, ``in`` tests and set lookups answer as with
    torch FSDP1.
    """

    FULL_SHARD = auto()
    SHARD_GRAD_OP = auto()
    NO_SHARD = auto()
    HYBRID_SHARD = auto()
    _HYBRID_SHARD_ZERO2 = auto()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Enum) and type(other).__name__ == type(self).__name__:
            return self.name == other.name
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.name)


def _release_module_references(flat_param: FlatParameter) -> None:
    """Runs when a handle is garbage: drops the FlatParameter's references to the unit's modules.

    [Note: Freeing a wrapped model] torch's metadata on a FlatParameter (``_param_infos``,
    ``_modules``, ``_params``; [Note: torch-named metadata]) refers to the unit's modules, and
    the modules' parameter views refer to the FlatParameter through their base tensor, a
    reference held in C++ that Python's garbage collector cannot see. That cycle kept every
    unit's modules, views and FlatParameter alive after the model was dropped (torch FSDP1 keeps
    it too: on a GPU, about one fp32 copy of the model stayed allocated per dropped model).
    Once the handle (owned by the wrapper) is collected, nothing needs those references; dropping
    them breaks the cycle and the rest is freed.
    """
    for name in ("_param_infos", "_modules", "_params", "_shared_params"):
        if name in flat_param.__dict__:
            setattr(flat_param, name, None)


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
            device is CUDA) between uses; see [Note: CPU offload] in ``_storage.py``.
        mixed_precision: A ``MixedPrecision`` config or None (see [Note: Mixed precision
            dtypes] in ``_precision.py``).
        sharding_strategy: The unit's strategy in effect (NO_SHARD at world size 1); None:
            FULL_SHARD if ``uses_sharding`` else NO_SHARD. Read as torch FSDP1's
            ``_sharding_strategy``.

    Attributes:
        shard_layout: The layout part (``_layout.py``).
        storage: The storage part (``_storage.py``); ``flat_param`` is its FlatParameter.
        grads: The gradient state (``_reduction.py``).
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
        mixed_precision: Optional[MixedPrecision] = None,
        sharding_strategy: Optional[ShardingStrategy] = None,
    ) -> None:
        self.wrapped_module = wrapped_module
        if sharding_strategy is None:
            sharding_strategy = ShardingStrategy.FULL_SHARD if uses_sharding else ShardingStrategy.NO_SHARD
        self.sharding_strategy = sharding_strategy
        self.device = device
        self.process_group = process_group
        self.replicate_group = replicate_group
        self.use_orig_params = use_orig_params
        self.mixed_precision_config = mixed_precision
        unit_params = collect_params(params)
        self.param_infos: list[ParamInfo] = unit_params.param_infos
        self.shared_param_infos: list[SharedParamInfo] = unit_params.shared_param_infos
        mark_flattened(self, unit_params)
        unique_params = unit_params.unique_params
        precision = HandlePrecision.resolve(mixed_precision, unique_params[0].dtype)
        # [Note: CPU offload on one rank] in _sharding.py: offload takes the sharded path on one rank.
        uses_sharding = handle_uses_sharding(uses_sharding, group_size(process_group), offload_params)
        self.shard_layout: ShardLayout = self._init_layout(uses_sharding, precision)
        local_shard = self._flatten_local_shard(unique_params, precision.full_dtype, sync_module_states)
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
        # With use_orig_params the original Parameters stay registered (optimizers hold them);
        # otherwise the FlatParameter replaces them on the wrapped module.
        self.views = ParamViews(
            self.param_infos,
            self.shared_param_infos,
            self.shard_layout,
            self.storage,
            list(unique_params) if use_orig_params else None,
            unit_name,
        )
        # See [Note: Gradient flow] in docs/flat_param_lifecycle.md.
        self.grads = GradReduction(self.storage, self.shard_layout, process_group, replicate_group, self.views)
        # torch FSDP1's handle attribute: the owning unit's HandleTrainingState
        # (fsdp/runtime/_state.py), kept in step by UnitState.training_state; object here, as
        # this layer may not import the runtime's enum.
        self._training_state: object = None
        orig_params = self.views.orig_params if use_orig_params else None
        set_torch_metadata(self.flat_param, unit_params, self.shard_layout, orig_params)
        weakref.finalize(self, _release_module_references, self.flat_param)
        self._register_params()

    # ------------------------------------------------------------------ construction steps
    def _init_layout(self, uses_sharding: bool, precision: HandlePrecision) -> ShardLayout:
        """The flat layout and this rank's shard of it ([Note: Only the unit's group])."""
        # use_orig_params: each parameter starts 16-byte aligned in the flat parameter, as in
        # torch FSDP1 (see [Note: Aligned flat parameter layout] in _sharding.py).
        align_numel = aligned_numel(itemsize(precision.param_dtype)) if self.use_orig_params else 0
        return ShardLayout.build(
            self.param_infos, group_rank(self.process_group), group_size(self.process_group), uses_sharding, align_numel
        )

    def _flatten_local_shard(
        self, unique_params: Sequence[nn.Parameter], dtype: torch.dtype, sync_module_states: bool
    ) -> torch.Tensor:
        """Flattens the parameters (rank 0's values with ``sync_module_states``) and returns
        this rank's shard of them."""
        with torch.no_grad():
            flat = self.shard_layout.flatten(unique_params, dtype, self.device)
            if sync_module_states:
                from fsdp._comm._groups import ShardingGroups, broadcast_from_group_rank0

                with collective_phase(None, self):
                    broadcast_from_group_rank0(flat, ShardingGroups(self.process_group, self.replicate_group))
            return self.shard_layout.cut_local_shard(flat, dtype, self.device)

    def _register_params(self) -> None:
        """Registers what the modules hold at rest: the original Parameters (use_orig_params)
        or the FlatParameter on the wrapped module, the names pointing at sharded views."""
        if self.use_orig_params:
            self.views.use_sharded()
            return
        for info in self.param_infos:
            info.module._parameters.pop(info.param_name, None)
        for shared in self.shared_param_infos:
            shared.module._parameters.pop(shared.param_name, None)
        self.wrapped_module.register_parameter(FLAT_PARAM, self.flat_param)
        if self.shard_layout.uses_sharding or self.has_unsharded_buffer:
            self.views.use_sharded()
        else:
            with torch.no_grad():
                self.use_unsharded_views()

    @property
    def unit_name(self) -> str:
        """The unit's name for messages (refined at lazy init); the views hold it."""
        return self.views.unit_name

    @unit_name.setter
    def unit_name(self, name: str) -> None:
        self.views.unit_name = name

    # ------------------------------------------------------------------ layout (read-only)
    @property
    def rank(self) -> int:
        """This rank in the shard group ([Note: Only the unit's group])."""
        return self.shard_layout.rank

    @property
    def world_size(self) -> int:
        """The shard group's size."""
        return self.shard_layout.world_size

    # ------------------------------------------------------------------ torch FSDP1's names
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
    def _sharding_strategy(self) -> HandleShardingStrategy:
        """torch FSDP1's handle attribute: the strategy in effect ([Note: A handle's strategy
        equals torch's])."""
        return HandleShardingStrategy[self.sharding_strategy.name]

    @property
    def uses_sharded_strategy(self) -> bool:
        """torch FSDP1's name: whether the strategy in effect is not NO_SHARD."""
        return self.sharding_strategy is not ShardingStrategy.NO_SHARD

    @property
    def _fwd_bwd_param_dtype(self) -> torch.dtype:
        """The dtype forward and backward compute in (torch FSDP1's name)."""
        return self.storage.precision.param_dtype

    # ------------------------------------------------------------------ storage
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
    def _local_shard(self) -> torch.Tensor:
        return self.storage.local_shard

    def unshard(self, full_precision: bool = False, async_op: bool = False, stream_ordered: bool = False) -> None:
        """Makes the padded unsharded parameter the FlatParameter's ``.data``.

        Args:
            full_precision: Gather the full-precision values (summon_full_params, state dicts)
                instead of the ``param_dtype`` copy forward and backward use.
            async_op: Prefetch: on CUDA only launch the all-gather on the unshard stream; the
                next plain ``unshard()`` waits for it ([Note: One gather path] in
                ``_storage.py``). On CPU the gather completes here all the same ([Note: On CPU
                a collective completes where it is launched] in ``_policy.py``).
            stream_ordered: The runtime has ordered the unshard stream after the compute
                stream's writes of the local shard (its once-per-iteration wait, [Note: Stream
                edges] in ``_streams.py``); otherwise the gather waits for the compute stream.

        Postcondition: state is UNSHARDED (UNSHARDED_FULL_PRECISION when ``full_precision`` and
        the parameters run in low precision) with ``.data`` on the compute device, its values
        valid unless ``async_op`` on CUDA. If already in that state only a pending prefetch is
        waited for; a handle unsharded in the other precision is resharded first.
        """
        target = self.storage.target_state(full_precision)
        if self.state is target:
            if not async_op:
                self.storage.wait_unshard()
            self.storage.show_unsharded()  # [Note: A kept unit shows its local shard]
            return
        if self.state is not HandleState.SHARDED:
            self.reshard()
        with collective_phase(None, self):  # [Note: Collective phase]: errors name this unit
            self.storage.gather(target, full_precision, async_op, stream_ordered)

    @property
    def unshard_pending(self) -> bool:
        """A prefetched all-gather has been launched and not yet waited for."""
        return self.storage.pending_unshard is not None

    def reshard(self) -> None:
        """Frees the padded unsharded tensors and points every name at a placeholder.

        Postcondition: state is SHARDED, ``.data`` is the local shard (full precision) and the
        unsharded storages have size 0. For a handle that never frees anything (NO_SHARD or
        world size 1 without mixed precision) only the original Parameters are registered back
        (use_orig_params).
        """
        if not self.has_unsharded_buffer:
            if self.use_orig_params:
                self.views.use_sharded()  # registers the original Parameters back
            return
        if self.state is HandleState.SHARDED:
            return
        self.storage.wait_unshard()  # never free memory a collective is still writing
        self.storage.free_unsharded()
        self.views.use_sharded()

    def write_back_shard(self, padded_unsharded: torch.Tensor) -> None:
        """Copies this rank's slice of ``padded_unsharded`` into the local shard."""
        self.storage.write_back_shard(padded_unsharded, self.shard_layout.local_slice(padded_unsharded))

    # ------------------------------------------------------------------ views and gradients
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
        self.storage.show_unsharded()
        recorded = not as_params and torch.is_grad_enabled() and self.flat_param.requires_grad
        self.views.use_unsharded(as_params, recorded)

    def show_local_shard(self) -> None:
        """A unit kept unsharded after its forward or backward shows its local shard.

        [Note: A kept unit shows its local shard]
        torch FSDP1 points a FlatParameter's ``.data`` back at the local shard after every
        forward and backward, also where it keeps the unsharded memory gathered (the root, and
        SHARD_GRAD_OP between forward and backward or inside ``no_sync``): without
        use_orig_params the FlatParameter is what ``parameters()`` gives, so that is what user
        code reads there. fsdp does the same: the gathered buffer stays (the state is still
        unsharded, the module's names still view it and autograd's saved views too), only
        ``.data`` changes, and :meth:`unshard` and :meth:`use_unsharded_views` point it at the
        buffer again. With use_orig_params the original Parameters are what user code reads
        ([Note: Original parameters between forward and backward] in ``runtime/_hooks.py``).
        tests/test_torch_fsdp1_cases.py compares the FlatParameter with torch FSDP1's.
        """
        if not self.use_orig_params:
            self.storage.show_local_shard()

    def use_sharded_views(self) -> None:
        """``views.use_sharded()``, kept for ``state_dict/`` until its own cut by ownership."""
        self.views.use_sharded()

    def managed_orig_params(self) -> list[nn.Parameter]:
        """The original Parameters this handle keeps registered (use_orig_params), else []."""
        return list(self.views.orig_params)

    def writeback_orig_params(self) -> None:
        """use_orig_params: adopts ``.data`` or Parameters the user replaced since the last step
        (``ParamViews.writeback``; raises ValueError for a wrong shape); a stale gathered copy
        is dropped, so the next unshard gathers the new values.

        A prefetched gather still reading the local shard is waited for first (the copy must
        not overwrite it under the collective), and the unshard stream is ordered after the
        copy ([Note: Stream edges] in ``_streams.py``, edge 1)."""
        self.storage.wait_unshard()
        if not self.views.writeback():
            return
        self.storage.order_gathers_after_compute()
        if self.has_unsharded_buffer and self.is_unsharded:
            self.reshard()
        self.views.use_sharded()

    def abandon_backward(self) -> None:
        """Drops what an interrupted backward left behind; restores the gradient from before it.

        Postcondition: sharded (if the handle shards), no pending reduction, ``.grad`` as it
        was before that backward.
        """
        self.grads.drop_backward()
        self.views.drop_recorded_views()
        if self.has_unsharded_buffer:
            self.reshard()
        self.grads.restore_prior_grad()
