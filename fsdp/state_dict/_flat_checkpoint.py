"""Sharded checkpoints written where the shards lie: no gather, no re-cut, no copy.

[Note: Flat-shard checkpoints]
A SHARDED state dict ([Note: Sharded state dict values]) re-cuts each parameter by rows
(``torch.chunk`` along dim 0), so every unit is gathered first. This module writes each rank's
flat shard as it is: of each original parameter the shard holds one contiguous range of
row-major elements, which is a few boxes of the parameter's shape ([Note: A flat range is a few
boxes] in ``fsdp/flat_param/_shard_map.py``), each a view of the shard. Every box becomes one
DCP chunk (a ``WriteItem`` of type SHARD with the box's offsets and sizes and the parameter's
global shape), the same for each optimizer state shaped like the shard (Adam's ``exp_avg``...).
A rank plans only its own boxes: no collective, no other rank's metadata, so the work per rank
does not grow with the world size. DCP's own planning (one gather of the plans' metadata to the
coordinator, one scatter back, one reduction of the write results) is the only communication.

Who writes: a sharding unit, every rank of its shard group, and under hybrid strategies only the
first replica (replicate-group rank 0); a unit that does not shard (NO_SHARD, one rank) holds
whole parameters everywhere, and only its group's rank 0 (of the first replica) writes them.
Buffers, unmanaged (ignored) parameters and scalar optimizer states (``step``) are plain tensors
on every rank, which DCP writes once (it deduplicates replicated entries).

The files hold the keys a SHARDED state dict has (``model.<fqn>``, ``optim.state.<fqn>.<name>``,
``optim.param_groups``), full shapes and dtypes; DCP reshards on read, so the checkpoint loads at
any world size and wrap plan, into torch FSDP1 / FSDP2 and into a plain model. Loading into fsdp
reads the same boxes straight into the flat shards ([Note: Flat-shard loads]).

[Note: Flat-shard checkpoints of tensor-parallel parameters]
Under tensor parallelism (a 2-D (dp, tp) mesh) a flat shard holds ranges of each DTensor
parameter's tp-local tensor, which is one box of the full parameter for ``Shard(d)`` and
``Replicate`` placements; so each box of the range in the tp-local tensor is the same box shifted
by the local tensor's global offset in the full one ([Note: Tensor-parallel pieces are boxes] in
``fsdp/flat_param/_shard_map.py``: the offset arithmetic the export's shard map uses too). Each
rank writes those shifted boxes as DCP chunks of the full shape, still views of its shard: no
tensor collective, and the keys and full shapes are those of a model without TP, so DCP reshards
on read to any dp x tp layout, or none. Parameters every tp rank holds alike (``Replicate``
DTensors, plain parameters) give the same boxes on each tp rank; DCP's planning keeps one of
each (it deduplicates write items with the same index), so they are written once. Placements that
are not boxes (``_StridedShard``, ``Partial``) raise ``NotImplementedError`` before anything is
written.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import weakref
from typing import Any, Iterator, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from fsdp._common import clean_fqn
from fsdp.flat_param._shard_map import layout_param_boxes
from fsdp.flat_param.flat_param import FlatParamHandle
from fsdp.runtime._mixed_precision import refresh_cast_buffers
from fsdp.runtime._state import is_fsdp, unit_state
from fsdp.state_dict._optim_keys import ModelView

__all__ = [
    "FlatShardChunks",
    "FlatShardSavePlanner",
    "FlatShardLoadPlanner",
    "collector_paused",
    "flat_shard_state_dict",
    "flat_shard_load_target",
    "optim_load_target",
    "apply_loaded",
    "frozen_fqns",
    "missing_from_checkpoint",
]


class _ParamChunks(NamedTuple):
    """One parameter's boxes in a flat shard as DCP chunk metadata, made once per (handle,
    parameter) and shared by every value shaped like it: the parameter and each optimizer state
    ([Note: A save's per-value work]).

    Attributes:
        size: The whole tensor's shape (a tensor-parallel parameter's full one).
        chunks: One ``ChunkStorageMetadata`` per box, in the range's order, its offsets in the
            whole tensor.
        starts: Where each box starts in the range (elements).
        first_replica: A tensor-parallel parameter's ``ParamBoxes.first_replica``.
        plain: Whether the parameter is a plain tensor (no DTensor).
        origin: Whether a box starts at the whole tensor's first element (this rank writes the
            parameter's scalar optimizer states, if it writes its boxes).
    """

    size: torch.Size
    chunks: tuple[ChunkStorageMetadata, ...]
    starts: tuple[int, ...]
    first_replica: bool
    plain: bool
    origin: bool


_CHUNKS: "weakref.WeakKeyDictionary[Any, tuple[_ParamChunks, ...]]" = weakref.WeakKeyDictionary()


def _layout_chunks(layout: Any) -> tuple[_ParamChunks, ...]:
    """Each parameter's :class:`_ParamChunks` in a handle's ``ShardLayout`` (its
    :func:`layout_param_boxes`), computed once per layout."""
    cached = _CHUNKS.get(layout)
    if cached is None:
        result = []
        for boxes in layout_param_boxes(layout):
            chunks, starts, at = [], [], 0
            for local, box in zip(boxes.boxes, boxes.global_boxes):
                chunks.append(ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.sizes)))
                starts.append(at)
                at += local.numel
            origin = any(not any(box.offsets) for box in boxes.global_boxes)
            result.append(
                _ParamChunks(
                    torch.Size(boxes.global_shape),
                    tuple(chunks),
                    tuple(starts),
                    boxes.first_replica,
                    boxes.placements is None,
                    origin,
                )
            )
        cached = _CHUNKS[layout] = tuple(result)
    return cached


_PROPERTIES: dict[tuple[torch.dtype, bool], TensorProperties] = {}


def _properties(dtype: torch.dtype, pinned: bool) -> TensorProperties:
    """One ``TensorProperties`` per dtype (and pinning) for every write item: what
    ``TensorProperties.create_from_tensor`` gives a detached contiguous box, shared."""
    key = (dtype, pinned)
    found = _PROPERTIES.get(key)
    if found is None:
        found = _PROPERTIES[key] = TensorProperties(dtype=dtype, pin_memory=pinned)
    return found


class FlatShardChunks:
    """One tensor's boxes held by this rank, as views of a flat shard (a state-dict leaf that
    only :class:`FlatShardSavePlanner` writes).

    Args:
        chunks: The boxes' chunk metadata (:class:`_ParamChunks`, shared by the values of one
            parameter), or None for a value this rank does not write.
        source: This rank's flat tensor (a local shard, or a state shaped like it).
        offset: Where the range starts in ``source``.
        size: The whole tensor's shape (only read when ``chunks`` is None).
    """

    def __init__(self, chunks: Optional[_ParamChunks], source: torch.Tensor, offset: int, size: torch.Size) -> None:
        self.shape = chunks.size if chunks is not None else size
        self.dtype = source.dtype
        self.source = source
        self._chunks = chunks
        self._offset = offset
        self.views: dict[torch.Size, torch.Tensor] = {}
        if chunks is not None:
            for chunk, start in zip(chunks.chunks, chunks.starts):
                self.views[chunk.offsets] = _own_storage_view(source, offset + start, chunk.sizes)

    def on(self, source: torch.Tensor) -> "FlatShardChunks":
        """The same boxes (placed as this one's, tensor-parallel offsets included), as views of
        ``source`` instead (a copy of this one's source: a staging buffer, [Note: Async
        flat-shard saves] in ``fsdp/checkpoint.py``)."""
        return FlatShardChunks(self._chunks, source, self._offset, self.shape)

    def size(self) -> torch.Size:
        """The whole tensor's shape (DCP's load planner checks it against the checkpoint's)."""
        return self.shape

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        """DCP's read-side hook: the boxes this rank holds, each read into its view."""
        return list(self._chunks.chunks) if self._chunks is not None else []

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        """DCP's hook: one SHARD write item per box."""
        if self._chunks is None:
            return []
        properties = _properties(self.dtype, self.source.is_pinned())
        return [
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=chunk, properties=properties, size=self.shape),
            )
            for chunk in self._chunks.chunks
        ]


