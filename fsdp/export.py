"""Weight export for inference engines: full parameters streamed unit by unit, and the shard map.

Reinforcement-learning stacks push the trainer's weights to an inference engine after every
step. This module gives them two ways to read an FSDP model without changing it:

- :func:`full_params_stream`, push: an iterator of buckets of ``(name, tensor)`` with the
  unwrapped model's names (those of a plain model's ``state_dict()``), in a dtype the caller
  picks, gathered one unit at a time with one collective per unit
  ([Note: Export streams one unit at a time]).
- :func:`full_params_delta`, push of what changed: only the elements that differ from a host
  snapshot the caller owns (sparse or dense, whichever is smaller), with a checksum per
  parameter that :func:`apply_delta` verifies ([Note: Export deltas]).
- :func:`shard_map` and :func:`local_shard_views`, pull: which range of which parameter this
  rank's flat shard holds (and the boxes of the parameter it covers, [Note: A flat range is a few
  boxes] in ``flat_param/_shard_map.py``), computed without communication, and zero-copy views
  of those ranges; a consumer with its own parallel layout takes exactly the slices it needs
  from the ranks that hold them.
- :func:`save_safetensors`: the stream written as Hugging Face safetensors files on rank 0
  ([Note: Streaming safetensors] in ``fsdp/state_dict/_safetensors.py``).

See docs/export.md for the guide and the measurements.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Generator, Iterator, MutableMapping, NamedTuple, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from fsdp._comm import _collectives as comm
from fsdp._common import FLAT_PARAM, clean_fqn
from fsdp.flat_param._layout import FLATTENED_ATTR, itemsize
from fsdp.flat_param._recast import adopt_external_cast
from fsdp.flat_param._shard_map import Box, layout_param_boxes, tp_piece
from fsdp.flat_param.flat_param import FlatParamHandle
from fsdp.runtime._state import HandleTrainingState, named_fsdp_states
from fsdp.state_dict._safetensors import TensorSpec, write_safetensors
from fsdp.state_dict._values import NOBODY, gather

__all__ = [
    "Bucket",
    "full_params_stream",
    "ShardMapEntry",
    "LocalRange",
    "shard_map",
    "local_shard_views",
    "ParamDelta",
    "checksum",
    "full_params_delta",
    "apply_delta",
    "save_safetensors",
]

#: A bucket of the stream: ``(name, tensor)`` pairs whose bytes add up to at most the bucket size
#: (or one tensor larger than it).
Bucket = list[tuple[str, torch.Tensor]]

_ALIGN_BYTES = 16  # where a tensor starts in the reused staging buffer


def _join(prefix: str, name: str) -> str:
    return clean_fqn(f"{prefix}.{name}" if prefix else name)


def _global_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class _UnitHandle(NamedTuple):
    """One handle to export and its parameters' unwrapped names (in flat order)."""

    handle: FlatParamHandle
    names: list[str]


def _prepare(module: nn.Module, what: str) -> list[_UnitHandle]:
    """Every handle under ``module`` in pre-order, its user edits adopted, and its names.

    Raises:
        RuntimeError: A unit is in forward, backward or ``summon_full_params``.
    """
    result: list[_UnitHandle] = []
    for prefix, _, state in named_fsdp_states(module):
        if state.training_state is not HandleTrainingState.IDLE:
            raise RuntimeError(
                f"fsdp: {what}() needs every unit idle, but the unit at '{prefix or '<root>'}' is in "
                f"{state.training_state.name}. Call it between steps, outside forward, backward and "
                "summon_full_params."
            )
        for handle in state.handles:
            adopt_external_cast(handle)  # [Note: Casting after wrapping]
            handle.writeback_orig_params()  # use_orig_params: the values the user set
            result.append(_UnitHandle(handle, [_join(prefix, info.fqn) for info in handle.param_infos]))
    return result


def _loose_tensors(module: nn.Module, handles: list[_UnitHandle], buffers: bool) -> list[tuple[str, torch.Tensor]]:
    """Parameters no unit manages (ignored modules) and, with ``buffers``, persistent buffers,
    each once, under their unwrapped names."""
    seen = {id(p) for unit in handles for p in unit.handle.managed_orig_params()}
    out: list[tuple[str, torch.Tensor]] = []
    for mod_name, mod in module.named_modules():
        for name, param in mod._parameters.items():
            if param is None or name == FLAT_PARAM or id(param) in seen:
                continue
            seen.add(id(param))
            if getattr(param, FLATTENED_ATTR, None) is None:
                out.append((_join(mod_name, name), param.detach()))
        if not buffers:
            continue
        for name, buf in mod._buffers.items():
            if buf is None or name in mod._non_persistent_buffers_set or id(buf) in seen:
                continue
            seen.add(id(buf))
            out.append((_join(mod_name, name), buf.detach()))
    return out


