"""Which part of each parameter a rank holds: the rows of a SHARDED state-dict value, and the
boxes a flat shard covers. Pure arithmetic.

[Note: Row chunks]
A SHARDED state-dict value (model or optimizer, ``ShardedTensor`` or ``DTensor``) holds on each
rank of the unit's shard group one ``torch.chunk`` piece of the full tensor along dim 0, as
torch FSDP1 cuts it: with ``d0`` rows over ``ws`` ranks every piece has
``ceil(d0 / ws)`` rows except the last non-empty one, and ranks past the last piece hold none.
Worked example, ``d0 = 5`` over ``ws = 4``: 2 rows per piece, so rank 0 holds rows [0, 2),
rank 1 [2, 4), rank 2 [4, 5), rank 3 nothing; ``torch.chunk`` makes 3 pieces, and torch FSDP1's
ShardedTensor metadata lists exactly those 3 (a ``DTensor`` ``Shard(0)`` gives rank 3 an empty
piece). A tensor with no rows is ``ws`` empty pieces (``torch.chunk``'s answer).

This is the one place that says which rows a rank holds; the state-dict values
(``fsdp/state_dict/_values.py``) build and check their layouts from it. It needs no process
group and is unit-tested on one process (``tests/test_flat_param_sharding.py``).
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple, Optional, Sequence

__all__ = [
    "RowChunk",
    "chunk_rows",
    "torch_chunks",
    "Box",
    "flat_range_boxes",
    "TensorParallelPiece",
    "tp_local_box",
    "tp_piece",
    "shifted",
    "ParamBoxes",
    "param_boxes",
    "layout_param_boxes",
]


class RowChunk(NamedTuple):
    """The rows ``[first_row, first_row + num_rows)`` of dim 0 one rank holds."""

    first_row: int
    num_rows: int


def _rows_per_rank(dim0: int, world_size: int) -> int:
    return -(-dim0 // world_size) if dim0 else 0  # ceil


def chunk_rows(dim0: int, world_size: int, rank: int) -> RowChunk:
    """Rank ``rank``'s ``torch.chunk`` piece of ``dim0`` rows over ``world_size`` ranks (possibly
    empty, then starting at ``dim0``); see [Note: Row chunks]."""
    rows_per_rank = _rows_per_rank(dim0, world_size)
    first = min(rank * rows_per_rank, dim0)
    return RowChunk(first, max(0, min(rows_per_rank, dim0 - first)))


def torch_chunks(dim0: int, world_size: int) -> list[RowChunk]:
    """The pieces ``torch.chunk(tensor, world_size)`` makes of ``dim0`` rows, in rank order: the
    non-empty ones (fewer than ``world_size`` when the last ranks get nothing), or ``world_size``
    empty ones when ``dim0 == 0``; see [Note: Row chunks]."""
    if dim0 == 0:
        return [RowChunk(0, 0)] * world_size
    rows_per_rank = _rows_per_rank(dim0, world_size)
    return [RowChunk(first, min(rows_per_rank, dim0 - first)) for first in range(0, dim0, rows_per_rank)]


# [Note: A flat range is a few boxes]
# A rank's flat shard holds, of each parameter, one contiguous range of its row-major elements
# (``ShardParamInfo``: ``intra_param_start_idx`` to ``intra_param_end_idx``). Such a range is a
# union of at most 2 * (ndim - 1) + 1 boxes of the parameter's shape, each contiguous in the shard
# and in row-major order of the range: for a matrix a partial first row, whole rows, a partial last
# row. Worked example, shape (3, 4), elements [2, 11): the box at (0, 2) of size (1, 2) (elements
# 2-3), the box at (1, 0) of size (1, 4) (4-7), the box at (2, 0) of size (1, 3) (8-10). A box's
# values are ``shard[offset_in_shard + k : ... + numel].view(sizes)`` for the box's place ``k`` in
# the range: no copy, no communication. Checkpoints write them as DCP chunks where they lie, and
# export consumers pull exactly the boxes they need.


class Box(NamedTuple):
    """A box of a tensor: ``offsets`` and ``sizes`` per dimension (DCP's chunk metadata)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for size in self.sizes:
            n *= size
        return n


def flat_range_boxes(shape: tuple[int, ...], start: int, end: int) -> list[Box]:
    """The boxes of ``shape`` that its row-major elements ``[start, end)`` make up, in that order
    (see [Note: A flat range is a few boxes]); none for an empty range, one for a 0-d tensor."""
    if start >= end:
        return []
    if not shape:
        return [Box((), ())]
    if len(shape) == 1:
        return [Box((start,), (end - start,))]
    inner = 1
    for size in shape[1:]:
        inner *= size
    first_row, first_offset = divmod(start, inner)
    last_row, last_offset = divmod(end, inner)  # the row the (exclusive) end falls in

    def in_row(row: int, lo: int, hi: int) -> list[Box]:
        return [Box((row, *b.offsets), (1, *b.sizes)) for b in flat_range_boxes(shape[1:], lo, hi)]

    if first_row == last_row:
        return in_row(first_row, first_offset, last_offset)
    boxes: list[Box] = []
    if first_offset:
        boxes += in_row(first_row, first_offset, inner)
        first_row += 1
    if last_row > first_row:
        boxes.append(Box((first_row, *([0] * (len(shape) - 1))), (last_row - first_row, *shape[1:])))
    if last_offset:
        boxes += in_row(last_row, 0, last_offset)
    return boxes


# [Note: Tensor-parallel pieces are boxes]
# Under tensor parallelism (``parallelize_module`` before FSDP) a parameter is a DTensor and the
# flat shard holds ranges of its tp-local tensor ([Note: DTensor parameters] in ``_layout.py``).
# With ``Shard(d)`` placements that local tensor is one box of the full parameter: along each
# sharded dim ``d`` the ``torch.chunk`` piece [Note: Row chunks] of the mesh dim's size at this
# rank's mesh coordinate (nested when several mesh dims shard, in mesh-dim order, as DTensor
# does), whole along every other dim; ``Replicate`` leaves it whole. So a box of the tp-local
# tensor (offsets ``b``, sizes ``s``) is the box (``b + o``, ``s``) of the full parameter, ``o``
# the local tensor's global offset, for Shard(0) (ColwiseParallel's weight: rows), Shard(1)
# (RowwiseParallel's weight: columns) or any dim, even or uneven. Worked example: a (4, 6) weight
# with Shard(1) over 2 tp ranks; tp rank 1 holds columns [3, 6), global offset (0, 3); its flat
# range [2, 8) of the local (4, 3) tensor is the boxes at (0, 2) size (1, 1), at (1, 0) size
# (1, 3), at (2, 0) size (1, 2) of the local tensor, i.e. at (0, 5), (1, 3), (2, 3) of the full
# one. Other placements are not boxes and raise: ``_StridedShard`` (an interleaving, made by
# FSDP2's ``fully_shard`` over TP, never by FSDP1's composition) holds several strided blocks, and
# ``Partial`` holds a summand of every element, not a part of the tensor.
class TensorParallelPiece(NamedTuple):
    """Where a tp-local tensor sits in its full (TP-unsharded) parameter.

    Attributes:
        global_shape: The full parameter's shape.
        box: The local tensor as a box of the full one: ``offsets`` its global offset,
            ``sizes`` its shape.
        placements: The DTensor placements, one per mesh dim.
        mesh_dims: The mesh dims that shard it (none when every placement is ``Replicate``).
    """

    global_shape: tuple[int, ...]
    box: Box
    placements: tuple[Any, ...]
    mesh_dims: tuple[int, ...]


def _shard_dim(placement: Any, ndim: int) -> Optional[int]:
    """The tensor dim a ``Shard`` placement splits, None for ``Replicate``; raises for the
    others ([Note: Tensor-parallel pieces are boxes])."""
    if placement.is_replicate():
        return None
    if type(placement).__name__ == "Shard":
        return placement.dim % ndim if ndim else 0
    raise NotImplementedError(
        f"fsdp: a tensor-parallel parameter with placement {placement} is not a box of the full "
        "parameter (only Shard(dim) and Replicate() are); export and flat-shard checkpoints need "
        "Shard/Replicate placements (parallelize_module's ColwiseParallel/RowwiseParallel give them)."
    )


def tp_local_box(
    global_shape: Sequence[int], placements: Sequence[Any], mesh_shape: Sequence[int], coordinate: Sequence[int]
) -> Box:
    """The box of ``global_shape`` the tp-local tensor at mesh ``coordinate`` holds ([Note:
    Tensor-parallel pieces are boxes]); DTensor's ``compute_local_shape_and_global_offset``."""
    offsets, sizes = [0] * len(global_shape), list(global_shape)
    for mesh_dim, placement in enumerate(placements):
        dim = _shard_dim(placement, len(global_shape))
        if dim is None:
            continue
        piece = chunk_rows(sizes[dim], mesh_shape[mesh_dim], coordinate[mesh_dim])
        # An empty piece starts at the end of the dim, as DTensor places it.
        offsets[dim] = offsets[dim] + piece.first_row if piece.num_rows else global_shape[dim]
        sizes[dim] = piece.num_rows
    return Box(tuple(offsets), tuple(sizes))


def tp_piece(spec: Any, coordinate: Optional[Sequence[int]] = None) -> TensorParallelPiece:
    """The :class:`TensorParallelPiece` of a DTensor ``spec`` (mesh, placements, global shape) at
    mesh ``coordinate`` (default: this rank's). No communication.

    Raises:
        NotImplementedError: A placement other than Shard/Replicate.
    """
    placements = tuple(spec.placements)
    shape = tuple(spec.shape)
    sharding = tuple(i for i, p in enumerate(placements) if _shard_dim(p, len(shape)) is not None)
    where = tuple(coordinate) if coordinate is not None else tuple(spec.mesh.get_coordinate())
    box = tp_local_box(shape, placements, tuple(spec.mesh.shape), where)
    return TensorParallelPiece(shape, box, placements, sharding)


def shifted(boxes: Sequence[Box], offsets: Sequence[int]) -> list[Box]:
    """``boxes`` of a tp-local tensor as boxes of the full parameter, the local tensor at global
    ``offsets`` ([Note: Tensor-parallel pieces are boxes])."""
    return [Box(tuple(b + o for b, o in zip(box.offsets, offsets)), box.sizes) for box in boxes]


# [Note: A parameter's boxes, once]
# The checkpoint's chunks (``fsdp/state_dict/_flat_checkpoint.py``), the export's shard map
# (``fsdp/export.py``) and its views all need the same thing of each parameter a flat shard
# holds: its range as boxes, and for a tensor-parallel parameter those boxes placed in the full
# one. ``param_boxes`` is that answer for one parameter, and ``layout_param_boxes`` gives every
# parameter's answer for a handle's ``ShardLayout``, computed on first use and kept as long as
# the layout lives: the layout, the parameters' shapes and their DTensor specs are fixed at
# construction, so a save computes no box (and an optimizer state reuses its parameter's).
class ParamBoxes(NamedTuple):
    """One parameter's range in a flat shard as boxes ([Note: A flat range is a few boxes]),
    placed in the full parameter ([Note: Tensor-parallel pieces are boxes]).

    Attributes:
        shape: The shape of the tensor the range is of: the parameter's, or for a
            tensor-parallel (DTensor) parameter its tp-local tensor's.
        boxes: The boxes of ``shape`` the range covers, in order (none for an empty range).
        global_shape: The full (TP-unsharded) parameter's shape; ``shape`` for a plain one.
        global_offset: Where the tensor of ``shape`` starts in the full parameter, per dim
            (zeros for a plain one).
        placements: The DTensor placements on the tp mesh, None for a plain parameter.
        global_boxes: ``boxes`` as boxes of the full parameter (``boxes`` for a plain one).
        first_replica: For a tensor-parallel parameter, whether this rank's mesh coordinate is 0
            along every mesh dim its placements replicate over (its copy is the first of those
            the tp ranks hold alike: [Note: Who writes a replicated value]); True for a plain
            one (whose tp replicas, if any, the caller knows of).
    """

    shape: tuple[int, ...]
    boxes: tuple[Box, ...]
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    placements: Optional[tuple[Any, ...]]
    global_boxes: tuple[Box, ...]
    first_replica: bool = True


# [Note: Who writes a replicated value]
# A flat-shard checkpoint writes each value once, and which rank writes it follows from static
# facts every rank knows alike, so no rank needs another's plan ([Note: A save without a global
# plan] in ``fsdp/state_dict/_local_plans.py``). Ranks that hold the same bytes: the replicas of a
# hybrid strategy (the first replica writes), the ranks of a NO_SHARD unit (its rank 0), and under
# tensor parallelism the tp ranks of a parameter's ``Replicate`` mesh dims and, for a plain
# parameter of a model with tensor-parallel ones, of every mesh dim of their mesh: of those, the
# rank at coordinate 0 writes (``first_replica``), the lowest rank, as DCP's deduplication would
# choose.
def param_boxes(shape: Sequence[int], start: int, end: int, spec: Optional[Any] = None) -> ParamBoxes:
    """The :class:`ParamBoxes` of the row-major range ``[start, end)`` of a parameter of local
    ``shape``, ``spec`` its DTensor spec (None for a plain parameter). No communication.

    Raises:
        NotImplementedError: ``spec`` has a placement other than Shard/Replicate (whether or not
            the range is empty: every rank says so alike).
    """
    local = tuple(shape)
    boxes = tuple(flat_range_boxes(local, start, end))
    if spec is None:
        return ParamBoxes(local, boxes, local, (0,) * len(local), None, boxes)
    tp = tp_piece(spec)
    offset = tp.box.offsets
    coordinate = spec.mesh.get_coordinate()
    first = not any(c for c, p in zip(coordinate, tp.placements) if p.is_replicate())
    return ParamBoxes(local, boxes, tp.global_shape, offset, tp.placements, tuple(shifted(boxes, offset)), first)


_BY_LAYOUT: "weakref.WeakKeyDictionary[Any, tuple[ParamBoxes, ...]]" = weakref.WeakKeyDictionary()


def layout_param_boxes(layout: Any) -> tuple[ParamBoxes, ...]:
    """Each parameter's :class:`ParamBoxes` in a handle's ``ShardLayout`` (``param_shapes``,
    ``shard_slices``, ``dtensor_specs``), in flat order, empty ``boxes`` where this rank holds
    none of it; computed once per layout ([Note: A parameter's boxes, once]).

    Raises:
        NotImplementedError: As :func:`param_boxes`.
    """
    cached = _BY_LAYOUT.get(layout)
    if cached is None:
        specs = layout.dtensor_specs or (None,) * len(layout.param_shapes)
        result = []
        for shape, piece, spec in zip(layout.param_shapes, layout.shard_slices, specs):
            start, end = (0, 0) if piece is None else (piece.offset_in_param, piece.offset_in_param + piece.numel)
            result.append(param_boxes(shape, start, end, spec))
        cached = _BY_LAYOUT[layout] = tuple(result)
    return cached
