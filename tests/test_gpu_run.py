"""The prepared GPU run (``benchmarks/gpu_run.py``) on CPU: its ``--dry-run`` runs every step's
CPU equivalent and import check, writes every log and JSON, and records the exact GPU commands;
the time budget skips steps; a step over its limit is killed with its children."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_run
from benchmarks.config import block_params, gpt_params
from benchmarks.report import flops_per_token
from benchmarks.scale import LLAMAS

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": ""}  # the script puts the repository root there itself


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The whole dry run, once for the tests below; its output folder."""
    out = tmp_path_factory.mktemp("gpu_run") / "out"
    cmd = [sys.executable, "benchmarks/gpu_run.py", "--dry-run", "--out", str(out), "--budget-s", "1500"]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=1600, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def test_dry_run_runs_every_step(dry_run: Path) -> None:
    out = dry_run
    summary = json.loads((out / "summary.json").read_text())
    names = [s.name for s in gpu_run.steps(str(out))]
    assert (out / "00_imports.log").read_text().rstrip().endswith("FAILED []")  # every step's modules import
    assert [r["step"] for r in summary["steps"]] == names
    for index, rec in enumerate(summary["steps"], 1):
        assert rec["status"] == "ok", rec
        assert (out / f"{index:02d}_{rec['step']}.log").read_text().startswith("$ " + rec["command"])
    gpu = {r["step"]: r["gpu_command"] for r in summary["steps"]}
    assert gpu["install"].endswith("-m pip install --no-deps --no-build-isolation -e .")
    assert gpu["cuda_lane"].endswith("tests/test_cuda_lane.py tests/test_cuda_lane_offload.py tests/test_cuda_lane_async_checkpoint.py")
    assert "--device cuda --max-total 60GiB" in gpu["plan_gpu"] and gpu["plan_gpu"].endswith("10M 100M 1B")
    assert "--compile --only fsdp,torch_fsdp1,local" in gpu["bench_compile"]
    assert "--offload --offload-sizes 1,2,4" in gpu["offload"]
    assert "-m benchmarks.ws2_memory" in gpu["ws2_memory"] and "--dry-run" not in gpu["ws2_memory"]
    assert "--cpu-dry-run" not in " ".join(gpu.values())
    assert {r["step"]: r["env"] for r in summary["steps"]}["lane_sanitizer"] == {
        "FSDP_TEST_DEVICE": "cuda", "TORCH_CUDA_SANITIZER": "1"}
    # The benchmark steps' CPU equivalents ran the measurement code: every run ok, JSON written.
    for name in ("bench_eager", "bench_compile"):
        doc = json.loads((out / f"{name}.json").read_text())
        assert doc["runs"] and all(r["status"] == "ok" for r in doc["runs"]), doc["runs"]
    compiled = json.loads((out / "bench_compile.json").read_text())
    assert compiled["config"]["compile"] is True
    losses = {r["impl"]: r["losses"] for r in compiled["runs"]}
    assert losses["fsdp"] == losses["torch_fsdp1"]  # the same arithmetic, compiled as eager
    walk = json.loads((out / "offload.json").read_text())["offload"]["sizes"]
    # fsdp trains every size; torch FSDP1's offload fails on a CPU-only machine (README), an
    # implementation's failure that the walk records and goes on.
    assert [row["fsdp"]["status"] for row in walk.values()] == ["trains", "trains"]
    assert all(row["torch_fsdp1"]["status"] in ("trains", "error") for row in walk.values())
    # Beside each size, the limits: the bytes fsdp's offload copies per step from the model's
    # parameter count (every unit host to device in forward and in backward but the last block,
    # every gradient back once: [Note: Offload limits]), exactly; the times measured, positive.
    for row in walk.values():
        params, limits = row["params"], row["limits"]
        assert params == gpt_params(row["layers"], 32, 64, 16)[0]  # gpu_run.TINY's GPT
        assert (limits["h2d_bytes"], limits["d2h_bytes"]) == (4 * (2 * params - block_params(32)), 4 * params)
        assert all(limits[k] > 0 for k in ("copies_s", "adamw_default_s", "adamw_fused_s", "adamw_traffic_s"))
        assert row["fsdp_step_vs_limits"] > 0
    offload_log = (out / f"{names.index('offload') + 1:02d}_offload.log").read_text()
    assert "no GPU: host memcpy" in offload_log and "step / (copies + fused AdamW) = " in offload_log
    # The offload knob's curve: five fractions, the units chosen growing with it, each point
    # against its floor; fraction 0 offloads nothing and 1 every unit.
    knob = json.loads((out / "offload_walk.json").read_text())
    assert {"date", "targets", "rates", "points"} <= knob.keys()
    chosen = [pt["units_offloaded"] for pt in knob["points"]]
    assert [pt["fraction"] for pt in knob["points"]] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert chosen == sorted(chosen) and chosen[0] == 0 and chosen[-1] == knob["points"][-1]["units"]
    assert all(pt["step_s"] > 0 and pt["floor_s"] > 0 for pt in knob["points"])
    ws2 = json.loads((out / "ws2_memory.json").read_text())["results"]
    assert [r["losses"] for r in ws2["fsdp"]] == [r["losses"] for r in ws2["torch_fsdp1"]]
    export = json.loads((out / "export.json").read_text())  # issue 34's export, world size 1 (on CPU here)
    assert "date" in export and export["targets"] and "world_size_1" in export["config"] and "--device cuda" in gpu["export"]
    assert (out / "cpu_suite.xml").exists() and (out / "cuda_lane.xml").exists()


