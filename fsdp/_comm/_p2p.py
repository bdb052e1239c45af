"""All-gather and reduce-scatter from ``torch.distributed`` point-to-point ops, for gloo.

[Note: Point-to-point collectives on gloo]
On CPU ranks gloo's ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` are slow for
FSDP's message sizes: measured on the 2-core benchmark machine with a 12.6 MB unit at world
size 2, the all-gather takes 13.8 ms and the reduce-scatter 20 ms (more than a whole
all-reduce, 17 ms), while the same exchange written as ``isend``/``irecv`` pairs takes 6.3 ms
and 8.3 ms. The point-to-point form moves exactly the strategy's minimum (each rank sends its
shard, resp. each other rank's chunk, once), receives straight into place (no staging copy),
and runs asynchronously like any other collective. It is built from ``torch.distributed``'s
own ``isend``/``irecv`` over the same process group: no other transport.

Numerics: an all-gather only moves bytes, so it is exact at every world size. A reduce-scatter
adds, and at world size 2 the single addition ``a + b`` is the same whatever the order, so the
result is bit-identical to gloo's (and to torch FSDP1's). Beyond two ranks gloo's summation
order depends on its internal segmentation; to keep results bit-identical to torch, larger
groups use gloo's reduce-scatter.

Matching: each kind uses its own tag, and every rank issues its collectives in the same
program order, so the k-th message from rank a to rank b of a kind always pairs with the k-th
receive b posts for it, even with several collectives in flight.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from fsdp._common import group_backend, group_rank, group_size
from fsdp._comm._errors import raise_collective_error


def _global_rank(group: Optional[dist.ProcessGroup], peer: int) -> int:
    """``peer``'s global rank for error messages (its group rank when c10d does not know the group)."""
    if group is None:
        return peer
    try:
        return dist.get_global_rank(group, peer)
    except (ValueError, RuntimeError, KeyError):
        return peer

__all__ = [
    "P2PWork",
    "all_gather_p2p",
    "gather_p2p",
    "reduce_scatter_halves_p2p",
    "reduce_scatter_p2p",
    "uses_p2p",
]

_ALL_GATHER_TAG = 7301
_REDUCE_SCATTER_TAG = 7302
_GATHER_TAG = 7310


def uses_p2p(tensor: torch.Tensor, group: Optional[dist.ProcessGroup]) -> bool:
    """Whether collectives on ``tensor`` over ``group`` take the point-to-point form (gloo, CPU)."""
    return tensor.device.type == "cpu" and group_backend(group) == "gloo"


class P2PWork:
    """A work handle over point-to-point requests; ``finish`` runs once they all completed.

    A request that fails or times out raises from :meth:`wait` with FSDP's context and the
    peer it waited for ([Note: Collective errors] in ``_comm_errors.py``).

    Args:
        requests: The ``isend``/``irecv`` works.
        peers: The global rank each request exchanges with.
        collective: What the requests make up, for error messages ("all-gather", ...).
        group: Their process group.
        finish: Runs after the last request completed.
    """

    def __init__(
        self,
        requests: list[Any],
        peers: list[int],
        collective: str,
        group: Optional[dist.ProcessGroup],
        finish: Optional[Callable[[], None]] = None,
    ) -> None:
        self._requests = requests
        self._peers = peers
        self._collective = collective
        self._group = group
        self._finish = finish

    def wait(self) -> bool:
        for request, peer in zip(self._requests, self._peers):
            try:
                request.wait()
            except RuntimeError as err:
                self._requests, self._peers, self._finish = [], [], None
                raise_collective_error(err, self._collective, self._group, peer)
        self._requests = []
        self._peers = []
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return True


def all_gather_p2p(
    output: torch.Tensor, input: torch.Tensor, group: Optional[dist.ProcessGroup]
) -> P2PWork:
    """Launches an all-gather of equal 1-D shards into ``output``; returns its work handle."""
    world_size, rank = group_size(group), group_rank(group)
    numel = input.numel()
    requests: list[Any] = []
    peers: list[int] = []
    # This rank's own shard first, before the receive is posted: the output is usually fresh
    # memory (the unsharded storage was just allocated again), and first touches of one mapping
    # from this thread and from gloo's receiving thread at once contend in the kernel. Measured
    # on the benchmark (6 layers, 2 ranks, profiler, 2 runs each): the own-shard copies took
    # 74-90 ms per step of the training thread when made after posting, 53-56 ms before.
    output[rank * numel : (rank + 1) * numel].copy_(input)
    try:
        for peer in range(world_size):
            if peer == rank:
                continue
            peers += [_global_rank(group, peer)] * 2
            requests.append(dist.isend(input, group=group, tag=_ALL_GATHER_TAG, group_dst=peer))
            requests.append(
                dist.irecv(output[peer * numel : (peer + 1) * numel], group=group, tag=_ALL_GATHER_TAG, group_src=peer)
            )
    except RuntimeError as err:
        raise_collective_error(err, "all-gather", group, peers[len(requests)] if len(requests) < len(peers) else None)
    return P2PWork(requests, peers, "all-gather", group)


