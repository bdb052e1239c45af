"""Pure sharding arithmetic: padding, chunking, and which slice of which parameter a rank holds.

Nothing here needs a process group; every function is unit-tested on its own.

[Note: Flat parameter layout]
A unit's parameters are flattened back to back (in ``named_parameters`` order, each shared
parameter once) into ``unpadded_unsharded_numel`` elements, then padded with zeros at the end
to ``padded_unsharded_numel``, the next multiple of the world size. Rank ``r`` holds elements
``[r * sharded_numel, (r + 1) * sharded_numel)`` of the padded tensor (the padding always sits on
the last ranks). Worked example, parameters of 3 and 4 elements, world size 3::

    unpadded unsharded: [a0 a1 a2 b0 b1 b2 b3]           (7 elements)
    padded unsharded:   [a0 a1 a2 b0 b1 b2 b3 0 0]       (9 elements, 2 of padding)
    rank 0 shard:       [a0 a1 a2]                        a[0:3]
    rank 1 shard:       [b0 b1 b2]                        b[0:3]
    rank 2 shard:       [b3 0 0]                          b[3:4], then 2 of padding
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

__all__ = [
    "padded_unsharded_numel",
    "sharded_numel",
    "shard_bounds",
    "ParamShardSlice",
    "param_slices_in_shard",
    "gradient_divide_factors",
]


def _check_world_size(world_size: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")


def padded_unsharded_numel(unpadded_unsharded_numel: int, world_size: int) -> int:
    """Returns the smallest multiple of ``world_size`` that holds ``unpadded_unsharded_numel``."""
    _check_world_size(world_size)
    return -(-unpadded_unsharded_numel // world_size) * world_size


def sharded_numel(unpadded_unsharded_numel: int, world_size: int) -> int:
    """Returns the number of elements each rank's shard holds (padding included)."""
    return padded_unsharded_numel(unpadded_unsharded_numel, world_size) // world_size


def shard_bounds(unpadded_unsharded_numel: int, rank: int, world_size: int) -> tuple[int, int]:
    """Returns ``[start, end)`` of ``rank``'s shard in the padded unsharded flat tensor."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    numel = sharded_numel(unpadded_unsharded_numel, world_size)
    return rank * numel, (rank + 1) * numel


class ParamShardSlice(NamedTuple):
    """The part of one original parameter that lies in one rank's shard.

    Attributes:
        param_index: Index of the parameter in the flat parameter's order.
        offset_in_param: Start of the slice within the parameter's flattened elements.
        numel: Number of elements in the slice.
        offset_in_shard: Start of the slice within the rank's shard.
    """

    param_index: int
    offset_in_param: int
    numel: int
    offset_in_shard: int


def param_slices_in_shard(
    param_numels: Sequence[int], rank: int, world_size: int
) -> list[ParamShardSlice]:
    """Returns, for ``rank``, the slice of each parameter its shard holds (empty ones omitted).

    With the docstring example of this module (``param_numels=[3, 4]``, world size 3), rank 2
    gets ``[ParamShardSlice(param_index=1, offset_in_param=3, numel=1, offset_in_shard=0)]``.
    """
    start, end = shard_bounds(sum(param_numels), rank, world_size)
    slices: list[ParamShardSlice] = []
    param_start = 0
    for index, numel in enumerate(param_numels):
        param_end = param_start + numel
        lo, hi = max(start, param_start), min(end, param_end)
        if lo < hi:
            slices.append(ParamShardSlice(index, lo - param_start, hi - lo, lo - start))
        param_start = param_end
    return slices


def gradient_divide_factors(world_size: int) -> tuple[float, float]:
    """Returns ``(pre, post)``: divide gradients by ``pre`` before the sum-reduction, ``post`` after.

    Splitting the averaging around the reduction keeps low-precision sums in range. The
    factors are those of torch FSDP1 so that results agree bit for bit: ``pre`` starts at 1 and
    doubles while ``world_size % pre == 0 and world_size / pre > pre``; ``post`` is
    ``world_size / pre``. For example world size 2 gives ``(2, 1)``, 4 gives ``(2, 2)``,
    8 gives ``(4, 2)`` and 16 gives ``(4, 4)``.
    """
    _check_world_size(world_size)
    pre = 1
    while world_size % pre == 0 and world_size / pre > pre:
        pre *= 2
    return float(pre), world_size / pre
