"""Asynchronous flat-shard saves (fsdp.checkpoint.async_save_sharded, issue 33 item 2).

- The staging copy is the snapshot: the optimizer steps (and the training loop's collectives
  run) while the background write is held open; the checkpoint loads bit for bit the values at
  save time, at another world size and wrap policy, into fsdp, torch FSDP1, torch FSDP2 and a
  plain model (the loaders of tests/test_flat_checkpoint.py).
- The staging buffers are allocated once: a second save reuses the same host tensors, and they
  hold exactly the written shards' bytes.
- One save in flight: a save started while one is in flight waits for it; a failed save whose
  future nobody read is raised by the next save (which starts nothing), a read one is not.
- A rank killed at any moment of a background write (named points of DCP's writer, and a timed
  moment) leaves the previous checkpoint loadable bit for bit; the folder being written is
  either incomplete (no ``.metadata``, refused) or complete and equal to the new state.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from tests._harness import get_pool
from tests.test_flat_checkpoint import CONFIGS_2, _assert_equal, _full, _ours, _train, _train_more, load_all


class GatedWriter(dcp.FileSystemWriter):
    """DCP's file writer whose data write waits for ``gate`` (set by the training loop once it
    has stepped): the background write is certainly in flight while the optimizer steps."""

    def __init__(self, path: str, gate: threading.Event) -> None:
        super().__init__(path, overwrite=True)
        self.gate = gate

    def write_data(self, plan: Any, planner: Any) -> Any:
        assert self.gate.wait(120), "the gate was never opened"
        return super().write_data(plan, planner)


def snapshot_save(directory: str, configs: dict[str, Any]) -> dict[str, Any]:
    """Each config: train 2 steps, keep the FULL state, start an async save whose write waits,
    step the optimizer twice (the state changes), then let the write go. Also: the staging
    buffers are the same host tensors at a second save."""
    from fsdp.checkpoint import _ASYNC, async_save_sharded

    report = {}
    for name, config in configs.items():
        model = _ours(config, seed=5)
        optim = _train(model, 2)
        expected = _full(model, optim)
        gate = threading.Event()
        path = os.path.join(directory, name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            future = async_save_sharded(model, optim, checkpoint_id=path, storage_writer=GatedWriter(path, gate))
            _train_more(model, optim)
            _train_more(model, optim)
            assert not future.done()  # the write is still waiting: training ran beside it
            moved = _full(model, optim)
            assert not torch.equal(moved[0]["head.weight"], expected[0]["head.weight"])
            gate.set()
            future.result(timeout=120)
            first = {id(b): b.data_ptr() for b in _ASYNC.staging._buffers.values()}
            again = async_save_sharded(model, optim, checkpoint_id=os.path.join(directory, f"{name}_again"))
            again.result(timeout=120)
        second = {id(b): b.data_ptr() for b in _ASYNC.staging._buffers.values()}
        assert second == first, "the second save reused the first one's staging buffers"
        report[name] = _ASYNC.staging.nbytes
        if dist.get_rank() == 0:
            torch.save({"model": expected[0], "optim": expected[1]}, os.path.join(directory, f"{name}.pt"))
        dist.barrier()
    return report


def _written_bytes(model: Any, optim: Any) -> int:
    """What a save of this rank writes, in tensor bytes: the flat shards of the units it writes
    and the optimizer states shaped like them (whole, padding included), plus plain tensors."""
    from fsdp.state_dict._flat_checkpoint import FlatShardChunks, flat_shard_state_dict

    seen: dict[int, int] = {}

    def walk(value: Any) -> None:
        if isinstance(value, FlatShardChunks) and value.views:
            seen[value.source.untyped_storage().data_ptr() + value.source.storage_offset()] = value.source.nbytes
        elif torch.is_tensor(value):
            seen[value.untyped_storage().data_ptr() + value.storage_offset()] = value.nbytes
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)

    walk(flat_shard_state_dict(model, optim))
    return sum(seen.values())


def test_async_save_is_a_snapshot_and_loads_elsewhere(tmp_path: Any) -> None:
    configs = {k: CONFIGS_2[k] for k in ("flat", "orig_mp", "zero2_offload")}
    get_pool(2).run(snapshot_save, str(tmp_path), configs, _timeout=300)
    get_pool(4).run(load_all, str(tmp_path), configs, _timeout=300)


def in_flight_rules(directory: str) -> None:
    """A save while one is in flight waits for it; a failed save is raised by the next one only
    when its future's outcome was never read."""
    from fsdp.checkpoint import async_save_sharded, load_sharded, save_sharded

    model = _ours(CONFIGS_2["flat"], seed=5)
    optim = _train(model, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for follower in ("async", "sync", "load"):
            gate = threading.Event()
            path = os.path.join(directory, f"first_{follower}")
            first = async_save_sharded(model, optim, checkpoint_id=path, storage_writer=GatedWriter(path, gate))
            threading.Timer(0.5, gate.set).start()
            start = time.perf_counter()
            if follower == "async":
                async_save_sharded(model, optim, checkpoint_id=os.path.join(directory, "second")).result(timeout=120)
            elif follower == "sync":
                save_sharded(model, optim, checkpoint_id=os.path.join(directory, "second"))
            else:
                load_sharded(model, optim, checkpoint_id=path)
            assert time.perf_counter() - start >= 0.45 and first.done(), follower  # it waited
            assert first.exception() is None

        class Failing(dcp.FileSystemWriter):
            def write_data(self, plan: Any, planner: Any) -> Any:
                raise OSError("disk full (planted)")

        failed = async_save_sharded(model, optim, checkpoint_id=os.path.join(directory, "bad"), storage_writer=Failing(os.path.join(directory, "bad")))
        while not failed.done():
            time.sleep(0.01)
        with pytest.raises(RuntimeError, match=r"the asynchronous save to '.*bad' failed \(CheckpointException: OSError: disk full \(planted\); the whole error is chained below\), and async_save_sharded waits for it before it starts.*Call it again"):
            async_save_sharded(model, optim, checkpoint_id=os.path.join(directory, "after"))
        assert not os.path.exists(os.path.join(directory, "after")), "the refused save started nothing"
        dist.barrier()
        async_save_sharded(model, optim, checkpoint_id=os.path.join(directory, "after")).result(timeout=120)
        # A failure already read from its future is not raised again.
        failed = async_save_sharded(model, optim, checkpoint_id=os.path.join(directory, "bad"), storage_writer=Failing(os.path.join(directory, "bad")))
        with pytest.raises(CheckpointException, match="disk full"):
            failed.result(timeout=120)
        save_sharded(model, optim, checkpoint_id=os.path.join(directory, "after"))
        # The staging holds one copy of what a save writes (every tensor once).
        from fsdp.checkpoint import _ASYNC

        async_save_sharded(model, optim, checkpoint_id=os.path.join(directory, "after")).result(timeout=120)
        assert _ASYNC.staging.nbytes == _written_bytes(model, optim), (_ASYNC.staging.nbytes, _written_bytes(model, optim))


def test_one_save_in_flight(tmp_path: Any) -> None:
    get_pool(2).run(in_flight_rules, str(tmp_path), _timeout=300)


# ---------------------------------------------------------------- kills during a background write
# Each scenario: a complete checkpoint of step 2 in ``prev`` (its FULL state in prev.pt), two
# more steps (their state in new.pt), then an async save into ``new`` during which a rank kills
# itself (SIGKILL) at a named point of DCP's writer in the background thread, or at a timed
# moment after the call returned (one: each scenario restarts the pool twice). Then, in a fresh
# pool, ``prev`` must load bit for bit, and ``new`` is either refused as incomplete or equal to
# new.pt.


class KillingWriter(dcp.FileSystemWriter):
    """DCP's file writer that SIGKILLs this process at ``point`` of the background write."""

    def __init__(self, path: str, point: str) -> None:
        super().__init__(path, overwrite=True)
        self.point, _, only = point.partition("@")
        self.armed = not only or int(only) == dist.get_rank()

    def _die(self, point: str) -> None:
        if self.armed and self.point == point:
            os.kill(os.getpid(), signal.SIGKILL)

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        future.wait()  # this rank's data files are written (and fsynced)
        self._die("data_written")
        return future

    def finish(self, metadata: Any, results: Any) -> None:
        self._die("before_metadata")  # the coordinator: every rank's data is written
        super().finish(metadata, results)
        self._die("after_metadata")


def kill_save(directory: str, point: str, delay_s: float) -> None:
    from fsdp.checkpoint import async_save_sharded, save_sharded

    model = _ours(CONFIGS_2["flat"], seed=5)
    optim = _train(model, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_sharded(model, optim, checkpoint_id=os.path.join(directory, "prev"))
        prev = _full(model, optim)
        _train_more(model, optim)
        _train_more(model, optim)
        new = _full(model, optim)
        if dist.get_rank() == 0:
            torch.save(prev, os.path.join(directory, "prev.pt"))
            torch.save(new, os.path.join(directory, "new.pt"))
        dist.barrier()
        path = os.path.join(directory, "new")
        future = async_save_sharded(model, optim, checkpoint_id=path, storage_writer=KillingWriter(path, point))
        if point == "staged" or delay_s > 0:
            time.sleep(delay_s)
            os.kill(os.getpid(), signal.SIGKILL)
        _train_more(model, optim)  # training goes on beside the write
        future.result(timeout=120)
    time.sleep(60)  # after_metadata: the kill comes from the background thread


def check_after_kill(directory: str, point: str) -> str:
    from fsdp.checkpoint import load_sharded

    outcome = ""
    for name in ("prev", "new"):
        model = _ours(CONFIGS_2["flat"], seed=9)
        optim = _train(model, 1, lr=0.5)
        path = os.path.join(directory, name)
        complete = os.path.isfile(os.path.join(path, ".metadata"))
        if name == "new" and not complete:
            with pytest.raises(FileNotFoundError, match=r"\.metadata"):
                load_sharded(model, optim, checkpoint_id=path)
            return outcome + "new incomplete"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load_sharded(model, optim, checkpoint_id=path)
        model_sd, optim_sd = _full(model, optim)
        expected = torch.load(os.path.join(directory, f"{name}.pt"), weights_only=False)
        _assert_equal(model_sd, expected[0], f"{name} model after a kill at {point}")
        _assert_equal(optim_sd, expected[1], f"{name} optim after a kill at {point}")
        outcome += f"{name} loaded; "
    return outcome + "new complete"


@pytest.mark.parametrize(
    "point,delay_s,new_complete",
    [
        ("staged", 0.0, False),  # right after the call returned: nothing written yet
        ("data_written@1", 0.0, False),  # one rank killed after its files
        ("before_metadata", 0.0, False),  # the coordinator, with every result gathered
        ("after_metadata", 0.0, True),  # the coordinator, once the checkpoint is complete
        ("", 0.1, None),  # a timed moment of the write (either outcome)
    ],
)
def test_kill_during_background_write_leaves_previous_loadable(tmp_path: Any, point: str, delay_s: float, new_complete: Any) -> None:
    from tests._harness import RankError

    directory = str(tmp_path)
    with pytest.raises(RankError, match="died|failed"):
        get_pool(2).run(kill_save, directory, point, delay_s, _timeout=120)
    outcome = get_pool(2).run(check_after_kill, directory, point, _timeout=120)
    assert outcome[0] == outcome[1]
    assert outcome[0].startswith("prev loaded; "), outcome
    if new_complete is not None:
        assert outcome[0].endswith("new complete" if new_complete else "new incomplete"), (point, outcome)
    shutil.rmtree(directory, ignore_errors=True)
