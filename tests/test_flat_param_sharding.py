"""Pure sharding arithmetic (no process group): padding, shard bounds, slices, divide factors."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from fsdp.flat_param._sharding import (
    FlatLayout,
    ParamShardSlice,
    aligned_numel,
    flat_layout,
    gradient_divide_factors,
    padded_unsharded_numel,
    param_slices_in_shard,
    shard_bounds,
    sharded_numel,
)


@pytest.mark.parametrize("numel,world_size,expected", [(7, 3, 9), (8, 4, 8), (1, 4, 4), (0, 2, 0), (5, 1, 5)])
def test_padded_numel(numel: int, world_size: int, expected: int) -> None:
    assert padded_unsharded_numel(numel, world_size) == expected
    assert sharded_numel(numel, world_size) * world_size == expected


def test_docstring_example() -> None:
    assert param_slices_in_shard([3, 4], 0, 3) == [ParamShardSlice(0, 0, 3, 0)]
    assert param_slices_in_shard([3, 4], 1, 3) == [ParamShardSlice(1, 0, 3, 0)]
    assert param_slices_in_shard([3, 4], 2, 3) == [ParamShardSlice(1, 3, 1, 0)]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("numels", [[3, 4], [1], [5, 1, 9, 2], [12], [1, 1, 1]])
def test_slices_reassemble_the_flat_tensor(numels: list[int], world_size: int) -> None:
    """Every element of every parameter lands in exactly one rank's shard, at the right place."""
    flat = torch.arange(1, sum(numels) + 1)
    padded = torch.cat([flat, flat.new_zeros(padded_unsharded_numel(flat.numel(), world_size) - flat.numel())])
    params = list(torch.split(flat, numels))
    seen = [torch.zeros(n, dtype=torch.long) for n in numels]
    for rank in range(world_size):
        start, end = shard_bounds(flat.numel(), rank, world_size)
        shard = padded[start:end]
        for s in param_slices_in_shard(numels, rank, world_size):
            piece = params[s.param_index][s.offset_in_param : s.offset_in_param + s.numel]
            assert torch.equal(shard[s.offset_in_shard : s.offset_in_shard + s.numel], piece)
            seen[s.param_index][s.offset_in_param : s.offset_in_param + s.numel] += 1
    assert all(torch.equal(c, torch.ones_like(c)) for c in seen)


def test_aligned_layout_note_example() -> None:
    """[Note: Aligned flat parameter layout]: fp32 parameters of 3 and 5 elements, world size 4."""
    layout = flat_layout([3, 5], 4, aligned_numel(4))
    assert layout == FlatLayout((3, 5), (0, 4), (3, 1, 5, 3), (False, True, False, True), 12, 4)
    assert layout.padded_unsharded_numel == 12 and layout.sharded_numel == 3
    assert [layout.slices_in_shard(r) for r in range(4)] == [
        [ParamShardSlice(0, 0, 3, 0)],
        [ParamShardSlice(1, 0, 2, 1)],
        [ParamShardSlice(1, 2, 3, 0)],
        [],
    ]
    assert layout.padding_runs() == [(3, 1), (9, 3)]


def test_aligned_numel_per_dtype() -> None:
    assert [aligned_numel(n) for n in (1, 2, 4, 8)] == [16, 8, 4, 2]
    with pytest.raises(ValueError, match="itemsize must be positive"):
        aligned_numel(0)