def _dst(handle: FlatParamHandle, rank0_only: bool, tp: list[Optional[_TpParam]]) -> Optional[int]:
    """Who receives the handle's gather: None (every rank), global rank 0's group rank, or
    :data:`NOBODY` for a group without global rank 0 (another replica of HYBRID_SHARD). With
    tensor-parallel parameters in the unit (``tp``): the group's member in global rank 0's tp
    group, which passes its tp pieces on to rank 0 ([Note: Export of tensor-parallel parameters])."""
    if not rank0_only:
        return None
    ranks = list(dist.get_process_group_ranks(handle.process_group))
    held = [i for i, rank in enumerate(ranks) if rank in _rank0_receivers(tp)]
    return held[0] if held else NOBODY


def _rank0_receivers(tp: list[Optional[_TpParam]]) -> frozenset[int]:
    """The global ranks that keep a unit's gather with ``rank0_only``: rank 0, or with
    tensor-parallel parameters the ranks of rank 0's tp group."""
    return next((param.rank0_group for param in tp if param is not None), frozenset({0}))


def _gathered(
    handle: FlatParamHandle, dtype: Optional[torch.dtype], rank0_only: bool, tp: list[Optional[_TpParam]]
) -> Optional[torch.Tensor]:
    """The handle's padded unsharded flat parameter in the export dtype, gathered with one
    collective (none where the handle does not shard); None on ranks that keep nothing.

    The local shard is cast before the gather ([Note: Export streams one unit at a time])."""
    shard = handle._local_shard.detach()
    target = _export_dtype(shard, dtype)
    dst = _dst(handle, rank0_only, tp)
    if not handle.shard_layout.uses_sharding:
        keeps = not rank0_only or _global_rank() in _rank0_receivers(tp)
        return shard.to(target) if keeps else None
    if dst is None:
        return _all_gathered(handle, shard, target)
    # CPU offload of parameters: communicate on the device.
    return gather(shard.to(handle.device, target), handle.process_group, handle.rank, handle.world_size, dst)


