"""The local-rank runner shared by ``python -m benchmarks`` and ``python -m benchmarks.validate_plan`` (``benchmarks/local_ranks.py``).

Its ranks are plain spawned processes, not the test harness's pools: the runner itself is under
test, its start, its deadline and its clean-up. The targets do no torch work, so each run costs
only the spawned interpreters' start.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
import time
from typing import Any

import pytest

from benchmarks.local_ranks import run_local_ranks, write_rank_result


def _echo(rank: int, payload: dict[str, Any], workdir: str) -> None:
    """Writes what it was given, so the test sees rank order and the payload; then leaves a
    non-daemon thread that would hold a finalizing interpreter for an hour: the rank must still
    exit at once ([Note: Rank exit without interpreter finalization])."""
    write_rank_result(workdir, rank, {"rank": rank, "payload": payload, "pid": os.getpid()})
    threading.Thread(target=time.sleep, args=(3600,), name="never-joined", daemon=False).start()


def _one_rank_fails(rank: int, payload: dict[str, Any], workdir: str) -> None:
    """Rank 1 exits with code 3; rank 0 would wait for it forever (as in a collective)."""
    if rank == 1:
        sys.exit(3)
    time.sleep(3600)


def _sleeps(rank: int, payload: dict[str, Any], workdir: str) -> None:
    time.sleep(3600)


def _writes_nothing(rank: int, payload: dict[str, Any], workdir: str) -> None:
    if rank == 0:
        write_rank_result(workdir, rank, {})


def _raises(rank: int, payload: dict[str, Any], workdir: str) -> None:
    if rank == 1:
        raise ValueError("rank 1 found a bad batch")
    write_rank_result(workdir, rank, {})


def _children() -> list[str]:
    """Child processes left running, other than the test harness's shared rank pools (which
    live for the whole session when other test files ran first)."""
    return [p.name for p in multiprocessing.active_children() if not p.name.startswith("rankpool-")]


def test_results_in_rank_order_and_ranks_exit_without_finalizing() -> None:
    payload = {"layers": 2, "only": ["fsdp", "ddp"]}
    start = time.monotonic()
    results = run_local_ranks(_echo, payload, 3, 300.0, prog="test.local_ranks")
    # A normal exit would have joined each rank's hour-long thread.
    assert time.monotonic() - start < 300.0
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert all(r["payload"] == payload for r in results)  # JSON round trip of the payload
    assert len({r["pid"] for r in results}) == 3  # one process per rank
    assert _children() == []


def test_failed_rank_ends_the_run_and_terminates_the_others() -> None:
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"^test\.local_ranks: rank 1 exited with code 3$"):
        run_local_ranks(_one_rank_fails, {}, 2, 300.0, prog="test.local_ranks")
    # Rank 0 sleeps for an hour: the run ended because rank 1 failed, long before the deadline.
    assert time.monotonic() - start < 300.0
    assert _children() == []


def test_deadline_terminates_every_rank() -> None:
    with pytest.raises(RuntimeError, match=r"^test\.local_ranks: timed out after 2 s$"):
        run_local_ranks(_sleeps, {}, 2, 2.0, prog="test.local_ranks")
    assert _children() == []


def test_rank_without_result_is_named() -> None:
    with pytest.raises(RuntimeError, match=r"rank 1 exited with code 0 without writing .*rank1\.json"):
        run_local_ranks(_writes_nothing, {}, 2, 300.0, prog="test.local_ranks")


def test_raising_rank_prints_its_traceback_and_exits_with_1(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(RuntimeError, match=r"^test\.local_ranks: rank 1 exited with code 1$"):
        run_local_ranks(_raises, {}, 2, 300.0, prog="test.local_ranks")
    err = capfd.readouterr().err
    assert "Traceback (most recent call last)" in err
    assert "ValueError: rank 1 found a bad batch" in err
    assert _children() == []
