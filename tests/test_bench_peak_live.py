"""benchmarks/peak_live.py rebuilds the live set at a peak from the allocator's events
([Note: Reading the live set from main-thread events]): main-thread blocks by address, a block
another thread frees matched by its size, what another thread allocated as the remainder."""

from __future__ import annotations

import threading
from typing import Callable

import torch

from benchmarks.memory import MemoryTrace
from benchmarks.peak_live import live_set_of_window

MiB = 1 << 20


def _on_other_thread(fn: Callable[[], object]) -> None:
    thread = threading.Thread(target=fn)
    thread.start()
    thread.join()


def _event() -> None:
    """A main-thread allocator event: the other thread's changes so far are seen apart."""
    torch.empty(16)


def test_live_set_at_peak() -> None:
    freed_elsewhere: list[torch.Tensor] = []
    made_elsewhere: list[torch.Tensor] = []
    with MemoryTrace(keep_trace=True) as trace:
        with trace.window("w"):
            kept = torch.empty(3 * MiB, dtype=torch.uint8)
            freed_elsewhere.append(torch.empty(2 * MiB, dtype=torch.uint8))
            _on_other_thread(freed_elsewhere.clear)  # a gloo worker dropping a work's input
            _event()
            _on_other_thread(lambda: made_elsewhere.append(torch.empty(MiB, dtype=torch.uint8)))
            _event()
            peak = torch.empty(5 * MiB, dtype=torch.uint8)
            del peak
        del kept
        made_elsewhere.clear()
    live = live_set_of_window(trace, "w")
    # 3 + 1 + 5 MiB: the 2 MiB block is gone although the main thread never freed it.
    assert live.peak == trace.peaks["w"] == 9 * MiB
    assert sorted(b.nbytes for b in live.blocks) == [3 * MiB, 5 * MiB]
    assert all(b.op == "aten::empty" and b.freed_by == "main" for b in live.blocks)
    assert live.off_thread == MiB  # allocated by the other thread, alive at the peak
    assert live.matched_off_thread == 1 and live.matched_reuse == 0
    assert live.peak_event.startswith(f"+{5 * MiB:,} bytes aten::empty")
