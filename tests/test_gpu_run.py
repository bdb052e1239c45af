"""The prepared GPU run (``benchmarks/gpu_run.py``) on CPU: its ``--dry-run`` runs every step's
CPU equivalent and import check, writes every log and JSON, and records the exact GPU commands;
the time budget skips steps; a step over its limit is killed with its children."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import gpu_run
from benchmarks.config import block_params, gpt_params

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": ""}  # the script puts the repository root there itself


def test_dry_run_runs_every_step(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = [sys.executable, "benchmarks/gpu_run.py", "--dry-run", "--out", str(out), "--budget-s", "1500"]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=1600, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
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