# [Note: Box views with their own storage]
# DCP's file writer clones every tensor whose storage is larger than the tensor itself (a
# ``torch.save`` of a view would write the whole storage), and keeps each clone until its file is
# closed: written as plain views, a save would copy the whole local state. A box is instead a
# tensor on a slice of the shard's storage (``UntypedStorage`` slicing shares the memory), so its
# storage is exactly its bytes: DCP writes it as it lies, without a copy.
def _own_storage_view(source: torch.Tensor, at: int, sizes: tuple[int, ...]) -> torch.Tensor:
    """The ``sizes``-shaped box at element ``at`` of the contiguous 1-D ``source``, as a tensor
    on a slice of ``source``'s storage ([Note: Box views with their own storage])."""
    strides: list[int] = []
    numel = 1
    for size in reversed(sizes):
        strides.insert(0, numel)
        numel *= size
    if not source.is_contiguous():
        return source[at : at + numel].view(sizes)
    itemsize = source.element_size()
    begin = (source.storage_offset() + at) * itemsize
    storage: torch.UntypedStorage = source.untyped_storage()[begin : begin + numel * itemsize]
    return torch.empty(0, dtype=source.dtype, device=source.device).set_(storage, 0, sizes, strides)


# [Note: A save's per-value work]
# No parameter or optimizer byte moves in a flat-shard save, so what is left of its cost is
# Python per value and per write item on every rank, and the coordinator's share, the metadata of
# all ranks' chunks ([Note: A save without a global plan] in ``_local_plans.py``). So:
# - every box's chunk metadata is made once per (handle, parameter) and kept with the layout
#   ([Note: A parameter's boxes, once] in ``fsdp/flat_param/_shard_map.py``); the optimizer
#   states of a parameter reuse its chunk objects, and every item of a dtype shares one
#   ``TensorProperties``, so what a rank sends the coordinator pickles each of them once (pickle
#   memoizes objects by identity) instead of once per write item;
# - a value several ranks hold alike is planned by one of them ([Note: Who writes a replicated
#   value] in ``fsdp/flat_param/_shard_map.py``): the model's plain values (buffers, unmanaged
#   parameters) and the param groups' entries, which every rank has under the same keys, by the
#   coordinator only; an optimizer state of a managed parameter that is not shaped like its shard
#   (a scalar ``step``) by the rank that writes the parameter's first element (with
#   ``use_orig_params`` a rank that holds none of a parameter may have no state for it, so the
#   coordinator cannot stand in for it); a parameter without elements keeps them on every rank
#   that has them, and the coordinator enters the lowest rank's copy.
# The files are the same kind as DCP's protocol writes: the same keys, chunks and metadata.

