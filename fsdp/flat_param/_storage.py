"""The tensors behind one FlatParameter, and unsharding and resharding them.

The storage concern of :class:`~fsdp.flat_param.flat_param.FlatParamHandle`: the local shard
(optionally offloaded to CPU), the padded unsharded buffers of each precision, which of them
the FlatParameter's ``.data`` is (:class:`HandleState`, an explicit state machine with checked
transitions), and the all-gather that fills an unsharded buffer (on CUDA possibly on a side
stream, ordered by an event). See docs/flat_param_lifecycle.md, [Note: Flat parameter storage
lifecycle], for what memory each state holds. The FlatParameter declares the metadata torch
FSDP1 keeps on it, and :func:`set_torch_metadata` sets it.
"""

from __future__ import annotations

from concurrent.futures import Future
from enum import Enum, auto
from typing import Any, NamedTuple, Optional, cast

import torch
import torch.distributed as dist
from torch import nn

from fsdp._comm import _collectives as comm
from fsdp._common import p_assert
from fsdp.flat_param._layout import FSDP_FLATTENED, ParamInfo, ShardLayout, ShardParamInfo, UnitParams
from fsdp.flat_param import _streams
from fsdp.flat_param._precision import HandlePrecision

__all__ = ["FlatParameter", "FlatParamStorage", "HandleState", "set_torch_metadata"]

#: The attribute that marks a parameter as a FlatParameter (torch FSDP1's name).
IS_FLAT_PARAM = "_is_flat_param"


# mypy takes no call as a base class; torch's metaclass of nn.Parameter (_ParameterMeta) is private.
class _FlatParameterMeta(type(nn.Parameter)):  # type: ignore[misc]
    """``isinstance(t, FlatParameter)`` is True for a parameter carrying the flat-parameter flag."""

    def __instancecheck__(cls, instance: object) -> bool:
        return isinstance(instance, torch.Tensor) and getattr(instance, IS_FLAT_PARAM, False)


class FlatParameter(nn.Parameter, metaclass=_FlatParameterMeta):
    """The one ``nn.Parameter`` a unit registers: its original parameters, flattened and padded.

    Its ``.data`` is the local shard (1-D, ``sharded_numel`` elements) while the handle is
    SHARDED, and the padded unsharded tensor while it is UNSHARDED. All metadata lives on the
    owning :class:`~fsdp.flat_param.flat_param.FlatParamHandle`; optimizers only ever see the
    sharded form.

    [Note: A FlatParameter's type is nn.Parameter]
    ``FlatParameter(...)`` returns a plain ``nn.Parameter`` flagged as flat
    (``isinstance(p, FlatParameter)`` checks the flag), as torch FSDP1's does. ``type(p)`` must
    be ``nn.Parameter``: torch's optimizers take their fast multi-tensor (``foreach``) path on
    CUDA only when every parameter's type is exactly ``Tensor`` or ``Parameter``. A subclass
    falls back to the per-tensor loop, which is slower on GPUs and rounds AdamW's update
    differently, so results would no longer equal torch FSDP1's bit for bit.
    """

    # torch FSDP1's read-only metadata, under its names (:func:`set_torch_metadata`).
    _num_params: int
    _param_infos: list[ParamInfo]
    _fqns: list[str]
    _shapes: list[torch.Size]
    _strides: list[tuple[int, ...]]
    _numels: tuple[int, ...]
    _numels_with_padding: tuple[int, ...]
    _is_padding_mask: list[bool]
    _shard_param_infos: tuple[ShardParamInfo, ...]
    _modules: set[nn.Module]
    _unpadded_unsharded_size: torch.Size
    _padded_unsharded_size: torch.Size  # set only when the handle shards, as torch's
    _shard_numel_padded: int
    _sharded_size: torch.Size
    _params: Optional[list[nn.Parameter]]
    _shared_params: Optional[list[nn.Parameter]]
    # A DTensor parameter's spec, None for a plain one (torch types the spec Any).
    _param_extensions: list[Optional[Any]]
    _fsdp_flattened: bool

    def __new__(cls, data: torch.Tensor, requires_grad: bool = True) -> "FlatParameter":
        p_assert(data.dim() == 1, f"FlatParameter data must be 1-D, got shape {tuple(data.shape)}")
        flat_param = nn.Parameter.__new__(nn.Parameter, data, requires_grad)
        setattr(flat_param, IS_FLAT_PARAM, True)
        setattr(flat_param, FSDP_FLATTENED, True)
        return cast("FlatParameter", flat_param)  # [Note: A FlatParameter's type is nn.Parameter]


