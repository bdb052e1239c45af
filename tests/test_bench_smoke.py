"""Smoke test of ``python -m benchmarks``: a tiny configuration runs end to end and reports
every implementation, every ratio, finite positive numbers, and the minimum communication."""

from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path

from torch import nn

from benchmarks.config import CHECKPOINTED, BenchConfig
from tests._preloaded import run_python

IMPLS = ("fsdp", "torch_fsdp1", "torch_fsdp2", "ddp", "local")
WARMUP = BenchConfig.warmup_steps
ROOT = Path(__file__).resolve().parents[1]


def _minimum_full_shard_bytes(layers: int, d_model: int, world_size: int) -> int:
    """FULL_SHARD minimum, computed here from the model itself (not from benchmarks)."""
    layer = nn.TransformerEncoderLayer(d_model, 8, dim_feedforward=4 * d_model, batch_first=True)
    layer_numel = sum(p.numel() for p in layer.parameters())
    root_numel = 2 * d_model  # the final LayerNorm

    def padded(n: int) -> int:
        return -(-n // world_size) * world_size

    # Layers twice (forward, backward) but the last once, root once: those two stay gathered
    # from their forward into their backward, which comes first.
    all_gather = (2 * layers - 1) * padded(layer_numel) + padded(root_numel)
    reduce_scatter = (layers * padded(layer_numel) + padded(root_numel)) // world_size
    return 4 * (all_gather + reduce_scatter)


def _number(text: str) -> float:
    return float(text.rstrip("x"))


def test_bench_tiny_config(tmp_path: Path) -> None:
    json_path = tmp_path / "bench.json"
    cmd = [
        sys.executable, "-m", "benchmarks",
        "--world-size", "2", "--layers", "2", "--d-model", "32", "--batch", "2", "--seq", "8",
        "--rounds", "1", "--steps-per-round", "2", "--checkpoint-reps", "1", "--timeout", "120",
        "--json", str(json_path),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = run_python(cmd[1:], cwd=str(ROOT), env=env, timeout=180)  # [Note: Test commands forked from a preloaded interpreter]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    # Progress on stderr (rank 0): a line per phase, implementation or round, never per step.
    progress = [line for line in proc.stderr.splitlines() if line.startswith("benchmarks: ")]
    assert progress == [
        f"benchmarks: starting 2 local ranks ({', '.join(IMPLS)})",
        *[f"benchmarks: memory [{i + 1}/{len(IMPLS)}] {name}" for i, name in enumerate(IMPLS)],
        f"benchmarks: warm-up: {WARMUP} steps of each of {len(IMPLS)} implementations",
        "benchmarks: timing round [1/1] (2 steps of each implementation)",
        f"benchmarks: checkpoint saves: 1 timed of each of {len(CHECKPOINTED)} implementations",
    ], proc.stderr[-3000:]

    # The main table: one row per implementation, every number finite and positive (the local
    # baseline communicates nothing, so its bytes and their ratio are 0).
    table = out.split("\nimplementation ", 1)[1].split("\n\n", 1)[0]
    rows = {}
    for line in table.splitlines()[1:]:
        fields = line.split()
        assert len(fields) == 8, line
        rows[fields[0]] = fields[1:]
    assert set(rows) == set(IMPLS), out
    for name, fields in rows.items():
        values = [_number(f) for f in fields]  # "n/a" would fail here: every ratio is present
        assert all(math.isfinite(v) for v in values), (name, fields)
        positive = values if name != "local" else values[:5]
        assert all(v > 0 for v in positive), (name, fields)
    assert rows["torch_fsdp1"][1] == "1.00x" and rows["local"][2] == "1.00x"

    # CPU section: every implementation's CPU time per step, the floor it sets, the ratio of the
    # floor to local and the time above the floor. The floor is a lower bound of the step: at
    # least the busiest training thread's CPU time, and at least the ranks' CPU over the cores.
    cpu_table = out.split("cpu per step", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    cpu_rows = {line.split()[0]: [_number(f) for f in line.split()[1:]] for line in cpu_table}
    assert set(cpu_rows) == set(IMPLS), out
    for name, (cpu_s, main_s, floor_s, floor_vs_local, waiting_s) in cpu_rows.items():
        assert 0 < main_s <= cpu_s and floor_s >= main_s and floor_vs_local > 0, (name, cpu_rows[name])
        assert math.isfinite(waiting_s), (name, cpu_rows[name])
    # The step-time guard shows the spread of its per-round ratios around the median.
    pattern = r"step time <= torch FSDP1's: ([\d.]+)x \(rounds ([\d.]+)x-([\d.]+)x; the CPU floor alone is [\d.]+x local\)"
    m = re.search(pattern, out)
    assert m and float(m.group(2)) <= float(m.group(1)) <= float(m.group(3)), (pattern, out[-2000:])

    # Checkpoint section: ours and torch FSDP1, times and ratios.
    ckpt = {}
    for line in out.split("checkpoint:", 1)[1].splitlines():
        fields = line.split()
        if fields and fields[0] in ("fsdp", "torch_fsdp1"):
            ckpt[fields[0]] = fields
    assert set(ckpt) == {"fsdp", "torch_fsdp1"}, out
    for fields in ckpt.values():
        nums = [_number(f) for f in fields[1:5]]
        assert all(math.isfinite(v) and v > 0 for v in nums), fields
        save = re.match(r"([\d.]+)x/([\d.]+)x", fields[5])
        assert save and float(save.group(1)) > 0 and float(save.group(2)) > 0, fields

    # Targets: every one reported, met or not.
    for target in ("step time <= torch FSDP1's",
                   "training peak <= min(torch FSDP1, torch FSDP2)",
                   "full model state dict time <= 0.5x", "optim_state_dict time <= 0.5x", "bytes == the FULL_SHARD minimum"):
        assert re.search(r"\[(met    |NOT MET)\] [^\n]*" + re.escape(target), out), target

    # Ours communicates exactly the strategy's minimum.
    minimum = _minimum_full_shard_bytes(layers=2, d_model=32, world_size=2)
    m = re.search(r"comm fsdp\s+(\d+) bytes", out)
    assert m and int(m.group(1)) == minimum, (m and m.group(1), minimum)
    assert f"[met    ] bytes == the FULL_SHARD minimum: {minimum} vs minimum {minimum}" in out

    summary = json.loads(json_path.read_text())["summary"]
    assert summary["minimum_total_bytes"] == minimum
    for name in IMPLS:
        entry = summary["implementations"][name]
        assert entry["step_s"] > 0 and math.isfinite(entry["step_s"])
        ranks = json.loads(json_path.read_text())["ranks"]
        for i, floor in enumerate(entry["floor_s_rounds"]):
            per_rank_cpu = [r["cpu_s"][name][i] for r in ranks]
            per_rank_main = [r["main_cpu_s"][name][i] for r in ranks]
            assert floor == max(max(per_rank_main), sum(per_rank_cpu) / entry["cores"])
        assert all(b > 0 for b in entry["peak_bytes_per_rank"])
    assert summary["implementations"]["fsdp"]["comm_bytes_per_rank"] == [minimum, minimum]


def _forward_prefetch_reaches_every_fsdp() -> None:
    from benchmarks.config import parse_args
    from benchmarks.core import WrapOptions, build_model, wrap

    args = ["--layers", "2", "--d-model", "16", "--nhead", "2"]
    for flag in (False, True):
        cfg = parse_args(args + (["--forward-prefetch"] if flag else []))
        assert cfg.forward_prefetch is flag
        opts = WrapOptions(strategy=cfg.strategy, forward_prefetch=cfg.forward_prefetch)
        ours = wrap("fsdp", build_model(cfg.spec), opts)
        assert ours._fsdp_state.forward_prefetch is flag  # type: ignore[union-attr]
        theirs = wrap("torch_fsdp1", build_model(cfg.spec), opts)
        assert theirs.forward_prefetch is flag  # type: ignore[union-attr]
        fsdp2 = wrap("torch_fsdp2", build_model(cfg.spec), opts)
        layers = list(fsdp2.layers)  # type: ignore[union-attr]
        first_prefetches = layers[0]._get_fsdp_state()._states_to_forward_prefetch  # type: ignore[operator]
        assert [s._modules[0] for s in first_prefetches] == ([layers[1]] if flag else [])


def test_bench_forward_prefetch_flag(pool2) -> None:  # type: ignore[no-untyped-def]
    pool2.run(_forward_prefetch_reaches_every_fsdp)
