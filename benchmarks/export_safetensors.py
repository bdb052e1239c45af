"""``python -m benchmarks.export_safetensors``: Hugging Face safetensors export, fsdp beside torch.

For each world size (local ranks, gloo), one process per rank builds the same model (``--layers``
units of ``Linear(d, d)``) under fsdp and torch FSDP1 (FULL_SHARD, one unit per Linear) and writes
it in bf16 as safetensors files, rank 0 writing, timed (median of ``--reps`` after a warm-up, the
slowest rank) with rank 0's peak extra memory: torch's allocations (the profiler trace of
``benchmarks.memory``) plus Python's (``tracemalloc``, a separate run: file buffers, bytes copies):

- ``floor``: the same units' gathers to rank 0 alone (each flat shard cast to bf16), what the
  export's collectives cost by themselves;
- ``fsdp_save_safetensors``: ``fsdp.export.save_safetensors(dtype=bf16)``;
- ``fsdp1_full_state_dict_save_file``: torch's way, FSDP1's FULL_STATE_DICT with
  ``rank0_only=True``, cast to bf16 on rank 0, then ``safetensors.torch.save_file``;
- ``fsdp_sharded_to_safetensors``: ``fsdp.checkpoint.sharded_to_safetensors`` of a
  ``save_sharded`` checkpoint of the same model, on rank 0 alone (no collective).

The report (``--json``) has ``date``, the figures per world size and ``targets``: the writer's
peak at most one unit (fp32) plus one file buffer (the live export beside its gathers' own), the
files identical in content to torch's way.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import tempfile
import tracemalloc
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.export import DTYPE, _fsdp1, _group, _ours, _time
from benchmarks.local_ranks import run_local_ranks, write_rank_result
from benchmarks.memory import MemoryTrace

__all__ = ["main"]


def _floor(model: nn.Module) -> Callable[[], None]:
    """The units' gathers to rank 0 alone, of the shards cast to bf16 (as the export issues them)."""
    from fsdp import FullyShardedDataParallel as FSDP
    from fsdp.state_dict._values import gather

    handles = [h for m in FSDP.fsdp_modules(model) for h in m._fsdp_state.handles]
    shards = [h._local_shard.detach().to(DTYPE) for h in handles]

    def run() -> None:
        for h, shard in zip(handles, shards):
            out = gather(shard, h.process_group, h.rank, h.world_size, 0)
            del out

    return run


def _ours_save(model: nn.Module, folder: str, buffer_bytes: int) -> Callable[[], None]:
    from fsdp.export import save_safetensors

    def run() -> None:
        save_safetensors(model, folder, dtype=DTYPE, buffer_bytes=buffer_bytes)

    return run


def _torch_save(model: nn.Module, folder: str) -> Callable[[], None]:
    from safetensors.torch import save_file
    from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel as TorchFSDP, StateDictType

    def run() -> None:
        with TorchFSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True)):
            sd = model.state_dict()
        if dist.get_rank() == 0:
            os.makedirs(folder, exist_ok=True)
            save_file({k: v.to(DTYPE) for k, v in sd.items()}, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        del sd

    return run


def _convert(checkpoint: str, folder: str, buffer_bytes: int) -> Callable[[], None]:
    from fsdp.checkpoint import sharded_to_safetensors

    def run() -> None:
        if dist.get_rank() == 0:
            sharded_to_safetensors(checkpoint, folder, dtype=DTYPE, buffer_bytes=buffer_bytes)

    return run


def _peaks(fn: Callable[[], None]) -> dict[str, int]:
    """Rank 0's peak extra bytes: torch's allocations, then (another run) Python's (the other
    ranks only run ``fn``)."""
    if dist.get_rank() != 0:
        for _ in range(2):
            dist.barrier()
            fn()
            dist.barrier()
        return {}
    dist.barrier()
    with MemoryTrace() as trace, trace.window("w"):
        fn()
    dist.barrier()
    dist.barrier()
    tracemalloc.start()
    fn()
    python = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    dist.barrier()
    torch_bytes = trace.peaks["w"] - trace.starts["w"]
    return {"torch": torch_bytes, "python": python, "total": torch_bytes + python}


def _same_files(a: str, b: str) -> bool:
    from safetensors.torch import load_file

    x, y = load_file(os.path.join(a, "model.safetensors")), load_file(os.path.join(b, "model.safetensors"))
    return x.keys() == y.keys() and all(x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]) for k in x)


def _rank(rank: int, payload: dict[str, Any], workdir: str) -> None:
    from fsdp.checkpoint import save_sharded

    torch.set_num_threads(1)
    layers, d, reps, buffer_bytes, out = payload["layers"], payload["d"], payload["reps"], payload["buffer_bytes"], payload["out"]
    with _group(rank, payload["world_size"], workdir):
        ours, fsdp1 = _ours(layers, d), _fsdp1(layers, d)
        checkpoint = os.path.join(out, "checkpoint")
        save_sharded(ours, checkpoint_id=checkpoint)
        dist.barrier()
        ways: list[tuple[str, Callable[[], None]]] = [
            ("floor", _floor(ours)),
            ("fsdp_save_safetensors", _ours_save(ours, os.path.join(out, "fsdp"), buffer_bytes)),
            ("fsdp1_full_state_dict_save_file", _torch_save(fsdp1, os.path.join(out, "torch"))),
            ("fsdp_sharded_to_safetensors", _convert(checkpoint, os.path.join(out, "converted"), buffer_bytes)),
        ]
        result: dict[str, Any] = {"rank": rank, "seconds": {}, "peak_extra_bytes": {}}
        for name, fn in ways:
            result["seconds"][name] = _time(fn, reps)
            result["peak_extra_bytes"][name] = _peaks(fn)
        if rank == 0:
            result["same_as_torch"] = _same_files(os.path.join(out, "fsdp"), os.path.join(out, "torch"))
            result["converted_same_as_torch"] = _same_files(os.path.join(out, "converted"), os.path.join(out, "torch"))
        result["unit_bytes"] = max(h.shard_layout.padded_unsharded_numel * 4 for m in type(ours).fsdp_modules(ours) for h in m._fsdp_state.handles)
        result["export_bytes"] = layers * (d * d + d) * 2  # bf16
        write_rank_result(workdir, rank, result)
        dist.barrier()


