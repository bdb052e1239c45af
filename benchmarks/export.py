"""``python -m benchmarks.export``: weight export, fsdp's stream beside torch's ways, CPU/gloo or CUDA.

For each world size (local ranks, gloo), one process per rank builds the same model (``--layers``
units of ``Linear(d, d)``, about 100M parameters by default) under fsdp, torch FSDP1 and torch
FSDP2 (FULL_SHARD, one unit per Linear), and exports every parameter in bf16 to a sink (the
consumer: it drops what it gets), timing each way (median of ``--reps``, after one warm-up) and
measuring its peak extra live bytes per rank (torch's CPU profiler, ``benchmarks.memory``; on
CUDA ``torch.cuda.max_memory_allocated`` above what was allocated before, its peak reset first):

- ``floor``: the same units' all-gathers alone, as the stream issues them (each fsdp unit's flat
  shard, already cast to bf16 outside the timing, into a fresh tensor); ``floor_fp32``: the same
  of the fp32 shards (what a stream that casts after gathering, like the others here, moves);
- ``fsdp_stream``: ``fsdp.export.full_params_stream(dtype=bf16, transient=True)``, every rank;
  timed interleaved with ``floor`` (below);
- ``fsdp_stream_rank0``: the same with ``rank0_only=True``;
- ``fsdp1_summon_walk``: torch FSDP1's ``summon_full_params(unit, recurse=False)`` over every unit
  (the walk TRL uses), casting each parameter;
- ``fsdp1_full_state_dict``: torch FSDP1's FULL_STATE_DICT with ``rank0_only=True``, cast on rank 0;
- ``fsdp2_full_tensor``: torch FSDP2's ``param.full_tensor()`` per parameter, cast;
- ``fsdp_delta``: ``fsdp.export.full_params_delta`` after one AdamW step (every element changes).

The report (``--json``) has ``date``, the figures per world size, and ``targets`` per the issue
(at the largest world size): the stream at most 1.2x the floor, no slower than the summon walk, at
most 0.5x FSDP2's loop; its extra memory at most one unit plus one bucket beside the gathers'
own (gloo's all-gather stages through a buffer of the output's size).

``--device cuda`` ([Note: The export benchmark on a GPU]): the same code on ``cuda:<rank>``, NCCL,
world size 1 and 15 units of ``Linear(8192, 8192)`` (1.007B parameters) by default.

[Note: The stream and its floor are timed interleaved]
On a shared machine the bare gathers' time moves by 2x between runs (0.22-0.54 s at 4 ranks on
2 cores), so a stream and a floor timed a few seconds apart compare two loads. They are timed in
the same process group on the same model, alternately (floor, stream, stream, floor, ...: a drift
in load weighs on both alike) for ``--ratio-reps`` repetitions after one warm-up each; each
repetition's time is the slowest rank's (barrier to barrier), and the target's ratio is the
median of the per-repetition ratios, with their min and max beside it (``floor_ratio`` in the
results; ``min``/``max``/``reps`` in the target). The floor stays exactly the units' all-gathers
in bf16 (the shards cast before timing): the stream's cast is its own work. Each rank's CPU
seconds (``time.process_time``, gloo's threads included) over the same repetitions give
``cpu_ratio``, the summed CPU of every rank, stream over floor (median of the per-repetition
ratios; the seconds are in ``floor_ratio``): reported beside the target, not targeted.

[Note: The export benchmark on a GPU]
Only the device differs: the models are built on ``cuda:<rank>`` (each rank one GPU, NCCL), every
timer is read after ``torch.cuda.synchronize`` (then the barrier), and a way's peak extra memory is
``torch.cuda.max_memory_allocated`` after it minus ``torch.cuda.memory_allocated`` before it, the
peak reset in between. The default shape is 15 units of ``Linear(8192, 8192)``: 1.007B parameters,
67M per unit, a Llama-3.2-1B decoder block's size (16 blocks of 61M). fsdp, torch FSDP1 and torch
FSDP2 are built side by side (4 GB of fp32 parameters each) and AdamW's state for the delta adds
12 GB (gradients and two moments): about 30 GB with the bf16 floor shards and the FULL state dict,
within an 80 GB GPU. The GPU run (``benchmarks/gpu_run.py``'s ``export`` step) has one GPU, so
world size 1: there both FSDP1 designs run NO_SHARD (torch warns), the stream issues no collective
and its work is the cast of each unit to bf16, the floor's all-gather is a local copy of the
already-cast unit, and torch FSDP2's ``full_tensor()`` an all-gather over one rank. The floor
ratio then measures the stream's own work (a cast reads 4 bytes and writes 2 per element, the
copy reads 2) and is no target; the targets are the stream against the summon walk and the
``full_tensor()`` loop and its extra memory (the JSON's ``config`` says so). The delta's host
side (the copy to the host, the comparison with the snapshot, SHA-1) runs on one thread, as on
CPU ranks (``torch.set_num_threads(1)``): about 2 GB of bf16 per export at 1B.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import time
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.local_ranks import run_local_ranks, write_rank_result
from benchmarks.memory import MemoryTrace

__all__ = ["main"]

DTYPE = torch.bfloat16
CPU = torch.device("cpu")
#: The default shapes per device type: (world sizes, layers, d) ([Note: The export benchmark on a GPU]).
DEFAULTS: dict[str, tuple[list[int], int, int]] = {"cpu": ([2, 4], 24, 2048), "cuda": ([1], 15, 8192)}


def _model(layers: int, d: int, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    with device:
        return nn.Sequential(*[nn.Linear(d, d) for _ in range(layers)])


def _sync(device: torch.device) -> None:
    """Waits for the device's queued work (before a timer or a memory counter is read)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _sink(tensor: torch.Tensor) -> None:
    del tensor


