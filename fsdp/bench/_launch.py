"""Spawning the local ranks and collecting what they wrote."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import tempfile
import time
from typing import Any

from fsdp.bench._config import BenchConfig

__all__ = ["launch"]


def launch(cfg: BenchConfig) -> list[dict[str, Any]]:
    """Runs :func:`fsdp.bench._worker.rank_entry` on ``cfg.world_size`` spawned processes.

    Ranks rendezvous through a file in a fresh temporary folder. Returns each rank's result in
    rank order; raises ``RuntimeError`` if a rank fails or the run exceeds ``cfg.timeout_s``
    (the other ranks are then terminated, they would block in a collective).
    """
    from fsdp.bench._worker import rank_entry

    # The profiler's kineto backend logs every start/stop (at its USDT level, 5) unless told otherwise;
    # the spawned ranks inherit this before they import torch.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    ctx = multiprocessing.get_context("spawn")
    cfg_dict = dataclasses.asdict(cfg)
    with tempfile.TemporaryDirectory(prefix="fsdp_bench_") as workdir:
        procs = [ctx.Process(target=rank_entry, args=(r, cfg_dict, workdir), name=f"fsdp-bench-rank{r}") for r in range(cfg.world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + cfg.timeout_s
        failed = None
        try:
            while any(p.is_alive() for p in procs):
                for r, p in enumerate(procs):
                    if not p.is_alive() and p.exitcode not in (0, None):
                        failed = f"rank {r} exited with code {p.exitcode}"
                if failed or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            for r, p in enumerate(procs):
                if p.exitcode not in (0, None) and failed is None:
                    failed = f"rank {r} exited with code {p.exitcode}"
            if failed is None and any(p.is_alive() for p in procs):
                failed = f"timed out after {cfg.timeout_s:.0f} s"
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
            for p in procs:
                p.join(10)
        if failed:
            raise RuntimeError(f"fsdp.bench: {failed}")
        results = []
        for r in range(cfg.world_size):
            with open(os.path.join(workdir, f"rank{r}.json")) as f:
                results.append(json.load(f))
        return results
