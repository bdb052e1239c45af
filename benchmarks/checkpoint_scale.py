"""Sharded checkpoint saves at several world sizes: fsdp's flat-shard save beside torch FSDP1's.

``python -m benchmarks.checkpoint_scale --world-sizes 2 4 8 --out docs/results/ckpt.json``
runs, for each world size, ``world_size`` local CPU ranks (gloo) that each build the same model
of 32 units (one ``nn.Linear(dim, dim)`` each plus a head), take one AdamW step and then save:

- ``fsdp``: ``fsdp.checkpoint.save_sharded(model, optim, checkpoint_id=...)`` (each rank writes
  its flat shards where they lie, [Note: Flat-shard checkpoints]);
- ``torch_fsdp1``: torch FSDP1's ``SHARDED_STATE_DICT`` model and optimizer state dicts written
  with ``torch.distributed.checkpoint.save`` (the documented way).

- ``fsdp_async``: ``fsdp.checkpoint.async_save_sharded`` ([Note: Async flat-shard saves]): the
  time the training loop is blocked (the call, which copies the written shards into host staging
  buffers; no save in flight, since each repetition waits for the previous write first), the
  first call's (it allocates the buffers), and the whole write (call to ``result()``).

Loads: each implementation then loads, into the same model and optimizer, the checkpoint it has
just saved (``load_same``) and one that a single rank saved with ``save_sharded`` before the runs
(``load_other``: another world size, resharded from whole parameters), the same repetitions:
fsdp's ``load_sharded``, torch FSDP1's documented DCP load of its SHARDED state dicts. The
JSON's ``growth`` says how each save's and load's time grows from the fewest ranks to the most.

Per implementation and world size: seconds per save on the slowest rank (median of the
repetitions; every rank times its own call, the slowest is the max over ranks), the CPU
seconds of each rank's process during its call (``time.process_time()``: every thread of the
process, DCP's writer threads included; median of the repetitions) and their most over ranks
(the coordinator's, which builds the metadata of all; and the most of the other ranks), the
tensor collectives during one save and their bytes per rank (``benchmarks/comm.py``: all-gathers,
reduce-scatters, all-reduces, broadcasts), the object collectives and messages of metadata on
rank 0 (the coordinator) and rank 1 (DCP's planning for torch FSDP1; fsdp's reports to the
coordinator and the outcome's broadcast, [Note: A save without a global plan]), and the
peak live CPU bytes during a save over the peak of a steady training step before it (the
second: the first allocates AdamW's state in ``step()``, so its backward peaks lower)
(``benchmarks/memory.py``; a separate, profiled build, so the profiler does not slow the timed
saves). The JSON has ``date``, the rows and ``targets`` (issue 33's, each ``met`` or ``NOT met``);
the two save-time targets are read on both measures, a row each.

On a machine with fewer cores than ranks (this one: 2 cores, up to 16 ranks) wall time measures
mostly the oversubscription: 16 processes share 2 cores, so a rank's call takes about 8 times
its own work plus the waits for the others, whatever the save does. CPU time measures the work
each rank does (the JSON's ``config`` says so); a save whose work per rank does not grow with
the world size keeps its CPU time flat while its wall time still grows.

Memory of the async save: the staging buffers are host memory allocated once and kept (like
optimizer state, a fixed cost reported as ``staging_bytes``: one copy of what the rank writes).
On a GPU they are not device memory at all; on CPU, where host is the device, the profiled peak
includes them, so the row reports the peak during an async save (the call, one training step
during the write, and the wait) over the training peak both with the staging buffers and
without them (``..._excluding_staging``), and the target reads the latter plus the staging
size stated beside it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.comm import count_collectives, count_object_messages
from benchmarks.local_ranks import run_local_ranks, write_rank_result
from benchmarks.memory import MemoryTrace

UNITS = 32
# The two measures of a save's time each target reads (module docstring).
_TIME_MEASURES = (
    ("wall time, slowest rank", "save_s_slowest_rank"),
    ("CPU time of the process, most of any rank", "save_cpu_s_max_rank"),
)
OVERSUBSCRIPTION = (
    "every rank is a local process: with more ranks than cores, wall time measures mostly the "
    "oversubscription (at 16 ranks on 2 cores, 8 processes per core), CPU time the work each rank does"
)


class Unit(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


def make_model(dim: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Unit(dim) for _ in range(UNITS)])


def _wrap(impl: str, dim: int) -> nn.Module:
    if impl == "fsdp":
        from fsdp import FullyShardedDataParallel as FSDP
        from fsdp.wrap import ModuleWrapPolicy
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # type: ignore[assignment]
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy  # type: ignore[assignment]
    kwargs: dict[str, Any] = {} if impl == "fsdp" else {"device_id": torch.device("cpu")}
    return FSDP(make_model(dim), auto_wrap_policy=ModuleWrapPolicy({Unit}), **kwargs)


def _train_step(model: nn.Module, optim: torch.optim.Optimizer, dim: int) -> None:
    x = torch.randn(8, dim, generator=torch.Generator().manual_seed(dist.get_rank()))
    model(x).square().mean().backward()
    optim.step()
    optim.zero_grad()


def _saver(impl: str, model: nn.Module, optim: torch.optim.Optimizer) -> Callable[[str], None]:
    import torch.distributed.checkpoint as dcp

    if impl == "fsdp":
        from fsdp.checkpoint import save_sharded

        return lambda path: save_sharded(model, optim, checkpoint_id=path)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType

    def save(path: str) -> None:
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path, overwrite=True))

    return save


def _loader(impl: str, model: nn.Module, optim: torch.optim.Optimizer) -> Callable[[str], None]:
    """Loads a checkpoint (either implementation's: the same keys) into ``model`` and ``optim``:
    fsdp's ``load_sharded`` (into the flat shards in place), torch FSDP1's documented DCP load of
    its SHARDED model and optimizer state dicts."""
    import torch.distributed.checkpoint as dcp

    if impl == "fsdp":
        from fsdp.checkpoint import load_sharded

        return lambda path: load_sharded(model, optim, checkpoint_id=path)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType

    def load(path: str) -> None:
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}
            dcp.load(state, checkpoint_id=path)
            model.load_state_dict(state["model"])
            optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, state["optim"]))

    return load


def _timed(reps: int, call: Callable[[], None]) -> tuple[float, float]:
    """Median wall and CPU seconds of ``call`` over ``reps`` repetitions, all ranks starting
    together."""
    times, cpu = [], []
    for _ in range(reps):
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        call()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return statistics.median(times), statistics.median(cpu)


def _measure(impl: str, payload: dict[str, Any], workdir: str) -> dict[str, Any]:
    dim, reps = payload["dim"], payload["reps"]
    # Memory: a profiled build, saved once.
    with MemoryTrace() as trace:
        model = _wrap(impl, dim)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        _train_step(model, optim, dim)  # the first step allocates the optimizer state in step()
        with trace.window("train"):  # a steady step: the state is alive through backward
            _train_step(model, optim, dim)
        save = _saver(impl, model, optim)
        dist.barrier()
        with trace.window("save"):
            save(os.path.join(workdir, f"{impl}_mem"))
        del model, optim, save
    # Time and communication: an unprofiled build.
    model = _wrap(impl, dim)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train_step(model, optim, dim)
    save = _saver(impl, model, optim)
    with count_collectives() as counts, count_object_messages() as objects:
        save(os.path.join(workdir, f"{impl}_count"))
    saves = iter(range(reps))
    save_s, save_cpu_s = _timed(reps, lambda: save(os.path.join(workdir, f"{impl}_{next(saves)}")))
    load = _loader(impl, model, optim)
    loads = {
        which: _timed(reps, lambda: load(path))
        for which, path in (("same", os.path.join(workdir, f"{impl}_0")), ("other", payload["reference"]))
    }
    return {
        "save_s": save_s,
        "save_cpu_s": save_cpu_s,
        **{f"load_{which}_s": wall for which, (wall, _) in loads.items()},
        **{f"load_{which}_cpu_s": cpu for which, (_, cpu) in loads.items()},
        "collectives": {k: int(v) for k, v in counts.calls.items() if v},
        "bytes_sent": int(counts.total_bytes()),
        "object_collectives": {k: v for k, v in objects.items() if v},
        "train_peak_bytes": trace.peaks.get("train", 0),
        "save_peak_bytes": trace.peaks.get("save", 0),
    }


def _measure_async(payload: dict[str, Any], workdir: str) -> dict[str, Any]:
    """The loop's blocked time per async save, the whole write, and the memory (module docstring)."""
    from fsdp.checkpoint import _ASYNC, async_save_sharded

    dim, reps = payload["dim"], payload["reps"]
    with MemoryTrace() as trace:
        model = _wrap("fsdp", dim)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        _train_step(model, optim, dim)
        with trace.window("train"):  # a steady step, as in _measure
            _train_step(model, optim, dim)
        async_save_sharded(model, optim, checkpoint_id=os.path.join(workdir, "async_mem0")).result()
        staging = _ASYNC.staging.nbytes
        dist.barrier()
        with trace.window("save"):
            future = async_save_sharded(model, optim, checkpoint_id=os.path.join(workdir, "async_mem"))
            _train_step(model, optim, dim)  # training goes on during the write
            future.result()
        del model, optim, future
    model = _wrap("fsdp", dim)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train_step(model, optim, dim)
    dist.barrier()
    start = time.perf_counter()
    future = async_save_sharded(model, optim, checkpoint_id=os.path.join(workdir, "async_first"))
    first_blocked = time.perf_counter() - start
    future.result()
    with count_collectives() as counts:  # the training loop's thread: the call itself
        async_save_sharded(model, optim, checkpoint_id=os.path.join(workdir, "async_count")).result()
    blocked, written = [], []
    for rep in range(reps):
        _train_step(model, optim, dim)
        dist.barrier()
        start = time.perf_counter()
        future = async_save_sharded(model, optim, checkpoint_id=os.path.join(workdir, f"async_{rep}"))
        blocked.append(time.perf_counter() - start)
        future.result()
        written.append(time.perf_counter() - start)
    return {
        "blocked_s": statistics.median(blocked),
        "first_blocked_s": first_blocked,
        "write_s": statistics.median(written),
        "collectives_in_call": {k: int(v) for k, v in counts.calls.items() if v},
        "bytes_sent": int(counts.total_bytes()),
        "staging_bytes": staging,
        "train_peak_bytes": trace.peaks.get("train", 0),
        "save_peak_bytes": trace.peaks.get("save", 0),
    }


def _reference(rank: int, payload: dict[str, Any], workdir: str) -> None:
    """One rank saves the model (one AdamW step) with ``save_sharded``: the checkpoint every world
    size also loads, from another world size (resharded from whole parameters)."""
    from fsdp.checkpoint import save_sharded

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/rendezvous", rank=rank, world_size=1)
    try:
        model = _wrap("fsdp", payload["dim"])
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        _train_step(model, optim, payload["dim"])
        save_sharded(model, optim, checkpoint_id=payload["reference"])
    finally:
        dist.destroy_process_group()
    write_rank_result(workdir, rank, {})


def _rank(rank: int, payload: dict[str, Any], workdir: str) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/rendezvous", rank=rank, world_size=payload["world_size"])
    try:
        result = {impl: _measure(impl, payload, workdir) for impl in ("fsdp", "torch_fsdp1")}
        result["fsdp_async"] = _measure_async(payload, workdir)
    finally:
        dist.destroy_process_group()
    write_rank_result(workdir, rank, result)


def _summary(per_rank: list[dict[str, Any]], dim: int) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for impl in ("fsdp", "torch_fsdp1"):
        ranks = [r[impl] for r in per_rank]
        rows[impl] = {
            "save_s_slowest_rank": max(r["save_s"] for r in ranks),
            "save_cpu_s_max_rank": max(r["save_cpu_s"] for r in ranks),
            "save_cpu_s_by_rank": [round(r["save_cpu_s"], 4) for r in ranks],
            "collectives_per_save": ranks[0]["collectives"],
            "bytes_sent_per_rank_max": max(r["bytes_sent"] for r in ranks),
            "object_collectives_per_save": {"rank 0": ranks[0]["object_collectives"], "rank 1": ranks[1]["object_collectives"]},
            "save_cpu_s_max_rank_but_0": max(r["save_cpu_s"] for r in ranks[1:]),
            "save_peak_over_train_peak_bytes_max": max(r["save_peak_bytes"] - r["train_peak_bytes"] for r in ranks),
            "save_peak_over_train_peak_bytes_by_rank": [r["save_peak_bytes"] - r["train_peak_bytes"] for r in ranks],
            **{
                f"load_{which}_{measure}": max(r[f"load_{which}_{key}"] for r in ranks)
                for which in ("same", "other")
                for measure, key in (("s_slowest_rank", "s"), ("cpu_s_max_rank", "cpu_s"))
            },
        }
    ranks = [r["fsdp_async"] for r in per_rank]
    over = [r["save_peak_bytes"] - r["train_peak_bytes"] for r in ranks]
    rows["fsdp_async"] = {
        "blocked_s_slowest_rank": max(r["blocked_s"] for r in ranks),
        "first_blocked_s_slowest_rank": max(r["first_blocked_s"] for r in ranks),
        "write_s_slowest_rank": max(r["write_s"] for r in ranks),
        "collectives_in_call": ranks[0]["collectives_in_call"],
        "bytes_sent_per_rank_max": max(r["bytes_sent"] for r in ranks),
        "staging_bytes_max": max(r["staging_bytes"] for r in ranks),
        "save_peak_over_train_peak_bytes_max": max(over),
        "save_peak_over_train_peak_bytes_excluding_staging_max": max(o - r["staging_bytes"] for o, r in zip(over, ranks)),
        "save_peak_over_train_peak_bytes_excluding_staging_by_rank": [o - r["staging_bytes"] for o, r in zip(over, ranks)],
    }
    rows["unit_shard_bytes"] = (dim * dim + dim) * 4 // len(per_rank)
    return rows


def _growth(rows: dict[int, dict[str, Any]]) -> dict[str, float]:
    """How each save's and load's time grows from the fewest ranks to the most, per
    implementation and measure (issue 33's "how each grows"; the save's is a target too)."""
    sizes = sorted(rows)
    low, high = sizes[0], sizes[-1]
    keys = ("save_s_slowest_rank", "save_cpu_s_max_rank", "save_cpu_s_max_rank_but_0")
    keys += tuple(f"load_{w}_{m}" for w in ("same", "other") for m in ("s_slowest_rank", "cpu_s_max_rank"))
    return {
        f"{impl} {key} {high}/{low}": round(rows[high][impl][key] / rows[low][impl][key], 3)
        for impl in ("fsdp", "torch_fsdp1")
        for key in keys
    }


def _targets(rows: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    sizes = sorted(rows)
    low, high = sizes[0], sizes[-1]
    ours_bytes = max(rows[ws]["fsdp"]["bytes_sent_per_rank_max"] for ws in sizes)

    def growth(key: str) -> float:
        return float(rows[high]["fsdp"][key] / rows[low]["fsdp"][key])

    def speedup(key: str) -> float:
        return float(rows[high]["torch_fsdp1"][key] / rows[high]["fsdp"][key])

    memory = max(rows[ws]["fsdp"]["save_peak_over_train_peak_bytes_max"] - rows[ws]["unit_shard_bytes"] for ws in sizes)

    def row(target: str, key: str, value: float, met: bool) -> dict[str, Any]:
        return {"target": target, key: round(value, 3), "status": "met" if met else "NOT met"}

    at = 8 if 8 in rows else high
    blocked = rows[at]["fsdp_async"]["blocked_s_slowest_rank"] / rows[at]["torch_fsdp1"]["save_s_slowest_rank"]
    async_memory = max(
        rows[ws]["fsdp_async"]["save_peak_over_train_peak_bytes_excluding_staging_max"] - rows[ws]["unit_shard_bytes"] for ws in sizes
    )
    staging = max(rows[ws]["fsdp_async"]["staging_bytes_max"] for ws in sizes)
    return [
        row("sharded save: parameter/optimizer bytes sent between ranks = 0", "value", ours_bytes, ours_bytes == 0),
        row(f"async save: loop blocked <= 0.1x torch FSDP1's sync SHARDED save at {at} ranks", "ratio", blocked, blocked <= 0.1),
        row(
            f"async save: peak during save (one step trained during the write) - training peak - one unit's shard "
            f"<= 0 bytes, not counting the host staging buffers (at most {staging} bytes per rank, allocated once)",
            "value",
            async_memory,
            async_memory <= 0,
        ),
        *(
            row(f"sharded save time per rank at {high} ranks <= 1.2x at {low} ({m})", "ratio", growth(k), growth(k) <= 1.2)
            for m, k in _TIME_MEASURES
        ),
        *(
            row(
                f"sharded save >= 3x faster than torch FSDP1 SHARDED at {high} ranks ({m})", "ratio", speedup(k), speedup(k) >= 3
            )
            for m, k in _TIME_MEASURES
        ),
        row("peak during save - training peak - one unit's shard <= 0 bytes", "value", memory, memory <= 0),
    ]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks.checkpoint_scale")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument("--timeout", type=float, default=900.0)
    a = parser.parse_args(argv)
    rows: dict[int, dict[str, Any]] = {}
    reference_dir = tempfile.TemporaryDirectory(prefix="ckpt_scale_reference_")
    reference = os.path.join(reference_dir.name, "one_rank")
    run_local_ranks(_reference, {"dim": a.dim, "reference": reference}, 1, a.timeout, prog="benchmarks.checkpoint_scale")
    for ws in a.world_sizes:
        payload = {"world_size": ws, "dim": a.dim, "reps": a.reps, "reference": reference}
        per_rank = run_local_ranks(_rank, payload, ws, a.timeout, prog="benchmarks.checkpoint_scale")
        rows[ws] = _summary(per_rank, a.dim)
        print(f"world size {ws}: {json.dumps(rows[ws])}", flush=True)
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": {
            "units": UNITS,
            "dim": a.dim,
            "reps": a.reps,
            "optimizer": "AdamW",
            "backend": "gloo (CPU)",
            "cpu_cores": os.cpu_count(),
            "time_measures": OVERSUBSCRIPTION,
        },
        "rows": {str(ws): row for ws, row in rows.items()},
        "growth": _growth(rows),
        "targets": _targets(rows),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
