"""Combining the ranks' measurements, the tables, and where each target stands.

[Note: CPU floor]
Every timed round also records each rank's CPU time per step: of the whole process (the
training thread plus gloo's communication threads) and of the training thread alone. From them
the report derives a lower bound on the step time that no scheduling can beat, given the work
each implementation does:

    floor = max(busiest rank's training-thread CPU, sum of all ranks' CPU / usable cores)

The training thread runs its work one op after another, and all the ranks' threads share the
machine's cores (the benchmark's ranks are local processes). ``step_s - floor_s`` is then the
time lost to waiting (for a peer, for a socket) and to scheduling. When the ranks fill the
machine (2 ranks on 2 cores), communication costs step time even when it overlaps compute,
because its CPU work (the kernel copying bytes through loopback TCP sockets on gloo) takes a
core away from a rank's compute; ``floor_vs_local`` says how far the CPU work alone puts an
implementation above the local baseline.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Optional

from fsdp.bench._config import IMPLEMENTATIONS, BenchConfig
from fsdp.bench._model import minimum_bytes, unit_numels

__all__ = ["summarize", "format_report", "format_profile", "TARGETS"]

MiB = 1024 * 1024
#: (key, description, threshold): each is met when the measured ratio is <= the threshold.
def _met(value: Any, threshold: float) -> Optional[bool]:
    """Whether a measured ratio is within its target (None when it was not measured)."""
    return None if value is None else float(value) <= threshold


TARGETS = (
    ("step_vs_fsdp1", "step time <= 0.85x torch FSDP1", 0.85),
    ("step_vs_ddp", "step time <= 1.05x DDP", 1.05),
    ("peak_vs_torch", "training peak <= 0.95x min(torch FSDP1, torch FSDP2) (same run)", 0.95),
    ("model_sd_vs_fsdp1", "rank0_only full model state dict time <= 0.5x torch FSDP1", 0.50),
    ("optim_sd_vs_fsdp1", "optim_state_dict time <= 0.5x torch FSDP1", 0.50),
)

#: The targets ``--checkpoint-only`` measures.
CHECKPOINT_TARGETS = ("model_sd_vs_fsdp1", "optim_sd_vs_fsdp1")


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    if a is None or b is None or b == 0:
        return None
    return a / b


def _round_ratios(entry: dict[str, Any], ref: Optional[dict[str, Any]]) -> Optional[list[float]]:
    """Per-round ratios of the step times (the implementations of a round run back to back)."""
    if ref is None:
        return None
    return [a / b for a, b in zip(entry["step_s_rounds"], ref["step_s_rounds"])]


def _round_ratio(entry: dict[str, Any], ref: Optional[dict[str, Any]]) -> Optional[float]:
    ratios = _round_ratios(entry, ref)
    return None if ratios is None else statistics.median(ratios)


def _cpu_entry(cfg: BenchConfig, ranks: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """CPU time per step and the step-time floor it implies ([Note: CPU floor])."""
    cores = min(r["cpus"] for r in ranks)
    cpu, main, floor = [], [], []
    for i in range(cfg.rounds):
        per_rank_cpu = [r["cpu_s"][name][i] for r in ranks]
        busiest_main = max(r["main_cpu_s"][name][i] for r in ranks)
        cpu.append(max(per_rank_cpu))
        main.append(busiest_main)
        floor.append(max(busiest_main, sum(per_rank_cpu) / cores))
    return {
        "cpu_s": statistics.median(cpu),
        "main_cpu_s": statistics.median(main),
        "floor_s": statistics.median(floor),
        "floor_s_rounds": floor,
        "cores": cores,
    }


def _waiting_s(entry: dict[str, Any]) -> float:
    """Median over rounds of the step time above the CPU floor."""
    return statistics.median(t - f for t, f in zip(entry["step_s_rounds"], entry["floor_s_rounds"]))


def _impl_entry(cfg: BenchConfig, ranks: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """One implementation's measurements: step time, CPU, memory and communication."""
    per_round = [max(r["step_s"][name][i] for r in ranks) for i in range(cfg.rounds)]
    entry: dict[str, Any] = {"step_s": statistics.median(per_round), "step_s_rounds": per_round}
    entry.update(_cpu_entry(cfg, ranks, name))
    if cfg.memory:
        peaks = [r["memory"][name]["step_peak_bytes"] for r in ranks]
        entry["peak_bytes_per_rank"] = peaks
        entry["peak_bytes"] = max(peaks)
        entry["persistent_bytes_per_rank"] = [r["memory"][name]["step_start_bytes"] for r in ranks]
    comm = ranks[0]["comm"][name]
    entry["comm_bytes"] = int(sum(comm["bytes"].values()))
    entry["comm_bytes_by_kind"] = comm["bytes"]
    entry["comm_calls"] = comm["calls"]
    entry["comm_bytes_per_rank"] = [int(sum(r["comm"][name]["bytes"].values())) for r in ranks]
    return entry


