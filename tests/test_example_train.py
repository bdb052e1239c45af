"""The example trainer (the README's main job) runs end to end from its command line: two local
CPU ranks, FULL_SHARD, in full precision and in bf16 mixed precision, and its loss falls."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


def _assert_loss_fell(stdout: str) -> None:
    match = re.search(r"OK: loss fell from ([0-9.]+) to ([0-9.]+)", stdout)
    assert match, stdout[-3000:]
    first, last = map(float, match.groups())
    assert last < first


def test_trainer_command_line_bf16() -> None:
    """bf16 mixed precision, no checkpoints, a chosen collective timeout (full precision with
    checkpoints and the default timeout: the first run of the checkpoint test below).

    Four steps, in which the loss falls by about 20% on every CPU tried (4.34 -> 3.41, the same to
    3 decimals with oneDNN limited to AVX2, AVX512-BF16 or AMX). Not more: on a CPU with AMX, bf16
    training of this model at its default learning rate diverges from step 6 (3.39 -> 5.94); the
    same loop on torch FSDP1 gives the same losses as fsdp to the bit there, and with AVX512-BF16
    or AVX2 kernels both go on falling. That is the CPU's bf16 kernels, not the trainer.
    """
    cmd = [
        sys.executable, "-m", "examples.train", "--steps", "4", "--batch-size", "4",
        "--log-every", "2", "--checkpoint-dir", "", "--mixed-precision", "bf16", "--timeout", "90",
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "collective timeout 90 s (--timeout): a rank stuck longer" in run.stdout, run.stdout[:2000]
    _assert_loss_fell(run.stdout)


def _train(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "examples.train", "--batch-size", "4", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_trainer_checkpoint_dir_resume_and_refusal(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    """Where checkpoints go is said; a second run into the same directory without --resume is
    refused before any rank starts; a resume at another world size says how the global batch
    changes; progress lines carry a percentage."""
    ckpt = str(tmp_path)
    # Full precision, the default collective timeout, checkpoints.
    first = _train("--steps", "8", "--checkpoint-dir", ckpt, "--checkpoint-every", "4", "--log-every", "4")
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

    resumed = _train("--steps", "10", "--checkpoint-dir", ckpt, "--resume", "--nprocs", "1")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "at step 8" in resumed.stdout
    # 2 ranks x 4 x 64 = 512 tokens per step saved; 1 rank x 4 x 64 = 256 now.
    assert "the global batch changes from 512 to 256 tokens/step" in resumed.stdout
    assert "pass --batch-size 8 to keep it" in resumed.stdout
    assert "FutureWarning" not in resumed.stderr, resumed.stderr[-3000:]


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
