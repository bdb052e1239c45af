"""Counting collectives by patching ``torch.distributed`` (the approach of tests/_comm_count.py).

Every implementation issues its collectives through the ``torch.distributed`` module functions
(fsdp and torch FSDP1/FSDP2 directly; DDP through the default ``allreduce_hook`` comm hook that
the benchmark registers, since DDP's built-in reducer calls the process group from C++), so
replacing those functions for one step counts the calls and the bytes of each kind. The bytes
counted are those of the output (or in-place) tensor: the full gathered tensor of an
all-gather, the shard of a reduce-scatter, the whole buffer of an all-reduce.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from typing import Any, Iterator

import torch.distributed as dist

__all__ = ["CommCounts", "count_collectives", "OBJECT_FUNCS", "count_object_messages"]

_KINDS = {
    "all_gather_single": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "_all_gather_base": "all_gather",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter": "reduce_scatter",  # list form
    "all_reduce": "all_reduce",
    "broadcast": "broadcast",
    "all_gather": "all_gather",  # list form (torch FSDP1 uses it on gloo)
    "all_gather_object": "all_gather_object",
}


class CommCounts:
    """Number of calls, bytes moved (size of the output/in-place tensor) and the dtypes that
    travelled, per collective kind."""

    def __init__(self) -> None:
        self.calls: collections.Counter[str] = collections.Counter()
        self.bytes: collections.Counter[str] = collections.Counter()
        self.dtypes: collections.defaultdict[str, set[Any]] = collections.defaultdict(set)

    def total_bytes(self) -> int:
        """Bytes of every collective kind together."""
        return int(sum(self.bytes.values()))


def _counting(original: Any, kind: str, counts: CommCounts, depth: threading.local) -> Any:
    """``original``, counting its outermost calls (nested collectives are not counted again)."""

    def patched(*args: Any, **kwargs: Any) -> Any:
        level = getattr(depth, "level", 0)
        if level == 0:
            counts.calls[kind] += 1
            first = args[0] if args else next(iter(kwargs.values()))
            tensors = first if isinstance(first, (list, tuple)) else [first]
            counts.bytes[kind] += sum(t.numel() * t.element_size() for t in tensors if hasattr(t, "numel"))
            counts.dtypes[kind].update(t.dtype for t in tensors if hasattr(t, "dtype"))
        depth.level = level + 1
        try:
            return original(*args, **kwargs)
        finally:
            depth.level = level

    return patched


@contextlib.contextmanager
def count_collectives() -> Iterator[CommCounts]:
    """Counts the outermost collective calls made inside the context (aliases not double counted)."""
    counts = CommCounts()
    depth = threading.local()
    originals: dict[str, Any] = {}
    for name, kind in _KINDS.items():
        if not hasattr(dist, name):
            continue
        original = getattr(dist, name)
        originals[name] = original

        setattr(dist, name, _counting(original, kind, counts, depth))
    # fsdp's own flat collectives may run as point-to-point exchanges on gloo: count them as
    # the collectives they are (the torch.distributed calls inside are then not counted).
    from fsdp._comm import _collectives as fsdp_comm

    fsdp_originals: dict[str, Any] = {}
    for name, kind in (
        ("all_gather_flat", "all_gather"),
        ("reduce_scatter_flat", "reduce_scatter"),
    ):
        original = getattr(fsdp_comm, name)
        fsdp_originals[name] = original
        setattr(fsdp_comm, name, _counting(original, kind, counts, depth))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
        for name, original in fsdp_originals.items():
            setattr(fsdp_comm, name, original)


# The object collectives and messages of ``torch.distributed`` (pickled Python objects: DCP's
# planning, fsdp's checkpoint reports), counted by name.
OBJECT_FUNCS = (
    "gather_object",
    "scatter_object_list",
    "all_gather_object",
    "broadcast_object_list",
    "send_object_list",
    "recv_object_list",
)


@contextlib.contextmanager
def count_object_messages() -> Iterator[dict[str, int]]:
    """Counts the calls of each of :data:`OBJECT_FUNCS` in the block (every name, 0 if not
    called), by patching ``torch.distributed``."""
    counts = {name: 0 for name in OBJECT_FUNCS}
    originals = {name: getattr(dist, name) for name in OBJECT_FUNCS}

    def counting(name: str) -> Any:
        def patched(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return originals[name](*args, **kwargs)

        return patched

    for name in OBJECT_FUNCS:
        setattr(dist, name, counting(name))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
