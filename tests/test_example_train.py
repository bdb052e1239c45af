"""The example trainer (the README's main job) runs end to end from its command line: two local
CPU ranks, FULL_SHARD, in full precision and in bf16 mixed precision, and its loss falls. Its
refusals (resuming past the end or another model, a missing checkpoint directory, a bad
--seq-len) come from ``main()`` before any rank starts, so they are checked in this process; its
memory report is checked on the test pool's ranks."""

from __future__ import annotations

import glob
import math
import os
import re
import subprocess
import sys
from typing import Any, Callable, Iterator

import pytest

from benchmarks.gpu_run import _Preloaded
from tests._harness import get_pool

#: How one trainer command line runs: ``python -m examples.train --batch-size 4 ARGS``.
Trainer = Callable[..., subprocess.CompletedProcess]


@pytest.fixture(scope="module")
def train(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trainer]:
    """Runs the trainer's command line as a fork of one interpreter that imported torch and fsdp
    once ([Note: The dry run's preloaded interpreter] in benchmarks/gpu_run.py): each command
    then runs as ``python -m`` runs it (argv, environment, working directory, its own stdout and
    stderr, exit status), less the seconds of CPU each fresh interpreter spends importing them.
    The ranks it spawns are fresh interpreters, as they are for a user."""
    preloaded = _Preloaded(dict(os.environ), preload=("torch", "torch.distributed", "torch.distributed.checkpoint", "fsdp"))
    logs = tmp_path_factory.mktemp("trainer")

    def run(*args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "examples.train", "--batch-size", "4", *args]
        out, err = str(logs / "stdout"), str(logs / "stderr")
        code, _ = preloaded.run(cmd, dict(os.environ), 300.0, out, err)
        with open(out) as f:
            stdout = f.read().split("\n", 1)[1]  # after the command line the log starts with
        with open(err) as f:
            return subprocess.CompletedProcess(cmd, -1 if code is None else code, stdout, f.read())

    yield run
    preloaded.close()


def _assert_loss_fell(stdout: str) -> None:
    match = re.search(r"OK: loss fell from ([0-9.]+) to ([0-9.]+)", stdout)
    assert match, stdout[-3000:]
    first, last = map(float, match.groups())
    assert last < first


def test_trainer_command_line_bf16(train: Trainer) -> None:
    """bf16 mixed precision, no checkpoints, a chosen collective timeout (full precision with
    checkpoints and the default timeout: the first run of the checkpoint test below).

    Four steps, in which the loss falls by about 20% on every CPU tried (4.34 -> 3.41, the same to
    3 decimals with oneDNN limited to AVX2, AVX512-BF16 or AMX). Not more: on a CPU with AMX, bf16
    training of this model at its default learning rate diverges from step 6 (3.39 -> 5.94); the
    same loop on torch FSDP1 gives the same losses as fsdp to the bit there, and with AVX512-BF16
    or AVX2 kernels both go on falling. That is the CPU's bf16 kernels, not the trainer.
    """
    run = train("--steps", "4", "--log-every", "2", "--checkpoint-dir", "", "--mixed-precision", "bf16", "--timeout", "90")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "collective timeout 90 s (--timeout): a rank stuck longer" in run.stdout, run.stdout[:2000]
    _assert_loss_fell(run.stdout)