def test_unaligned_layout_has_no_padding() -> None:
    """use_orig_params=False: back to back, no padding entries, no world-size padding inside."""
    layout = flat_layout([3, 4], 3)
    assert layout.param_offsets == (0, 3) and layout.numels_with_padding == (3, 4)
    assert layout.unpadded_unsharded_numel == 7 and layout.padded_unsharded_numel == 9


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("align", [2, 4, 8])
@pytest.mark.parametrize("numels", [[3, 4], [1], [5, 1, 9, 2], [12], [1, 1, 1]])
def test_aligned_slices_reassemble_the_parameters(numels: list[int], align: int, world_size: int) -> None:
    """Aligned layout: every parameter starts at a multiple of ``align``, the whole divides by
    the world size, and every element lands in exactly one shard, at its layout offset."""
    layout = flat_layout(numels, world_size, align)
    assert all(offset % align == 0 for offset in layout.param_offsets)
    assert layout.unpadded_unsharded_numel % world_size == 0
    assert sum(layout.numels_with_padding) == layout.unpadded_unsharded_numel
    assert [n for n, pad in zip(layout.numels_with_padding, layout.is_padding_mask) if not pad] == numels
    assert all(0 < n < max(align, world_size) for n, pad in zip(layout.numels_with_padding, layout.is_padding_mask) if pad)
    flat = torch.zeros(layout.unpadded_unsharded_numel, dtype=torch.long)
    params = [torch.arange(1, n + 1) + 100 * i for i, n in enumerate(numels)]
    for param, offset in zip(params, layout.param_offsets):
        flat[offset : offset + param.numel()] = param
    seen = [torch.zeros(n, dtype=torch.long) for n in numels]
    for rank in range(world_size):
        start, end = rank * layout.sharded_numel, (rank + 1) * layout.sharded_numel
        shard = flat[start:end]
        for s in layout.slices_in_shard(rank):
            piece = params[s.param_index][s.offset_in_param : s.offset_in_param + s.numel]
            assert torch.equal(shard[s.offset_in_shard : s.offset_in_shard + s.numel], piece)
            seen[s.param_index][s.offset_in_param : s.offset_in_param + s.numel] += 1
    assert all(torch.equal(c, torch.ones_like(c)) for c in seen)


def test_shard_bounds_rejects_bad_rank() -> None:
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        shard_bounds(5, 2, 2)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        padded_unsharded_numel(5, 0)


@pytest.mark.parametrize("world_size", range(1, 65))
def test_divide_factors_match_torch_rule(world_size: int) -> None:
    """pre doubles while world_size % pre == 0 and world_size / pre > pre; pre * post == world_size."""
    pre, post = gradient_divide_factors(world_size)
    expected = 1
    while world_size % expected == 0 and world_size / expected > expected:
        expected *= 2
    assert pre == expected
    assert pre * post == pytest.approx(world_size)


def test_divide_factors_known_values() -> None:
    assert [gradient_divide_factors(n) for n in (1, 2, 4, 8, 16)] == [
        (1.0, 1.0), (2.0, 1.0), (2.0, 2.0), (4.0, 2.0), (4.0, 4.0)
    ]


def test_divide_factors_agree_with_torch() -> None:
    from torch.distributed.algorithms._comm_hooks.default_hooks import DefaultState  # oracle

    _get_gradient_predivide_factor = DefaultState._get_gradient_predivide_factor

    for n in itertools.chain(range(1, 33), [48, 64, 96, 128, 1000]):
        assert gradient_divide_factors(n)[0] == _get_gradient_predivide_factor(n)