def _all_gathered(handle: FlatParamHandle, shard: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The all-gather of ``shard`` (the handle's local shard) in ``dtype`` on the handle's
    device: a shard that needs a cast or a move is cast straight into its own chunk of the
    gathered tensor, which is the collective's input ([Note: Export streams one unit at a
    time])."""
    numel = shard.numel()
    padded_unsharded = torch.empty(handle.world_size * numel, dtype=dtype, device=handle.device)
    own_chunk = shard
    if (shard.dtype, shard.device) != (dtype, handle.device):
        own_chunk = padded_unsharded.narrow(0, handle.rank * numel, numel)
        own_chunk.copy_(shard)
    comm.all_gather_flat(padded_unsharded, own_chunk, handle.process_group)
    return padded_unsharded


# [Note: Export streams one unit at a time]
# The stream walks the units in pre-order. For each it casts the local flat shard to the export
# dtype (a cast is elementwise, so casting each shard and gathering the results is bit for bit
# the gathered tensor cast; each rank casts 1/world_size of the unit, and a bf16 export moves half
# the bytes of the fp32 parameters), gathers it once (one all-gather, or one gather to rank 0
# with ``rank0_only``: the other ranks send their shards and never hold the unit; a NO_SHARD unit
# is already whole) straight into a fresh padded tensor ([Note: State dict gathers]), and copies
# each parameter's view of it into the bucket being filled; the gathered unit is dropped before
# the next one is gathered. The handle itself is never unsharded and its state never changes, so
# a training step after an export is the step without it, bit for bit.
#
# The all-gather's input is this rank's own chunk of the gathered tensor (an in-place
# all-gather, as FSDP2's: gloo and NCCL both take an input that is the output's chunk of the
# caller's rank): the cast (and, with CPU offload, the move to the device) writes the shard
# straight where the gather would put it, so a cast export allocates no separate shard copy and
# the stream's work beyond the collective is that one cast. A shard already in the export dtype
# on the device is the input as it is (copying it into the chunk would be a copy more).
#
# Memory: at any moment the stream holds at most one gathered unit plus the bucket it is filling.
# With ``transient=True`` nothing is copied where nothing has to be: a bucket's parameters are
# views of the gathered unit itself (the unit's parameters lie back to back in it, so a bucket
# never spans two units), and only tensors that must move (to ``device``, or the buffers and
# ignored parameters, cast) are staged in one buffer allocated once. That is the strict bound
# whatever the consumer does, at no copy, but a bucket's tensors are only valid until the next
# bucket is asked for, and are read-only (a NO_SHARD unit's views are its live parameters). With
# ``transient=False`` (the default) each tensor is a fresh copy the consumer owns, and buckets
# are packed across units; the bound then holds as long as the consumer lets go of a bucket
# before it asks for the next (``for bucket in stream: send(bucket); del bucket``).
class _Stager:
    """Fills buckets of at most ``bucket_bytes`` (a larger tensor gets a bucket of its own)."""

    def __init__(self, bucket_bytes: int, capacity: int, transient: bool, device: Optional[torch.device]) -> None:
        self.bucket_bytes = bucket_bytes
        self.capacity = capacity
        self.transient = transient
        self.device = device
        self.buffer: Optional[torch.Tensor] = None  # the reused staging buffer, bytes
        self.bucket: Bucket = []
        self.used = 0  # the bucket's bytes (staged ones aligned)
        self.staged = 0  # bytes of the staging buffer in use

    def _size(self, nbytes: int) -> int:
        return -(-nbytes // _ALIGN_BYTES) * _ALIGN_BYTES if self.transient else nbytes

    def slot(
        self, name: str, shape: torch.Size, dtype: torch.dtype, device: torch.device
    ) -> Generator[Bucket, None, torch.Tensor]:
        """Adds an uninitialized tensor to the bucket and returns it for the caller to fill
        (``target = yield from stager.slot(...)``); yields the bucket first when the tensor does
        not fit in it."""
        nbytes = shape.numel() * itemsize(dtype)
        if self.bucket and self.used + self._size(nbytes) > self.bucket_bytes:
            yield self.flush()
        device = self.device if self.device is not None else device
        if not self.transient:
            target = torch.empty(shape, dtype=dtype, device=device)
        else:
            if self.buffer is None or self.buffer.device != device:
                self.buffer = torch.empty(self.capacity, dtype=torch.uint8, device=device)
            target = self.buffer[self.staged : self.staged + nbytes].view(dtype).view(shape)
            self.staged += self._size(nbytes)
        self.bucket.append((name, target))
        self.used += self._size(nbytes)
        return target

    def add(self, name: str, source: torch.Tensor, dtype: torch.dtype) -> Iterator[Bucket]:
        """Copies ``source`` (cast to ``dtype``) into the bucket; yields the bucket first when
        ``source`` does not fit in it."""
        target = yield from self.slot(name, source.shape, dtype, source.device)
        target.copy_(source)

    def add_view(self, name: str, view: torch.Tensor) -> Iterator[Bucket]:
        """Puts ``view`` itself into the bucket (transient, zero-copy); yields the bucket first
        when ``view`` does not fit in it."""
        nbytes = view.numel() * view.element_size()
        if self.bucket and self.used + nbytes > self.bucket_bytes:
            yield self.flush()
        self.bucket.append((name, view))
        self.used += nbytes

    def flush(self) -> Bucket:
        bucket, self.bucket, self.used, self.staged = self.bucket, [], 0, 0
        return bucket


def _export_dtype(tensor: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.dtype:
    # As ``nn.Module.to(dtype)``: only floating-point tensors are cast.
    return dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype


# [Note: Export of tensor-parallel parameters]
# Under tensor parallelism on a 2-D (dp, tp) mesh a unit's flat parameter holds the tp-local
# tensors of its DTensor parameters ([Note: DTensor parameters]), so the unit's one gather over dp
# gives whole tp-local tensors. A parameter split by ``Shard(d)`` over the tp mesh dim then needs
# the other tp ranks' pieces: one all-gather over its tp group (a gather to rank 0 with
# ``rank0_only``) per such parameter, right after the unit's gather, in flat order on every rank.
# A unit costs 1 + (its tp-split parameters) collectives; ``Replicate`` DTensors and plain
# parameters need none (every tp rank holds them whole). One gather per parameter rather than one
# per unit keeps the full tensor being assembled to one parameter (a unit-wide tp gather would
# hold all of the unit's tp-split parameters in full at once) and lets a Shard(0) parameter split
# evenly be gathered straight into its bucket slot: its pieces back to back are the full tensor
# in row-major order. Any other split is gathered into one temporary of ``tp * P`` elements
# (``P``: the largest piece, ``torch.chunk``'s first, to which a smaller piece is padded: the
# all-gather takes equal sizes) and each piece copied into its box of the slot ([Note:
# Tensor-parallel pieces are boxes] in ``flat_param/_shard_map.py``, the arithmetic the shard map
# and the checkpoints use).
#
# Memory: at any moment the stream holds at most the unit's gathered tp-local flat parameter (U,
# padded, in the export dtype), the tp gather output of one parameter (tp * P; none when gathered
# straight into its slot; ``tp * P`` is the parameter's full size when the split is even) plus
# the padded copy of one uneven piece (P), and one bucket (B, or one tensor larger than it):
# extra <= U + (tp + 1) * P + B, with U and P the largest over the units.
#
# ``rank0_only``: each dp group's gather goes to its member in global rank 0's tp group (read
# from the mesh, no communication), which sends its pieces on to rank 0; so the ranks of rank 0's
# tp group hold one gathered tp-local unit each, the others send their shards and hold none, and
# only rank 0 gets buckets.
class _TpParam(NamedTuple):
    """How one tensor-parallel parameter's full tensor is gathered over its tp group."""

    group: dist.ProcessGroup
    size: int  # tp ranks
    pieces: list[Box]  # each tp rank's local tensor as a box of the full one, in tp rank order
    global_shape: torch.Size
    in_order: bool  # the pieces back to back are the full tensor (Shard(0), even)
    rank0_group: frozenset[int]  # the global ranks of global rank 0's tp group