class HandleState(Enum):
    """What the FlatParameter's ``.data`` is, and so what memory the unit holds.

    - ``SHARDED``: ``.data`` is the local shard; every unsharded buffer's storage has size 0;
      the original parameter names on the modules hold placeholders that raise a clear error
      (NO_SHARD: full-precision views of the local shard, which is the whole parameter).
    - ``UNSHARDED``: ``.data`` is the padded unsharded tensor in the compute dtype
      (``param_dtype``; allocated, gathered); forward and backward use it.
    - ``UNSHARDED_FULL_PRECISION``: ``.data`` is the padded unsharded tensor in full precision,
      for summon_full_params and state dicts. Only a handle with low-precision parameters is
      ever in this state; for the others full precision *is* the compute dtype (UNSHARDED).

    A handle that never frees anything (NO_SHARD or world size 1, without mixed precision)
    stays UNSHARDED: its local shard is the whole parameter in its only dtype.
    """

    SHARDED = auto()
    UNSHARDED = auto()
    UNSHARDED_FULL_PRECISION = auto()


# The transitions unshard and reshard make; a recast starts the machine afresh (rebuild).
_TRANSITIONS: dict[HandleState, tuple[HandleState, ...]] = {
    HandleState.SHARDED: (HandleState.UNSHARDED, HandleState.UNSHARDED_FULL_PRECISION),
    HandleState.UNSHARDED: (HandleState.SHARDED,),
    HandleState.UNSHARDED_FULL_PRECISION: (HandleState.SHARDED,),
}


class _PendingUnshard(NamedTuple):
    """An all-gather launched on the unshard stream (CUDA): its completion event, and the input
    shard, kept alive until the collective has read it."""

    event: Any  # a torch.cuda.Event (the stream layer's, [Note: Stream edges])
    shard: torch.Tensor


def _free_storage(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)