def _ours(layers: int, d: int, device: torch.device) -> nn.Module:
    from fsdp import FullyShardedDataParallel as FSDP
    from fsdp.wrap import ModuleWrapPolicy

    return FSDP(_model(layers, d, device), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), device_id=device)


def _fsdp1(layers: int, d: int, device: torch.device) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return TorchFSDP(_model(layers, d, device), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), device_id=device)


def _fsdp2(layers: int, d: int, device: torch.device) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    model = _model(layers, d, device)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _floor(model: nn.Module, dtype: Optional[torch.dtype]) -> Callable[[], None]:
    """The units' all-gathers alone (fsdp's one gather path, into fresh tensors), of the shards
    as they are (fp32) or already cast to ``dtype`` (the gathers a ``dtype`` stream issues)."""
    from fsdp import FullyShardedDataParallel as FSDP
    from fsdp._comm._collectives import all_gather_flat

    handles = [h for m in FSDP.fsdp_modules(model) for h in m._fsdp_state.handles]
    shards = [h._local_shard.detach().to(dtype) if dtype is not None else h._local_shard.detach() for h in handles]

    def run() -> None:
        for h, shard in zip(handles, shards):
            out = shard.new_empty(shard.numel() * h.world_size)
            all_gather_flat(out, shard, h.process_group)
            del out

    return run


def _stream(model: nn.Module, rank0_only: bool, bucket_bytes: int) -> Callable[[], None]:
    from fsdp.export import full_params_stream

    def run() -> None:
        for bucket in full_params_stream(model, dtype=DTYPE, bucket_bytes=bucket_bytes, rank0_only=rank0_only, transient=True):
            for _, tensor in bucket:
                _sink(tensor)
            del bucket

    return run


def _summon_walk(model: nn.Module) -> Callable[[], None]:
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    def run() -> None:
        for unit in TorchFSDP.fsdp_modules(model):
            with TorchFSDP.summon_full_params(unit, recurse=False, writeback=False):
                for name, param in unit.named_parameters():
                    if "_flat_param" not in name:
                        _sink(param.detach().to(DTYPE))

    return run


def _full_state_dict(model: nn.Module) -> Callable[[], None]:
    from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel as TorchFSDP, StateDictType

    def run() -> None:
        with TorchFSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True)):
            sd = model.state_dict()
        for value in sd.values():
            _sink(value.to(DTYPE))
        del sd

    return run


def _full_tensor_loop(model: nn.Module) -> Callable[[], None]:
    def run() -> None:
        for _, param in model.named_parameters():
            _sink(param.full_tensor().to(DTYPE))  # type: ignore[operator]

    return run