# [Note: No cyclic garbage collection during a save]
# A save allocates tens of thousands of small objects that live until it ends (write items,
# every rank's plans unpickled on the coordinator, the metadata, the write results), so
# Python's cyclic collector runs its older generations again and again during it, and each
# such pass walks every object of the process (torch's modules, the model): measured on the
# 32-unit benchmark, half of a save's CPU time at 16 ranks, on every rank. None of these
# objects is in a reference cycle (reference counting frees them), so a synchronous save turns
# the collector off while it runs and back on after (if it was on), as ``timeit`` does; a cycle
# made meanwhile by another thread waits for the next collection. The asynchronous save leaves
# it alone: its planning runs in a background thread while training goes on.
@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Turns Python's cyclic garbage collector off for the block, if it was on ([Note: No
    cyclic garbage collection during a save])."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


class FlatShardSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, that also finds the box views of :class:`FlatShardChunks`,
    and plans the values every rank has alike under the same keys on the coordinator only
    ([Note: Who writes a replicated value]). DCP's plan caching stays off (its default): it
    would keep the plan from before this filter."""

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        if not self.is_coordinator:  # the model's plain values and the param groups: alike everywhere
            shards = [i for i in plan.items if i.type == WriteItemType.SHARD or i.index.fqn.startswith("optim.state.")]
            if len(shards) != len(plan.items):
                plan = self.plan = dataclasses.replace(plan, items=shards)
        return plan

    def _dedup_save_plans(self, all_plans: list[SavePlan]) -> list[SavePlan]:
        """DCP's hook (``DefaultSavePlanner._create_global_plan`` calls it): each (fqn,
        offsets) planned by several ranks is kept by the lowest one."""
        seen: set[tuple[str, Any]] = set()
        result = []
        for plan in all_plans:
            kept = []
            for item in plan.items:
                key = (item.index.fqn, item.index.offset)
                if key not in seen:
                    seen.add(key)
                    kept.append(item)
            result.append(plan if len(kept) == len(plan.items) else dataclasses.replace(plan, items=kept))
        return result

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict.get(index.fqn)
        if isinstance(obj, FlatShardChunks):
            offsets = index.offset if index.offset is not None else torch.Size([0] * len(obj.shape))
            return obj.views[torch.Size(offsets)]
        return super().lookup_object(index)


class FlatShardLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, that reads a :class:`FlatShardChunks`' boxes into its views
    (the live flat shards: [Note: Flat-shard loads])."""

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Any = None, is_coordinator: bool = False) -> None:
        """As DCP's, without its meta-device pass, which knows only tensors and would replace
        every :class:`FlatShardChunks` by None (the target holds no meta tensors or
        ShardedTensors)."""
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict

        self.original_state_dict = state_dict
        self.state_dict, self.mappings = flatten_state_dict(state_dict)
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict.get(index.fqn)
        if isinstance(obj, FlatShardChunks):
            return obj.views[torch.Size(index.offset if index.offset is not None else [0] * len(obj.shape))]
        return super().lookup_tensor(index)