def _alloc_storage(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    nbytes = tensor.numel() * tensor.element_size()
    if storage.size() != nbytes:
        storage.resize_(nbytes)


class FlatParamStorage:
    """The local shard, the padded unsharded buffers and the :class:`HandleState` between them.

    Args:
        local_shard: This rank's shard (1-D; the whole flat parameter without sharding).
        requires_grad: Whether the FlatParameter requires a gradient.
        precision: The handle's dtypes (``_precision.py``).
        device: The compute device.
        process_group: The group the parameter is sharded over.
        uses_sharding: Whether the handle shards (see ``ShardLayout.uses_sharding``).
        padded_unsharded_numel: Elements of each padded unsharded buffer.
        offload_params: Keep the local shard on CPU; see [Note: CPU offload].

    Raises:
        NotImplementedError: CPU offload of a handle that does not shard, on an accelerator.
    """

    def __init__(
        self,
        local_shard: torch.Tensor,
        requires_grad: bool,
        precision: HandlePrecision,
        device: torch.device,
        process_group: dist.ProcessGroup,
        uses_sharding: bool,
        padded_unsharded_numel: int,
        offload_params: bool,
    ) -> None:
        self.device = device
        self.process_group = process_group
        self.uses_sharding = uses_sharding
        self.padded_unsharded_numel = padded_unsharded_numel
        # [Note: CPU offload] The local shard (what the optimizer updates) and its reduced
        # gradient live in host buffers: tensors of their own, pinned where an accelerator
        # copies from them. Unshard copies the shard to the compute device (non-blocking) before
        # gathering; the reduced gradient is copied into a new host buffer. On a CPU compute
        # device the copies are real copies too, so the same code runs (and is tested) without
        # an accelerator; torch FSDP1 refuses CPU offload there.
        self.offload_params = offload_params
        # Pinned memory needs an accelerator (and only serves copies to one).
        self.pin_host_buffers = offload_params and device.type != "cpu"
        if offload_params:
            if not uses_sharding and device.type != "cpu":
                # (On a CPU compute device the host buffer is a compute buffer: nothing to copy.)
                raise NotImplementedError(
                    "fsdp: CPUOffload(offload_params=True) with NO_SHARD on more than one rank "
                    "on an accelerator is not supported yet; use FULL_SHARD or SHARD_GRAD_OP."
                )
            local_shard = self.new_host_buffer(local_shard).copy_(local_shard)
        self.flat_param = FlatParameter(local_shard, requires_grad=requires_grad)
        self.local_shard: torch.Tensor = self.flat_param.data
        # An all-gather not yet waited for (a prefetch, see [Note: Prefetch]).
        self.pending_unshard: Optional[_PendingUnshard] = None
        # An update of the local shard still running elsewhere (the pipelined host step,
        # [Note: Pipelined host step] in runtime/_host_step.py): every gather waits for it.
        self.pending_update: Optional[Future[Any]] = None
        # CUDA: the side streams every all-gather, every gradient reduction and the hybrid
        # strategies' all-reduce across replicas run on (set at lazy init, shared by the tree, as
        # torch FSDP1's; [Note: Stream edges] in _streams.py); None on CPU.
        self.unshard_stream: Optional[Any] = None
        self.post_backward_stream: Optional[Any] = None
        self.all_reduce_stream: Optional[Any] = None
        self.precision = precision
        self.padded_unsharded_full: Optional[torch.Tensor] = None
        self.padded_unsharded_low: Optional[torch.Tensor] = None
        self.has_unsharded_buffer = False
        self.state = HandleState.SHARDED
        self._new_buffers()

    def _new_buffers(self) -> None:
        """(Re)makes the padded unsharded buffers, freed, for :attr:`precision`, and starts
        the state machine: SHARDED, or UNSHARDED for good if there is nothing to free.

        The buffers are allocated once, their storage resized to 0 when freed so that views
        saved by autograd stay valid once refilled (see the design note). The full-precision
        one exists when the handle shards; the low-precision one (the compute copy for forward
        and backward) when parameters run in another dtype.
        """
        self.padded_unsharded_full = self._new_freed_buffer(self.precision.full_dtype) if self.uses_sharding else None
        self.padded_unsharded_low = (
            self._new_freed_buffer(self.precision.param_dtype) if self.precision.low_precision_params else None
        )
        # Whether the handle ever frees an unsharded copy (else it stays UNSHARDED for good).
        self.has_unsharded_buffer = self.padded_unsharded_full is not None or self.padded_unsharded_low is not None
        self.state = HandleState.SHARDED if self.has_unsharded_buffer else HandleState.UNSHARDED

    def new_host_buffer(self, like: torch.Tensor) -> torch.Tensor:
        """An uninitialized host tensor shaped like ``like`` (pinned where an accelerator
        copies from it), for CPU offload."""
        return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=self.pin_host_buffers)

    def _new_freed_buffer(self, dtype: torch.dtype) -> torch.Tensor:
        buffer = torch.empty(self.padded_unsharded_numel, dtype=dtype, device=self.device)
        _free_storage(buffer)
        return buffer

    def _transition(self, target: HandleState) -> None:
        p_assert(
            target in _TRANSITIONS[self.state],
            f"flat parameter storage: no transition from {self.state} to {target}",
        )
        self.state = target

    def rebuild(self, new_local_shard: torch.Tensor, precision: HandlePrecision) -> None:
        """Takes ``new_local_shard`` (a cast of the local shard) as the local shard.

        Precondition: no unsharded buffer is in use (SHARDED, or never frees anything), no
        gather pending, and the FlatParameter has no gradient.

        Postcondition: ``.data`` is the new local shard; the buffers are made again (freed) in
        the new dtypes; the state is SHARDED (UNSHARDED if nothing is ever freed).
        """
        self.flat_param.data = new_local_shard
        self.local_shard = new_local_shard
        self.precision = precision
        self._new_buffers()
        self.order_gathers_after_compute()  # the cast was made on the compute stream

    def padded_unsharded_for(self, full_precision: bool) -> torch.Tensor:
        """The padded unsharded tensor of the requested precision (its storage may be freed)."""
        if not full_precision and self.padded_unsharded_low is not None:
            return self.padded_unsharded_low
        if self.padded_unsharded_full is not None:
            return self.padded_unsharded_full
        return self.local_shard  # never sharded: the local shard is the whole parameter

    def unsharded_storage_nbytes(self) -> int:
        """Bytes the padded unsharded buffers hold right now (0 when freed)."""
        buffers = [self.padded_unsharded_full, self.padded_unsharded_low]
        if not self.has_unsharded_buffer:
            buffers = [self.local_shard]
        return sum(b.untyped_storage().nbytes() for b in buffers if b is not None)

    def target_state(self, full_precision: bool) -> HandleState:
        """The state an unshard of that precision ends in."""
        if self.precision.low_precision_params and full_precision:
            return HandleState.UNSHARDED_FULL_PRECISION
        return HandleState.UNSHARDED

    def gather(self, target: HandleState, full_precision: bool, async_op: bool, stream_ordered: bool = False) -> None:
        """Fills the padded unsharded buffer of ``target``'s precision and makes it ``.data``.

        [Note: One gather path] Every unshard (forward, backward, prefetch, summon, state dicts)
        takes this path. On CUDA it runs on the unshard stream and the compute stream waits on
        its event where the unit starts (:meth:`wait_unshard`): the CPU runs ahead and the
        gather overlaps the previous unit's compute. The unshard stream waits for the compute
        stream only where a gather reads what the compute stream may have written, the local
        shard ([Note: Stream edges] in ``_streams.py``): the runtime's gathers
        (``stream_ordered``) are ordered once per iteration by the runtime, any other gather
        (summon, state dicts, between iterations) waits here. tests/test_cuda_lane.py runs it
        (every config on the two-rank pool, offload on the one-rank NCCL pool, the overlap on
        the fake group); tests/test_streams.py checks its edges on CPU. A prefetch
        (``async_op``) is waited for by :meth:`wait_unshard`, any other gather at once. On CPU
        every gather completes here, a prefetch too ([Note: On CPU a collective completes where
        it is launched] in ``_policy.py``).

        Precondition: SHARDED, no gather pending. Postcondition: the state is ``target``; the
        values are valid unless ``async_op`` on CUDA.
        """
        self.wait_update()
        low = self.precision.low_precision_params and not full_precision
        padded_unsharded = self.padded_unsharded_for(full_precision)
        if padded_unsharded is not self.local_shard:
            stream = self.unshard_stream if self.uses_sharding else None
            if stream is not None and not stream_ordered:
                self.order_gathers_after_compute()
            with _streams.use_stream(stream):
                _alloc_storage(padded_unsharded)
                shard = self.local_shard
                if self.offload_params:
                    # A copy on the compute device (a real copy on a CPU compute device too).
                    shard = shard.to(self.device, non_blocking=True, copy=True)
                if low:
                    # Cast the shard first so the gather moves param_dtype bytes (as torch FSDP1).
                    shard = shard.to(self.precision.param_dtype)
                if not self.uses_sharding:
                    padded_unsharded.copy_(shard)
                else:
                    comm.all_gather_flat(padded_unsharded, shard, self.process_group)
                    if stream is not None:
                        self.pending_unshard = _PendingUnshard(_streams.record_event(stream), shard)
        self.flat_param.data = padded_unsharded
        self._transition(target)
        if not async_op:
            self.wait_unshard()

    def order_gathers_after_compute(self) -> None:
        """The unshard stream waits for the compute stream's work so far (a no-op without
        streams): called right after the compute stream wrote the local shard inside an
        iteration, where no iteration wait follows before the next gather ([Note: Stream
        edges], edge 1)."""
        if self.unshard_stream is not None:
            self.unshard_stream.wait_stream(_streams.current_stream(self.device))

    def wait_update(self) -> None:
        """Waits for a pending update of the local shard (a no-op without one); re-raises its
        error."""
        pending, self.pending_update = self.pending_update, None
        if pending is not None:
            pending.result()

    def wait_unshard(self) -> None:
        """Completes a prefetched all-gather (a no-op without one)."""
        pending, self.pending_unshard = self.pending_unshard, None
        if pending is None:
            return
        current = _streams.current_stream(self.device)
        current.wait_event(pending.event)
        # Allocated on the unshard stream, used on this one: once freed, no gather reuses the
        # block before this stream is past its last read ([Note: Stream edges], edge 2).
        _streams.record_stream(self.flat_param.data, current)

    def free_unsharded(self) -> None:
        """Points ``.data`` back at the local shard and frees the padded unsharded buffers.

        Precondition: an unsharded state, no gather pending. Postcondition: SHARDED.
        """
        self.flat_param.data = self.local_shard
        for buffer in (self.padded_unsharded_full, self.padded_unsharded_low):
            if buffer is not None:
                _free_storage(buffer)
        self._transition(HandleState.SHARDED)

    def show_local_shard(self) -> None:
        """Makes ``.data`` the local shard while the unsharded buffer stays gathered (the state
        does not change); :meth:`show_unsharded` undoes it. [Note: A kept unit shows its local
        shard] in ``flat_param.py``."""
        if self.state is not HandleState.SHARDED and self.has_unsharded_buffer:
            self.flat_param.data = self.local_shard

    @property
    def shows_local_shard(self) -> bool:
        """Unsharded, with ``.data`` showing the local shard (:meth:`show_local_shard`)."""
        return (
            self.state is not HandleState.SHARDED
            and self.has_unsharded_buffer
            and self.flat_param.data_ptr() == self.local_shard.data_ptr()
        )

    def show_unsharded(self) -> None:
        """Makes ``.data`` the gathered padded unsharded buffer of the current state again."""
        if self.state is not HandleState.SHARDED and self.has_unsharded_buffer:
            self.flat_param.data = self.padded_unsharded_for(self.state is HandleState.UNSHARDED_FULL_PRECISION)

    def write_back_shard(self, padded_unsharded: torch.Tensor, local_slice: torch.Tensor) -> None:
        """Copies ``local_slice`` (this rank's slice of ``padded_unsharded``) into the local shard."""
        if padded_unsharded.data_ptr() != self.local_shard.data_ptr():
            self.local_shard.copy_(local_slice)
            self.order_gathers_after_compute()


