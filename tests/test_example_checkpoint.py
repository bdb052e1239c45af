"""The example trainer's atomic, sharded checkpoints: resume equals training straight, a load at
another world size restores exactly the saved state and continues exactly as that state loaded
another way, an interrupted save leaves the previous checkpoint loadable, a corrupt checkpoint is a
clear error.

Why the other world sizes are not compared with training straight: a run at world size 1 or 4
reduces gradients in another order than the run at world size 2 that wrote the checkpoint, so the
gradients differ in their last bits. AdamW divides each update by the root of the gradient's second
moment, so for an element whose gradient is near zero (a bias that barely matters) a last-bit
difference can change the update by up to the learning rate: no tolerance follows from the
arithmetic. Resharding itself involves no arithmetic, so it is checked bit for bit instead.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import time
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests._harness import get_pool


def _setup(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    from fsdp import FullyShardedDataParallel as FSDP
    from examples.data import CharTokenizer, load_corpus
    from fsdp.plan.gpt import GPT, Block, GPTConfig
    from fsdp.wrap import ModuleWrapPolicy

    text = load_corpus()
    tokenizer = CharTokenizer(text)
    torch.manual_seed(seed)
    model = FSDP(
        GPT(GPTConfig(vocab_size=tokenizer.vocab_size, block_size=16, n_layer=2, n_head=2, d_model=32)),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    return model, optimizer, tokenizer.encode_tensor(text)


def _steps(model: nn.Module, optimizer: torch.optim.Optimizer, data: torch.Tensor, steps: range, data_ws: int) -> None:
    """Trains on the global batch of ``data_ws`` ranks, split over this run's ranks."""
    from examples.data import sample_batch

    rank, ws = dist.get_rank(), dist.get_world_size()
    for step in steps:
        batches = [sample_batch(data, 4, 16, seed=0, rank=r, step=step) for r in range(data_ws)]
        inputs = torch.cat([b[0] for b in batches])
        targets = torch.cat([b[1] for b in batches])
        per_rank = inputs.shape[0] // ws
        x, y = inputs[rank * per_rank : (rank + 1) * per_rank], targets[rank * per_rank : (rank + 1) * per_rank]
        logits = model(x)
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_same(expected: Any, actual: Any, where: str) -> None:
    """Bit-for-bit equality of nested dicts / lists of tensors and plain values."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and torch.equal(expected, actual), where
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and set(expected) == set(actual), (where, set(expected) ^ set(actual))
        for key in expected:
            _assert_same(expected[key], actual[key], f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(expected) == len(actual), where
        for i, (e, a) in enumerate(zip(expected, actual)):
            _assert_same(e, a, f"{where}[{i}]")
    else:
        assert expected == actual, (where, expected, actual)


def _full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Full model and optimizer state (a collective; FULL_STATE_DICT is the default type)."""
    from fsdp import FullyShardedDataParallel as FSDP

    return {"model": _full(model), "optim": FSDP.optim_state_dict(model, optimizer)}


def _reference_path(directory: str) -> str:
    return os.path.join(directory, "reference_step_2.pt")


def save_phase(directory: str) -> None:
    from examples.checkpoint import save_checkpoint

    model, optimizer, data = _setup()
    _steps(model, optimizer, data, range(2), 4)
    save_checkpoint(directory, 2, model, optimizer, {"step": 2})
    reference = _full_state(model, optimizer)  # what the checkpoint must restore, exactly
    if dist.get_rank() == 0:
        torch.save(reference, _reference_path(directory))
    # An interrupted later save: shards of step 4 half-written, pointer never updated.
    _steps(model, optimizer, data, range(2, 4), 4)
    if dist.get_rank() == 0:
        os.makedirs(os.path.join(directory, "step_000004.partial"))
        with open(os.path.join(directory, "step_000004.partial", "__0_0.distcp"), "wb") as f:
            f.write(b"\x00garbage")
    dist.barrier()