def _rank0_tp_group(mesh: Any, mesh_dim: int) -> frozenset[int]:
    """The global ranks of global rank 0's group along ``mesh_dim`` of ``mesh`` (the tp mesh, or
    the mesh it was sliced from), from the mesh's rank layout: no communication."""
    root = mesh._get_root_mesh()
    if root is None or root is mesh or root == mesh:
        layout, dim = mesh.mesh, mesh_dim
    else:
        layout, dim = root.mesh, list(root.mesh_dim_names).index(mesh.mesh_dim_names[mesh_dim])
    if layout.numel() != dist.get_world_size():
        raise NotImplementedError(
            f"fsdp: full_params_stream(rank0_only=True) finds rank 0's tp group in the tp mesh's layout, "
            f"but this tp mesh covers {layout.numel()} of {dist.get_world_size()} ranks. Slice it from a "
            "mesh of every rank (init_device_mesh(..., (dp, tp), mesh_dim_names=('dp', 'tp'))['tp']), "
            "or export on every rank."
        )
    index: list[Any] = [int(i) for i in (layout == 0).nonzero()[0]]
    index[dim] = slice(None)
    return frozenset(int(r) for r in layout[tuple(index)].reshape(-1).tolist())


def _tp_params(handle: FlatParamHandle, rank0_only: bool) -> list[Optional[_TpParam]]:
    """Each parameter's :class:`_TpParam`, None for a plain or replicated one."""
    result: list[Optional[_TpParam]] = []
    for info in handle.param_infos:
        spec: Any = info.dtensor_spec
        piece = tp_piece(spec) if spec is not None else None
        if piece is None or not piece.mesh_dims:
            result.append(None)
            continue
        if len(piece.mesh_dims) > 1:
            raise NotImplementedError(
                f"fsdp: full_params_stream() gathers a tensor-parallel parameter over one mesh dim; "
                f"{info.fqn} is split over {len(piece.mesh_dims)} ({piece.placements})."
            )
        (mesh_dim,) = piece.mesh_dims
        coordinate = list(spec.mesh.get_coordinate())
        pieces = []
        for tp_rank in range(spec.mesh.shape[mesh_dim]):
            coordinate[mesh_dim] = tp_rank
            pieces.append(tp_piece(spec, coordinate).box)
        split = piece.placements[mesh_dim].dim % len(piece.global_shape)
        result.append(
            _TpParam(
                spec.mesh.get_group(mesh_dim),
                len(pieces),
                pieces,
                torch.Size(piece.global_shape),
                split == 0 and len({box.numel for box in pieces}) == 1,
                _rank0_tp_group(spec.mesh, mesh_dim) if rank0_only else frozenset(),
            )
        )
    return result


def _tp_gather(local: torch.Tensor, tp: _TpParam, rank0_only: bool, slot: Optional[torch.Tensor]) -> None:
    """Gathers one parameter's tp pieces (``local``: this rank's) into ``slot``, its full tensor
    (None on a rank that only sends); [Note: Export of tensor-parallel parameters]."""
    chunk = tp.pieces[0].numel  # torch.chunk's first piece is the largest
    flat = local.reshape(-1)
    if flat.numel() < chunk:
        flat = torch.cat([flat, flat.new_zeros(chunk - flat.numel())])
    straight = (
        slot is not None and tp.in_order and slot.is_contiguous() and (slot.device, slot.dtype) == (flat.device, flat.dtype)
    )
    out = None if slot is None else slot.view(-1) if straight else flat.new_empty(tp.size * chunk)
    if not rank0_only:
        comm.all_gather_flat(out, flat, tp.group)  # type: ignore[arg-type]
    else:
        comm.gather_flat_to(out, flat, tp.group, list(dist.get_process_group_ranks(tp.group)).index(0))
    if slot is None or out is None or straight:
        return
    for tp_rank, box in enumerate(tp.pieces):
        at = tp_rank * chunk
        where = tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))
        slot[where] = out[at : at + box.numel].view(box.sizes)


def _unit_tensors(
    unit: _UnitHandle, padded: torch.Tensor, tp: list[Optional[_TpParam]], stager: Optional[_Stager], rank0_only: bool
) -> Iterator[Bucket]:
    """Puts the unit's parameters, from its gathered ``padded`` flat parameter, into ``stager``'s
    buckets (views where ``stager`` is zero-copy), gathering the tp-split ones ([Note: Export of
    tensor-parallel parameters]); with ``stager`` None (a rank that only sends) just the gathers."""
    zero_copy = stager is not None and stager.transient and stager.device in (None, padded.device)
    views = unit.handle.shard_layout.unsharded_views(padded)
    for name, view, param in zip(unit.names, views, tp):
        if param is not None:
            slot = None if stager is None else (yield from stager.slot(name, param.global_shape, view.dtype, view.device))
            _tp_gather(view, param, rank0_only, slot)
        elif stager is not None:
            yield from (stager.add_view(name, view) if zero_copy else stager.add(name, view, view.dtype))
    if zero_copy and stager is not None and stager.bucket:  # its views must not outlive the unit
        yield stager.flush()