def set_torch_metadata(
    flat: FlatParameter,
    unit_params: UnitParams,
    layout: ShardLayout,
    orig_params: Optional[list[nn.Parameter]],
) -> None:
    """Sets the read-only metadata torch FSDP1 keeps on its FlatParameter, under its names.

    [Note: torch-named metadata] Stacks built on torch FSDP1 read these (accelerate:
    ``_flat_param._fqns``; Lightning: ``param._fsdp_flattened``). Same types and meaning as
    torch's: ``_fqns`` (list of names relative to the wrapped module), ``_shapes`` (list of
    ``torch.Size``), ``_strides`` (list of tuples), ``_numels`` (tuple of int),
    ``_num_params``, ``_param_infos`` (``param_name``, ``module``, ``module_name`` first),
    ``_modules`` (set), ``_unpadded_unsharded_size`` / ``_padded_unsharded_size`` (sharding
    only) / ``_sharded_size`` (``torch.Size``), ``_shard_numel_padded`` (padding elements in
    this rank's shard), ``_params`` / ``_shared_params`` (the original Parameters with
    use_orig_params, else None) and ``_fsdp_flattened`` (on the FlatParameter, and on the
    original Parameters with use_orig_params), and the layout: ``_numels_with_padding``
    (tuple), ``_is_padding_mask`` (list of bool) and ``_shard_param_infos`` (tuple of
    :class:`ShardParamInfo`, one per parameter), with torch's alignment padding under
    use_orig_params (see [Note: Aligned flat parameter layout] in ``_sharding.py``).

    Args:
        flat: The FlatParameter.
        unit_params: Its parameters and their names.
        layout: Its layout.
        orig_params: The original Parameters kept registered (use_orig_params), else None.
    """
    infos = unit_params.param_infos
    flat._num_params = len(infos)
    flat._param_infos = list(infos)
    flat._fqns = [info.fqn for info in infos]
    flat._shapes = [info.shape for info in infos]
    flat._strides = [tuple(p.stride()) for p in unit_params.unique_params]
    flat._numels = tuple(info.numel for info in infos)
    flat._numels_with_padding = layout.flat.numels_with_padding
    flat._is_padding_mask = list(layout.flat.is_padding_mask)
    flat._shard_param_infos = tuple(
        ShardParamInfo(False, None, None, None, None)
        if piece is None
        else ShardParamInfo(
            True, piece.offset_in_shard, piece.numel, piece.offset_in_param, piece.offset_in_param + piece.numel - 1
        )
        for piece in layout.shard_slices
    )
    flat._modules = {info.module for info in infos} | {shared.module for shared in unit_params.shared_param_infos}
    flat._unpadded_unsharded_size = torch.Size([layout.unpadded_unsharded_numel])
    if layout.uses_sharding:
        flat._padded_unsharded_size = torch.Size([layout.padded_unsharded_numel])
    flat._shard_numel_padded = layout.shard_numel_padded()
    flat._sharded_size = torch.Size([layout.sharded_numel])
    if orig_params is not None:
        flat._params = orig_params
        flat._shared_params = [orig_params[shared.prim_index] for shared in unit_params.shared_param_infos]
        for param in unit_params.unique_params:
            setattr(param, FSDP_FLATTENED, True)  # a plain nn.Parameter declares no such attribute
    else:
        flat._params = None
        flat._shared_params = None
    flat._param_extensions = [info.dtensor_spec for info in infos]
