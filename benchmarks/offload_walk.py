"""The offload knob's curve (issue 35, item 4): fsdp's step time and GPU memory at 0, 25, 50, 75
and 100% of the parameters offloaded (``CPUOffload(offload_params=True, fraction=f)``), one
model size, world size 1, with the physical limits printed beside: the pinned host-to-device and
device-to-host copy rates and the host's fused AdamW rate (about 28 bytes per parameter).

Each point: a fresh model wrapped with the fraction (one unit per GPT block), fused AdamW (on the
host shards torch's CPU kernel, on the device ones the GPU's), warm-up steps, then the median of
timed steps and ``torch.cuda.max_memory_allocated``. The floor of a point is
``max(step without offload, host AdamW over the offloaded parameters, their copies)``.

    python -m benchmarks.offload_walk --device cuda --json walk.json   # 1.0e9 parameters, batch 2 x 1024
    python -m benchmarks.offload_walk --cpu-dry-run --layers 2 --d-model 32 --n-head 4 --vocab 64 --seq 16 --batch 2

The dry run measures the same points on CPU (the copies then are host memcpy).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from benchmarks.core import ModelSpec, blocks, build_model, make_batches, train_step

FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)
ADAMW_BYTES_PER_PARAM = 28


def _point(spec: ModelSpec, device: torch.device, fraction: float, warmup: int, steps: int) -> dict[str, Any]:
    from fsdp import CPUOffload, FullyShardedDataParallel as FSDP
    from fsdp.wrap import ModuleWrapPolicy

    model = build_model(spec, torch.device("cpu"))
    offload = CPUOffload(offload_params=True, fraction=fraction) if fraction > 0 else None
    if offload is None:
        model = model.to(device)
    wrapped = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({type(blocks(model)[0])}), device_id=device, cpu_offload=offload)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    batches = make_batches(spec, warmup + steps, device=device)
    units = [u for u in FSDP.fsdp_modules(wrapped)]
    offloaded = sum(
        h.flat_param.numel() for u in units if u._fsdp_state.policy.offload_params for h in u._fsdp_state.handles
    )
    total = sum(h.flat_param.numel() for u in units for h in u._fsdp_state.handles)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for i, batch in enumerate(batches):
        sync()
        start = time.perf_counter()
        train_step(wrapped, opt, batch)
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    point = {
        "fraction": fraction,
        "units_offloaded": sum(u._fsdp_state.policy.offload_params for u in units),
        "units": len(units),
        "offloaded_params": offloaded,
        "params": total,
        "step_s": statistics.median(times),
        "max_allocated": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    }
    del wrapped, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return point


def _rates(device: torch.device, numel: int) -> dict[str, float]:
    """Bytes per second: pinned H2D and D2H copies (host memcpy on CPU), fused host AdamW per parameter."""
    pin = device.type == "cuda"
    host = torch.randn(numel, pin_memory=pin)
    dev = torch.empty(numel, device=device)
    sync = torch.cuda.synchronize if pin else (lambda: None)

    def best(fn: Any) -> float:
        fn()
        sync()
        out = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            sync()
            out.append(time.perf_counter() - start)
        return min(out)

    h2d = best(lambda: dev.copy_(host, non_blocking=True))
    d2h = best(lambda: host.copy_(dev, non_blocking=True))
    param = torch.nn.Parameter(torch.randn(numel))
    param.grad = torch.randn(numel)
    opt = torch.optim.AdamW([param], lr=1e-4, fused=True)
    adamw = best(opt.step)
    return {"h2d_Bps": 4 * numel / h2d, "d2h_Bps": 4 * numel / d2h, "host_adamw_params_per_s": numel / adamw,
            "host_adamw_Bps": ADAMW_BYTES_PER_PARAM * numel / adamw}


def run(spec: ModelSpec, device: torch.device, warmup: int, steps: int) -> dict[str, Any]:
    points = [_point(spec, device, f, warmup, steps) for f in FRACTIONS]
    rates = _rates(device, min(points[0]["params"], 64 * 2**20))
    base = points[0]["step_s"]
    for p in points:
        n = p["offloaded_params"]
        copies = 4 * n / rates["h2d_Bps"] + 4 * n / rates["d2h_Bps"]
        adamw = n / rates["host_adamw_params_per_s"]
        p["floor_s"] = max(base, adamw, copies)
        p["vs_floor"] = p["step_s"] / p["floor_s"]
        p["vs_no_offload"] = p["step_s"] / base
    half = next(p for p in points if p["fraction"] == 0.5)
    full = points[-1]
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "model": vars(spec),
        "rates": rates,
        "points": points,
        "targets": {
            "offload_100_vs_floor": {"value": full["vs_floor"], "target": "<= 1.2", "met": full["vs_floor"] <= 1.2},
            "offload_50_vs_floor": {"value": half["vs_floor"], "target": "<= 1.1", "met": half["vs_floor"] <= 1.1},
        },
    }


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--cpu-dry-run", action="store_true", help="measure on CPU (tiny model)")
    p.add_argument("--layers", type=int, default=18)
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--n-head", type=int, default=16)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--warmup-steps", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    device = torch.device("cpu") if a.cpu_dry_run else torch.device(a.device, 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    spec = ModelSpec("gpt", a.layers, a.d_model, a.n_head, a.batch, a.seq, a.vocab)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29557")
    import warnings

    warnings.filterwarnings("ignore", message=".*NO_SHARD.*")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    try:
        doc = run(spec, device, a.warmup_steps, a.steps)
    finally:
        dist.destroy_process_group()
    r = doc["rates"]
    print(f"limits: H2D {r['h2d_Bps'] / 1e9:.1f} GB/s, D2H {r['d2h_Bps'] / 1e9:.1f} GB/s, "
          f"host fused AdamW {r['host_adamw_Bps'] / 1e9:.1f} GB/s ({ADAMW_BYTES_PER_PARAM} B/param)")
    for pt in doc["points"]:
        mem = f"{pt['max_allocated'] / 2**30:.2f} GiB" if pt["max_allocated"] is not None else "n/a"
        print(f"offload {pt['fraction']:4.0%} ({pt['units_offloaded']}/{pt['units']} units): step {pt['step_s']:.3f} s, "
              f"{pt['vs_no_offload']:.2f}x no offload, {pt['vs_floor']:.2f}x floor, max allocated {mem}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
