"""Peak live CPU tensor bytes, from the allocator events of ``torch.profiler``.

The CPU build of torch keeps no allocator statistics (there is no ``torch.cpu.memory_stats``),
and the obvious substitutes miss exactly what FSDP does: a ``TorchDispatchMode`` never sees
``UntypedStorage.resize_`` (how FSDP allocates and frees unsharded flat parameters), and RSS
mostly measures glibc's caching. With ``profile_memory=True``, however, torch's default CPU
allocator reports every allocation and every free of a block it saw allocated during profiling
as a ``[memory]`` event with its size, whatever allocated it (tensor ops, storage resizes, the
autograd engine, collectives). :class:`MemoryTrace` runs the profiler around a phase and turns
those events into a running total of live bytes allocated since the trace started; marked
windows (:meth:`MemoryTrace.window`) report their peak of that total.

Everything the measured implementation owns (model, wrapper, optimizer, data) must be created
and released inside the trace: a block allocated before the trace started produces no event
when it is freed.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from torch.profiler import ProfilerActivity, profile, record_function

_PREFIX = "fsdp_bench_window:"

__all__ = ["MemoryTrace"]


class MemoryTrace:
    """Context manager: live-bytes timeline of everything allocated inside it, with marked windows."""

    def __init__(self) -> None:
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False)
        self._windows: list[str] = []
        self.final = 0
        self.overall_peak = 0
        self.peaks: dict[str, int] = {}
        self.starts: dict[str, int] = {}

    def __enter__(self) -> "MemoryTrace":
        self._prof.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._prof.__exit__(*exc)
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

    def _analyse(self) -> None:
        events = self._prof.profiler.kineto_results.events()  # type: ignore[union-attr]
        memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")  # type: ignore[union-attr]
        marks = {e.name()[len(_PREFIX):]: (e.start_ns(), e.end_ns()) for e in events if e.name().startswith(_PREFIX)}
        live = 0
        timeline: list[tuple[int, int]] = []
        for ts, nbytes in memory:
            live += nbytes
            timeline.append((ts, live))
        self.final = live
        self.overall_peak = max((v for _, v in timeline), default=0)
        for name in self._windows:
            if name not in marks:
                continue
            begin, end = marks[name]
            at_start = 0
            peak = None
            for ts, value in timeline:
                if ts < begin:
                    at_start = value
                elif ts <= end:
                    peak = value if peak is None else max(peak, value)
                else:
                    break
            self.starts[name] = at_start
            self.peaks[name] = max(at_start, peak if peak is not None else at_start)