def test_row_chunks_are_torch_chunk() -> None:
    """``fsdp.flat_param._shard_map``: each rank's rows and the list of pieces are exactly what
    ``torch.chunk`` makes along dim 0, for every row count up to 3 x the world size (empty pieces
    past the last one, and the zero-row case included)."""
    from fsdp.flat_param._shard_map import RowChunk, chunk_rows, torch_chunks

    for world_size in (1, 2, 3, 4, 5, 8):
        for dim0 in range(0, 3 * world_size + 2):
            full = torch.arange(dim0 * 2).view(dim0, 2)
            pieces = full.chunk(world_size, dim=0)
            firsts = [int(p[0, 0]) // 2 if p.numel() else 0 for p in pieces]
            assert torch_chunks(dim0, world_size) == [RowChunk(f, p.shape[0]) for f, p in zip(firsts, pieces)]
            for rank in range(world_size):
                chunk = chunk_rows(dim0, world_size, rank)
                expected = pieces[rank] if rank < len(pieces) else full[dim0:]
                assert torch.equal(full.narrow(0, chunk.first_row, chunk.num_rows), expected), (dim0, world_size, rank)
    assert torch_chunks(5, 4) == [RowChunk(0, 2), RowChunk(2, 2), RowChunk(4, 1)]  # the note's example
    assert chunk_rows(5, 4, 3) == RowChunk(5, 0)


def test_flat_range_boxes_cover_the_range_exactly() -> None:
    """[Note: A flat range is a few boxes]: every range of every small shape is covered by its
    boxes in row-major order, each box contiguous, at most 2 * (ndim - 1) + 1 of them."""
    from fsdp.flat_param._shard_map import Box, flat_range_boxes

    assert flat_range_boxes((3, 4), 2, 11) == [Box((0, 2), (1, 2)), Box((1, 0), (1, 4)), Box((2, 0), (1, 3))]
    assert flat_range_boxes((), 0, 1) == [Box((), ())] and flat_range_boxes((5,), 3, 3) == []
    for shape in [(7,), (3, 4), (2, 3, 4), (2, 1, 3, 2)]:
        total = 1
        for size in shape:
            total *= size
        full = torch.arange(total).view(shape)
        for start, end in itertools.combinations(range(total + 1), 2):
            boxes = flat_range_boxes(shape, start, end)
            assert len(boxes) <= 2 * (len(shape) - 1) + 1
            pieces = []
            for box in boxes:
                index = tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))
                piece = full[index].reshape(-1)
                assert box.numel == piece.numel() and bool((piece.diff() == 1).all())  # contiguous
                pieces.append(piece)
            assert torch.equal(torch.cat(pieces), torch.arange(start, end)), (shape, start, end)


def test_tp_local_box_is_dtensor_arithmetic() -> None:
    """[Note: Tensor-parallel pieces are boxes]: the tp-local tensor's box is DTensor's own local
    shape and global offset (``_compute_local_shape_and_global_offset``) for Shard(0) (rows),
    Shard(1) (columns), negative dims, nested shards on a 2-D mesh, Replicate, even and uneven;
    the note's worked example; a box of the local tensor shifted by the offset holds the same
    values in the full tensor; ``_StridedShard`` and ``Partial`` raise."""
    from fsdp.flat_param._shard_map import Box, flat_range_boxes, shifted, tp_local_box
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    cases: list[tuple[tuple[int, ...], tuple[Any, ...]]] = [
        ((1,), (Shard(0),)),
        ((2,), (Shard(1),)),
        ((3,), (Shard(-1),)),
        ((4,), (Replicate(),)),
        ((2, 2), (Shard(0), Shard(1))),
        ((2, 3), (Shard(1), Shard(1))),
        ((2, 2), (Replicate(), Shard(0))),
    ]
    for mesh_shape, placements in cases:
        for shape in [(5, 7), (4, 6), (11, 3), (2, 3, 5)]:
            full = torch.arange(torch.Size(shape).numel()).view(shape)
            for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
                box = tp_local_box(shape, placements, mesh_shape, coordinate)
                local_shape, offset = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coordinate), placements)
                assert box == Box(tuple(offset), tuple(local_shape)), (mesh_shape, placements, shape, coordinate)
                local = full[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))]
                numel = local.numel()
                for start, end in [(0, numel), (1, max(1, numel - 2)), (numel // 2, numel)]:
                    ranged = flat_range_boxes(tuple(local.shape), start, end)
                    for local_box, full_box in zip(ranged, shifted(ranged, box.offsets)):
                        a = local[tuple(slice(o, o + n) for o, n in zip(local_box.offsets, local_box.sizes))]
                        b = full[tuple(slice(o, o + n) for o, n in zip(full_box.offsets, full_box.sizes))]
                        assert torch.equal(a, b)
    # The note's example: (4, 6) with Shard(1) over 2; tp rank 1's range [2, 8) of its (4, 3).
    assert tp_local_box((4, 6), (Shard(1),), (2,), (1,)) == Box((0, 3), (4, 3))
    assert shifted(flat_range_boxes((4, 3), 2, 8), (0, 3)) == [Box((0, 5), (1, 1)), Box((1, 3), (1, 3)), Box((2, 3), (1, 2))]
    for placement in (_StridedShard(0, split_factor=2), Partial()):
        with pytest.raises(NotImplementedError, match="is not a box of the full parameter"):
            tp_local_box((4, 6), (placement,), (2,), (0,))
