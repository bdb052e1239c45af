"""Which rows of a parameter each rank holds in a SHARDED state dict: pure arithmetic.

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

from typing import NamedTuple

__all__ = ["RowChunk", "chunk_rows", "torch_chunks"]


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