def test_trainer_checkpoint_dir_resume_and_refusal(
    train: Trainer, tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    """Where checkpoints go is said; a second run into the same directory without --resume is
    refused before any rank starts; a resume at another world size says how the global batch
    changes; progress lines carry a percentage."""
    ckpt = str(tmp_path)
    # Full precision, the default collective timeout, checkpoints.
    first = train("--steps", "8", "--checkpoint-dir", ckpt, "--checkpoint-every", "4", "--log-every", "4")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert f"checkpoints: {ckpt} every 4 steps and at the end (keeping the newest 3)" in first.stdout
    assert re.search(r"step +8/8 \(100%", first.stdout), first.stdout[-2000:]
    assert "collective timeout 600 s (--timeout): a rank stuck longer" in first.stdout, first.stdout[:2000]
    _assert_loss_fell(first.stdout)

    # Refused before any rank starts: main() returns the exit status without spawning, so it
    # runs in this process (``python -m`` passes that status to sys.exit).
    from examples.train import main

    assert main(["--batch-size", "4", "--steps", "8", "--checkpoint-dir", ckpt]) == 2
    again = capsys.readouterr()
    assert "already holds checkpoints of an earlier run (latest: step_000008)" in again.err
    assert "Pass --resume to continue from it, --overwrite to start over" in again.err
    assert "step " not in again.out  # nothing trained

    # The checkpoint records the model's configuration and the flags that shape it.
    from examples.checkpoint import latest_checkpoint, read_info

    latest = latest_checkpoint(ckpt)
    assert latest is not None
    assert read_info(latest) == {
        "step": 8,
        "flags": {"model": "tiny", "seq_len": 64},
        "model_config": {"vocab_size": 74, "block_size": 64, "n_layer": 4, "n_head": 4, "d_model": 128, "dropout": 0.0},
        "steps": 8,
    }
    # Resuming another model, or past the end: one line, before loading, no rank started.
    for flags, message in [
        (["--model", "small"], f"{latest} was made with --model tiny --seq-len 64; this run's --model small "
         "--seq-len 64 makes another model (n_layer 4 there, 6 here; n_head 4 there, 6 here; d_model 128 "
         "there, 384 here). Resume with --model tiny --seq-len 64, or start over with --overwrite or another "
         "--checkpoint-dir.\n"),
        (["--seq-len", "32"], "this run's --model tiny --seq-len 32 makes another model (block_size 64 there, 32 here)"),
        (["--steps", "8"], f"checkpoint is at step 8 >= --steps 8: nothing to train; pass --steps > 8 (checkpoint {latest})\n"),
        (["--steps", "3"], "checkpoint is at step 8 >= --steps 3: nothing to train; pass --steps > 8"),
    ]:
        assert main(["--batch-size", "4", "--steps", "10", "--checkpoint-dir", ckpt, "--resume", *flags]) == 2
        refused = capsys.readouterr()
        assert message in refused.err and refused.err.count("\n") == 1, (flags, refused.err)
        assert refused.out == "", refused.out  # nothing trained, no OK line

    resumed = train("--steps", "10", "--checkpoint-dir", ckpt, "--resume", "--nprocs", "1")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    # Said before the ranks start (their first line is the model's description).
    assert resumed.stdout.startswith(
        f"fsdp example: resuming {latest} at step 8 of --steps 10; made with --model tiny --seq-len 64\n"
        "fsdp example: model tiny"
    ), resumed.stdout[:2000]
    assert "resumed from" in resumed.stdout and "at step 8" in resumed.stdout
    # 2 ranks x 4 x 64 = 512 tokens per step saved; 1 rank x 4 x 64 = 256 now.
    assert "the global batch changes from 512 to 256 tokens/step" in resumed.stdout
    assert "pass --batch-size 8 to keep it" in resumed.stdout
    assert "FutureWarning" not in resumed.stderr, resumed.stderr[-3000:]
    # One rank: the log and the summary name the strategy that runs (nothing to shard).
    assert "1 rank (gloo, cpu), strategy NO_SHARD (--strategy FULL_SHARD: nothing to shard on 1 rank)" in resumed.stdout
    assert "summary (NO_SHARD (--strategy FULL_SHARD: nothing to shard on 1 rank), 1 rank, tiny model)" in resumed.stdout
    assert "(NO_SHARD: every rank holds all of the" in resumed.stdout
    # --steps 10 after a run of 8: the schedule is re-stretched, said in one line with both lrs
    # (peak 3e-3; at step index 8 the 8-step schedule (warmup 1) is at progress 1 (its 10%
    # floor), the 10-step one at progress 7/9).
    from examples.train import _lr_factor

    old, new = 3e-3 * _lr_factor(8, 8), 3e-3 * _lr_factor(8, 10)
    assert f"{old:.2e}" == "3.00e-04" and new > 2 * old  # 0.1 + 0.45 * (1 + cos(7 pi / 9)) = 0.205 of the peak
    assert (
        "  note: --steps 10 is not the checkpoint's run's 8: the learning-rate schedule (warmup + cosine) "
        f"is re-stretched to end at step 10; lr at step 9 is {new:.2e} (the old schedule's {old:.2e})\n"
    ) in resumed.stdout, resumed.stdout[:3000]
    assert re.search(rf"step +9/10 .*\| lr {new:.2e} \|", resumed.stdout), resumed.stdout[-2000:]

    # A corrupt checkpoint: two lines of advice on stderr, no traceback, exit status 2; --debug
    # adds the traceback.
    latest = latest_checkpoint(ckpt)
    assert latest is not None and latest.endswith("step_000010")
    for shard in glob.glob(os.path.join(latest, "*.distcp")):
        with open(shard, "r+b") as f:
            f.truncate(os.path.getsize(shard) // 2)
    broken = train("--steps", "12", "--checkpoint-dir", ckpt, "--resume", "--nprocs", "2")
    assert broken.returncode == 2, broken.stdout[-3000:] + broken.stderr[-3000:]
    assert "Traceback" not in broken.stderr + broken.stdout, broken.stderr[-3000:]
    advice = broken.stderr.strip().splitlines()
    assert len(advice) == 2, broken.stderr
    assert advice[0].startswith(f"fsdp example: cannot read checkpoint {latest} (") and advice[0].endswith(
        "It is truncated, corrupt or from another model; resume from an earlier step_* folder by pointing "
        f"latest at it (the newest other one: echo step_000008 > {os.path.join(ckpt, 'latest')}), or start "
        "without --resume."
    ), advice
    assert advice[1] == "  (--debug prints the reader's traceback)"
    assert "summary" not in broken.stdout and "total wall time" not in broken.stdout
    debug = train("--steps", "12", "--checkpoint-dir", ckpt, "--resume", "--nprocs", "1", "--debug")
    assert debug.returncode == 2, debug.stdout[-3000:] + debug.stderr[-3000:]
    assert "Traceback (most recent call last)" in debug.stderr and debug.stderr.strip().endswith(advice[1])

    # --overwrite deletes the earlier run's checkpoints before any rank starts (in this process).
    from examples.train import parse_args, prepare_checkpoint_dir

    assert prepare_checkpoint_dir(parse_args(["--checkpoint-dir", ckpt, "--overwrite"])) is None
    assert f"--overwrite: deleted the 3 checkpoint(s) of an earlier run in {ckpt}" in capsys.readouterr().out
    assert os.listdir(ckpt) == []


def test_trainer_timeout_argument(capsys: pytest.CaptureFixture[str]) -> None:
    """``--timeout`` (seconds, default 600) is validated before any rank starts."""
    from examples.train import parse_args

    assert parse_args([]).timeout == 600
    assert parse_args(["--timeout", "2.5"]).timeout == 2.5
    # Refused by the argument parser (exit status 2), before any rank starts.
    from examples.train import main

    with pytest.raises(SystemExit) as exited:
        main(["--batch-size", "4", "--timeout", "0"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--timeout must be positive (seconds)" in err, err[-2000:]


def test_resume_without_a_checkpoint_is_an_error(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """--resume with a misspelled, empty or disabled --checkpoint-dir stops before any rank starts."""
    from examples.train import main

    empty = tmp_path / "empty"
    empty.mkdir()
    for directory, why in [(tmp_path / "typo", "no such directory"), (empty, "it holds no checkpoint")]:
        assert main(["--resume", "--checkpoint-dir", str(directory)]) == 2
        err = capsys.readouterr().err
        assert (
            f"--resume: nothing to resume in --checkpoint-dir {directory} ({why}). Check the directory, "
            "or leave out --resume to start from step 0." in err
        ), err
    with pytest.raises(SystemExit) as exited:
        main(["--resume", "--checkpoint-dir", ""])
    assert exited.value.code == 2
    assert "--resume needs the --checkpoint-dir to resume from (it is '')" in capsys.readouterr().err


def test_short_runs_get_no_loss_verdict() -> None:
    """A run shorter than its model's transient is not judged (the exit status is 0); from the
    minimum on, the smoothed last loss must be below 0.99 x the first (see [Note: Loss verdict])."""
    from examples.train import MIN_VERDICT_STEPS, loss_verdict, parse_args

    assert parse_args(["--model", "medium", "--steps", "3"]).steps == 3
    # medium's first three losses at the default --lr: rising, as a fresh model's do.
    fell, text = loss_verdict("medium", 3, [4.1542], [4.1542, 4.8909, 5.6105])
    assert fell is None and text == (
        "no loss verdict: 3 steps are fewer than the 10 after which a medium model's loss is judged "
        "(its first steps are a transient); loss 4.1542 -> 5.6105"
    )
    assert loss_verdict("tiny", 4, [4.34], [4.34, 3.9, 3.6, 3.41]) == (True, "OK: loss fell from 4.3400 to 3.4100")
    assert loss_verdict("tiny", 4, [4.34], [4.34, 4.3, 4.33, 4.3])[0] is False
    assert loss_verdict("tiny", 4, [4.34], [4.34, 4.3, 4.33, math.nan])[0] is False
    # The windows are means: 20 steps average 2 at each end.
    assert loss_verdict("small", 20, [5.0, 3.0], [9.0] * 18 + [3.9, 3.9])[0] is True
    assert MIN_VERDICT_STEPS["tiny"] <= 4  # the bf16 command-line test judges 4 steps


def test_seq_len_is_the_block_size_and_has_a_maximum(capsys: pytest.CaptureFixture[str]) -> None:
    from examples.train import MAX_SEQ_LEN, parse_args

    assert parse_args(["--seq-len", str(MAX_SEQ_LEN)]).seq_len == MAX_SEQ_LEN
    for bad in ("100000", str(MAX_SEQ_LEN + 1)):
        with pytest.raises(SystemExit) as exited:
            parse_args(["--seq-len", bad])
        assert exited.value.code == 2
        assert f"--seq-len {bad} is above the maximum {MAX_SEQ_LEN} (the model's block_size;" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    assert "also the model's block_size" in " ".join(capsys.readouterr().out.split())


def _readme_trainer_section() -> str:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "README.md"), encoding="utf-8") as f:
        text = f.read()
    return text[text.index("### The example trainer") :].split("\n## ", 1)[0]


def test_help_and_readme_agree(capsys: pytest.CaptureFixture[str]) -> None:
    """Every flag of --help is in the README's table with the same default, the model sizes with
    their parameter counts (computed from the model) in both."""
    from examples.data import CharTokenizer, load_corpus
    from examples.train import describe_presets, parse_args

    section = _readme_trainer_section()
    rows = dict(re.findall(r"^\| `(--[a-z-]+)[^`]*` \| ([^|]*) \|", section, flags=re.M))
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    help_text = capsys.readouterr().out
    flags = re.findall(r"^  (--[a-z-]+)", help_text, flags=re.M)
    assert flags and sorted(rows) == sorted(flags), (sorted(rows), sorted(flags))
    defaults = vars(parse_args([]))
    for flag in flags:
        default, cell = defaults[flag[2:].replace("-", "_")], rows[flag].strip()
        if flag == "--log-every":
            assert cell == "`--steps // 20`, at least 1" and "default: --steps // 20, at least 1" in help_text
        elif default is False:
            assert cell == "", flag
        elif isinstance(default, float):
            assert float(cell.strip("`")) == default, flag
        else:
            assert cell.strip("`") == str(default), flag
    sizes = describe_presets(CharTokenizer(load_corpus()).vocab_size)
    assert sizes == "tiny 0.82M, small 10.7M, medium 85.2M"
    assert sizes in " ".join(help_text.split()) and sizes + " parameters" in section


def memory_phase(strategies: list[str]) -> dict[str, dict[str, Any]]:
    """One step of the trainer per strategy: the memory its summary reports."""
    import time

    import torch
    import torch.distributed as dist

    from examples.train import _setup, _step, memory_bytes, parse_args, predict_memory

    found = {}
    for strategy in strategies:
        args = parse_args(["--strategy", strategy, "--batch-size", "2", "--seq-len", "32", "--checkpoint-dir", ""])
        run = _setup(dist.get_rank(), 2, torch.device("cpu"), "gloo", args)
        _step(run, 0, time.perf_counter())
        found[strategy] = {"measured": memory_bytes(run)}
        if dist.get_rank() == 0:
            predicted = predict_memory(args, run.config.vocab_size, 2)
            found[strategy].update(peak=predicted.peak_bytes, breakdown=predicted.breakdown)
    return found


def test_memory_report_shows_sharding() -> None:
    """The summary's per-rank sizes, measured from the tensors, are what each strategy must hold
    at 2 ranks: FULL_SHARD and SHARD_GRAD_OP half of every unit's parameters (padded to an even
    count), gradients of the same size and AdamW's two moments plus one 4-byte step per unit;
    NO_SHARD all of them. The predicted step peak (fsdp.estimate_memory, what CPU runs report)
    counts the same sharded parameters and optimizer state, and orders the strategies as their
    schedules must: FULL_SHARD frees each unit after its forward and backward, SHARD_GRAD_OP keeps
    the gathered units from forward to backward, NO_SHARD holds everything unsharded."""
    import torch

    from examples.data import CharTokenizer, load_corpus
    from fsdp.plan.gpt import GPT, GPTConfig

    gpt = GPT(GPTConfig.from_preset("tiny", vocab_size=CharTokenizer(load_corpus()).vocab_size, block_size=32))
    blocks = [sum(p.numel() for p in block.parameters()) for block in gpt.blocks]
    units = [gpt.num_parameters() - sum(blocks), *blocks]  # the root unit, one per block
    fp32 = torch.float32.itemsize
    expected_params = {
        "FULL_SHARD": fp32 * sum(math.ceil(n / 2) for n in units),
        "SHARD_GRAD_OP": fp32 * sum(math.ceil(n / 2) for n in units),
        "NO_SHARD": fp32 * gpt.num_parameters(),
    }
    peaks = {}
    ranks = get_pool(2).run(memory_phase, list(expected_params))
    for strategy, params in expected_params.items():
        expected = {"parameters": params, "gradients": params, "optimizer state": 2 * params + fp32 * len(units)}
        assert [r[strategy]["measured"] for r in ranks] == [expected, expected], strategy
        breakdown = ranks[0][strategy]["breakdown"]
        assert breakdown["sharded parameters"] == params, (strategy, breakdown)
        assert breakdown["optimizer state"] == expected["optimizer state"], (strategy, breakdown)
        peaks[strategy] = ranks[0][strategy]["peak"]
    assert peaks["FULL_SHARD"] < peaks["SHARD_GRAD_OP"] < peaks["NO_SHARD"], peaks


def test_resume_of_a_checkpoint_without_run_json(tmp_path: Any) -> None:
    """A checkpoint saved before checkpoints recorded their configuration: its step comes from
    the folder's name, and the line before loading says that nothing checks the model."""
    from examples.checkpoint import LATEST
    from examples.train import _check_checkpoint_dir, parse_args

    folder = tmp_path / "step_000005"
    folder.mkdir()
    (folder / ".metadata").write_text("x")  # what makes a folder complete
    (tmp_path / LATEST).write_text("step_000005\n")
    args = parse_args(["--resume", "--checkpoint-dir", str(tmp_path), "--steps", "5"])
    assert _check_checkpoint_dir(args) == (
        f"fsdp example: checkpoint is at step 5 >= --steps 5: nothing to train; pass --steps > 5 (checkpoint {folder})"
    )
    args = parse_args(["--resume", "--checkpoint-dir", str(tmp_path), "--steps", "9", "--seq-len", "32"])
    assert _check_checkpoint_dir(args) is None and args.resume_from == str(folder)
    assert args.resume_note == (
        f"fsdp example: resuming {folder} at step 5 of --steps 9; it records no configuration (an older "
        "save): loading it as --model tiny --seq-len 32"
    )


def test_resume_says_how_the_lr_schedule_changes() -> None:
    """[Note: Resuming with another --steps]: the line a resume prints for a longer, a shorter,
    the same and an unrecorded --steps, and for a --lr the checkpoint overrides."""
    from types import SimpleNamespace

    from examples.train import _lr_factor, _say_schedule_change, parse_args

    def said(steps: int, saved: Any, lr: float = 3e-3, peak: float = 3e-3) -> list[str]:
        lines: list[str] = []
        args = parse_args(["--steps", str(steps), "--lr", str(lr)])
        args.resume_steps = saved
        run = SimpleNamespace(args=args, start_step=300, scheduler=SimpleNamespace(base_lrs=[peak]), say=lines.append)
        _say_schedule_change(run)  # type: ignore[arg-type]
        return lines

    assert said(500, 500) == []
    longer, old = 3e-3 * _lr_factor(300, 800), 3e-3 * _lr_factor(300, 500)
    assert said(800, 500) == [
        "  note: --steps 800 is not the checkpoint's run's 500: the learning-rate schedule (warmup + cosine) "
        f"is re-stretched to end at step 800; lr at step 301 is {longer:.2e} (the old schedule's {old:.2e})"
    ]
    assert longer > old  # further from the end of its cosine
    shorter = 3e-3 * _lr_factor(300, 400)
    assert said(400, 500)[0].startswith("  note: --steps 400 is not the checkpoint's run's 500: the learning-rate "
                                         f"schedule (warmup + cosine) is shortened to end at step 400; lr at step 301 is {shorter:.2e}")
    assert said(800, None) == [
        "  note: the checkpoint does not record its run's --steps (an older save): the learning-rate schedule "
        f"(warmup + cosine) is this run's, ending at step 800; lr at step 301 is {longer:.2e}"
    ]
    assert said(500, 500, lr=1e-3) == ["  note: --lr 0.001 is ignored: the peak learning rate is the checkpoint's, 0.003"]