def _check_args(bucket_bytes: int) -> None:
    if bucket_bytes <= 0:
        raise ValueError(f"fsdp: full_params_stream(bucket_bytes={bucket_bytes}) needs a positive bucket size.")


def _staging_bytes(
    handles: list[_UnitHandle],
    tps: list[list[Optional[_TpParam]]],
    loose: list[tuple[str, torch.Tensor]],
    dtype: Optional[torch.dtype],
    bucket_bytes: int,
    views: bool,
) -> int:
    """The reused staging buffer's size: a bucket, or the largest staged tensor if larger, and
    never more than everything staged (each tensor rounded up to the alignment). With ``views``
    the units' parameters come as views and only the tp-split ones are staged."""
    sizes: list[int] = []
    for unit, tp in zip(handles, tps):
        element = itemsize(_export_dtype(unit.handle._local_shard, dtype))
        for info, param in zip(unit.handle.param_infos, tp):
            if param is not None or not views:
                sizes.append(element * (param.global_shape.numel() if param is not None else info.numel))
    sizes += [t.numel() * itemsize(_export_dtype(t, dtype)) for _, t in loose]
    aligned = [-(-n // _ALIGN_BYTES) * _ALIGN_BYTES for n in sizes]
    return max(min(bucket_bytes, sum(aligned)), max(aligned, default=0))


def full_params_stream(
    module: nn.Module,
    dtype: Optional[torch.dtype] = None,
    bucket_bytes: int = 256 << 20,
    rank0_only: bool = False,
    buffers: bool = True,
    transient: bool = False,
    device: Optional[Union[torch.device, str]] = None,
) -> Iterator[Bucket]:
    """Streams the model's full parameters in buckets, one unit gathered at a time.

    Every rank must run the stream to its end (it issues the units' collectives in the same
    order on every rank), between steps: not inside forward, backward or
    ``summon_full_params``, and no step may run while it is open. Nothing about the model
    changes: no unit is unsharded, no state moves. See [Note: Export streams one unit at a time].

    Args:
        module: An FSDP model (the root, or any module holding FSDP units).
        dtype: Cast floating-point values to this dtype (``torch.bfloat16`` for inference);
            None keeps each tensor's own (the parameters' full precision, not ``param_dtype``).
        bucket_bytes: The most bytes a bucket holds; a tensor larger than this comes alone.
        rank0_only: Only global rank 0 receives; the other ranks send their shards, never hold
            a gathered unit (but the ranks of rank 0's tp group under tensor parallelism, which
            pass their tp pieces on), and get no bucket.
        buffers: Include persistent buffers (as ``state_dict()`` does).
        transient: Give read-only tensors valid only until the next bucket is requested
            (views of the gathered unit, no copy; a bucket then never spans two units; copy
            what you keep); False gives owned copies.
        device: Where the bucket tensors live; None: where the unit was gathered.

    Tensor-parallel (DTensor) parameters come in full (TP-unsharded, as ``full_tensor()``), at
    one extra collective per tp-split parameter ([Note: Export of tensor-parallel parameters]).

    Yields:
        Buckets: lists of ``(name, tensor)``, names as in the unwrapped model's ``state_dict()``,
        units in pre-order, each parameter once (a tied parameter under its first name), then
        the parameters of ignored modules and the buffers.

    Raises:
        RuntimeError: A unit is in forward, backward or ``summon_full_params``.
        NotImplementedError: A tensor-parallel parameter whose placements are not
            ``Shard``/``Replicate`` over one mesh dim.
    """
    _check_args(bucket_bytes)
    handles = _prepare(module, "full_params_stream")
    tps = [_tp_params(unit.handle, rank0_only) for unit in handles]
    loose = _loose_tensors(module, handles, buffers)
    receives = not rank0_only or _global_rank() == 0
    target = torch.device(device) if device is not None else None
    capacity = _staging_bytes(handles, tps, loose, dtype, bucket_bytes, transient and target is None)
    stager = _Stager(bucket_bytes, capacity, transient, target)
    for unit, tp in zip(handles, tps):
        padded_unsharded = _gathered(unit.handle, dtype, rank0_only, tp)
        if padded_unsharded is not None:
            yield from _unit_tensors(unit, padded_unsharded, tp, stager if receives else None, rank0_only)
        del padded_unsharded
    if receives:
        for name, tensor in loose:
            yield from stager.add(name, tensor, _export_dtype(tensor, dtype))
    if stager.bucket:
        yield stager.flush()


# ----------------------------------------------------------------------------- the shard map
class ShardMapEntry(NamedTuple):
    """Which part of one parameter this rank's local flat shard holds.

    Attributes:
        name: The parameter's name in the unwrapped model.
        unit: The name of the unit's module ('' for the root).
        handle_index: Which handle of the unit (0 but for units with several).
        param_index: The parameter's place in its FlatParameter.
        offset: The first element held, in the flattened (row-major) parameter.
        length: Elements held (at least 1: parameters this rank holds none of have no entry).
        offset_in_shard: Where they start in the local flat shard.
        dtype: The shard's dtype (the parameters' full precision).
        shape: The shape of the tensor the range is of: the parameter's, or for a
            tensor-parallel (DTensor) parameter its tp-local tensor's.
        boxes: The boxes of ``shape`` the range covers, in order ([Note: A flat range is a few
            boxes]).
        global_shape: The full (TP-unsharded) parameter's shape; ``shape`` for a plain one.
        global_offset: Where the tp-local tensor starts in the full parameter, per dim (zeros
            for a plain one): it is the box (``global_offset``, ``shape``) of it.
        placements: The DTensor placements on the tp mesh (one per mesh dim), None for a
            plain parameter.
        global_boxes: ``boxes`` as boxes of the full parameter (each shifted by
            ``global_offset``; [Note: Tensor-parallel pieces are boxes]).
    """

    name: str
    unit: str
    handle_index: int
    param_index: int
    offset: int
    length: int
    offset_in_shard: int
    dtype: torch.dtype
    shape: torch.Size
    boxes: tuple[Box, ...]
    global_shape: torch.Size
    global_offset: tuple[int, ...]
    placements: Optional[tuple[Any, ...]]
    global_boxes: tuple[Box, ...]


def shard_map(module: nn.Module) -> list[ShardMapEntry]:
    """This rank's shard map: one entry per parameter range its local flat shards hold.

    Pure metadata fixed at wrap time: no collective, no copy, nothing changes. Every parameter a
    unit manages is covered exactly once by the union of all ranks' entries of one shard group
    (NO_SHARD: every rank holds everything). Parameters of ignored modules are not in it (every
    rank holds them whole). Under tensor parallelism the ranges are of each rank's tp-local
    tensor, placed in the full parameter by ``global_offset`` and ``global_boxes``; a replicated
    (``Replicate``) parameter is held alike by every tp rank.

    Raises:
        NotImplementedError: A tensor-parallel parameter whose placements are not ``Shard`` or
            ``Replicate`` ([Note: Tensor-parallel pieces are boxes]).
    """
    entries: list[ShardMapEntry] = []
    for prefix, _, state in named_fsdp_states(module):
        for handle_index, handle in enumerate(state.handles):
            layout = handle.shard_layout
            boxes = layout_param_boxes(layout)  # [Note: A parameter's boxes, once]
            for index, (info, piece) in enumerate(zip(handle.param_infos, layout.shard_slices)):
                if piece is None or piece.numel == 0:
                    continue
                b = boxes[index]
                where = (piece.offset_in_param, piece.numel, piece.offset_in_shard, handle.dtype, torch.Size(b.shape))
                entries.append(
                    ShardMapEntry(
                        _join(prefix, info.fqn),
                        prefix,
                        handle_index,
                        index,
                        *where,
                        b.boxes,
                        torch.Size(b.global_shape),
                        b.global_offset,
                        b.placements,
                        b.global_boxes,
                    )
                )
    return entries


class LocalRange(NamedTuple):
    """A :class:`ShardMapEntry` and zero-copy views of the local shard it describes.

    Attributes:
        entry: What the range is.
        flat: The range, 1-D (``entry.length`` elements).
        boxes: One view per ``entry.boxes``, shaped like the box.
    """

    entry: ShardMapEntry
    flat: torch.Tensor
    boxes: list[torch.Tensor]


def local_shard_views(module: nn.Module) -> list[LocalRange]:
    """:func:`shard_map` with views of the local flat shards (no collective, no copy).

    The views alias the live shards (on the host with CPU offload): they show the values of the
    last optimizer step and change with the next. Read them between steps.
    """
    _prepare(module, "local_shard_views")  # adopt what the user set (use_orig_params)
    handles = {(prefix, i): h for prefix, _, state in named_fsdp_states(module) for i, h in enumerate(state.handles)}
    result: list[LocalRange] = []
    for entry in shard_map(module):
        handle = handles[(entry.unit, entry.handle_index)]
        shard = handle._local_shard.detach()
        flat = shard[entry.offset_in_shard : entry.offset_in_shard + entry.length]
        views: list[torch.Tensor] = []
        at = 0
        for box in entry.boxes:
            views.append(flat[at : at + box.numel].view(box.sizes))
            at += box.numel
        result.append(LocalRange(entry, flat, views))
    return result


# ----------------------------------------------------------------------------- deltas
# [Note: Export deltas]
# An RL trainer changes a small part of the weights per step (0.02-2.6% of the bytes in public
# measurements), so the engine needs only those elements. ``full_params_delta`` runs the stream
# and compares each full tensor with the caller's host snapshot of the previous export bit for
# bit (as integers of the element's width: exact, and a NaN that stays NaN is no change), then
# updates the snapshot in place. A parameter comes as a sparse delta (flat int64 indices and
# their new values) when that is smaller than the dense tensor (``changed * (8 + itemsize) <
# numel * itemsize``), else dense (the whole new tensor); a name the snapshot lacks comes dense
# and is added to it. Each delta carries :func:`checksum` of the whole new tensor, so the
# consumer checks what it holds after applying it (:func:`apply_delta` does).
class ParamDelta(NamedTuple):
    """What changed in one tensor since the snapshot.

    Attributes:
        name: The name in the unwrapped model.
        shape: The full shape.
        indices: Sparse form: the changed elements' flat (row-major) indices, int64, 1-D;
            None for the dense form.
        values: Sparse form: their new values (1-D); dense: the whole new tensor (the
            snapshot's own tensor, no copy: read it, do not change it).
        checksum: :func:`checksum` of the whole new tensor.
    """

    name: str
    shape: torch.Size
    indices: Optional[torch.Tensor]
    values: torch.Tensor
    checksum: str

    @property
    def nbytes(self) -> int:
        """Bytes the delta carries."""
        n = self.values.numel() * self.values.element_size()
        return n + (self.indices.numel() * 8 if self.indices is not None else 0)


def checksum(tensor: torch.Tensor) -> str:
    """SHA-1 (hex) of the tensor's bytes in row-major order: ``hashlib.sha1(bytes).hexdigest()``,
    reproducible anywhere (and hardware-accelerated on current CPUs)."""
    flat = tensor.detach().reshape(-1).contiguous().cpu()
    digest = hashlib.sha1()
    if flat.numel():
        digest.update(flat.view(torch.uint8).numpy().data)  # the array's buffer, no copy
    return digest.hexdigest()


_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dtype == torch.bool or tensor.element_size() not in _INT_OF_WIDTH:
        return tensor
    return tensor.view(_INT_OF_WIDTH[tensor.element_size()])


def _delta(name: str, new: torch.Tensor, snapshot: MutableMapping[str, torch.Tensor]) -> ParamDelta:
    """The delta of ``new`` (a host tensor) against ``snapshot[name]``, which it then updates."""
    old = snapshot.get(name)
    digest = checksum(new)
    if old is None or old.shape != new.shape or old.dtype != new.dtype:
        snapshot[name] = new.clone()
        return ParamDelta(name, new.shape, None, snapshot[name], digest)
    differs = _bits(new).reshape(-1) != _bits(old).reshape(-1)
    itemsize = new.element_size()
    if int(torch.count_nonzero(differs)) * (8 + itemsize) < new.numel() * itemsize:
        changed = differs.nonzero().reshape(-1)
        delta = ParamDelta(name, new.shape, changed, new.reshape(-1)[changed], digest)
        old.reshape(-1)[changed] = delta.values
        return delta
    old.copy_(new)
    return ParamDelta(name, new.shape, None, old, digest)


def full_params_delta(
    module: nn.Module,
    snapshot: MutableMapping[str, torch.Tensor],
    dtype: Optional[torch.dtype] = None,
    bucket_bytes: int = 256 << 20,
    rank0_only: bool = False,
    buffers: bool = True,
) -> Iterator[list[ParamDelta]]:
    """Streams, bucket by bucket, what changed since the caller's host ``snapshot``.

    Runs :func:`full_params_stream` (same collectives, same order, same arguments), compares
    each tensor with ``snapshot`` exactly and updates ``snapshot`` in place to the exported
    values ([Note: Export deltas]). Start with an empty dict: the first export is dense and fills
    it. Keep one snapshot per consumer and per ``dtype``.

    Args:
        module: As for :func:`full_params_stream`.
        snapshot: The host tensors of the previous export, by name (the caller owns it; on
            ranks that receive nothing it is left alone).
        dtype, bucket_bytes, rank0_only, buffers: As for :func:`full_params_stream`.

    Yields:
        Lists of :class:`ParamDelta`, one per tensor of a stream bucket (unchanged tensors too:
        an empty sparse delta, whose checksum still lets the consumer verify its copy).
    """
    for bucket in full_params_stream(
        module, dtype=dtype, bucket_bytes=bucket_bytes, rank0_only=rank0_only, buffers=buffers, transient=True
    ):
        yield [_delta(name, tensor.to("cpu"), snapshot) for name, tensor in bucket]


def apply_delta(target: torch.Tensor, delta: ParamDelta, verify: bool = True) -> None:
    """Applies ``delta`` to the consumer's copy ``target`` in place, then checks its checksum.

    Raises:
        ValueError: ``target`` has another shape, or (``verify``) its checksum after applying is
            not the delta's: the copy was not the snapshot the delta was computed against.
    """
    if target.shape != delta.shape:
        raise ValueError(f"fsdp: apply_delta: {delta.name} has shape {tuple(delta.shape)}, the target {tuple(target.shape)}.")
    with torch.no_grad():
        if delta.indices is None:
            target.copy_(delta.values.reshape(delta.shape))
        else:
            target.view(-1)[delta.indices.to(target.device)] = delta.values.to(target.device, target.dtype)
    if verify and checksum(target) != delta.checksum:
        raise ValueError(
            f"fsdp: apply_delta: {delta.name} does not match the exported values after applying the delta "
            f"(checksum {checksum(target)}, expected {delta.checksum}); the target did not hold "
            "the previous export. Apply every delta in order, or start again from an empty snapshot."
        )


# ----------------------------------------------------------------------------- safetensors
def _full_shape(info: Any) -> torch.Size:
    """A parameter's full shape: a tensor-parallel (DTensor) one's global shape, from its spec
    (no communication), else its own."""
    return torch.Size(info.dtensor_spec.shape if info.dtensor_spec is not None else info.shape)


def _safetensors_specs(module: nn.Module, dtype: Optional[torch.dtype]) -> list[TensorSpec]:
    """Every tensor :func:`full_params_stream` yields (name, dtype, full shape), in its order,
    known from the units' parameter infos before any value is gathered."""
    units = _prepare(module, "save_safetensors")
    specs = [
        TensorSpec(name, _export_dtype(unit.handle._local_shard, dtype), _full_shape(info))
        for unit in units
        for name, info in zip(unit.names, unit.handle.param_infos)
    ]
    return specs + [TensorSpec(name, _export_dtype(t, dtype), t.shape) for name, t in _loose_tensors(module, units, True)]


def _one_at_a_time(stream: Iterator[Bucket]) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream's pairs, each let go before the next is taken: no view of a gathered unit
    outlives it while the next unit is gathered."""
    for bucket in stream:
        bucket.reverse()
        while bucket:
            yield bucket.pop()


def save_safetensors(
    module: nn.Module,
    path: Union[str, os.PathLike[str]],
    *,
    dtype: Optional[torch.dtype] = None,
    max_shard_size: Union[int, str] = "50GB",
    buffer_bytes: int = 16 << 20,
    config: Any = None,
    metadata: Optional[dict[str, str]] = None,
) -> list[str]:
    """Writes the model's full parameters and persistent buffers as Hugging Face safetensors
    files, streamed one unit at a time; global rank 0 writes.

    Every rank calls it, between steps (as :func:`full_params_stream`, which it runs with
    ``rank0_only=True, transient=True``): each unit is gathered to rank 0 with one collective and
    its parameters go from the gathered unit straight into the file, so rank 0 holds at most one
    gathered unit plus the file buffer and the other ranks only send their shards ([Note:
    Streaming safetensors] in ``fsdp/state_dict/_safetensors.py``). The names are the unwrapped
    model's, a tied parameter once under its first name (``save_pretrained`` also leaves tied
    weights out), so ``transformers``' ``from_pretrained(path)`` loads the folder.
    Tensor-parallel (DTensor) parameters are written in full (the header has their global
    shapes): each comes to rank 0 through its tp group, one gather per tp-split parameter, within
    the stream's bound ([Note: Export of tensor-parallel parameters]).

    Args:
        module: An FSDP model (the root, or any module holding FSDP units).
        path: The output folder (created on rank 0 if needed); files already there are replaced.
        dtype: Cast floating-point values to it (``torch.bfloat16`` for inference); None keeps
            the parameters' full precision (not ``param_dtype``).
        max_shard_size: The most bytes of tensor data per file (an int, or "5GB"-style as
            Hugging Face takes it; default its "50GB"); a larger model gets several files
            ``model-0000i-of-0000N.safetensors`` and ``model.safetensors.index.json``.
        buffer_bytes: The file buffer: small tensors are coalesced into writes of this size
            (buffers and ignored parameters, cast, are staged in one buffer of this size or the
            largest of them).
        config: A ``transformers`` config (or a dict) written as ``config.json``; None writes
            none (``from_pretrained`` needs one in the folder, or passed to it).
        metadata: Extra string entries for each file's ``__metadata__`` (``format`` is "pt").

    Returns:
        On rank 0 the names of the files written in ``path``, ``[]`` on the other ranks. The
        files are complete when rank 0 returns; the other ranks may return earlier
        (``dist.barrier()`` before reading them elsewhere).

    Raises:
        RuntimeError: A unit is in forward, backward or ``summon_full_params``.
        NotImplementedError: A tensor-parallel parameter whose placements are not
            ``Shard``/``Replicate`` over one mesh dim, or a tp mesh not sliced from a mesh of
            every rank (as :func:`full_params_stream` with ``rank0_only``).
    """
    specs = _safetensors_specs(module, dtype)
    stream = full_params_stream(module, dtype, buffer_bytes, rank0_only=True, transient=True, device="cpu")
    pairs = _one_at_a_time(stream)
    if _global_rank() != 0:
        for _ in pairs:  # send the shards; nothing comes back
            pass
        return []
    try:
        return write_safetensors(
            path, specs, pairs, max_shard_size=max_shard_size, buffer_bytes=buffer_bytes, config=config, metadata=metadata
        )
    except Exception:
        for _ in pairs:  # keep joining the units' gathers so the other ranks do not hang
            pass
        raise
