"""Every collective ``fsdp`` issues goes through this file.

One place to count, trace, or swap communication. Functions look ``torch.distributed`` up at
call time, so tests that patch ``torch.distributed.<collective>`` see every call. On gloo
(CPU) the flat all-gather and the two-rank reduce-scatter run as point-to-point exchanges
([Note: Point-to-point collectives on gloo] in ``_p2p.py``); counters count these functions.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from fsdp._common import group_size

from fsdp.runtime._p2p import (
    P2PWork,
    all_gather_p2p,
    gather_p2p,
    reduce_scatter_halves_p2p,
    reduce_scatter_p2p,
    uses_p2p,
)


def all_gather_flat(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Optional[dist.ProcessGroup],
    async_op: bool = False,
) -> Optional[Any]:
    """All-gathers equal-sized 1-D ``input`` shards into ``output`` (rank order).

    With ``async_op`` it returns the work handle to wait on before ``output`` is read.
    """
    if uses_p2p(input, group) and group_size(group) > 1:
        return _complete_unless_async(all_gather_p2p(output, input, group), async_op)
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def reduce_scatter_flat(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Optional[dist.ProcessGroup],
    async_op: bool = False,
) -> Optional[Any]:
    """Sum-reduces ``input`` across ranks and leaves chunk ``rank`` of the result in ``output``.

    Example with world size 2: rank 0 passes ``[1, 2, 3, 4]`` and rank 1 ``[5, 6, 7, 8]``;
    rank 0 receives ``[6, 8]`` and rank 1 ``[10, 12]``. With ``async_op`` it returns the
    work handle to wait on (gloo runs it on its own thread, overlapping compute).
    """
    if uses_p2p(input, group) and group_size(group) == 2:
        return _complete_unless_async(reduce_scatter_p2p(output, input, group), async_op)
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, group=group, async_op=async_op)


def reduce_scatter_halves(
    output: torch.Tensor,
    peer_half: torch.Tensor,
    own_parts: list[tuple[int, torch.Tensor]],
    own_scale: float,
    group: Optional[dist.ProcessGroup],
) -> Any:
    """Launches a two-rank reduce-scatter given as (peer half, own pieces); returns its work.

    Gloo only (see :func:`fsdp.runtime._p2p.reduce_scatter_halves_p2p`); the caller checks
    :func:`can_reduce_scatter_halves` first.
    """
    return reduce_scatter_halves_p2p(output, peer_half, own_parts, own_scale, group)


def can_reduce_scatter_halves(tensor: torch.Tensor, group: Optional[dist.ProcessGroup]) -> bool:
    """Whether :func:`reduce_scatter_halves` applies: gloo, CPU tensors, two ranks."""
    return uses_p2p(tensor, group) and group_size(group) == 2


def gather_flat_to(
    output: Optional[torch.Tensor],
    input: torch.Tensor,
    group: Optional[dist.ProcessGroup],
    dst: int,
    async_op: bool = False,
) -> Optional[Any]:
    """Gathers equal-sized 1-D ``input`` shards into ``output`` on group rank ``dst`` only.

    Point to point on every backend ([Note: State dict gathers]): the other ranks send from
    where their shard lives and pass ``output=None``. With ``async_op`` it returns the work.
    """
    return _complete_unless_async(gather_p2p(output, input, group, dst), async_op)


def _complete_unless_async(work: P2PWork, async_op: bool) -> Optional[Any]:
    if async_op:
        return work
    work.wait()
    return None


def all_reduce_sum(tensor: torch.Tensor, group: Optional[dist.ProcessGroup]) -> None:
    """Sum-reduces ``tensor`` in place across ranks."""
    dist.all_reduce(tensor, group=group)


def all_reduce_max(tensor: torch.Tensor, group: Optional[dist.ProcessGroup]) -> None:
    """Max-reduces ``tensor`` in place across ranks."""
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)


def broadcast_from_rank0(tensor: torch.Tensor, group: Optional[dist.ProcessGroup]) -> None:
    """Overwrites ``tensor`` with the value of group-rank 0."""
    dist.broadcast(tensor, group=group, group_src=0)


def all_gather_object(obj: Any, group: Optional[dist.ProcessGroup]) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order."""
    out: list[Any] = [None] * group_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object_from_rank0(obj: Any, group: Optional[dist.ProcessGroup]) -> Any:
    """Group-rank 0's picklable ``obj`` on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]