def _targets(ws: int, r: dict[str, Any], buffer_bytes: int) -> list[dict[str, Any]]:
    """The issue's target, "the writer's peak at most one unit plus one file buffer": a unit is
    its fp32 parameters (what training holds of it unsharded), the buffer ``buffer_bytes`` plus
    64 KiB for the headers; the live export is judged beside its gathers' own peak (the floor:
    gloo stages a gather through a buffer of its output's size), the conversion beside nothing
    but 1 MiB for DCP's Python objects."""
    peaks = r["peak_extra_bytes_rank0"]
    bound = r["unit_bytes"] + buffer_bytes + (64 << 10)

    def t(target: str, value: float, limit: float) -> dict[str, Any]:
        return {"target": f"{target} ({ws} ranks)", "ratio": round(value, 3), "bound": limit, "status": "met" if value <= limit else "NOT met"}

    ours = peaks["fsdp_save_safetensors"]["total"] - peaks["floor"]["total"]
    return [
        t("writer peak at most one unit plus one file buffer: save_safetensors beside its gathers' own / bound", ours / bound, 1.0),
        t(
            "writer peak at most one unit plus one file buffer: sharded_to_safetensors / (bound + 1 MiB)",
            peaks["fsdp_sharded_to_safetensors"]["total"] / (bound + (1 << 20)),
            1.0,
        ),
        {
            "target": f"files equal in content to torch's way (FULL_STATE_DICT + save_file), live and from the checkpoint ({ws} ranks)",
            "status": "met" if r["same_as_torch"] and r["converted_same_as_torch"] else "NOT met",
        },
    ]


def _summarize(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    slowest = {n: max(x["seconds"][n] for x in ranks) for n in ranks[0]["seconds"]}
    return {
        "seconds_slowest": slowest,
        "seconds_per_gb": {n: v / (ranks[0]["export_bytes"] / 1e9) for n, v in slowest.items()},
        "peak_extra_bytes_rank0": ranks[0]["peak_extra_bytes"],
        "unit_bytes": ranks[0]["unit_bytes"],
        "export_bytes": ranks[0]["export_bytes"],
        "same_as_torch": ranks[0]["same_as_torch"],
        "converted_same_as_torch": ranks[0]["converted_same_as_torch"],
    }


def _print(ws: int, r: dict[str, Any]) -> None:
    gb = r["export_bytes"] / 1e9
    print(f"== {ws} ranks: {gb:.3f} GB written (bf16), unit {r['unit_bytes'] / 2**20:.1f} MiB (fp32)")
    for name, sec in r["seconds_slowest"].items():
        p = r["peak_extra_bytes_rank0"][name]
        print(
            f"  {name:<34} {sec:8.3f} s  {sec / gb:8.3f} s/GB  rank-0 peak extra {p['total'] / 2**20:8.1f} MiB "
            f"(torch {p['torch'] / 2**20:.1f}, Python {p['python'] / 2**20:.1f})"
        )
    print(f"  files equal to torch's way: live {r['same_as_torch']}, from the checkpoint {r['converted_same_as_torch']}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.export_safetensors", description=__doc__.split("\n")[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--d", type=int, default=1024)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--buffer-mib", type=int, default=16)
    p.add_argument("--timeout", type=float, default=1200.0)
    p.add_argument("--out-dir", default=None, help="where the files go (default: a temporary folder, removed)")
    p.add_argument("--json", dest="json_out", default=None)
    a = p.parse_args(argv)
    buffer_bytes = a.buffer_mib << 20
    report: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "model": {"layers": a.layers, "d": a.d, "params": a.layers * (a.d * a.d + a.d)},
        "buffer_bytes": buffer_bytes,
        "cpu_count": os.cpu_count(),
        "results": {},
        "targets": [],
    }
    root = a.out_dir or tempfile.mkdtemp(prefix="export-safetensors-")
    try:
        for ws in a.world_sizes:
            out = os.path.join(root, f"ws{ws}")
            payload = {"layers": a.layers, "d": a.d, "reps": a.reps, "buffer_bytes": buffer_bytes, "world_size": ws, "out": out}
            summary = _summarize(run_local_ranks(_rank, payload, ws, a.timeout, prog="benchmarks.export_safetensors"))
            report["results"][str(ws)] = summary
            _print(ws, summary)
            report["targets"] += _targets(ws, summary, buffer_bytes)
    finally:
        if a.out_dir is None:
            shutil.rmtree(root, ignore_errors=True)
    for t in report["targets"]:
        print(f"  {t['target']}: " + (f"{t['ratio']}x (<= {t['bound']}) " if "ratio" in t else "") + t["status"])
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
