"""The example trainer (the README's main job) runs end to end from its command line: two local
CPU ranks, FULL_SHARD, in full precision and in bf16 mixed precision, and its loss falls."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


@pytest.mark.parametrize("precision", ["none", "bf16"])
def test_trainer_command_line(precision: str) -> None:
    cmd = [
        sys.executable, "-m", "fsdp.examples.train", "--steps", "8", "--batch-size", "4",
        "--log-every", "4", "--checkpoint-dir", "", "--mixed-precision", precision,
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    match = re.search(r"OK: loss fell from ([0-9.]+) to ([0-9.]+)", run.stdout)
    assert match, run.stdout[-3000:]
    first, last = map(float, match.groups())
    assert last < first
