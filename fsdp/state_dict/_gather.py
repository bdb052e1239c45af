"""Full-state-dict gathers: a handle-shaped shard into a freshly allocated, owned full tensor.

[Note: State dict gathers]
A FULL state dict (model or optimizer) returns full tensors that the caller owns. Gathering
into a buffer that is then copied (the unshard buffer, then one clone per parameter) costs
twice the memory traffic; here each gather writes straight into a tensor allocated for the
result, and the per-parameter values are views of it (the padding at its end is a few
elements).

Who receives:

- ``dst=None``: every rank (one all-gather into the fresh tensor).
- ``dst=NOBODY``: no rank of this group keeps the result (with hybrid sharding, the rank that
  saves is in another replica's group): nothing is communicated.
- ``dst=<group rank>`` (``rank0_only``): point-to-point. Each other rank sends its shard from
  where it lives (no copy, no allocation: a rank that keeps nothing never holds an unsharded
  unit); the receiver copies its own shard in and receives every other shard in place. On
  gloo this is about 3x faster than an all-gather of the same size, which goes through a
  temporary flat buffer on every rank and moves every shard to every rank.

The point-to-point exchange is ``fsdp._comm._collectives.gather_flat_to`` (with its own
message tag, see [Note: Point-to-point collectives on gloo]); each call's sends and receives are
matched by order on every rank pair, and the callers issue them in the same order on every
rank of the group (as any collective).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from fsdp._comm import _collectives as comm

__all__ = ["NOBODY", "PendingGather", "start_gather", "gather"]

#: ``dst`` for a gather whose result no rank of the group keeps.
NOBODY = -1


class PendingGather:
    """A gather in flight; :meth:`wait` returns the padded unsharded tensor (None if not kept)."""

    def __init__(self, padded_unsharded: Optional[torch.Tensor], works: list[Any]) -> None:
        self._padded_unsharded = padded_unsharded
        self._works = works

    def wait(self) -> Optional[torch.Tensor]:
        for work in self._works:
            work.wait()
        self._works = []
        return self._padded_unsharded


def start_gather(
    shard: torch.Tensor,
    group: dist.ProcessGroup,
    rank: int,
    world_size: int,
    dst: Optional[int],
) -> PendingGather:
    """Starts gathering the equal-sized 1-D shards of ``group`` into a new padded unsharded tensor.

    Args:
        shard: This rank's 1-D shard (``padded_numel / world_size`` elements), on the device
            the group communicates on.
        group: The group the shards are spread over; ``rank`` / ``world_size`` in it.
        dst: The group rank that receives, None for every rank, :data:`NOBODY` for none.

    Returns:
        A :class:`PendingGather` whose result is a fresh tensor of ``world_size * shard.numel()``
        elements on the receiving ranks and None on the others.
    """
    if dst == NOBODY:
        return PendingGather(None, [])
    shard = shard.contiguous()
    if dst is None:
        everyone = shard.new_empty(world_size * shard.numel())
        comm.all_gather_flat(everyone, shard, group)
        return PendingGather(everyone, [])
    received = shard.new_empty(world_size * shard.numel()) if rank == dst else None
    work = comm.gather_flat_to(received, shard, group, dst, async_op=True)
    return PendingGather(received, [work])


def gather(
    shard: torch.Tensor,
    group: dist.ProcessGroup,
    rank: int,
    world_size: int,
    dst: Optional[int],
) -> Optional[torch.Tensor]:
    """:func:`start_gather`, waited for."""
    return start_gather(shard, group, rank, world_size, dst).wait()
