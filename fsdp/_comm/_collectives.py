"""Every collective ``fsdp`` issues goes through this file.

One place to count, trace, or swap communication, and one path for every backend and world
size: the handle and the hooks say "all-gather this shard", "reduce-scatter this gradient",
and these functions call ``torch.distributed``'s collective for it (FSDP2's
``_fsdp_collectives.py`` is the model). Functions look ``torch.distributed`` up at call time,
so tests that patch ``torch.distributed.<collective>`` see every call.

A collective that fails or times out, here or in the ``wait()`` of the work it returned, raises
the same exception type again with the unit, the phase, the collective and the group's ranks
([Note: Collective errors] in ``_errors.py``). Each one is also counted per group and marked
while a thread is inside it, for the watcher that reports blocked collectives ([Note: Blocked
collectives] in ``_watch.py``). Both are one ``with _Watched(...)`` around every launch and
every wait; on the hot path that costs one small object, a dict update and a pop.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any, Optional, TypeVar

import torch
import torch.distributed as dist

from fsdp._common import group_rank, group_size, p_assert
from fsdp._comm import _watch
from fsdp._comm._errors import raise_collective_error

T = TypeVar("T")


class _Watched:
    """``with _Watched(collective, group[, number]):`` around a collective's launch or its
    work's ``wait()``: marks this thread as inside it for the watcher ([Note: Blocked
    collectives] in ``_watch.py``) and re-raises a ``RuntimeError`` it raises with FSDP's
    context ([Note: Collective errors] in ``_errors.py``), then unmarks the thread.

    ``number`` is the collective's number among the FSDP collectives issued on ``group``: given
    where the caller needs it again (an asynchronous launch hands it to its work's ``wait()``),
    else counted here. A plain class, not a generator: one small object per collective.
    """

    __slots__ = ("_collective", "_group", "_number", "_mark")

    def __init__(self, collective: str, group: Optional[dist.ProcessGroup], number: Optional[int] = None) -> None:
        self._collective = collective
        self._group = group
        self._number = _watch.issue(group) if number is None else number

    def __enter__(self) -> None:
        self._mark = _watch.begin(self._group, self._number, self._collective)

    def __exit__(self, exc_type: object, exc: Optional[BaseException], tb: object) -> None:
        try:
            if isinstance(exc, RuntimeError):
                raise_collective_error(exc, self._collective, self._group)
        finally:
            _watch.end(self._mark)


def all_gather_flat(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Optional[dist.ProcessGroup],
    async_op: bool = False,
) -> Optional[CheckedWork]:
    """All-gathers equal-sized 1-D ``input`` shards into ``output`` (rank order).

    With ``async_op`` it returns the work handle to wait on before ``output`` is read.
    """
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    number = _watch.issue(group)
    with _Watched("all-gather", group, number):
        work = fn(output, input, group=group, async_op=async_op)
    return _checked(work, "all-gather", group, number)


def reduce_scatter_flat(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Optional[dist.ProcessGroup],
    async_op: bool = False,
) -> Optional[CheckedWork]:
    """Sum-reduces ``input`` across ranks and leaves chunk ``rank`` of the result in ``output``.

    Example with world size 2: rank 0 passes ``[1, 2, 3, 4]`` and rank 1 ``[5, 6, 7, 8]``;
    rank 0 receives ``[6, 8]`` and rank 1 ``[10, 12]``. With ``async_op`` it returns the
    work handle to wait on.
    """
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    number = _watch.issue(group)
    with _Watched("reduce-scatter", group, number):
        work = fn(output, input, group=group, async_op=async_op)
    return _checked(work, "reduce-scatter", group, number)


def gather_flat_to(
    output: Optional[torch.Tensor],
    input: torch.Tensor,
    group: Optional[dist.ProcessGroup],
    dst: int,
    async_op: bool = False,
) -> Optional[CheckedWork]:
    """Gathers equal-sized 1-D ``input`` shards into ``output`` on group rank ``dst`` only.

    One collective ([Note: Gather to one rank]): every rank sends its shard from where it lives,
    the other ranks pass ``output=None`` (no allocation), and ``dst`` receives each shard straight
    into its chunk of ``output``. With ``async_op`` it returns the work.
    """
    world_size, rank = group_size(group), group_rank(group)
    numel = input.numel()
    if rank == dst:
        p_assert(output is not None, "the receiving rank of a gather needs an output tensor")
    received = output if rank == dst and output is not None else input.new_empty(0)
    output_splits = [numel if rank == dst else 0] * world_size
    input_splits = [numel if peer == dst else 0 for peer in range(world_size)]
    number = _watch.issue(group)
    with _Watched("gather", group, number):
        work = dist.all_to_all_single(received, input, output_splits, input_splits, group=group, async_op=async_op)
    return _checked(work, "gather", group, number)


# [Note: Gather to one rank]
# ``gather_flat_to`` is an all-to-all in which every rank sends its shard to ``dst`` and nothing
# to anyone else (``dist.all_to_all_single`` with split sizes), not ``dist.gather``: the same
# bytes, moved once, in one collective of the group, but received in place. gloo's ``gather``
# receives into a temporary flat tensor of the full size that it allocates on every call and then
# copies into the output chunks; its all-to-all receives straight into ``output``. Measured on
# the 2-rank CPU benchmark (7 units of up to 12.6 MB, both forms in the same processes, turn
# about): rank 0 spends 42-48 ms of CPU on a rank0_only model state dict with ``gather``, 28-32
# ms with the all-to-all (31-38 ms with the per-peer receives of before): about 2 ms a unit for
# the temporary and its copy, which took the save from 0.29x to 0.55x torch FSDP1's time. On NCCL
# both are the same grouped ``ncclSend``/``ncclRecv`` inside the group's own communicator (a
# zero split sends nothing); per-peer ``isend``/``irecv`` would build one communicator per pair.
# gloo does exchange the empty messages (N - 1 per rank and unit at world size N, a few bytes
# each), a small price next to a staging copy of every unit.


class CheckedWork:
    """A ``torch.distributed`` work whose ``wait()`` failure carries FSDP's context.

    Only asynchronous collectives return one.
    """

    __slots__ = ("_work", "_collective", "_group", "_number")

    def __init__(
        self,
        work: dist.Work,
        collective: str,
        group: Optional[dist.ProcessGroup],
        number: int,
    ) -> None:
        self._work = work
        self._collective = collective
        self._group = group
        self._number = number  # its number among the FSDP collectives issued on the group

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        """``dist.Work.wait``: blocks until the collective is done (or ``timeout``)."""
        with _Watched(self._collective, self._group, self._number):
            return self._work.wait() if timeout is None else self._work.wait(timeout)

    # Any: forwards whatever else dist.Work has (is_completed, get_future, ...), typed by torch.
    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _checked(
    work: Optional[dist.Work], collective: str, group: Optional[dist.ProcessGroup], number: int
) -> Optional[CheckedWork]:
    """``work`` (None for a completed synchronous call) with a checked ``wait()``."""
    return None if work is None else CheckedWork(work, collective, group, number)


def all_reduce_sum(tensor: torch.Tensor, group: Optional[dist.ProcessGroup]) -> None:
    """Sum-reduces ``tensor`` in place across ranks."""
    with _Watched("all-reduce", group):
        dist.all_reduce(tensor, group=group)


def all_reduce_max(tensor: torch.Tensor, group: Optional[dist.ProcessGroup]) -> None:
    """Max-reduces ``tensor`` in place across ranks."""
    with _Watched("all-reduce (max)", group):
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)


def broadcast_from_rank0(tensor: torch.Tensor, group: Optional[dist.ProcessGroup]) -> None:
    """Overwrites ``tensor`` with the value of group-rank 0."""
    with _Watched("broadcast", group):
        dist.broadcast(tensor, group=group, group_src=0)


def all_gather_tensors(tensor: torch.Tensor, group: Optional[dist.ProcessGroup]) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (same shape and dtype everywhere), in rank order."""
    out = [torch.empty_like(tensor) for _ in range(group_size(group))]
    with _Watched("all-gather", group):
        dist.all_gather(out, tensor, group=group)
    return out


def all_gather_object(obj: T, group: Optional[dist.ProcessGroup], device: torch.device) -> list[T]:
    """Every rank's picklable ``obj``, in rank order, staged on the unit's compute ``device``
    where the group stages objects on CUDA ([Note: Object collectives' device])."""
    out = [obj] * group_size(group)  # placeholders, every entry overwritten
    with _Watched("all-gather (objects)", group), _object_device(device):
        dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object_from_rank0(obj: T, group: Optional[dist.ProcessGroup], device: torch.device) -> T:
    """Group-rank 0's picklable ``obj`` on every rank (staged as :func:`all_gather_object`)."""
    box = [obj]
    with _Watched("broadcast (objects)", group), _object_device(device):
        dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]


# [Note: Object collectives' device]
# torch's object collectives pickle into a byte tensor on the device type the group stages
# objects on ("cuda" for NCCL, "cpu" for gloo), and "cuda" means torch.cuda.current_device().
# A user who passes device_id and never calls torch.cuda.set_device (as the README shows) trains,
# since every other collective uses tensors on the unit's device, and then the first checkpoint
# (or order check) would stage on cuda:0: a second NCCL communicator on the wrong GPU, or a hang.
# Making the unit's compute device current for the call fixes the device and keeps torch's own
# choice of staging device type (gloo with CUDA tensors still stages on the host).
def _object_device(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """``torch.cuda.device(device)`` for a CUDA ``device``, else nothing."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