class _Writers(NamedTuple):
    """Which of the values this rank holds it writes ([Note: Flat-shard checkpoints], [Note: Who
    writes a replicated value] in ``fsdp/flat_param/_shard_map.py``), or for a load's target
    (``every_value``) which it reads: all of them.

    Attributes:
        handles: Per ``id(handle)``, whether this rank writes the handle's parameters (its shard
            group's, under hybrid strategies the first replica's; NO_SHARD's rank 0).
        plain_first_replica: Whether this rank writes plain parameters, which every tp rank of
            a tensor-parallel model holds alike (its coordinate on the tp mesh is 0; True
            without tensor parallelism).
        every_value: A load's target: every rank reads every value it holds.
    """

    handles: dict[int, bool]
    plain_first_replica: bool = True
    every_value: bool = False

    @classmethod
    def of(cls, model: nn.Module, view: ModelView) -> "_Writers":
        """The save's rules for this rank."""
        handles: dict[int, bool] = {}
        for module in model.modules():
            if is_fsdp(module):
                for handle in unit_state(module).handles:
                    handles.setdefault(id(handle), _writes(handle, unit_state(module)))
        specs = (spec for handle in view.handles for spec in handle.shard_layout.dtensor_specs or () if spec is not None)
        tp_mesh = next((spec.mesh for spec in specs), None)
        return cls(handles, tp_mesh is None or not any(tp_mesh.get_coordinate()))

    @classmethod
    def reading(cls, view: ModelView) -> "_Writers":
        """A load's target: every value this rank holds."""
        return cls({id(handle): True for handle in view.handles}, True, every_value=True)

    def boxes(self, handle: FlatParamHandle, chunks: "_ParamChunks") -> bool:
        """Whether this rank writes (reads) its boxes of a parameter of ``handle``."""
        if self.every_value:
            return True
        first = self.plain_first_replica if chunks.plain else chunks.first_replica
        return self.handles[id(handle)] and first


