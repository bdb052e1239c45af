"""Peak live CPU tensor bytes of a process, all threads, from torch's CPU allocator reports.

The CPU build of torch keeps no allocator statistics (there is no ``torch.cpu.memory_stats``),
and the obvious substitutes miss exactly what FSDP does: a ``TorchDispatchMode`` never sees
``UntypedStorage.resize_`` (how FSDP allocates and frees unsharded flat parameters), and RSS
mostly measures glibc's caching. With ``profile_memory=True``, torch's default CPU allocator
reports allocations and frees to the profiler as ``[memory]`` events, whatever allocated them
(tensor ops, storage resizes, the autograd engine, collectives).

[Note: Frees on other threads]
The profiler's memory reporting is per thread: c10's CPU allocator reports (and tracks the size
of) a block only on a thread that is being profiled, i.e. the rank's main thread. A block the
main thread allocated and a gloo worker thread frees (the last reference to a tensor dropped by
an asynchronous collective's work object, which is how torch FSDP1 releases some of its
unsharded buffers on gloo) produces no free event at all. Summing the events' sizes then shows
such blocks as alive forever: live bytes drift upward from step to step, in unit-sized steps,
and the drift depends on thread timing. That is what made torch FSDP1's peak look like 225-286
MiB (and growing with the number of steps) in this benchmark until this note was written; with
every thread's frees counted it is 189-195 MiB.

c10's flag ``caffe2_report_cpu_memory_usage`` makes the allocator track every block's size and
a process-wide live total on every thread; each ``[memory]`` event then carries that total as
``Total Allocated``. :class:`MemoryTrace` sets the flag (through ``ctypes``; it is a plain
global of ``libc10``) for the duration of the trace, reads ``Total Allocated`` from the trace's
events, and measures everything relative to the total just before the first event of the trace,
so blocks left from earlier phases do not count. Allocations made on other threads are in the
total from the moment they happen; the timeline only has a point at each main-thread event, so a
short-lived block allocated and freed by another thread between two such events is missed (a
gloo-internal buffer would be; FSDP's own buffers are all allocated on the main thread). Where the
flag cannot be found (a torch build without it), the trace falls back to summing the
main thread's events and says so (:attr:`MemoryTrace.all_threads` is False).

Everything the measured implementation owns (model, wrapper, optimizer, data) must be created
and released inside the trace: a block allocated before the trace started is not counted.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import tempfile
from typing import Any, Iterator, Optional

import torch
from torch.profiler import ProfilerActivity, profile, record_function

_PREFIX = "fsdp_bench_window:"
_FLAG = "FLAGS_caffe2_report_cpu_memory_usage"

__all__ = ["MemoryTrace", "all_thread_accounting_available"]


def _report_flag() -> Optional[ctypes.c_bool]:
    """c10's ``caffe2_report_cpu_memory_usage`` flag, or None where this torch build lacks it."""
    library = os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so")
    try:
        return ctypes.c_bool.in_dll(ctypes.CDLL(library), _FLAG)
    except (OSError, ValueError):
        return None


def all_thread_accounting_available() -> bool:
    """Whether traces count frees made on every thread (see [Note: Frees on other threads])."""
    return _report_flag() is not None


class MemoryTrace:
    """Context manager: live-bytes timeline of everything allocated inside it, with marked windows."""

    def __init__(self, keep_trace: bool = False) -> None:
        """``keep_trace``: keep the exported trace's events in :attr:`trace_events` (with Python
        stacks, for ``benchmarks/peak_live.py``); the peaks are measured the same way."""
        self._prof = profile(
            activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False, with_stack=keep_trace
        )
        self._keep_trace = keep_trace
        self.trace_events: list[dict[str, Any]] = []
        self._flag = _report_flag()
        self._flag_before = False
        self.all_threads = self._flag is not None
        self._windows: list[str] = []
        self.final = 0
        self.overall_peak = 0
        self.peaks: dict[str, int] = {}
        self.starts: dict[str, int] = {}

    def __enter__(self) -> "MemoryTrace":
        if self._flag is not None:
            self._flag_before = bool(self._flag.value)
            self._flag.value = True
        self._prof.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._prof.__exit__(*exc)
        finally:
            if self._flag is not None:
                self._flag.value = self._flag_before
        if exc[0] is None:
            self._analyse()

    @contextlib.contextmanager
    def window(self, name: str) -> Iterator[None]:
        """Marks a phase whose peak live bytes :attr:`peaks` reports under ``name``.

        The mark is a profiler annotation, so it shares the allocator events' clock.
        """
        self._windows.append(name)
        with record_function(_PREFIX + name):
            yield

    def _events(self) -> tuple[list[tuple[float, int, int]], dict[str, tuple[float, float]]]:
        """(time-ordered ``(time, live bytes after, bytes of the event)``, window -> (begin, end)).

        Read from the exported trace: ``Total Allocated`` is only there, not on the event objects.
        """
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            self._prof.export_chrome_trace(path)
            with open(path) as f:
                trace: list[dict[str, Any]] = json.load(f)["traceEvents"]
        if self._keep_trace:
            self.trace_events = trace
        memory_events = sorted(
            (e["ts"], e["args"]["Total Allocated"], e["args"]["Bytes"]) for e in trace if e.get("name") == "[memory]"
        )
        marks = {
            e["name"][len(_PREFIX):]: (e["ts"], e["ts"] + e.get("dur", 0))
            for e in trace
            if e.get("name", "").startswith(_PREFIX)
        }
        points: list[tuple[float, int, int]] = []
        if self.all_threads and memory_events:
            _, first_total, first_bytes = memory_events[0]
            base = first_total - first_bytes  # the process-wide total just before the first event
            points = [(ts, total - base, nbytes) for ts, total, nbytes in memory_events]
        else:  # main thread only: the running sum of its events
            live = 0
            for ts, _, nbytes in memory_events:
                live += nbytes
                points.append((ts, live, nbytes))
        return points, marks

    def _analyse(self) -> None:
        timeline, marks = self._events()
        self.final = timeline[-1][1] if timeline else 0
        self.overall_peak = max((v for _, v, _ in timeline), default=0)
        for name in self._windows:
            if name not in marks:
                continue
            begin, end = marks[name]
            before = 0  # live bytes after the last event before the window
            inside = [(value, nbytes) for ts, value, nbytes in timeline if begin <= ts <= end]
            for ts, value, _ in timeline:
                if ts >= begin:
                    break
                before = value
            # Live bytes at the window's start: just before its first event, whose total already
            # includes frees other threads made since the previous event; else the last value.
            at_start = inside[0][0] - inside[0][1] if inside else before
            self.starts[name] = at_start
            self.peaks[name] = max([at_start] + [value for value, _ in inside])
