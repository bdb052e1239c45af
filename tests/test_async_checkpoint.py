"""Asynchronous flat-shard saves (fsdp.checkpoint.async_save_sharded, issue 33 item 2).

- The staging copy is the snapshot: the optimizer steps (and the training loop's collectives
  run) while the background write is held open; the checkpoint loads bit for bit the values at
  save time, at another world size and wrap policy, into fsdp, torch FSDP1, torch FSDP2 and a
  plain model (the loaders of tests/test_flat_checkpoint.py).
- The staging buffers are allocated once: a second save reuses the same host tensors, and they
  hold exactly the written shards' bytes.
- One save in flight: a save started while one is in flight waits for it; a failed save whose
  future nobody read is raised by the next save (which starts nothing), a read one is not.
- A rank killed at any moment of a write (named points of the writer, and a timed moment)
  leaves the previous checkpoint loadable bit for bit; a folder written anew is either
  incomplete (no ``.metadata``, refused) or complete and equal to the new state; a re-save into
  the previous checkpoint's own folder (sync and async) leaves there exactly one complete
  checkpoint, the previous state or the new one, bit for bit through load_sharded and a plain
  dcp.load, at the moment itself and after; the next save removes what the kill left.
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

from fsdp.state_dict._commit_writer import CommitWriter
from tests._harness import get_pool
from tests.test_flat_checkpoint import CONFIGS_2, _assert_equal, _full, _ours, _train, _train_more, load_all


class _Gated:
    """A writer whose data write waits for ``gate`` (set by the training loop once it has
    stepped): the background write is certainly in flight while the optimizer steps."""

    gate: threading.Event

    def write_data(self, plan: Any, planner: Any) -> Any:
        assert self.gate.wait(120), "the gate was never opened"
        return super().write_data(plan, planner)  # type: ignore[misc]


class GatedWriter(_Gated, CommitWriter):
    """fsdp's default writer, gated: the save without a global plan in fsdp's thread."""

    def __init__(self, path: str, gate: threading.Event) -> None:
        super().__init__(path)
        self.gate = gate


class GatedDCPWriter(_Gated, dcp.FileSystemWriter):
    """DCP's file writer, gated: a caller's writer, which DCP's own ``async_save`` drives."""

    def __init__(self, path: str, gate: threading.Event) -> None:
        super().__init__(path, overwrite=True)
        self.gate = gate


