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

[Note: Aligned flat parameter layout]
With ``use_orig_params=True`` torch FSDP1 starts every parameter at a 16-byte boundary of the
flat parameter (``16 // itemsize`` elements of the forward/backward dtype: 4 for fp32, 8 for
bf16/fp16), inserting padding elements in front of a parameter that would not, and then pads
the flat parameter itself to a multiple of the world size (also for NO_SHARD; a multiple of 1
at world size 1). Its "unpadded" unsharded numel then counts all of that padding, and the
shards divide it exactly (no padding at the shards' end). We use the same layout, so shards are
cut at the same offsets (the same local state dicts, the same reduce-scatter chunks). Worked
example, fp32 parameters of 3 and 5 elements, world size 4::

    unsharded:    [a0 a1 a2 P b0 b1 b2 b3 b4 P P P]   (12 elements: numels with padding
                                                     [3, 1, 5, 3], padding mask [F, T, F, T])
    rank 0 shard: [a0 a1 a2]                         a[0:3]
    rank 1 shard: [P b0 b1]                          b[0:2]
    rank 2 shard: [b2 b3 b4]                         b[2:5]
    rank 3 shard: [P P P]                            nothing (padding only)

Without ``use_orig_params`` nothing is inserted (the layout of [Note: Flat parameter layout]).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

__all__ = [
    "ALIGNMENT_BYTES",
    "aligned_numel",
    "FlatLayout",
    "flat_layout",
    "padded_unsharded_numel",
    "sharded_numel",
    "shard_bounds",
    "ParamShardSlice",
    "param_slices_in_shard",
    "gradient_divide_factors",
    "handle_uses_sharding",
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

    The parameters lie back to back (no alignment; see :meth:`FlatLayout.slices_in_shard` for
    any layout). With the docstring example of this module (``param_numels=[3, 4]``, world
    size 3), rank 2 gets ``[ParamShardSlice(param_index=1, offset_in_param=3, numel=1,
    offset_in_shard=0)]``.
    """
    return flat_layout(param_numels, world_size, align_numel=0).slices_in_shard(rank)


ALIGNMENT_BYTES = 16
"""Where torch FSDP1 starts each original parameter in the flat parameter with use_orig_params."""


def aligned_numel(itemsize: int) -> int:
    """Elements of ``itemsize`` bytes per alignment step (``ALIGNMENT_BYTES // itemsize``)."""
    if itemsize <= 0:
        raise ValueError(f"itemsize must be positive, got {itemsize}")
    return max(ALIGNMENT_BYTES // itemsize, 1)


class FlatLayout(NamedTuple):
    """Where each original parameter and each run of padding sits in the unsharded flat tensor.

    See [Note: Aligned flat parameter layout].

    Attributes:
        param_numels: Each parameter's number of elements (torch FSDP1's ``_numels``).
        param_offsets: Each parameter's start in the unsharded flat tensor.
        numels_with_padding: Parameters and padding runs in flat order (torch FSDP1's
            ``_numels_with_padding``); they sum to ``unpadded_unsharded_numel``.
        is_padding_mask: Whether each entry of ``numels_with_padding`` is padding (torch
            FSDP1's ``_is_padding_mask``).
        unpadded_unsharded_numel: Elements of the flat tensor before the shard padding
            (including any alignment padding; torch FSDP1's ``_unpadded_unsharded_size``).
        world_size: Ranks the shards are cut for.
    """

    param_numels: tuple[int, ...]
    param_offsets: tuple[int, ...]
    numels_with_padding: tuple[int, ...]
    is_padding_mask: tuple[bool, ...]
    unpadded_unsharded_numel: int
    world_size: int

    @property
    def padded_unsharded_numel(self) -> int:
        """Elements once padded to a multiple of the world size (what is sharded)."""
        return padded_unsharded_numel(self.unpadded_unsharded_numel, self.world_size)

    @property
    def sharded_numel(self) -> int:
        """Elements of each rank's shard (padding included)."""
        return self.padded_unsharded_numel // self.world_size

    @property
    def param_numel(self) -> int:
        """Elements of the parameters alone (no padding of any kind)."""
        return sum(self.param_numels)

    def slices_in_shard(self, rank: int) -> list[ParamShardSlice]:
        """Returns, for ``rank``, the slice of each parameter its shard holds (empty ones omitted).

        With the example of [Note: Aligned flat parameter layout], rank 1 gets
        ``[ParamShardSlice(param_index=1, offset_in_param=0, numel=2, offset_in_shard=1)]``.
        """
        start, end = shard_bounds(self.unpadded_unsharded_numel, rank, self.world_size)
        slices: list[ParamShardSlice] = []
        for index, (param_start, numel) in enumerate(zip(self.param_offsets, self.param_numels)):
            lo, hi = max(start, param_start), min(end, param_start + numel)
            if lo < hi:
                slices.append(ParamShardSlice(index, lo - param_start, hi - lo, lo - start))
        return slices

    def padding_runs(self) -> list[tuple[int, int]]:
        """``(offset, numel)`` of every run of padding inside ``unpadded_unsharded_numel``."""
        runs, offset = [], 0
        for numel, is_padding in zip(self.numels_with_padding, self.is_padding_mask):
            if is_padding:
                runs.append((offset, numel))
            offset += numel
        return runs


def flat_layout(param_numels: Sequence[int], world_size: int, align_numel: int = 0) -> FlatLayout:
    """Lays out parameters of ``param_numels`` elements in one flat tensor.

    Args:
        param_numels: The parameters' numbers of elements, in flat order (each shared
            parameter once).
        world_size: The handle's process-group size (torch FSDP1 pads an aligned flat tensor
            to a multiple of it even when it does not shard).
        align_numel: 0 for back-to-back parameters (use_orig_params=False); otherwise each
            parameter starts at a multiple of it and the whole is padded to a multiple of
            ``world_size`` (see [Note: Aligned flat parameter layout] and
            :func:`aligned_numel`).

    Returns:
        The :class:`FlatLayout`. For the note's example, ``flat_layout([3, 5], 4, 4)`` has
        ``param_offsets == (0, 4)``, ``numels_with_padding == (3, 1, 5, 3)`` and
        ``unpadded_unsharded_numel == 12``.
    """
    _check_world_size(world_size)
    if align_numel < 0:
        raise ValueError(f"align_numel must be >= 0, got {align_numel}")
    offsets: list[int] = []
    with_padding: list[int] = []
    mask: list[bool] = []
    total = 0
    for numel in param_numels:
        gap = (-total) % align_numel if align_numel > 0 else 0
        if gap:
            with_padding.append(gap)
            mask.append(True)
            total += gap
        offsets.append(total)
        with_padding.append(numel)
        mask.append(False)
        total += numel
    if align_numel > 0:
        gap = (-total) % world_size
        if gap:
            with_padding.append(gap)
            mask.append(True)
            total += gap
    return FlatLayout(
        tuple(param_numels), tuple(offsets), tuple(with_padding), tuple(mask), total, world_size
    )


def handle_uses_sharding(strategy_shards: bool, shard_world_size: int, offload_params: bool) -> bool:
    """Whether a handle takes the sharded path (local shard, padded unsharded buffer, gathers).

    A sharding strategy over more than one rank does. So does CPU offload on one rank ([Note:
    CPU offload on one rank]): the local shard (the whole flat parameter) stays in the host
    buffer, unshard copies it to the compute device (the one-rank all-gather is a copy) and the
    reduced gradient goes back to the host. ``FlatParamHandle`` and the planner both ask this.
    """
    return (strategy_shards and shard_world_size > 1) or (offload_params and shard_world_size == 1)


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