def _add_ratios(impls: dict[str, dict[str, Any]]) -> None:
    """Adds each implementation's ratios to the references (torch FSDP1, local, DDP, torch)."""
    ref = impls.get("torch_fsdp1")
    local = impls.get("local")
    torch_peaks = [
        impls[n]["peak_bytes"]
        for n in ("torch_fsdp1", "torch_fsdp2")
        if n in impls and impls[n].get("peak_bytes") is not None
    ]
    for entry in impls.values():
        # Ratios of step times are medians of the per-round ratios: the implementations run
        # back to back within a round, so a slow spell of a shared machine cancels out.
        entry["step_vs_fsdp1"] = _round_ratio(entry, ref)
        entry["step_vs_local"] = _round_ratio(entry, local)
        entry["step_vs_ddp"] = _round_ratio(entry, impls.get("ddp"))
        entry["step_vs_fsdp1_rounds"] = _round_ratios(entry, ref)
        entry["step_vs_ddp_rounds"] = _round_ratios(entry, impls.get("ddp"))
        entry["floor_vs_local"] = (
            statistics.median(f / t for f, t in zip(entry["floor_s_rounds"], local["step_s_rounds"]))
            if local is not None
            else None
        )
        entry["peak_vs_fsdp1"] = _ratio(entry.get("peak_bytes"), ref.get("peak_bytes")) if ref else None
        entry["comm_vs_fsdp1"] = _ratio(entry["comm_bytes"], ref["comm_bytes"]) if ref else None
        entry["peak_vs_torch"] = _ratio(entry.get("peak_bytes"), min(torch_peaks)) if torch_peaks else None