def snapshot_save(directory: str, configs: dict[str, Any]) -> dict[str, Any]:
    """Each config: train 2 steps, keep the FULL state, start an async save whose write waits,
    step the optimizer twice (the state changes), then let the write go (fsdp's default writer;
    the last config a plain DCP writer, so DCP's ``async_save`` runs it). Also: the staging
    buffers are the same host tensors at a second save."""
    from fsdp.checkpoint import _ASYNC, async_save_sharded

    report = {}
    last = list(configs)[-1]
    for name, config in configs.items():
        writer = GatedDCPWriter if name == last else GatedWriter  # both protocols
        model = _ours(config, seed=5)
        optim = _train(model, 2)
        expected = _full(model, optim)
        gate = threading.Event()
        path = os.path.join(directory, name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            future = async_save_sharded(model, optim, checkpoint_id=path, storage_writer=writer(path, gate))
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

        class Failing(CommitWriter):  # fsdp's default writer: the save without a global plan
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


# ---------------------------------------------------------------- kills during a write
# Each scenario: a complete checkpoint of step 2 (its FULL state in prev.pt), two more steps
# (their state in new.pt), then a save during which a rank kills itself (SIGKILL) at a named
# point of the writer (fsdp's default, CommitWriter: [Note: Kill-safe re-saves]) or at a timed
# moment after the call returned (one: each scenario restarts the pool twice). Modes:
# ``async_new``: an async save into another folder ``new`` (``prev`` must load bit for bit, ``new``
# is refused as incomplete or equals new.pt); ``async_same`` / ``sync_same``: a re-save into the
# previous checkpoint's own folder, which must then load, through load_sharded and a plain
# dcp.load, bit for bit the previous state or the new one (which one is fixed by the point). The
# sweep below interrupts every point, sync and async, in one job.


class KillingWriter(CommitWriter):
    """fsdp's default writer that SIGKILLs this process (or, with ``raising``, raises
    :class:`Died` there, leaving the files as a kill would) at ``point`` of a write; ``seen``
    records what a plain single-process ``dcp.load`` of the folder reads at that moment."""

    def __init__(self, path: str, point: str, raising: bool = False) -> None:
        super().__init__(path)
        self.point, _, only = point.partition("@")
        self.armed = not only or int(only) == dist.get_rank()
        self.raising = raising
        self.seen: dict[str, Any] = {}

    def _die(self, point: str) -> None:
        if not (self.armed and self.point == point):
            return
        if not self.raising:
            os.kill(os.getpid(), signal.SIGKILL)
        self.seen[point] = _plain_read(str(self.path))
        raise Died(point)

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        future.wait()  # this rank's data files are written (and fsynced)
        self._die("data_written")
        return future

    def commit(self, metadata: Any) -> None:
        self._die("before_metadata")  # the coordinator: every rank's data is written
        super().commit(metadata)
        self._die("after_metadata")  # complete, the replaced files removed

    def _commit(self, tmp: str, final: str) -> None:
        self._die("before_commit")  # the new .metadata.tmp is written and fsynced
        super()._commit(tmp, final)
        self._die("after_commit")  # the replaced checkpoint's files are still there

    def _remove_unnamed(self, folder: str, named: set[str]) -> None:
        if self.point == "during_removal":
            stale = sorted(n for n in os.listdir(folder) if n.endswith(".distcp") and n not in named)
            assert len(stale) >= 2, stale  # both ranks' files of the replaced checkpoint
            os.remove(os.path.join(folder, stale[0]))
            self._die("during_removal")
        super()._remove_unnamed(folder, named)


class Died(BaseException):
    """A simulated kill (BaseException, as DCP's wrappers catch it and nothing cleans up)."""


def _plain_read(path: str) -> dict[str, torch.Tensor] | None:
    """What a plain ``dcp.load`` into a plain model reads from ``path`` in this process alone
    (no collective): its model state dict, or None where the folder is not a checkpoint."""
    from tests._models import make_toy

    if not os.path.isfile(os.path.join(path, ".metadata")):
        return None
    state = {"model": make_toy(seed=9).state_dict()}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    return state["model"]


def _expect_files_named(path: str) -> None:
    """The folder's data files are exactly those its .metadata names (no garbage left)."""
    metadata = dcp.FileSystemReader(path).read_metadata()
    named = {info.relative_path for info in metadata.storage_data.values()}
    assert {n for n in os.listdir(path) if n.endswith(".distcp")} == named, (sorted(os.listdir(path)), named)


def kill_save(directory: str, mode: str, point: str, delay_s: float) -> None:
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
        path = os.path.join(directory, "new" if mode == "async_new" else "prev")
        if mode == "sync_same":
            save_sharded(model, optim, checkpoint_id=path, storage_writer=KillingWriter(path, point))
            time.sleep(60)  # the other rank: until the harness sees the death
        future = async_save_sharded(model, optim, checkpoint_id=path, storage_writer=KillingWriter(path, point))
        if point == "staged" or delay_s > 0:
            time.sleep(delay_s)
            os.kill(os.getpid(), signal.SIGKILL)
        _train_more(model, optim)  # training goes on beside the write
        future.result(timeout=120)
    time.sleep(60)  # after_metadata: the kill comes from the background thread


def _holds(model_sd: dict[str, Any], optim_sd: Any, directory: str, what: str) -> str:
    """Which of prev.pt / new.pt the loaded state equals bit for bit (one must)."""
    for name in ("prev", "new"):
        expected = torch.load(os.path.join(directory, f"{name}.pt"), weights_only=False)
        if all(torch.equal(v, expected[0][k]) for k, v in model_sd.items()):
            _assert_equal(model_sd, expected[0], f"{name} model {what}")
            if optim_sd is not None:
                _assert_equal(optim_sd, expected[1], f"{name} optim {what}")
            return name
    raise AssertionError(f"{what}: the folder holds neither the previous nor the new state")


def check_after_kill(directory: str, mode: str, point: str) -> str:
    from fsdp.checkpoint import load_sharded, save_sharded

    outcome = ""
    for name in ("prev", "new") if mode == "async_new" else ("prev",):
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
        held = _holds(*_full(model, optim), directory, f"{name} after a kill at {point}")
        if mode == "async_new":
            assert held == name, (name, held)
            outcome += f"{name} loaded; "
            continue
        plain = _plain_read(path)  # a plain dcp.load reads the same checkpoint
        assert plain is not None and _holds(plain, None, directory, f"plain dcp.load after {point}") == held
        # What the kill left beside it (a killed save's files, or the replaced one's) goes at
        # the next save's commit.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            save_sharded(model, optim, checkpoint_id=path)
        if dist.get_rank() == 0:
            _expect_files_named(path)
        return f"prev folder holds {held}"
    return outcome + "new complete"


@pytest.mark.parametrize(
    "mode,point,delay_s,holds",
    [
        ("async_new", "staged", 0.0, "new incomplete"),  # right after the call returned
        ("async_new", "after_metadata", 0.0, "new complete"),  # the coordinator, once complete
        ("async_same", "data_written@1", 0.0, "prev"),  # one rank killed after its files
        ("async_same", "before_commit", 0.0, "prev"),  # the coordinator, new .metadata.tmp written
        ("async_same", "", 0.1, None),  # a timed moment of the write (either outcome)
        ("sync_same", "before_metadata", 0.0, "prev"),  # every rank's data written
        ("sync_same", "after_commit", 0.0, "new"),  # committed, the old files not yet removed
    ],
)
def test_kill_during_write_leaves_one_complete_checkpoint(tmp_path: Any, mode: str, point: str, delay_s: float, holds: Any) -> None:
    from tests._harness import RankError

    directory = str(tmp_path)
    with pytest.raises(RankError, match="died|failed"):
        get_pool(2).run(kill_save, directory, mode, point, delay_s, _timeout=120)
    outcome = get_pool(2).run(check_after_kill, directory, mode, point, _timeout=120)
    assert outcome[0] == outcome[1]
    if mode == "async_new":
        assert outcome[0].startswith("prev loaded; "), outcome
        assert outcome[0].endswith(holds), (point, outcome)
    else:
        assert outcome[0] in ("prev folder holds prev", "prev folder holds new"), outcome
        if holds is not None:
            assert outcome[0] == f"prev folder holds {holds}", (mode, point, outcome)
    shutil.rmtree(directory, ignore_errors=True)


# Every point of a re-save into the same folder, sync and async, interrupted in one job: the
# interrupted rank raises where a kill would stop it (nothing runs after it that touches the
# files: DCP catches the error and reports it), so the folder is what a kill leaves. At the
# point itself a plain single-process dcp.load of the folder reads the state the folder must
# hold; afterwards load_sharded reads it bit for bit, and the next save leaves no garbage.
_RESAVE_POINTS = {
    "data_written@1": "prev",
    "before_metadata": "prev",
    "before_commit": "prev",
    "after_commit": "new",
    "during_removal": "new",
    "after_metadata": "new",
}


def resave_interrupted(directory: str) -> dict[str, str]:
    from fsdp.checkpoint import async_save_sharded, load_sharded, save_sharded

    models = {}  # the previous state and the new one, each a model and its optimizer
    for name, steps in (("prev", 2), ("new", 3)):
        model = _ours(CONFIGS_2["flat"], seed=5)
        models[name] = (model, _train(model, steps))
        full = _full(*models[name])
        if dist.get_rank() == 0:
            torch.save(full, os.path.join(directory, f"{name}.pt"))
    dist.barrier()
    reader = _ours(CONFIGS_2["flat"], seed=9)
    reader_optim = _train(reader, 1, lr=0.5)
    path = os.path.join(directory, "ckpt")
    report, holding = {}, ""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for mode in ("sync", "async"):
            for point, holds in _RESAVE_POINTS.items():
                if holding != "prev":
                    save_sharded(*models["prev"], checkpoint_id=path)  # the folder holds prev
                writer = KillingWriter(path, point, raising=True)
                with pytest.raises(CheckpointException, match=f"Died: {point.partition('@')[0]}"):
                    if mode == "sync":
                        save_sharded(*models["new"], checkpoint_id=path, storage_writer=writer)
                    else:
                        async_save_sharded(*models["new"], checkpoint_id=path, storage_writer=writer).result(timeout=120)
                what = f"{mode} re-save interrupted at {point}"
                for at, seen in writer.seen.items():  # a plain dcp.load at that moment
                    assert seen is not None and _holds(seen, None, directory, f"plain dcp.load at {at}") == holds, what
                load_sharded(reader, reader_optim, checkpoint_id=path)
                holding = report[f"{mode} {point}"] = _holds(*_full(reader, reader_optim), directory, what)
                assert holding == holds, (what, report)
        save_sharded(*models["new"], checkpoint_id=path)
        if dist.get_rank() == 0:
            _expect_files_named(path)
    return report


def test_resave_interrupted_at_every_point(tmp_path: Any) -> None:
    reports = get_pool(2).run(resave_interrupted, str(tmp_path), _timeout=300)
    assert reports[0] == reports[1] == {f"{m} {p}": h for m in ("sync", "async") for p, h in _RESAVE_POINTS.items()}
