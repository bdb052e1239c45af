"""The benchmark's memory measure counts frees made on any thread ([Note: Frees on other threads])."""

from __future__ import annotations

import threading

import torch

from benchmarks.memory import MemoryTrace, all_thread_accounting_available

MiB = 1 << 20


def _free_on_other_thread(holder: list[torch.Tensor]) -> None:
    thread = threading.Thread(target=holder.clear)
    thread.start()
    thread.join()


def test_free_on_another_thread_is_counted() -> None:
    # The torch build the project pins (2.13.0) has the allocator flag the measure relies on.
    assert all_thread_accounting_available()
    holder: list[torch.Tensor] = []
    with MemoryTrace() as trace:
        with trace.window("a"):
            holder.append(torch.empty(4 * MiB, dtype=torch.uint8))
            _free_on_other_thread(holder)  # a gloo worker dropping a work's tensors does this
        with trace.window("b"):
            small = torch.empty(MiB, dtype=torch.uint8)
            del small
    assert trace.all_threads
    assert trace.peaks["a"] == 4 * MiB
    # Window b starts with nothing alive: the 4 MiB block was freed, although not on the main thread.
    assert trace.starts["b"] == 0
    assert trace.peaks["b"] == MiB
    assert trace.final == 0


def test_blocks_from_before_the_trace_do_not_count() -> None:
    before = torch.empty(8 * MiB, dtype=torch.uint8)
    with MemoryTrace() as trace:
        with trace.window("w"):
            x = torch.empty(2 * MiB, dtype=torch.uint8)
            del before  # allocated before the trace: its free is not part of the measure
            y = torch.empty(MiB, dtype=torch.uint8)
            del x, y
    assert trace.peaks["w"] == 3 * MiB
    assert trace.final == 0


def test_main_thread_only_fallback_misses_the_other_thread_free(monkeypatch) -> None:
    # Where the flag is unavailable the trace says so; its timeline then overstates (documented).
    monkeypatch.setattr("benchmarks.memory._report_flag", lambda: None)
    holder: list[torch.Tensor] = []
    with MemoryTrace() as trace:
        with trace.window("a"):
            holder.append(torch.empty(4 * MiB, dtype=torch.uint8))
            _free_on_other_thread(holder)
    assert not trace.all_threads
    assert trace.final == 4 * MiB