def resume_phase(directory: str) -> None:
    """At the world size that saved: resuming equals training straight, bit for bit."""
    from examples.checkpoint import latest_checkpoint, load_checkpoint

    path = latest_checkpoint(directory)
    assert path is not None and path.endswith("step_000002"), path  # the half-written save is ignored
    straight, straight_opt, data = _setup()
    _steps(straight, straight_opt, data, range(4), 4)
    model, optimizer, _ = _setup(seed=99)
    extra = load_checkpoint(path, model, optimizer, {"step": 0})
    assert extra["step"] == 2
    _steps(model, optimizer, data, range(2, 4), 4)
    a, b = _full(straight), _full(model)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def reshard_phase(directory: str) -> None:
    """At another world size: the load restores the saved state bit for bit, and training from
    it equals training from the same state loaded as full state dicts (see the module docstring)."""
    from fsdp import FullyShardedDataParallel as FSDP
    from examples.checkpoint import _init_optimizer_state, latest_checkpoint, load_checkpoint

    path = latest_checkpoint(directory)
    assert path is not None and path.endswith("step_000002"), path
    reference = torch.load(_reference_path(directory), weights_only=False)
    model, optimizer, data = _setup(seed=99)
    assert load_checkpoint(path, model, optimizer, {"step": 0})["step"] == 2
    _assert_same(reference, _full_state(model, optimizer), "restored")

    via_full, via_full_opt, _ = _setup(seed=7)
    via_full.load_state_dict(reference["model"])
    _init_optimizer_state(via_full, via_full_opt)
    via_full_opt.load_state_dict(FSDP.optim_state_dict_to_load(via_full, via_full_opt, reference["optim"]))
    _steps(model, optimizer, data, range(2, 4), 4)
    _steps(via_full, via_full_opt, data, range(2, 4), 4)
    _assert_same(_full(via_full), _full(model), "trained")


