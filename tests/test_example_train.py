"""The example trainer (the README's main job) runs end to end from its command line: two local
CPU ranks, FULL_SHARD, in full precision and in bf16 mixed precision, and its loss falls."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


@pytest.mark.parametrize("precision", ["none", "bf16"])
def test_trainer_command_line(precision: str) -> None:
    # The collective timeout: the default once, a chosen one once; the log says which.
    timeout = ["--timeout", "90"] if precision == "bf16" else []
    cmd = [
        sys.executable, "-m", "fsdp.examples.train", "--steps", "8", "--batch-size", "4",
        "--log-every", "4", "--checkpoint-dir", "", "--mixed-precision", precision, *timeout,
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    seconds = "90" if timeout else "600"
    assert f"collective timeout {seconds} s (--timeout): a rank stuck longer" in run.stdout, run.stdout[:2000]
    match = re.search(r"OK: loss fell from ([0-9.]+) to ([0-9.]+)", run.stdout)
    assert match, run.stdout[-3000:]
    first, last = map(float, match.groups())
    assert last < first


def _train(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "fsdp.examples.train", "--batch-size", "4", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_trainer_checkpoint_dir_resume_and_refusal(tmp_path: object) -> None:
    """Where checkpoints go is said; a second run into the same directory without --resume is
    refused before any rank starts; a resume at another world size says how the global batch
    changes; progress lines carry a percentage."""
    ckpt = str(tmp_path)
    first = _train("--steps", "8", "--checkpoint-dir", ckpt, "--checkpoint-every", "4")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert f"checkpoints: {ckpt} every 4 steps and at the end (keeping the newest 3)" in first.stdout
    assert re.search(r"step +8/8 \(100%", first.stdout), first.stdout[-2000:]

    again = _train("--steps", "8", "--checkpoint-dir", ckpt)
    assert again.returncode == 2
    assert "already holds checkpoints of an earlier run (latest: step_000008)" in again.stderr
    assert "Pass --resume to continue from it, --overwrite to start over" in again.stderr
    assert "step " not in again.stdout  # nothing trained

    resumed = _train("--steps", "10", "--checkpoint-dir", ckpt, "--resume", "--nprocs", "1")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "at step 8" in resumed.stdout
    # 2 ranks x 4 x 64 = 512 tokens per step saved; 1 rank x 4 x 64 = 256 now.
    assert "the global batch changes from 512 to 256 tokens/step" in resumed.stdout
    assert "pass --batch-size 8 to keep it" in resumed.stdout
    assert "FutureWarning" not in resumed.stderr, resumed.stderr[-3000:]


def test_trainer_timeout_argument() -> None:
    """``--timeout`` (seconds, default 600) is validated before any rank starts."""
    from fsdp.examples.train import parse_args

    assert parse_args([]).timeout == 600
    assert parse_args(["--timeout", "2.5"]).timeout == 2.5
    bad = _train("--timeout", "0")
    assert bad.returncode == 2 and "--timeout must be positive (seconds)" in bad.stderr, bad.stderr[-2000:]