def _checkpoint_entries(cfg: BenchConfig, ranks: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """State-dict save times (and their memory next to training's), fsdp and torch FSDP1."""
    checkpoint: dict[str, dict[str, Any]] = {}
    save_rank = 1 if cfg.world_size > 1 else 0
    for name in ("fsdp", "torch_fsdp1"):
        if not cfg.checkpoint or name not in cfg.only:
            continue
        reps = len(ranks[0]["checkpoint"][name]["model_s"])
        c: dict[str, Any] = {
            "model_s": statistics.median(max(r["checkpoint"][name]["model_s"][i] for r in ranks) for i in range(reps)),
            "optim_s": statistics.median(max(r["checkpoint"][name]["optim_s"][i] for r in ranks) for i in range(reps)),
            "model_offload_to_cpu": name == "fsdp",
        }
        if cfg.memory:
            mem = ranks[save_rank]["memory"][name]
            c["save_rank"] = save_rank
            c["save_model_peak_vs_train"] = mem["save_model_peak_bytes"] / mem["step_peak_bytes"]
            c["save_optim_peak_vs_train"] = mem["save_optim_peak_bytes"] / mem["step_peak_bytes"]
        checkpoint[name] = c
    if "torch_fsdp1" in checkpoint:
        for c in checkpoint.values():
            c["model_vs_fsdp1"] = c["model_s"] / checkpoint["torch_fsdp1"]["model_s"]
            c["optim_vs_fsdp1"] = c["optim_s"] / checkpoint["torch_fsdp1"]["optim_s"]
    return checkpoint


def _targets(
    cfg: BenchConfig,
    impls: dict[str, dict[str, Any]],
    checkpoint: dict[str, dict[str, Any]],
    minimum: dict[str, int],
) -> list[dict[str, Any]]:
    """Where fsdp stands against each of :data:`TARGETS` and the communication minimum."""
    ours = impls.get("fsdp", {})
    ours_ckpt = checkpoint.get("fsdp", {})
    values = {
        "step_vs_fsdp1": ours.get("step_vs_fsdp1"),
        "step_vs_ddp": ours.get("step_vs_ddp"),
        "peak_vs_torch": ours.get("peak_vs_torch"),
        "model_sd_vs_fsdp1": ours_ckpt.get("model_vs_fsdp1"),
        "optim_sd_vs_fsdp1": ours_ckpt.get("optim_vs_fsdp1"),
    }
    details: dict[str, str] = {}
    for key in ("step_vs_fsdp1", "step_vs_ddp"):
        # The spread says how much one run's median can be trusted on a noisy machine.
        rounds = ours.get(f"{key}_rounds")
        if rounds:
            details[key] = f"(rounds {min(rounds):.3f}x-{max(rounds):.3f}x)"
    if ours.get("floor_vs_local") is not None:
        floor = f"the CPU floor alone is {_x(ours['floor_vs_local'])} local"
        details["step_vs_ddp"] = f"{details['step_vs_ddp'][:-1]}; {floor})" if "step_vs_ddp" in details else f"({floor})"
    targets = [
        {"key": key, "description": desc, "threshold": thr, "value": values[key],
         "met": _met(values[key], thr), "detail": details.get(key)}
        for key, desc, thr in TARGETS
        if not cfg.checkpoint_only or key in CHECKPOINT_TARGETS
    ]
    if "fsdp" in impls:
        comm_ok = impls["fsdp"]["comm_bytes_by_kind"] == minimum
        targets.append({"key": "comm_minimum", "description": f"bytes == the {cfg.strategy} minimum",
                        "threshold": sum(minimum.values()), "value": impls["fsdp"]["comm_bytes"], "met": comm_ok})
    return targets


def summarize(cfg: BenchConfig, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One number per metric and implementation (slowest rank's time, largest rank's memory)."""
    root, layers = unit_numels(cfg)
    minimum = minimum_bytes(cfg)
    impls = {name: _impl_entry(cfg, ranks, name) for name in (() if cfg.checkpoint_only else cfg.only)}
    _add_ratios(impls)
    checkpoint = _checkpoint_entries(cfg, ranks)
    return {
        "params": root + sum(layers),
        "root_params": root,
        "layer_params": layers,
        "minimum_bytes": minimum,
        "minimum_total_bytes": sum(minimum.values()),
        "implementations": impls,
        "memory_all_threads": all(m.get("all_threads", False) for r in ranks for m in r["memory"].values()),
        "checkpoint": checkpoint,
        "targets": _targets(cfg, impls, checkpoint, minimum),
    }


def _x(value: Optional[float], digits: int = 2) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.{digits}f}x"


def _header(cfg: BenchConfig, s: dict[str, Any]) -> str:
    return (
        f"fsdp.bench: world size {cfg.world_size} (local CPU ranks, gloo, {cfg.threads} thread/rank), "
        f"{cfg.layers} x TransformerEncoderLayer(d_model={cfg.d_model}, nhead={cfg.nhead}, "
        f"ff={cfg.dim_feedforward}) + LayerNorm, {s['params'] / 1e6:.2f}M params, "
        f"per-rank batch {cfg.batch} x seq {cfg.seq}, AdamW, {cfg.strategy}"
        + (", forward prefetch" if cfg.forward_prefetch else "")
    )


def _memory_source(s: dict[str, Any]) -> str:
    """How the peaks were counted (see [Note: Frees on other threads] in ``_memory.py``)."""
    if s.get("memory_all_threads", True):
        return "allocator's live total, frees on every thread counted"
    return "main thread's allocator events only: frees on other threads missed, peaks overstated"


def _step_lines(cfg: BenchConfig, s: dict[str, Any]) -> list[str]:
    """The step time / peak memory / bytes table and the communication breakdown."""
    lines = [
        f"step time: median over {cfg.rounds} alternating rounds of {cfg.steps_per_round} steps "
        f"(after {cfg.warmup_steps} warm-up steps), slowest rank; step ratios: median of per-round ratios; "
        f"peak: largest rank's peak live CPU tensor bytes over {cfg.memory_steps} steps ({_memory_source(s)}); comm: bytes per step on rank 0 (output tensors)",
        "",
        f"{'implementation':<14} {'step_s':>8} {'vs_fsdp1':>9} {'vs_local':>9} {'peak_MiB':>9} "
        f"{'vs_fsdp1':>9} {'comm_MB':>9} {'vs_fsdp1':>9}",
    ]
    for name in IMPLEMENTATIONS:
        e = s["implementations"].get(name)
        if e is None:
            continue
        peak = e.get("peak_bytes")
        lines.append(
            f"{name:<14} {e['step_s']:>8.3f} {_x(e['step_vs_fsdp1']):>9} {_x(e['step_vs_local']):>9} "
            f"{(f'{peak / MiB:.1f}' if peak is not None else 'n/a'):>9} {_x(e['peak_vs_fsdp1']):>9} "
            f"{e['comm_bytes'] / 1e6:>9.2f} {_x(e['comm_vs_fsdp1']):>9}"
        )
    lines.append("")
    lines.append(
        f"minimum comm for {cfg.strategy}: {s['minimum_total_bytes']} bytes/step "
        + ", ".join(f"{k} {v}" for k, v in s["minimum_bytes"].items())
    )
    for name in IMPLEMENTATIONS:
        e = s["implementations"].get(name)
        if e is None:
            continue
        kinds = ", ".join(f"{k} {e['comm_calls'].get(k, 0)} calls / {v} B" for k, v in sorted(e["comm_bytes_by_kind"].items()))
        lines.append(f"  comm {name:<12} {e['comm_bytes']} bytes: {kinds or 'none'}")
    return lines + _cpu_lines(s)


def _cpu_lines(s: dict[str, Any]) -> list[str]:
    """CPU time per step, the floor it sets on the step time, and the time above it."""
    entries = s["implementations"]
    cores = min(e["cores"] for e in entries.values())
    lines = [
        "",
        f"cpu per step (median over rounds): cpu_s = all threads of the busiest rank, main_s = its training thread; "
        f"floor_s = max(main_s, all ranks' cpu / {cores} cores), the shortest step this work allows; "
        "waiting_s = step_s - floor_s",
        f"{'implementation':<14} {'cpu_s':>8} {'main_s':>8} {'floor_s':>8} {'vs_local':>9} {'waiting_s':>10}",
    ]
    for name in IMPLEMENTATIONS:
        e = entries.get(name)
        if e is None:
            continue
        lines.append(
            f"{name:<14} {e['cpu_s']:>8.3f} {e['main_cpu_s']:>8.3f} {e['floor_s']:>8.3f} "
            f"{_x(e['floor_vs_local']):>9} {_waiting_s(e):>10.3f}"
        )
    return lines


def _checkpoint_lines(cfg: BenchConfig, s: dict[str, Any]) -> list[str]:
    lines = [
        "",
        "checkpoint: FULL_STATE_DICT, rank0_only=True; model: fsdp offload_to_cpu=True, torch FSDP1 "
        "offload_to_cpu=False (its offload fails on CPU-only); optim: offload_to_cpu=True for both; median of "
        f"{cfg.checkpoint_reps}, slowest rank",
        f"{'implementation':<14} {'model_sd_s':>10} {'vs_fsdp1':>9} {'optim_sd_s':>10} {'vs_fsdp1':>9} "
        f"{'save_peak/train_peak':>21}",
    ]
    for name, c in s["checkpoint"].items():
        save = (
            f"{c['save_model_peak_vs_train']:.2f}x/{c['save_optim_peak_vs_train']:.2f}x (rank {c['save_rank']})"
            if "save_model_peak_vs_train" in c
            else "n/a"
        )
        lines.append(
            f"{name:<14} {c['model_s']:>10.4f} {_x(c.get('model_vs_fsdp1')):>9} {c['optim_s']:>10.4f} "
            f"{_x(c.get('optim_vs_fsdp1')):>9} {save:>21}"
        )
    lines.append("  save_peak/train_peak: peak live bytes while saving the model / the optimizer state, over the training-step peak")
    return lines


def format_report(cfg: BenchConfig, s: dict[str, Any]) -> str:
    lines = [_header(cfg, s)]
    if cfg.checkpoint_only:
        lines.append("--checkpoint-only: no step-time rounds, no communication count")
    else:
        lines += _step_lines(cfg, s)
    if s["checkpoint"]:
        lines += _checkpoint_lines(cfg, s)
    lines += ["", "targets (fsdp):"]
    for t in s["targets"]:
        status = "n/a    " if t["met"] is None else ("met    " if t["met"] else "NOT MET")
        if t["key"] == "comm_minimum":
            value = f"{t['value']} vs minimum {t['threshold']}"
        else:
            # Three decimals, so a ratio just above its threshold does not print as equal to it.
            value = _x(t["value"], digits=3)
        detail = f" {t['detail']}" if t.get("detail") else ""
        lines.append(f"  [{status}] {t['description']}: {value}{detail}")
    if "wall_s" in s:
        lines.append(f"\ntotal wall time {s['wall_s']:.0f} s")
    return "\n".join(lines)


def format_profile(cfg: BenchConfig, p: dict[str, Any]) -> str:
    lines = [
        f"fsdp.bench --profile: {cfg.profile_impl}, rank 0, {cfg.profile_steps} steps after {cfg.warmup_steps} warm-up; "
        f"wall {p['wall_ms_per_step']:.1f} ms/step (profiled), self CPU total {p['self_ms_per_step']:.1f} ms/step",
        f"{'op':<48} {'calls/step':>10} {'self_ms/step':>12} {'self_%':>7}",
    ]
    for row in p["top"]:
        lines.append(f"{row['name'][:48]:<48} {row['calls']:>10} {row['self_ms_per_step']:>12.2f} {row['self_pct']:>7.1f}")
    return "\n".join(lines)
