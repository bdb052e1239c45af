"""Tests of the multi-process test harness itself (``tests/_harness.py``).

Rank functions are module-level (the workers import them by name) and start with ``_``.
Tests that deliberately break a pool (failures, hangs, deaths) use the shared pools on purpose:
they also prove that the next job transparently gets a working pool.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests import _harness as harness
from tests._harness import RankError, RankPool, get_pool, is_worker, rank, world_size

# --------------------------------------------------------------------------------------------
# Rank functions
# --------------------------------------------------------------------------------------------


def _identity() -> tuple[int, int, int, bool, int]:
    return rank(), world_size(), os.getpid(), is_worker(), torch.get_num_threads()


def _all_reduce_sum(scale: float, *, offset: float = 0.0) -> torch.Tensor:
    t = torch.full((3,), float(dist.get_rank() + 1) * scale)
    dist.all_reduce(t)
    return t + offset


def _random_draw() -> torch.Tensor:
    return torch.rand(4)


def _noop() -> None:
    return None


def _raise_on_rank1() -> int:
    if dist.get_rank() == 1:
        raise ValueError("boom from rank 1")
    return dist.get_rank()


def _pytest_raises_inside() -> str:
    with pytest.raises(ZeroDivisionError, match="division"):
        _ = 1 / 0
    with pytest.raises(RuntimeError):
        torch.ones(2) @ torch.ones(3)
    return "ok"


def _failed_assert() -> None:
    values = [1, 2, 3]
    assert sum(values) == 7


def _rank0_raises_rank1_barrier() -> None:
    if dist.get_rank() == 0:
        raise RuntimeError("rank 0 gives up before the barrier")
    dist.barrier()


def _sleep_forever_on_rank0() -> None:
    if dist.get_rank() == 0:
        time.sleep(3600)
    dist.barrier()


def _exit_on_rank1() -> None:
    if dist.get_rank() == 1:
        print("rank 1 about to exit", flush=True)
        os._exit(3)
    dist.barrier()


def _print_something(text: str) -> None:
    print(f"{text} {dist.get_rank()}")


def _skip_everywhere() -> None:
    pytest.skip("not supported here")


def _unpicklable_result() -> object:
    return lambda: None


def _destroy_group() -> int:
    dist.destroy_process_group()
    return 0


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------

WORLD_SIZES = [1, 2, 4]


@pytest.mark.parametrize("dist_pool", WORLD_SIZES, indirect=True)
def test_results_in_rank_order(dist_pool: RankPool) -> None:
    results = dist_pool.run(_identity)
    ws = dist_pool.world_size
    assert [r[0] for r in results] == list(range(ws))
    assert all(r[1] == ws for r in results)
    assert len({r[2] for r in results}) == ws  # one process per rank
    assert os.getpid() not in {r[2] for r in results}
    assert all(r[3] for r in results)  # is_worker() inside ranks
    assert all(r[4] == 1 for r in results)  # torch.set_num_threads(1)
    assert not is_worker()


@pytest.mark.parametrize("dist_pool", WORLD_SIZES, indirect=True)
def test_all_reduce_inside_job(dist_pool: RankPool) -> None:
    ws = dist_pool.world_size
    results = dist_pool.run(_all_reduce_sum, 2.0, offset=0.5)
    expected = torch.full((3,), 2.0 * ws * (ws + 1) / 2 + 0.5)
    assert len(results) == ws
    for t in results:
        torch.testing.assert_close(t, expected)


@pytest.mark.parametrize("dist_pool", WORLD_SIZES, indirect=True)
def test_warm_pool_job_is_fast(dist_pool: RankPool) -> None:
    dist_pool.run(_noop)  # make sure the pool is started and warm
    starts = dist_pool.starts
    t0 = time.perf_counter()
    for _ in range(5):
        assert dist_pool.run(_noop) == [None] * dist_pool.world_size
    per_job = (time.perf_counter() - t0) / 5
    assert per_job < 0.5, f"a job on a warm pool took {per_job:.3f} s"
    assert dist_pool.starts == starts  # no restarts


def test_seed_is_reset_before_each_job(pool2: RankPool) -> None:
    first = pool2.run(_random_draw)
    second = pool2.run(_random_draw)
    torch.testing.assert_close(first[0], first[1])
    torch.testing.assert_close(first[0], second[0])
    torch.manual_seed(0)
    torch.testing.assert_close(first[0], torch.rand(4))


def test_pools_are_shared(pool1: RankPool, pool2: RankPool, pool3: RankPool, pool4: RankPool) -> None:
    assert [p.world_size for p in (pool1, pool2, pool3, pool4)] == [1, 2, 3, 4]
    assert get_pool(2) is pool2 and get_pool(4) is pool4
    import _harness  # the bare-name import must share the same cache

    assert _harness.get_pool(2) is pool2


def test_pool3_runs(pool3: RankPool) -> None:
    assert [r[0] for r in pool3.run(_identity)] == [0, 1, 2]


def test_raise_on_one_rank_is_reported(pool2: RankPool) -> None:
    with pytest.raises(RankError) as info:
        pool2.run(_raise_on_rank1)
    message = str(info.value)
    assert "rank 1 raised ValueError: boom from rank 1" in message
    assert "Traceback (most recent call last)" in message
    assert 'raise ValueError("boom from rank 1")' in message  # the source line
    assert "_raise_on_rank1" in message
    assert "rank 0 raised" not in message
    assert isinstance(info.value, AssertionError)
    assert set(info.value.failures) == {1}
    failure = info.value.failures[1]
    assert failure.kind == "raised" and failure.exc_type == "builtins.ValueError"
    assert isinstance(failure.exception, ValueError)
    # The pool is usable afterwards.
    assert [r[0] for r in pool2.run(_identity)] == [0, 1]


def test_pytest_raises_inside_rank_function(pool2: RankPool) -> None:
    assert pool2.run(_pytest_raises_inside) == ["ok", "ok"]


def test_asserts_are_rewritten_in_ranks(pool1: RankPool) -> None:
    with pytest.raises(RankError) as info:
        pool1.run(_failed_assert)
    message = str(info.value)
    assert "assert 6 == 7" in message
    assert "sum([1, 2, 3])" in message


def test_hang_after_peer_failure_is_reported_with_stacks(pool2: RankPool) -> None:
    pool2.run(_noop)
    old_pids = pool2.pids
    t0 = time.monotonic()
    # A 1 s grace instead of the default 5 s: the mechanism is the same, 4 s less waiting.
    pool2.failure_grace_s = 1.0
    try:
        with pytest.raises(RankError) as info:
            pool2.run(_rank0_raises_rank1_barrier, _timeout=10)
    finally:
        pool2.failure_grace_s = harness._FAILURE_GRACE_S
    elapsed = time.monotonic() - t0
    message = str(info.value)
    assert elapsed < 10 + 8
    assert "rank 0 raised RuntimeError: rank 0 gives up before the barrier" in message
    assert "rank 1 still running 1 s after another rank failed" in message  # the grace ended it
    assert "most recent call first" in message  # faulthandler dump
    assert "_rank0_raises_rank1_barrier" in message.split("rank 1 still running", 1)[1]
    assert info.value.failures[1].kind == "timeout"
    # The next job transparently gets a fresh, working pool.
    assert [r[0] for r in pool2.run(_identity)] == [0, 1]
    assert set(pool2.pids).isdisjoint(old_pids)


def test_timeout_dumps_stacks_and_recovers(pool2: RankPool) -> None:
    pool2.run(_noop)  # measure the job, not a (re)start
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        pool2.run(_sleep_forever_on_rank0, _timeout=3)
    elapsed = time.monotonic() - t0
    message = str(info.value)
    assert 3 <= elapsed < 3 + 8
    assert "rank 0 timed out: no answer after 3 s" in message
    assert "rank 1 timed out" in message
    dump0 = info.value.failures[0].output
    assert "most recent call first" in dump0 and "_sleep_forever_on_rank0" in dump0
    assert "barrier" in info.value.failures[1].output
    assert pool2.run(_all_reduce_sum, 1.0)[0].tolist() == [3.0, 3.0, 3.0]


def test_dead_rank_fails_fast_and_pool_recovers(pool2: RankPool) -> None:
    pool2.run(_noop)
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        pool2.run(_exit_on_rank1)  # default (long) timeout: must not be waited for
    elapsed = time.monotonic() - t0
    message = str(info.value)
    assert elapsed < 8, f"death detection took {elapsed:.1f} s"  # the default timeout is 120 s
    assert "rank 1 exited with exit code 3" in message
    assert "rank 1 about to exit" in message  # the dead rank's output
    assert info.value.failures[1].exit_code == 3
    assert [r[0] for r in pool2.run(_identity)] == [0, 1]


def test_rank_output_is_forwarded(pool2: RankPool, capsys: pytest.CaptureFixture[str]) -> None:
    pool2.run(_print_something, "hello from")
    out = capsys.readouterr().out
    assert "[rank 0] hello from 0" in out
    assert "[rank 1] hello from 1" in out


def test_skip_in_ranks_skips_the_test(pool2: RankPool) -> None:
    pool2.run(_noop)
    pids = pool2.pids
    with pytest.raises(pytest.skip.Exception, match="not supported here"):
        pool2.run(_skip_everywhere)
    assert pool2.run(_noop) == [None, None]
    assert pool2.pids == pids  # a skip is not a failure: no restart


def test_unpicklable_result_is_reported(pool1: RankPool) -> None:
    with pytest.raises(RankError, match="cannot be pickled"):
        pool1.run(_unpicklable_result)
    assert pool1.run(_noop) == [None]


def test_destroyed_group_gets_a_fresh_pool(pool2: RankPool) -> None:
    assert pool2.run(_destroy_group) == [0, 0]
    assert [r[0] for r in pool2.run(_identity)] == [0, 1]


def test_spawn_start_method() -> None:
    with RankPool(2, start_method="spawn") as pool:
        results = pool.run(_all_reduce_sum, 1.0)
        assert [t.tolist() for t in results] == [[3.0, 3.0, 3.0]] * 2
        assert [r[0] for r in pool.run(_identity)] == [0, 1]
    assert not pool.running


def test_local_functions_are_rejected(pool2: RankPool) -> None:
    def local() -> None:
        return None

    with pytest.raises(TypeError, match="module level"):
        pool2.run(local)
    with pytest.raises(TypeError, match="module level"):
        pool2.run(lambda: None)
    with pytest.raises(TypeError, match="cannot be pickled"):
        pool2.run(_noop, lambda: None)
