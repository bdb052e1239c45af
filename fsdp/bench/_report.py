"""Combining the ranks' measurements, the tables, and where each target stands."""

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
    ("step_vs_fsdp1", "step time <= 0.80x torch FSDP1", 0.80),
    ("step_vs_local", "step time <= 1.15x local (no communication)", 1.15),
    ("peak_vs_fsdp1", "peak memory <= 0.75x torch FSDP1", 0.75),
    ("model_sd_vs_fsdp1", "rank0_only full model state dict time <= 0.5x torch FSDP1", 0.50),
    ("optim_sd_vs_fsdp1", "optim_state_dict time <= 0.5x torch FSDP1", 0.50),
)

#: The targets ``--checkpoint-only`` measures.
CHECKPOINT_TARGETS = ("model_sd_vs_fsdp1", "optim_sd_vs_fsdp1")


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    if a is None or b is None or b == 0:
        return None
    return a / b


def _round_ratio(entry: dict[str, Any], ref: Optional[dict[str, Any]]) -> Optional[float]:
    if ref is None:
        return None
    return statistics.median(a / b for a, b in zip(entry["step_s_rounds"], ref["step_s_rounds"]))


def summarize(cfg: BenchConfig, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One number per metric and implementation (slowest rank's time, largest rank's memory)."""
    root, layers = unit_numels(cfg)
    minimum = minimum_bytes(cfg)
    impls: dict[str, dict[str, Any]] = {}
    for name in () if cfg.checkpoint_only else cfg.only:
        per_round = [max(r["step_s"][name][i] for r in ranks) for i in range(cfg.rounds)]
        entry: dict[str, Any] = {"step_s": statistics.median(per_round), "step_s_rounds": per_round}
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
        impls[name] = entry
    ref = impls.get("torch_fsdp1")
    local = impls.get("local")
    for name, entry in impls.items():
        # Ratios of step times are medians of the per-round ratios: the implementations run
        # back to back within a round, so a slow spell of a shared machine cancels out.
        entry["step_vs_fsdp1"] = _round_ratio(entry, ref)
        entry["step_vs_local"] = _round_ratio(entry, local)
        entry["peak_vs_fsdp1"] = _ratio(entry.get("peak_bytes"), ref.get("peak_bytes")) if ref else None
        entry["comm_vs_fsdp1"] = _ratio(entry["comm_bytes"], ref["comm_bytes"]) if ref else None
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
    ours = impls.get("fsdp", {})
    ours_ckpt = checkpoint.get("fsdp", {})
    values = {
        "step_vs_fsdp1": ours.get("step_vs_fsdp1"),
        "step_vs_local": ours.get("step_vs_local"),
        "peak_vs_fsdp1": ours.get("peak_vs_fsdp1"),
        "model_sd_vs_fsdp1": ours_ckpt.get("model_vs_fsdp1"),
        "optim_sd_vs_fsdp1": ours_ckpt.get("optim_vs_fsdp1"),
    }
    targets = [
        {"key": key, "description": desc, "threshold": thr, "value": values[key],
         "met": _met(values[key], thr)}
        for key, desc, thr in TARGETS
        if not cfg.checkpoint_only or key in CHECKPOINT_TARGETS
    ]
    if "fsdp" in impls:
        comm_ok = impls["fsdp"]["comm_bytes_by_kind"] == minimum
        targets.append({"key": "comm_minimum", "description": f"bytes == the {cfg.strategy} minimum",
                        "threshold": sum(minimum.values()), "value": impls["fsdp"]["comm_bytes"], "met": comm_ok})
    return {
        "params": root + sum(layers),
        "root_params": root,
        "layer_params": layers,
        "minimum_bytes": minimum,
        "minimum_total_bytes": sum(minimum.values()),
        "implementations": impls,
        "memory_all_threads": all(m.get("all_threads", False) for r in ranks for m in r["memory"].values()),
        "checkpoint": checkpoint,
        "targets": targets,
    }


def _x(value: Optional[float]) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.2f}x"


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
            value = _x(t["value"])
        lines.append(f"  [{status}] {t['description']}: {value}")
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
