"""The stream layer: every stream operation of the gather and reduce paths goes through here.

On CUDA these are torch's streams and events; on CPU there are none (:func:`new_stream` gives
None and every path runs on the one thread, [Note: On CPU a collective completes where it is
launched] in ``_policy.py``). The gather path (``_storage.py``), the reduce path
(``_reduction.py``) and the runtime (``runtime/_prefetch.py``, ``runtime/_hooks.py``) call these
functions through the module (``_streams.current_stream(...)``), and stream and event objects
only through their methods ``wait_stream``, ``wait_event``, ``synchronize`` and ``record``: so a
test can stand in recording streams on a CPU run and check every edge of the CUDA schedule
(``tests/test_streams.py``), the values staying exact because the collectives complete anyway.

[Note: Stream edges]
Three side streams, made once per tree by the root (torch FSDP1's): the unshard stream (every
all-gather), the post-backward stream (every reduce-scatter, NO_SHARD all-reduce and comm hook,
and the cast to ``reduce_dtype`` before it), the all-reduce stream (the hybrid strategies'
all-reduce across replicas). The edges, each with why it is there:

1. unshard <- compute, once per iteration: in the root's pre-forward and at the first FSDP hook
   of a backward (``order_gathers_after_compute`` in ``runtime/_prefetch.py``); and right after
   fsdp itself writes a local shard on the compute stream (writeback, a recast). A gather reads
   only the local shard, which only the optimizer (between iterations) and those writes change;
   it writes a buffer the allocator hands the unshard stream. So no gather waits for the
   compute work of the units before it: unit k+1's gather runs while unit k computes
   ([Note: One gather path] in ``_storage.py``).
2. compute <- unshard, per gather, on its event, where the unit starts (``wait_unshard``); the
   gathered buffer is ``record_stream``ed on the compute stream, so once freed its block is
   reused by no gather before the compute stream is past its last read.
3. post-backward <- compute, per reduction: the gradient is the compute stream's.
4. all-reduce <- post-backward, per hybrid reduction, on the reduce-scatter's event.
5. compute <- post-backward, on the event after the last read of the reduction's input, at the
   next unit's gradient assembly, and only where the input's memory is given back there
   ([Note: The reduction's input outlives its readers] in ``_reduction.py``); compute <- the
   reduction's last stream, on its completion event, at the end of backward (the root's final
   callback), or where optimizers in backward need the gradient.
6. The host waits (``limit_all_gathers``): before a gather, for the compute stream's event of
   the second-newest free of a gathered buffer ([Note: Prefetch] in ``runtime/_prefetch.py``).
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Optional

import torch

__all__ = ["current_stream", "new_stream", "record_event", "record_stream", "use_stream"]


def new_stream(device: torch.device) -> Optional[Any]:
    """A new side stream on ``device``; None where the device has no streams (CPU)."""
    if device.type != "cuda":
        return None
    return torch.cuda.Stream(device=device)


def current_stream(device: torch.device) -> Any:
    """The stream the calling thread issues work on (the compute stream in the hooks)."""
    return torch.cuda.current_stream(device)


def use_stream(stream: Optional[Any]) -> ContextManager[object]:
    """Issues the block's work on ``stream`` (no wait: the caller orders it); a no-op for None."""
    if stream is None:
        return contextlib.nullcontext()
    return torch.cuda.stream(stream)


def record_event(stream: Any) -> Any:
    """An event recorded on ``stream`` now."""
    event = torch.cuda.Event()
    event.record(stream)
    return event


def record_stream(tensor: torch.Tensor, stream: Any) -> None:
    """Tells the caching allocator that ``stream`` uses ``tensor``: its block is reused only once
    the work ``stream`` has queued when the tensor is freed is done."""
    tensor.record_stream(stream)
