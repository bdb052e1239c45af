"""The README's flat-shard checkpoint example runs: saves at 2 ranks (synchronously, and
asynchronously with a step trained during the write), resumes bit-exactly at 3 (at 1 after
the asynchronous save: fewer processes to start)."""

from __future__ import annotations

import os
import subprocess
from typing import Any, List

from tests._preloaded import REPO_ROOT, run_python

# The example's main() with its ranks forked, not spawned: its mp.spawn(fn, args=..., nprocs=...)
# becomes torch's start_processes(..., start_method="fork") from a process that imported what
# every rank imports (fsdp's checkpoint module, DCP, Dynamo, which AdamW loads) once. Each
# spawned rank spent ~2.5 s of CPU on those imports (8 ranks here). The ranks take everything
# from their arguments and a file rendezvous, so how they start changes nothing they compute.
# That process is itself a fork of the session's torch-loaded interpreter ([Note: Test
# commands forked from a preloaded interpreter] in tests/_preloaded.py); what rank 0 prints is
# its stdout.
_MAIN_WITH_FORKED_RANKS = r"""
import functools, sys, types
import torch._dynamo, torch.multiprocessing
import fsdp.checkpoint
import examples.sharded_checkpoint as example
example.mp = types.SimpleNamespace(spawn=functools.partial(torch.multiprocessing.start_processes, start_method="fork"))
sys.exit(example.main(sys.argv[1:]))
"""


def _main(args: List[str]) -> str:
    """The example's exit status (asserted 0) and stdout."""
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    done: subprocess.CompletedProcess = run_python(["-c", _MAIN_WITH_FORKED_RANKS, *args], env=env, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_example_sharded_checkpoint(tmp_path: Any) -> None:
    out = _main(["--save-ranks", "2", "--load-ranks", "3", "--steps", "2", "--dir", str(tmp_path)])
    assert "saved after 2 steps at 2 ranks" in out
    assert "resumed at 3 ranks, state bit-exact" in out


def test_example_async_sharded_checkpoint(tmp_path: Any) -> None:
    out = _main(["--save-ranks", "2", "--load-ranks", "1", "--steps", "2", "--dir", str(tmp_path), "--async-save"])
    assert "async-saved (one more step trained during the write) after 2 steps at 2 ranks" in out
    assert "resumed at 1 ranks, state bit-exact" in out