def _writes(handle: FlatParamHandle, state: Any) -> bool:
    """Whether this rank writes ``handle``'s parameters ([Note: Flat-shard checkpoints])."""
    replicate = state.replicate_group
    if replicate is not None and dist.get_rank(replicate) != 0:
        return False
    return bool(handle.shard_layout.uses_sharding) or state.rank == 0


def _chunks(handle: FlatParamHandle, index: int, source: torch.Tensor, orig_value: bool, who: _Writers) -> FlatShardChunks:
    """Parameter ``index``'s boxes in ``source``: the handle's flat shard (or a state shaped
    like it), or with ``orig_value`` a use_orig_params parameter's own (1-D or whole) part. A
    tensor-parallel parameter's boxes are of its full shape, placed by its tp-local tensor's
    global offset ([Note: Flat-shard checkpoints of tensor-parallel parameters])."""
    layout = handle.shard_layout
    chunks = _layout_chunks(layout)[index]  # every rank: a placement that is not a box raises
    piece = layout.shard_slices[index]
    if piece is None or not chunks.chunks or not who.boxes(handle, chunks):
        return FlatShardChunks(None, source, 0, chunks.size)
    return FlatShardChunks(chunks, source.reshape(-1), 0 if orig_value else piece.offset_in_shard, chunks.size)


def _model_entries(model: nn.Module, view: ModelView, who: _Writers) -> dict[str, Any]:
    """The model's entries: managed parameters as box views (those ``who`` says this rank
    writes), the rest as plain tensors."""
    entries: dict[str, Any] = {}
    for handle, fqns in zip(view.handles, view.handle_fqns):
        shard = handle.flat_param.detach()
        for index, fqn in enumerate(fqns):
            entries[fqn] = _chunks(handle, index, shard, False, who)
    for fqn, param in view.unmanaged.items():
        entries[fqn] = param.detach()
    cast = {}
    for module in model.modules():
        if is_fsdp(module):
            for buffer in unit_state(module).cast_buffers:
                cast[(id(buffer.module), buffer.name)] = buffer
    for name, module in model.named_modules():
        for buf_name, buf in module._buffers.items():
            if buf is None or buf_name in module._non_persistent_buffers_set:
                continue
            fqn = _buffer_fqn(name, buf_name)
            kept = cast.get((id(module), buf_name))
            entries.setdefault(fqn, kept.state_dict_value() if kept is not None else buf.detach())
    return entries


def _buffer_fqn(module_name: str, buffer_name: str) -> str:
    """A buffer's state-dict key: its module's name (from ``named_modules``) and its own, without
    FSDP's wrapper prefixes."""
    return clean_fqn(f"{module_name}.{buffer_name}" if module_name else buffer_name)