def _delta(model: nn.Module, d: int, bucket_bytes: int, device: torch.device) -> tuple[Callable[[], None], Callable[[], None], dict[str, Any]]:
    from fsdp.export import full_params_delta

    snapshot: dict[str, torch.Tensor] = {}
    info: dict[str, Any] = {}
    for _ in full_params_delta(model, snapshot, dtype=DTYPE, bucket_bytes=bucket_bytes):
        pass  # the first export fills the snapshot
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def run() -> None:
        sent = 0
        for bucket in full_params_delta(model, snapshot, dtype=DTYPE, bucket_bytes=bucket_bytes):
            sent += sum(d.nbytes for d in bucket)
        info["delta_bytes"] = sent

    def step() -> None:
        model(torch.randn(8, d, device=device)).sum().backward()
        opt.step()
        opt.zero_grad()

    return step, run, info


def _interleaved(
    fns: dict[str, Callable[[], None]], reps: int, device: torch.device = CPU
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Each of ``fns`` once per repetition, the order reversed every other one, after one warm-up
    each: wall seconds (barrier to barrier) and this process's CPU seconds, per repetition
    ([Note: The stream and its floor are timed interleaved])."""
    for fn in fns.values():
        fn()  # warm-up
    wall: dict[str, list[float]] = {name: [] for name in fns}
    cpu: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for rep in range(reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            _sync(device)
            dist.barrier()
            cpu_start, start = time.process_time(), time.perf_counter()
            fns[name]()
            _sync(device)
            dist.barrier()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - cpu_start)
    return wall, cpu


def _time(fn: Callable[[], None], reps: int, device: torch.device) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(reps):
        _sync(device)
        dist.barrier()
        start = time.perf_counter()
        fn()
        _sync(device)
        dist.barrier()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _peak(fn: Callable[[], None], device: torch.device) -> int:
    """Peak live bytes above those live before, while ``fn`` runs (on this rank's device)."""
    _sync(device)
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        fn()
        _sync(device)
        peak = torch.cuda.max_memory_allocated(device) - start
        dist.barrier()
        return peak
    with MemoryTrace() as trace, trace.window("w"):
        fn()
    dist.barrier()
    return trace.peaks["w"] - trace.starts["w"]


@contextlib.contextmanager
def _group(rank: int, world_size: int, workdir: str, device: torch.device) -> Iterator[None]:
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's barrier runs on the current device
    dist.init_process_group(backend, init_method=f"file://{os.path.join(workdir, 'rendezvous')}", rank=rank, world_size=world_size)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _rank(rank: int, payload: dict[str, Any], workdir: str) -> None:
    torch.set_num_threads(1)
    layers, d, reps, bucket = payload["layers"], payload["d"], payload["reps"], payload["bucket_bytes"]
    device = torch.device("cuda", rank) if payload["device"] == "cuda" else CPU  # one GPU per rank
    with _group(rank, payload["world_size"], workdir, device):
        result: dict[str, Any] = {"rank": rank, "seconds": {}, "peak_extra_bytes": {}}
        ours = _ours(layers, d, device)
        paired = {"floor": _floor(ours, DTYPE), "fsdp_stream": _stream(ours, False, bucket)}
        result["paired_wall"], result["paired_cpu"] = _interleaved(paired, payload["ratio_reps"], device)
        ways: list[tuple[str, Callable[[], None]]] = [
            ("floor_fp32", _floor(ours, None)),
            *paired.items(),
            ("fsdp_stream_rank0", _stream(ours, True, bucket)),
        ]
        fsdp1 = _fsdp1(layers, d, device)
        ways += [("fsdp1_summon_walk", _summon_walk(fsdp1)), ("fsdp1_full_state_dict", _full_state_dict(fsdp1))]
        fsdp2 = _fsdp2(layers, d, device)
        ways.append(("fsdp2_full_tensor", _full_tensor_loop(fsdp2)))
        for name, fn in ways:
            if name not in paired:
                result["seconds"][name] = _time(fn, reps, device)
            result["peak_extra_bytes"][name] = _peak(fn, device)
        step, delta, info = _delta(ours, d, bucket, device)
        step()
        _sync(device)
        dist.barrier()
        start = time.perf_counter()
        delta()  # once: a second run would find nothing changed
        _sync(device)
        dist.barrier()
        result["seconds"]["fsdp_delta_after_step"] = time.perf_counter() - start
        result["delta_bytes"] = info["delta_bytes"]
        result["unit_bytes"] = max(h.shard_layout.padded_unsharded_numel * 4 for m in type(ours).fsdp_modules(ours) for h in m._fsdp_state.handles)
        result["export_bytes"] = layers * (d * d + d) * 2
        write_rank_result(workdir, rank, result)
        dist.barrier()


def _targets(ws: int, r: dict[str, Any], bucket_bytes: int) -> list[dict[str, Any]]:
    s = r["seconds_slowest"]
    mem = r["peak_extra_bytes_max"]
    stream = s["fsdp_stream"]

    def t(target: str, value: float, bound: float) -> dict[str, Any]:
        return {"target": f"{target} ({ws} ranks)", "ratio": round(value, 3), "bound": bound, "status": "met" if value <= bound else "NOT met"}

    bound = r["unit_bytes"] // 2 + bucket_bytes  # one gathered unit in bf16 plus one bucket
    spread = r["floor_ratio"]
    floor = [
        {
            **t("stream time / floor (the same units' all-gathers alone; median of interleaved repetitions)", spread["median"], 1.2),
            "min": round(spread["min"], 3),
            "max": round(spread["max"], 3),
            "reps": spread["reps"],
        }
    ]
    # At one rank nothing is gathered: the floor is a copy ([Note: The export benchmark on a GPU]).
    return floor[: ws > 1] + [
        t("stream time / torch FSDP1 summon_full_params(recurse=False) walk", stream / s["fsdp1_summon_walk"], 1.0),
        t("stream time / torch FSDP2 full_tensor() loop", stream / s["fsdp2_full_tensor"], 0.5),
        t("stream peak extra memory / (one bf16 unit + one bucket)", mem["fsdp_stream"] / bound, 1.0),
        t("stream peak extra memory beside the bare gathers' own / (one bf16 unit + one bucket)", (mem["fsdp_stream"] - mem["floor"]) / bound, 1.0),
    ]


def _ratio_spread(ranks: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, float], float]:
    """The interleaved repetitions: the per-repetition stream/floor ratios (each side the slowest
    rank's wall time) as median, min and max; each side's median slowest time; and the summed
    CPU seconds of every rank, stream over floor (median of the per-repetition ratios)."""
    wall = {n: [max(x["paired_wall"][n][i] for x in ranks) for i in range(len(ranks[0]["paired_wall"][n]))] for n in ("floor", "fsdp_stream")}
    cpu = {n: [sum(x["paired_cpu"][n][i] for x in ranks) for i in range(len(ranks[0]["paired_cpu"][n]))] for n in ("floor", "fsdp_stream")}
    ratios = [s / f for s, f in zip(wall["fsdp_stream"], wall["floor"])]
    spread = {
        "median": statistics.median(ratios),
        "min": min(ratios),
        "max": max(ratios),
        "reps": len(ratios),
        "ratios": [round(x, 4) for x in ratios],
        "floor_seconds": [round(x, 4) for x in wall["floor"]],
        "stream_seconds": [round(x, 4) for x in wall["fsdp_stream"]],
        "floor_cpu_seconds": [round(x, 4) for x in cpu["floor"]],
        "stream_cpu_seconds": [round(x, 4) for x in cpu["fsdp_stream"]],
    }
    cpu_ratio = statistics.median(s / f for s, f in zip(cpu["fsdp_stream"], cpu["floor"]))
    return spread, {n: statistics.median(v) for n, v in wall.items()}, cpu_ratio


def _summarize(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    spread, paired, cpu_ratio = _ratio_spread(ranks)
    names = list(ranks[0]["peak_extra_bytes"]) + [n for n in ranks[0]["seconds"] if n not in ranks[0]["peak_extra_bytes"]]
    slowest = {n: paired[n] if n in paired else max(x["seconds"][n] for x in ranks) for n in names}
    return {
        "floor_ratio": spread,
        "cpu_ratio": cpu_ratio,
        "seconds_slowest": slowest,
        "seconds_per_gb": {n: v / (ranks[0]["export_bytes"] / 1e9) for n, v in slowest.items()},
        "peak_extra_bytes_max": {n: max(x["peak_extra_bytes"][n] for x in ranks) for n in ranks[0]["peak_extra_bytes"]},
        "peak_extra_bytes_rank0": ranks[0]["peak_extra_bytes"],
        "unit_bytes": ranks[0]["unit_bytes"],
        "export_bytes": ranks[0]["export_bytes"],
        "delta_bytes": ranks[0]["delta_bytes"],
    }


def _print(ws: int, r: dict[str, Any]) -> None:
    gb = r["export_bytes"] / 1e9
    print(f"== {ws} ranks: {gb:.3f} GB exported (bf16), unit {r['unit_bytes'] / 2**20:.1f} MiB (fp32)")
    for name, sec in r["seconds_slowest"].items():
        mem = r["peak_extra_bytes_max"].get(name)
        mem_s = f"{mem / 2**20:9.1f} MiB (rank 0 {r['peak_extra_bytes_rank0'][name] / 2**20:.1f})" if mem is not None else ""
        print(f"  {name:<24} {sec:8.3f} s  {sec / gb:8.3f} s/GB  peak extra {mem_s}")
    print(f"  delta after one AdamW step: {r['delta_bytes'] / 1e9:.3f} GB sent")
    f = r["floor_ratio"]
    print(
        f"  stream / floor over {f['reps']} interleaved repetitions: median {f['median']:.3f}x (min {f['min']:.3f}, "
        f"max {f['max']:.3f}); CPU seconds of every rank, stream / floor: {r['cpu_ratio']:.3f}x; load {r['loadavg']}"
    )


def _config(device: str, world_sizes: list[int]) -> dict[str, Any]:
    """The run's device and backend, and what a world size of 1 measures."""
    config: dict[str, Any] = {
        "device": device,
        "backend": "nccl" if device == "cuda" else "gloo",
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
        "world_sizes": world_sizes,
        "memory": "torch.cuda.max_memory_allocated minus memory_allocated before, peak reset" if device == "cuda" else "benchmarks.memory.MemoryTrace (every thread's CPU allocations)",
    }
    if 1 in world_sizes:
        config["world_size_1"] = (
            "nothing is gathered: fsdp and torch FSDP1 run NO_SHARD, the stream issues no collective and casts each unit to "
            "bf16, the floor's all-gather is a local copy of the already-cast unit, so the floor ratio measures the stream's "
            "own work (a cast against a copy) and is not a target; torch FSDP2's full_tensor() is an all-gather over one rank"
        )
    return config


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.export", description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=sorted(DEFAULTS), default="cpu", help="cuda: one GPU per rank, NCCL")
    p.add_argument("--world-sizes", type=int, nargs="+", default=None, help="default: 2 4 on cpu, 1 on cuda")
    p.add_argument("--layers", type=int, default=None, help="default: 24 on cpu, 15 on cuda")
    p.add_argument("--d", type=int, default=None, help="default: 2048 on cpu, 8192 on cuda")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--ratio-reps", type=int, default=9, help="interleaved repetitions of the floor and the stream")
    p.add_argument("--bucket-mib", type=int, default=64)
    p.add_argument("--timeout", type=float, default=1200.0)
    p.add_argument("--json", dest="json_out", default=None)
    a = p.parse_args(argv)
    default_world_sizes, default_layers, default_d = DEFAULTS[a.device]
    world_sizes: list[int] = a.world_sizes or default_world_sizes
    layers: int = a.layers if a.layers is not None else default_layers
    d: int = a.d if a.d is not None else default_d
    bucket = a.bucket_mib << 20
    out: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "config": _config(a.device, world_sizes),
        "model": {"layers": layers, "d": d, "params": layers * (d * d + d)},
        "bucket_bytes": bucket,
        "cpu_count": os.cpu_count(),
        "results": {},
        "targets": [],
    }
    for ws in world_sizes:
        payload = {"layers": layers, "d": d, "reps": a.reps, "ratio_reps": a.ratio_reps, "bucket_bytes": bucket, "world_size": ws, "device": a.device}
        load_before = os.getloadavg()
        ranks = run_local_ranks(_rank, payload, ws, a.timeout, prog="benchmarks.export")
        summary = _summarize(ranks)
        summary["loadavg"] = {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in os.getloadavg()]}
        out["results"][str(ws)] = summary
        _print(ws, summary)
        out["targets"] += _targets(ws, summary, bucket)
    for t in out["targets"]:
        print(f"  {t['target']}: {t['ratio']}x (<= {t['bound']}) {t['status']}")
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