def reduce_scatter_p2p(
    output: torch.Tensor, input: torch.Tensor, group: Optional[dist.ProcessGroup]
) -> P2PWork:
    """Launches a two-rank sum reduce-scatter of ``input`` into ``output``; returns its handle.

    Each rank sends the other its chunk of ``input``, receives the other's contribution to its
    own chunk straight into ``output`` and adds its own chunk in place when the handle is waited
    for (``b + a == a + b`` exactly, so this equals gloo's sum).
    """
    world_size, rank = group_size(group), group_rank(group)
    assert world_size == 2, "point-to-point reduce-scatter is bit-identical to gloo's only for 2 ranks"
    numel = output.numel()
    peer = 1 - rank
    peer_global = _global_rank(group, peer)
    try:
        requests = [
            dist.isend(input[peer * numel : (peer + 1) * numel], group=group, tag=_REDUCE_SCATTER_TAG, group_dst=peer),
            dist.irecv(output, group=group, tag=_REDUCE_SCATTER_TAG, group_src=peer),
        ]
    except RuntimeError as err:
        raise_collective_error(err, "reduce-scatter", group, peer_global)
    own = input[rank * numel : (rank + 1) * numel]

    def finish() -> None:
        output.add_(own)

    return P2PWork(requests, [peer_global, peer_global], "reduce-scatter", group, finish)


def gather_p2p(
    output: Optional[torch.Tensor],
    input: torch.Tensor,
    group: Optional[dist.ProcessGroup],
    dst: int,
    finish: Optional[Callable[[], None]] = None,
) -> P2PWork:
    """Launches a gather of equal 1-D shards into ``output`` on group rank ``dst`` only.

    The other ranks send their shard from where it lives (``output`` is None there: no copy, no
    allocation); ``dst`` receives every other shard in place and copies its own in. ``finish``
    runs on ``dst`` once every shard has arrived.
    """
    if input.device.type != "cpu" and group_backend(group) == "gloo":
        return _gather_staged_on_host(output, input, group, dst)
    rank, world_size = group_rank(group), group_size(group)
    if rank != dst:
        dst_global = _global_rank(group, dst)
        try:
            request = dist.isend(input, group=group, tag=_GATHER_TAG, group_dst=dst)
        except RuntimeError as err:
            raise_collective_error(err, "gather", group, dst_global)
        return P2PWork([request], [dst_global], "gather", group)
    assert output is not None, "the receiving rank of a gather needs an output tensor"
    numel = input.numel()
    sources = [src for src in range(world_size) if src != dst]
    peers = [_global_rank(group, src) for src in sources]
    requests: list[Any] = []
    output[dst * numel : (dst + 1) * numel].copy_(input)  # before the receives (see all_gather_p2p)
    try:
        for src in sources:
            requests.append(
                dist.irecv(output[src * numel : (src + 1) * numel], group=group, tag=_GATHER_TAG, group_src=src)
            )
    except RuntimeError as err:
        raise_collective_error(err, "gather", group, peers[len(requests)])
    return P2PWork(requests, peers, "gather", group, finish)


def _gather_staged_on_host(
    output: Optional[torch.Tensor], input: torch.Tensor, group: Optional[dist.ProcessGroup], dst: int
) -> P2PWork:
    """:func:`gather_p2p` for GPU tensors over gloo, whose send/recv take host memory only (a
    CUDA tensor aborts the process in gloo's TCP transport): the shard goes through a host copy
    and ``dst`` copies the gathered host tensor into ``output`` when the work is waited for."""
    if output is None:
        return gather_p2p(None, input.cpu(), group, dst)
    host_output = torch.empty(output.shape, dtype=output.dtype)

    def copy_to_device() -> None:
        output.copy_(host_output)

    return gather_p2p(host_output, input.cpu(), group, dst, finish=copy_to_device)


def reduce_scatter_halves_p2p(
    output: torch.Tensor,
    peer_half: torch.Tensor,
    own_parts: list[tuple[int, torch.Tensor]],
    own_scale: float,
    group: Optional[dist.ProcessGroup],
) -> P2PWork:
    """A two-rank reduce-scatter whose input is already split by destination.

    ``peer_half`` is this rank's (already scaled) contribution to the other rank's chunk;
    ``own_parts`` are ``(offset in output, values)`` pieces of its contribution to its own
    chunk, added as ``output[offset:] += own_scale * values`` once the other rank's
    contribution has arrived in ``output``. With ``own_scale`` a power of two (FSDP's
    pre-divide factors are), ``b + s * a`` rounds once, exactly like ``b + (a * s)``.
    """
    world_size, rank = group_size(group), group_rank(group)
    assert world_size == 2, "point-to-point reduce-scatter is bit-identical to gloo's only for 2 ranks"
    peer_global = _global_rank(group, 1 - rank)
    try:
        requests = [
            dist.irecv(output, group=group, tag=_REDUCE_SCATTER_TAG, group_src=1 - rank),
            dist.isend(peer_half, group=group, tag=_REDUCE_SCATTER_TAG, group_dst=1 - rank),
        ]
    except RuntimeError as err:
        raise_collective_error(err, "reduce-scatter", group, peer_global)

    def finish() -> None:
        for offset, values in own_parts:
            output[offset : offset + values.numel()].add_(values, alpha=own_scale)

    return P2PWork(requests, [peer_global, peer_global], "reduce-scatter", group, finish)