def corrupt_phase(directory: str) -> None:
    from examples.checkpoint import CheckpointReadError, latest_checkpoint, load_checkpoint

    path = latest_checkpoint(directory)
    assert path is not None
    if dist.get_rank() == 0:
        for file in glob.glob(os.path.join(path, "*.distcp")):
            with open(file, "r+b") as f:
                f.truncate(max(0, os.path.getsize(file) // 2))
    dist.barrier()
    model, optimizer, _ = _setup(seed=5)
    before = _full(model)
    # Every rank raises (DCP gathers the readers' errors), one line naming the first failing
    # rank's error: the trainer prints it as its advice ([Note: An unreadable checkpoint]).
    with pytest.raises(CheckpointReadError, match=r"cannot read checkpoint .*step_000002 \(\w+(: .*)?, on rank \d\)\. It is truncated, corrupt or from another model") as raised:
        load_checkpoint(path, model, optimizer, {"step": 0})
    assert "\n" not in str(raised.value) and "Traceback" not in str(raised.value), str(raised.value)
    after = _full(model)
    assert all(torch.equal(before[k], after[k]) for k in before), "model unchanged"


def test_resume_bit_exact_and_interrupted_save(tmp_path: Any) -> None:
    get_pool(2).run(save_phase, str(tmp_path))
    _keep_as_kill_base(str(tmp_path))  # the phases below read it; corrupt_phase truncates it
    get_pool(2).run(resume_phase, str(tmp_path))
    get_pool(4).run(reshard_phase, str(tmp_path))  # another world size
    get_pool(1).run(reshard_phase, str(tmp_path))
    get_pool(2).run(corrupt_phase, str(tmp_path))


# ---------------------------------------------------------------- kills during a save
# [Note: Atomic checkpoints] in examples/checkpoint.py. Each scenario starts from a copy of a
# directory holding one complete save of step 2 (``reference_step_2.pt`` is its full state), then
# trains two more steps, writes that state as ``reference_new.pt`` and saves again: the same step
# (a re-save) or step 4. A rank SIGKILLs itself at a named point of the save, or at a seeded random
# moment. Afterwards the newest complete checkpoint must load and equal one of the two references
# bit for bit: the one the kill point implies, or (random kills) either.
_OLD, _NEW, _EITHER = "reference_step_2.pt", "reference_new.pt", "either"


#: The points of a save where a rank kills itself, each right after the step it names:
#: (the function the save calls there, which call of it). ``dcp.save`` writes the shards; rank 0's
#: ``os.replace`` calls move the old step aside, rename the ``.partial`` in, and replace the
#: ``latest`` pointer.
_CRASH_POINTS = {
    "shards_written": ("dcp.save", lambda args: True),
    "old_moved_aside": ("os.replace", lambda args: str(args[1]).endswith(".old")),
    "renamed": ("os.replace", lambda args: str(args[0]).endswith(".partial")),
    "pointer_written": ("os.replace", lambda args: os.path.basename(str(args[0])) == "latest.tmp"),
}


@contextlib.contextmanager
def _crash_after(crash_at: str) -> Iterator[None]:
    """Kills this rank (SIGKILL) right after the save step ``crash_at`` names (``point`` or
    ``point@RANK`` for one rank only), by wrapping the call that makes it; nothing if empty."""
    import signal

    from examples import checkpoint

    point, _, only_rank = crash_at.partition("@")
    if not point or (only_rank and int(only_rank) != dist.get_rank()):
        yield
        return
    where, matches = _CRASH_POINTS[point]
    owner = checkpoint.dcp if where == "dcp.save" else checkpoint.os
    name = where.split(".")[1]
    original = getattr(owner, name)

    def call_then_die(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        if matches(args):
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    setattr(owner, name, call_then_die)
    try:
        yield
    finally:
        setattr(owner, name, original)


def crash_save_phase(directory: str, step: int, crash_at: str, delay_s: float) -> None:
    import signal
    import threading

    from examples.checkpoint import save_checkpoint

    model, optimizer, data = _setup()
    _steps(model, optimizer, data, range(2), 4)
    _steps(model, optimizer, data, range(2, 4), 4)
    reference = _full_state(model, optimizer)
    if dist.get_rank() == 0:
        torch.save(reference, os.path.join(directory, _NEW))
    dist.barrier()
    if delay_s > 0:
        threading.Timer(delay_s, os.kill, (os.getpid(), signal.SIGKILL)).start()
    with _crash_after(crash_at):
        save_checkpoint(directory, step, model, optimizer, {"step": step})
    if delay_s > 0:
        time.sleep(60)  # the timer fires: this rank dies after (or during) the save


def check_latest_phase(directory: str, expected: str) -> str:
    import warnings

    from examples.checkpoint import latest_checkpoint, load_checkpoint

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = latest_checkpoint(directory)
    assert path is not None
    model, optimizer, _ = _setup(seed=99)
    load_checkpoint(path, model, optimizer, {"step": 0})
    restored = _full_state(model, optimizer)
    names = [_OLD, _NEW] if expected == _EITHER else [expected]
    for name in names:
        try:
            _assert_same(torch.load(os.path.join(directory, name), weights_only=False), restored, name)
            return name + ("" if not caught else " (warned)")
        except AssertionError:
            if name == names[-1]:
                raise
    raise AssertionError("unreachable")


@pytest.mark.parametrize(
    "step,crash_at,delay_s,expected",
    [
        (2, "shards_written", 0.0, _OLD),  # re-save, every rank killed before publishing
        (2, "shards_written@1", 0.0, _OLD),  # re-save, one rank killed
        (2, "old_moved_aside", 0.0, _NEW),  # the re-save window: the complete .partial is taken
        (2, "renamed", 0.0, _NEW),
        (4, "renamed", 0.0, _OLD),  # a new step renamed in, pointer not yet moved
        (4, "pointer_written", 0.0, _NEW),
        (2, "", 0.05, _EITHER),  # random moments (seeded: the same on every run)
        (2, "", 0.2, _EITHER),
        (4, "", 0.12, _EITHER),
    ],
)
def test_kill_during_save_leaves_a_loadable_checkpoint(
    tmp_path: Any, step: int, crash_at: str, delay_s: float, expected: str
) -> None:
    from tests._harness import RankError

    base = _kill_base(tmp_path)
    directory = str(tmp_path / "run")
    shutil.copytree(base, directory)
    with pytest.raises(RankError, match="died|failed"):
        get_pool(2).run(crash_save_phase, directory, step, crash_at, delay_s, _timeout=60)
    found = get_pool(2).run(check_latest_phase, directory, expected)
    assert found[0] == found[1]
    if crash_at == "old_moved_aside":
        assert found[0] == _NEW + " (warned)", found  # the loader says it took the .partial


_KILL_BASE: dict[str, str] = {}


def _kill_base(tmp_path: Any) -> str:
    """A directory with one complete save of step 2, made once per session and copied per test
    (from the resume test's save_phase when that ran first: the same save)."""
    if "path" not in _KILL_BASE:
        saved = str(tmp_path.parent / "kill-save")
        os.makedirs(saved, exist_ok=True)
        get_pool(2).run(save_phase, saved)
        _keep_as_kill_base(saved)
    return _KILL_BASE["path"]


def _keep_as_kill_base(saved: str) -> None:
    """Keeps a copy of ``saved`` (save_phase's directory) without its half-written step 4."""
    if "path" in _KILL_BASE:
        return
    base = saved + "-kill-base"
    shutil.copytree(saved, base, ignore=shutil.ignore_patterns("step_000004.partial"))
    _KILL_BASE["path"] = base


def keep_phase(directory: str) -> list[str]:
    from examples.checkpoint import latest_checkpoint, save_checkpoint

    model, optimizer, _ = _setup()
    for step in (1, 2, 3, 4):
        save_checkpoint(directory, step, model, optimizer, {"step": step}, keep=2)
    with pytest.raises(ValueError, match="keep=0"):
        save_checkpoint(directory, 5, model, optimizer, {"step": 5}, keep=0)
    assert latest_checkpoint(directory) == os.path.join(directory, "step_000004")
    return sorted(name for name in os.listdir(directory) if name.startswith("step_"))


def test_keep_prunes_old_steps_and_a_missing_latest_falls_back(tmp_path: Any) -> None:
    from examples.checkpoint import LATEST, latest_checkpoint

    directory = str(tmp_path)
    assert get_pool(2).run(keep_phase, directory)[0] == ["step_000003", "step_000004"]
    # The folder 'latest' names is gone (no .partial / .old either): the newest complete step
    # is taken, with a warning; with nothing complete left, a clear error.
    shutil.rmtree(os.path.join(directory, "step_000004"))
    with pytest.warns(RuntimeWarning, match=r"names 'step_000004'.*loading the complete checkpoint .*step_000003"):
        assert latest_checkpoint(directory) == os.path.join(directory, "step_000003")
    shutil.rmtree(os.path.join(directory, "step_000003"))
    with pytest.raises(RuntimeError, match=r"holds no other complete step_\* folder"):
        latest_checkpoint(directory)
    assert os.path.exists(os.path.join(directory, LATEST))


# ---------------------------------------------------------------- --overwrite
def _fake_run(directory: str, steps: list[int]) -> None:
    """Step folders that count as complete (DCP's ``.metadata`` is the mark) and a pointer to the last."""
    from examples.checkpoint import INFO, LATEST

    for step in steps:
        folder = os.path.join(directory, f"step_{step:06d}")
        os.makedirs(folder)
        for name in (".metadata", INFO, "__0_0.distcp"):
            with open(os.path.join(folder, name), "w") as f:
                f.write("{}" if name == INFO else "x")
    with open(os.path.join(directory, LATEST), "w") as f:
        f.write(f"step_{steps[-1]:06d}\n")


def test_clear_checkpoints_interrupted_anywhere_never_leaves_a_checkpoint_to_resume(tmp_path: Any, monkeypatch: Any) -> None:
    """--overwrite deletes the earlier run's step folders and pointer (the user's other files
    stay). Interrupted after any of its renames, what is left is either the untouched old run or
    no checkpoint that --resume would take (no pointer), while the leftovers still count as an
    earlier run's (a new run without --overwrite is refused); --overwrite again finishes."""
    from examples import checkpoint
    from examples.checkpoint import clear_checkpoints, has_checkpoints, latest_checkpoint

    def layout(directory: str) -> None:
        _fake_run(directory, [250, 500])
        os.makedirs(os.path.join(directory, "step_000750.partial"))  # an interrupted save
        with open(os.path.join(directory, "notes.txt"), "w") as f:
            f.write("mine")

    directory = str(tmp_path / "full")
    layout(directory)
    assert clear_checkpoints(directory) == 2
    assert sorted(os.listdir(directory)) == ["notes.txt"]
    assert not has_checkpoints(directory) and latest_checkpoint(directory) is None
    assert clear_checkpoints(str(tmp_path / "missing")) == 0

    renames = 4  # latest, step_000250, step_000500, step_000750.partial
    for crash_after in range(1, renames + 1):
        directory = str(tmp_path / f"crash{crash_after}")
        layout(directory)
        calls = []
        original = checkpoint.os.replace

        def replace_then_crash(src: str, dst: str) -> None:
            original(src, dst)
            calls.append(src)
            if len(calls) == crash_after:
                raise KeyboardInterrupt("killed")

        monkeypatch.setattr(checkpoint.os, "replace", replace_then_crash)
        with pytest.raises(KeyboardInterrupt):
            clear_checkpoints(directory)
        monkeypatch.setattr(checkpoint.os, "replace", original)
        assert os.path.basename(calls[0]) == "latest"  # the pointer goes first
        assert latest_checkpoint(directory) is None, crash_after
        complete_left = [name for name in os.listdir(directory) if name in ("step_000250", "step_000500")]
        assert has_checkpoints(directory) == bool(complete_left), (crash_after, complete_left)
        assert clear_checkpoints(directory) == len(complete_left)
        assert sorted(os.listdir(directory)) == ["notes.txt"], crash_after


def info_phase(directory: str) -> dict:
    """A save records its ``info`` in the published folder, readable without loading."""
    from examples.checkpoint import latest_checkpoint, read_info, save_checkpoint

    model, optimizer, _ = _setup()
    info = {"step": 3, "flags": {"model": "tiny"}}
    save_checkpoint(directory, 3, model, optimizer, {"step": 3}, info=info)
    path = latest_checkpoint(directory)
    assert path is not None and read_info(path) == info
    return info


def test_save_records_info(tmp_path: Any) -> None:
    from examples.checkpoint import INFO, read_info

    get_pool(2).run(info_phase, str(tmp_path))
    broken = tmp_path / "step_000003"
    (broken / INFO).write_text("{not json")
    with pytest.raises(RuntimeError, match=r"cannot read .*run.json .*the checkpoint folder is damaged"):
        read_info(str(broken))
    os.remove(broken / INFO)
    assert read_info(str(broken)) is None  # a save made before checkpoints recorded it
