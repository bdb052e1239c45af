"""``--profile`` of the GPU benchmark: fsdp's steps under ``torch.profiler``, top ops by GPU time."""

from __future__ import annotations

import gc
import traceback
from typing import Any

import torch

from fsdp.bench._cuda_config import CudaBenchConfig
from fsdp.bench._cuda_model import build_model, make_batches, make_optimizer, train_step, wrap

__all__ = ["profile_fsdp", "format_profile"]

ROWS = 25


def _total(event: Any, *names: str) -> float:
    """The first of ``names`` that ``event`` has, in microseconds (0 if none)."""
    for name in names:
        value = getattr(event, name, None)
        if value is not None:
            return float(value)
    return 0.0


def _rows(prof: Any, by_device: bool) -> list[dict[str, Any]]:
    rows = []
    for event in prof.key_averages():
        rows.append(
            {
                "name": event.key,
                "count": int(event.count),
                "cpu_total_us": _total(event, "cpu_time_total"),
                "self_cpu_us": _total(event, "self_cpu_time_total"),
                "device_total_us": _total(event, "device_time_total", "cuda_time_total"),
                "self_device_us": _total(event, "self_device_time_total", "self_cuda_time_total"),
            }
        )
    key = "self_device_us" if by_device else "self_cpu_us"
    rows.sort(key=lambda row: row[key], reverse=True)
    return rows[:ROWS]


def profile_fsdp(cfg: CudaBenchConfig, device: torch.device) -> dict[str, Any]:
    """fsdp built fresh, ``cfg.warmup_steps`` unprofiled steps, then ``cfg.profile_steps``
    steps under the profiler (CPU and CUDA activity); the top :data:`ROWS` ops by self GPU time
    (self CPU time on the CPU dry run). A failure is returned as ``{"error": ...}``."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    model: Any = None
    opt: Any = None
    try:
        warmup = cfg.warmup_steps or 1
        model = wrap("fsdp", build_model(cfg, cfg.layers_, device), device)
        opt = make_optimizer(model)
        batches = make_batches(cfg, warmup + cfg.profile_steps, device)
        for batch in batches[:warmup]:
            train_step(model, opt, batch, False, device.type)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=activities) as prof:
            for batch in batches[warmup:]:
                train_step(model, opt, batch, False, device.type)
            if cuda:
                torch.cuda.synchronize()
        return {"steps": cfg.profile_steps, "sorted_by": "self_device_us" if cuda else "self_cpu_us", "rows": _rows(prof, cuda)}
    except Exception:
        return {"error": "".join(traceback.format_exc().splitlines(keepends=True)[-30:])}
    finally:
        model = opt = None
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def format_profile(p: dict[str, Any]) -> str:
    """The profile's top ops: calls and total / self times in milliseconds over all steps."""
    if "error" in p:
        return "== fsdp profile FAILED:\n" + p["error"]
    lines = [
        f"== fsdp profile: {p['steps']} steps, top {len(p['rows'])} ops by {p['sorted_by']} (ms over all steps)",
        f"{'op':<52} {'calls':>6} {'gpu_self':>9} {'gpu_tot':>9} {'cpu_self':>9} {'cpu_tot':>9}",
    ]
    for r in p["rows"]:
        lines.append(
            f"{r['name'][:52]:<52} {r['count']:>6} {r['self_device_us'] / 1e3:>9.2f} "
            f"{r['device_total_us'] / 1e3:>9.2f} {r['self_cpu_us'] / 1e3:>9.2f} {r['cpu_total_us'] / 1e3:>9.2f}"
        )
    return "\n".join(lines)