def test_bench_eager_step_is_the_benchmark_end_to_end_on_cpu(dry_run: Path) -> None:
    """``python -m benchmarks --device cuda --cpu-dry-run`` (the dry run's ``bench_eager`` step,
    two rounds of two steps with ``--profile``): the GPU benchmark's measurement code end to end
    on CPU, JSON included (its folder's creation: tests/test_bench_cuda.py)."""
    json_path = dry_run / "bench_eager.json"
    log = next(dry_run.glob("*_bench_eager.log")).read_text()
    assert [f.name for f in dry_run.glob("bench_eager.json*")] == ["bench_eager.json"]  # rewritten after each run, whole
    doc = json.loads(json_path.read_text())
    assert doc["schema"] == "benchmarks.cuda/1"
    assert set(doc) == {"schema", "date", "env", "config", "model", "runs", "summary", "targets", "profile"}
    assert doc["date"][:4].isdigit() and "T" in doc["date"]  # the benchmark JSON contract: dated
    assert doc["model"] == dict(zip(("params", "matmul_params"), gpt_params(2, 32, 64, 16)))
    assert set(doc["env"]) >= {"device_name", "torch", "cuda", "date", "nccl"}
    assert doc["env"]["device_name"] == "cpu (dry run)" and doc["env"]["torch"] == torch.__version__
    assert doc["config"]["layers"] == 2 and doc["config"]["batch"] == 2 and doc["config"]["cpu_dry_run"] is True

    impls = ["fsdp", "torch_fsdp1", "torch_fsdp2", "local"]
    runs = doc["runs"]
    assert sorted((r["round"], r["impl"]) for r in runs) == sorted((rnd, i) for rnd in range(2) for i in impls)
    # Alternating order, rotated each round; the first round measures the torch baselines
    # before fsdp (should fsdp break the GPU, their numbers are in).
    assert [r["impl"] for r in runs if r["round"] == 0] == impls[1:] + impls[:1]
    assert [r["impl"] for r in runs if r["round"] == 1] == impls[2:] + impls[:2]
    for r in runs:
        assert r["status"] == "ok", r
        assert len(r["step_s"]) == 2 and all(x > 0 for x in r["step_s"])
        assert r["host_step_s"] == r["step_s"]  # on CPU both are the same perf_counter marks
        assert len(r["losses"]) == 3 and all(math.isfinite(x) for x in r["losses"])
        assert r["max_allocated"] is None and r["max_reserved"] is None  # no GPU counters on CPU
    losses = {r["impl"]: r["losses"] for r in runs if r["round"] == 0}
    # fsdp, torch FSDP1 (both NO_SHARD at world size 1) and torch FSDP2 do the same arithmetic:
    # fp32 parameters cast to bf16 for forward and backward, bf16 gradients cast to fp32 and
    # "reduced" over one rank (a copy), the same elementwise AdamW per element: equal bits.
    assert losses["fsdp"] == losses["torch_fsdp1"] == losses["torch_fsdp2"]
    # Every round starts from the same weights and data, so rounds repeat exactly.
    assert [r["losses"] for r in runs if r["impl"] == "fsdp"][0] == [r["losses"] for r in runs if r["impl"] == "fsdp"][1]
    # The unwrapped model under autocast keeps LayerNorm and the residual stream in fp32, so it
    # is not bit-equal; its first loss differs only by bf16 rounding (relative 2^-8) of logits
    # that are below 1 in magnitude at this initialization, and cross entropy moves by at most
    # twice the largest logit change: well within 2 * 2^-8 * (a few roundings) < 0.05.
    assert abs(losses["local"][0] - losses["fsdp"][0]) < 0.05
    # The first loss of an untrained model is close to ln(vocab) (logits near 0).
    assert abs(losses["fsdp"][0] - math.log(64)) < 0.1

    s = doc["summary"]
    assert s["flops_per_token"] == flops_per_token(2, 32, 64, 16) and s["peak_flops"] is None
    assert s["loss_max_abs_diff"] == 0.0
    for impl in impls:
        e = s["impls"][impl]
        assert e["status"] == "ok" and e["rounds"] == 2 and e["mfu"] is None
        assert e["tokens_per_s"] == pytest.approx(32 / e["step_s"], rel=1e-12)
    assert s["impls"]["torch_fsdp1"]["ratios"]["tokens_per_s"] == 1.0
    assert [t["status"] for t in doc["targets"]][2:] == ["n/a"]  # no memory counters on CPU
    assert doc["profile"]["steps"] == 3 and 0 < len(doc["profile"]["rows"]) <= 25
    assert any(row["name"] == "aten::addmm" and row["count"] > 0 for row in doc["profile"]["rows"])

    assert "== fsdp profile: 3 steps" in log and "== GPU benchmark: cpu (dry run)" in log
    assert log.rstrip().endswith(f"wrote {json_path}")
    assert "targets:" in log and "fsdp max allocated <= torch_fsdp2's" in log


