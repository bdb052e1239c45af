"""Spawning the benchmark's local ranks and collecting what they wrote."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from fsdp._local_ranks import run_local_ranks
from fsdp.bench._config import BenchConfig

__all__ = ["launch"]


def launch(cfg: BenchConfig) -> list[dict[str, Any]]:
    """Runs :func:`fsdp.bench._worker.rank_entry` on ``cfg.world_size`` spawned processes.

    Ranks rendezvous through a file in a fresh temporary folder ([Note: Local rank protocol] in
    ``fsdp/_local_ranks.py``). Returns each rank's result in rank order; raises ``RuntimeError``
    if a rank fails or the run exceeds ``cfg.timeout_s`` (the other ranks are then terminated,
    they would block in a collective).
    """
    from fsdp.bench._worker import rank_entry

    # The profiler's kineto backend logs every start/stop (at its USDT level, 5) unless told otherwise;
    # the spawned ranks inherit this before they import torch.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    return run_local_ranks(
        rank_entry, dataclasses.asdict(cfg), cfg.world_size, cfg.timeout_s, prog="fsdp.bench"
    )
