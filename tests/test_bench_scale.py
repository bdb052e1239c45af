"""``benchmarks/scale.py``, rank r of N on torch's fake process group: the fabric's arithmetic,
and the CPU run (the tooling CI can run: memory and modelled communication, no timing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.scale import LLAMAS, PRESETS, Fabric

ROOT = Path(__file__).resolve().parents[1]


def test_collective_seconds_follow_the_bus_bandwidth_convention() -> None:
    fabric = Fabric("f", intra_bw=400e9, inter_bw=50e9, intra_latency_s=1e-5, inter_latency_s=2e-5, ranks_per_node=8)
    gib = 2**30
    # An all-gather of 1 GiB over one node's 8 ranks: 7/8 of it at the intra-node bus bandwidth.
    assert fabric.collective_seconds("all_gather", gib, list(range(8))) == pytest.approx(7 / 8 * gib / 400e9 + 1e-5)
    # The same over 16 ranks spans two nodes: the inter-node bandwidth, 15/16 of the bytes.
    assert fabric.collective_seconds("reduce_scatter", gib, list(range(16))) == pytest.approx(15 / 16 * gib / 50e9 + 2e-5)
    # HYBRID's replicate group (one rank per node) crosses nodes; an all-reduce moves 2(n-1)/n.
    assert fabric.collective_seconds("all_reduce", gib, [0, 8, 16, 24]) == pytest.approx(2 * 3 / 4 * gib / 50e9 + 2e-5)
    assert fabric.collective_seconds("all_gather", gib, [3]) == 0.0  # one rank moves nothing
    presets = PRESETS(efficiency=0.5)
    assert presets["nvlink"].intra_bw == 225e9 and presets["ib"].inter_bw == 25e9


def test_llama_shapes() -> None:
    # Llama 3 8B's shapes: 8.03e9 parameters; the 1B's (head untied): 1.50e9.
    assert LLAMAS["llama-8b"].params() == 8_030_261_248
    assert round(LLAMAS["llama-1b"].params() / 1e9, 2) == 1.50


def test_cpu_run_writes_every_implementation_and_prices_the_same_bytes(tmp_path: Path) -> None:
    """fsdp, torch FSDP1 and FSDP2 train as rank 3 of 16 (FULL_SHARD, and HYBRID_SHARD with 8
    ranks per node); fsdp issues torch FSDP1's collectives but one all-gather (the last block stays
    gathered from forward into backward: [Note: The first backward unit stays gathered]), so its
    modelled seconds are lower by that gather's; the JSON carries its date and targets."""
    out = tmp_path / "scale.json"
    cmd = [sys.executable, "-m", "benchmarks.scale", "--cpu-dry-run", "--model", "tiny", "--rank", "3",
           "--world-size", "16", "--fabric", "ib", "--strategies", "FULL_SHARD,HYBRID_SHARD", "--batch", "2",
           "--seq", "16", "--warmup", "1", "--steps", "1", "--rounds", "1", "--no-plan", "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "not modelled: NCCL kernels sharing SMs" in proc.stderr
    doc = json.loads(out.read_text())
    assert doc["date"] and doc["timed"] is False
    assert [r["config"]["strategy"] for r in doc["results"]] == ["FULL_SHARD", "HYBRID_SHARD"]
    for result in doc["results"]:
        strategy = result["config"]["strategy"]
        assert result["config"]["world_size"] == 16 and result["config"]["rank"] == 3
        rows = {r["impl"]: r for r in result["rows"]}
        assert list(rows) == ["fsdp", "torch_fsdp1", "torch_fsdp2"]
        assert all(r["modelled_comm_s"] > 0 and r["step_peak_above_start"] > 0 for r in rows.values())
        units = LLAMAS["tiny"].layers + 1  # one per block, and the root
        # torch FSDP1: every unit gathered in forward, again in backward but the root (kept).
        replicated = {"all_reduce": units} if strategy == "HYBRID_SHARD" else {}
        theirs = {"all_gather": 2 * units - 1, "reduce_scatter": units, **replicated}
        assert rows["torch_fsdp1"]["collectives"] == theirs
        assert rows["fsdp"]["collectives"] == {**theirs, "all_gather": 2 * units - 2}
        assert rows["fsdp"]["modelled_comm_s"] < rows["torch_fsdp1"]["modelled_comm_s"]
    assert [t["status"] for t in doc["targets"]] == ["met", "met"]
    assert all(t["ratio"] < 1.0 for t in doc["targets"])
    # HYBRID keeps its shards in the node (NVLink) and all-reduces across nodes (InfiniBand):
    # the same bytes cost less than FULL_SHARD's all-gathers over 16 ranks of two nodes.
    full, hybrid = (r["rows"][0]["modelled_comm_s"] for r in doc["results"])
    assert hybrid < full