def _optim_entries(optim: torch.optim.Optimizer, view: ModelView, who: _Writers) -> dict[str, Any]:
    """The optimizer's entries, keyed as a SHARDED optimizer state dict: ``state`` by FQN and
    state name, ``param_groups`` listing FQNs. For a load's target (``who.every_value``) every
    rank reads each parameter's scalar states (``step``), also a rank that holds none of it."""
    states: dict[str, dict[str, Any]] = {}
    for param, entry in optim.state.items():
        if id(param) in view.flat_to_handle:
            h = view.flat_to_handle[id(param)]
            handle = view.handles[h]
            for index, fqn in enumerate(view.handle_fqns[h]):
                states[fqn] = _state_values(entry, param, handle, index, False, who)
        elif id(param) in view.orig_to_slot:
            h, index = view.orig_to_slot[id(param)]
            handle = view.handles[h]
            states[view.handle_fqns[h][index]] = _state_values(entry, param, handle, index, True, who)
        else:
            fqn = view.param_to_fqns[id(param)][0]
            states[fqn] = {k: v.detach() if torch.is_tensor(v) else v for k, v in entry.items()}
    params = [p for group in optim.param_groups for p in group["params"]]
    groups = []
    position = 0
    for group in optim.param_groups:
        new = {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
        names: list[str] = []
        for param in params[position : position + len(group["params"])]:
            names.extend(view.param_to_fqns[id(param)])
        position += len(group["params"])
        new["params"] = names
        groups.append(new)
    return {"state": states, "param_groups": groups}


def _state_values(
    entry: dict[str, Any],
    param: torch.Tensor,
    handle: FlatParamHandle,
    index: int,
    orig: bool,
    who: _Writers,
) -> dict[str, Any]:
    """Parameter ``index``'s optimizer states: those shaped like the shard as boxes, the others
    (a scalar ``step``) only where this rank writes the parameter's first element, or, for a
    parameter without elements, everywhere ([Note: A save's per-value work]); for a load's
    target, everywhere."""
    layout = handle.shard_layout
    chunks = _layout_chunks(layout)[index]
    holds = layout.shard_slices[index] is not None and bool(chunks.chunks) and who.boxes(handle, chunks)
    plans_others = who.every_value or (holds and chunks.origin) or chunks.size.numel() == 0
    values: dict[str, Any] = {}
    for name, value in entry.items():
        if torch.is_tensor(value) and value.dim() > 0 and value.shape == param.shape:
            values[name] = _chunks(handle, index, value.detach(), orig, who)
        elif not plans_others:
            continue
        elif torch.is_tensor(value):
            values[name] = value.detach()
        else:
            values[name] = value
    return values


def flat_shard_state_dict(
    model: nn.Module, optim: Optional[torch.optim.Optimizer] = None, ignore_frozen_params: bool = False
) -> dict[str, Any]:
    """What :func:`fsdp.checkpoint.save_sharded` hands DCP: ``{"model": ..., "optim": ...}``
    with every managed parameter and shard-shaped optimizer state as :class:`FlatShardChunks`
    (views of this rank's flat shards, [Note: Flat-shard checkpoints]); no collective.
    ``ignore_frozen_params``: parameters with ``requires_grad=False`` (and any optimizer state
    of theirs) are left out ([Note: Trainable-only checkpoints])."""
    view = ModelView(model)
    who = _Writers.of(model, view)
    result: dict[str, Any] = {"model": _model_entries(model, view, who)}
    if optim is not None:
        result["optim"] = _optim_entries(optim, view, who)
    if ignore_frozen_params:
        for fqn in frozen_fqns(view):
            result["model"].pop(fqn, None)
            if optim is not None:
                result["optim"]["state"].pop(fqn, None)
    return result


# [Note: Trainable-only checkpoints]
# A fine-tuning run (LoRA / PEFT) trains a small adapter on a large frozen base; writing the base
# into every checkpoint costs time and disk for bytes that never change. With
# ``ignore_frozen_params=True`` (the name of DCP's ``StateDictOptions`` field) the save leaves out
# every parameter with ``requires_grad=False`` and its optimizer state, if any; buffers and the
# optimizer's param groups stay. Such a checkpoint loads only where the base comes from
# elsewhere (the pretrained weights loaded before): ``load_sharded`` compares the model's keys
# with the checkpoint's metadata before reading anything, and a missing key raises naming the
# missing parameters, unless every missing one is frozen and the caller says so with
# ``ignore_frozen_params=True`` (then those keep their current values).
def frozen_fqns(view: ModelView) -> list[str]:
    """The FQNs of the model's parameters with ``requires_grad=False``."""
    return [fqn for fqn, param in view.fqn_to_param.items() if not param.requires_grad]


def missing_from_checkpoint(model: nn.Module, template: dict[str, Any], saved_keys: set[str]) -> tuple[list[str], list[str]]:
    """The model's state-dict keys the checkpoint lacks, as (frozen parameters, the others)."""
    frozen = set(frozen_fqns(ModelView(model)))
    missing = [key for key in template if f"model.{key}" not in saved_keys]
    return [k for k in missing if k in frozen], [k for k in missing if k not in frozen]


# [Note: Flat-shard loads]
# ``load_sharded`` reads a checkpoint straight into the flat shards, the mirror of the save: the
# target DCP reads into is the save's state dict built for every rank that holds a part (under
# hybrid strategies every replica, for NO_SHARD every rank), each managed parameter a
# :class:`FlatShardChunks` whose boxes are views of the live flat shard, each optimizer state
# shaped like the shard the same boxes of the live state tensor. DCP's load planner asks each
# target for its chunks (``__create_chunk_list__``: the boxes, shifted by the tp-local tensor's
# global offset under tensor parallelism), reads from the stored chunks exactly the overlaps
# (resharding: the checkpoint may come from any world size, wrap plan, tp degree, or from torch
# FSDP1's row-cut SHARDED state dict), and copies each into the view (``lookup_tensor``): the
# bytes land in the flat shard in place, with no SHARDED state dict, no DTensor or ShardedTensor,
# no collective beyond DCP's planning. That is also why an uneven tensor-parallel split loads: a
# SHARDED state dict of such a model redistributes uneven tp pieces over dp and aborts gloo (torch
# FSDP1's too), while a box is a box whatever its size.
# The rest is loaded into plain tensors: buffers and ignored parameters in place (a buffer mixed
# precision casts into a full-precision copy, then copied into the buffer and kept as its
# full-precision value, as a state-dict load does), scalar optimizer states (``step``) in place;
# non-tensor values (the param groups' hyperparameters, non-tensor states) come back from DCP as
# objects and :func:`apply_loaded` sets them.
def flat_shard_load_target(model: nn.Module) -> dict[str, Any]:
    """What ``load_sharded`` hands DCP to read the model into ([Note: Flat-shard loads]): the
    save's keys, managed parameters as :class:`FlatShardChunks` on the live shards of every rank
    that holds them; no collective. :func:`optim_load_target` adds the optimizer's."""
    view = ModelView(model)
    return {"model": _model_entries(model, view, _Writers.reading(view))}


def optim_load_target(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's part of the load target (``state["optim"]``): shard-shaped states as
    :class:`FlatShardChunks` on the live states, every scalar state on every rank."""
    view = ModelView(model)
    return _optim_entries(optim, view, _Writers.reading(view))


def apply_loaded(model: nn.Module, optim: Optional[torch.optim.Optimizer], state: dict[str, Any]) -> None:
    """After DCP read into :func:`flat_shard_load_target`'s ``state``: the mixed-precision buffers
    and the non-tensor optimizer values, which were not read in place."""
    states = [unit_state(m) for m in model.modules() if is_fsdp(m)]
    names = {id(module): name for name, module in model.named_modules()}
    for unit in states:
        for record in unit.cast_buffers:
            name = names.get(id(record.module))
            value = state["model"].get(_buffer_fqn(name, record.name)) if name is not None else None
            buffer = record.module._buffers[record.name]
            if torch.is_tensor(value) and buffer is not None:
                buffer.copy_(value)
    refresh_cast_buffers(model, states, state["model"])
    if optim is None:
        return
    view = ModelView(model)
    loaded = state["optim"]
    for param, entry in optim.state.items():
        for fqn in view.param_to_fqns[id(param)]:
            for key, value in loaded["state"].get(fqn, {}).items():
                if not torch.is_tensor(value) and not isinstance(value, FlatShardChunks):
                    entry[key] = value
    # DCP flattens the param groups key by key (``optim.param_groups.<i>.<name>``): a group the
    # checkpoint lacks is refused at planning, before anything is read.
    for group, saved in zip(optim.param_groups, loaded["param_groups"]):
        group.update({key: value for key, value in saved.items() if key != "params"})