def test_scale_step_is_the_cpu_run_pricing_the_same_bytes(dry_run: Path) -> None:
    """The dry run's ``scale`` step (``benchmarks/scale.py --cpu-dry-run``): fsdp, torch FSDP1 and
    FSDP2 train as rank 3 of 16 (FULL_SHARD, and HYBRID_SHARD with 8 ranks per node); fsdp issues
    torch FSDP1's collectives but one all-gather (the last block stays gathered from forward into
    backward: [Note: The first backward unit stays gathered]), so its modelled seconds are lower by
    that gather's; the JSON carries its date and targets."""
    out = dry_run / "scale.json"
    log = next(dry_run.glob("*_scale.log")).read_text()  # the command's stdout and stderr
    assert "not modelled: NCCL kernels sharing SMs" in log
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


def test_budget_skips_steps_and_unknown_steps_are_an_error(tmp_path: Path) -> None:
    assert gpu_run.main(["--dry-run", "--out", str(tmp_path), "--budget-s", "1", "--steps", "env,cpu_suite"]) == 0
    recs = json.loads((tmp_path / "summary.json").read_text())["steps"]
    assert [(r["step"], r["status"]) for r in recs] == [("env", "skipped"), ("cpu_suite", "skipped")]
    assert recs[0]["reason"].endswith("needs 5")
    assert not (tmp_path / "00_imports.log").exists()  # no step started: no import check either
    proc = subprocess.run([sys.executable, "benchmarks/gpu_run.py", "--out", str(tmp_path), "--steps", "nope"],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2 and "--steps: unknown ['nope']" in proc.stderr


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed but not yet reaped by its new parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("runner", ["fresh", "preloaded"])
def test_a_step_over_its_limit_is_killed_with_its_children(tmp_path: Path, runner: str) -> None:
    """A fresh process (the GPU run's) and a fork of the dry run's preloaded interpreter alike."""
    pid_file = tmp_path / "child.pid"
    script = (
        "import subprocess, sys, time\n"
        f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(300)\n"
    )
    start = time.monotonic()
    preloaded = gpu_run._Preloaded(dict(os.environ), preload=())  # what it preloads changes nothing here
    run = gpu_run._run if runner == "fresh" else preloaded.run
    try:
        code, seconds = run([sys.executable, "-c", script], dict(os.environ), 3.0, str(tmp_path / "log"))
        assert code is None and 3.0 <= seconds < 30 and time.monotonic() - start < 30
        if runner == "preloaded":  # and the next command runs in it as before: its exit status, its output
            code, _ = run([sys.executable, "-c", "import sys; print('next'); sys.exit(3)"], {}, 60.0, str(tmp_path / "next"))
            assert code == 3 and (tmp_path / "next").read_text().endswith("\nnext\n")
    finally:
        preloaded.close()
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(child):
        assert time.monotonic() < deadline, f"the step's child {child} outlived the kill"
        time.sleep(0.1)
    assert "killed after its limit of 3 s" in (tmp_path / "log").read_text()
