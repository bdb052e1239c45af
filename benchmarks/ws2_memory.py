"""``python -m benchmarks.ws2_memory``: per-rank peak GPU memory at world size 2 on one GPU.

Two local ranks share GPU 0 through gloo with CUDA tensors (NCCL refuses two ranks on one GPU),
so step times mean nothing here, but each rank's ``torch.cuda.max_memory_allocated`` does: the
memory a rank holds when its model is sharded in two. Each implementation (torch FSDP1, then
fsdp) runs in fresh rank processes ([Note: One process per measured run] in
``benchmarks/cuda.py``; a dry run's ranks run both in turn): the example GPT built on the GPU,
wrapped FULL_SHARD with bf16 mixed precision (:func:`benchmarks.core.wrap`), AdamW, the peak
counters reset, then ``--steps`` training steps. The report gives each rank's peak and fsdp's ratio to torch FSDP1's (the
target: at most 0.93x). ``--dry-run`` runs the same code on CPU ranks (no memory figures).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import sys
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from benchmarks.core import ModelSpec, WrapOptions, build_model, make_batches, make_optimizer, ratio, times, train_step, wrap
from benchmarks.local_ranks import run_local_ranks, write_rank_result

__all__ = ["main"]

WORLD_SIZE = 2
IMPLS = ("torch_fsdp1", "fsdp")
TARGET = 0.93


def _train(impl: str, spec: ModelSpec, steps: int, rank: int, device: torch.device) -> dict[str, Any]:
    """Builds, wraps and trains ``impl`` for ``steps`` steps; its losses and peaks on this rank."""
    cuda = device.type == "cuda"
    model = wrap(impl, build_model(spec, device), WrapOptions("FULL_SHARD", device, bf16=True))
    opt = make_optimizer(model)
    batches = make_batches(spec, steps, rank, device)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    losses = [float(train_step(model, opt, batch)) for batch in batches]
    return {
        "rank": rank,
        "impl": impl,
        "losses": losses,
        "max_allocated": torch.cuda.max_memory_allocated() if cuda else None,
        "max_reserved": torch.cuda.max_memory_reserved() if cuda else None,
    }


def _rank(rank: int, payload: dict[str, Any], workdir: str) -> None:
    """One rank: trains each of ``payload["impls"]`` in turn; writes ``{impl: its result}``."""
    spec = ModelSpec(**payload["spec"])
    cuda = not payload["dry_run"]
    if cuda:
        torch.cuda.set_device(0)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dist.init_process_group(
        "gloo", init_method=f"file://{os.path.join(workdir, 'rendezvous')}", rank=rank, world_size=WORLD_SIZE
    )
    try:
        write_rank_result(workdir, rank, {impl: _train(impl, spec, payload["steps"], rank, device) for impl in payload["impls"]})
        dist.barrier()
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ws2_memory", description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--n-head", type=int, default=16)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per implementation")
    p.add_argument("--json", dest="json_out", default=None)
    p.add_argument("--dry-run", action="store_true", help="the same code on CPU ranks (no memory figures)")
    return p


def _gib(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value / 2**30:.2f}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs both implementations; prints the per-rank table; returns the exit status."""
    a = _parser().parse_args(argv)
    if not a.dry_run and not torch.cuda.is_available():
        print("python -m benchmarks.ws2_memory: error: CUDA is not available; use --dry-run on CPU", file=sys.stderr)
        return 2
    spec = ModelSpec("gpt", a.layers, a.d_model, a.n_head, a.batch, a.seq, vocab=a.vocab)
    results: dict[str, Any] = {}
    # On the GPU each implementation gets fresh ranks ([Note: One process per measured run] in
    # benchmarks/cuda.py); a dry run has no memory figures to keep apart, so one set of ranks runs
    # both in turn (two interpreter starts fewer).
    for impls in [list(IMPLS)] if a.dry_run else [[impl] for impl in IMPLS]:
        payload = {"spec": dataclasses.asdict(spec), "impls": impls, "steps": a.steps, "dry_run": a.dry_run}
        try:
            ranks = run_local_ranks(_rank, payload, WORLD_SIZE, a.timeout * len(impls), prog="benchmarks.ws2_memory")
            results.update({impl: [r[impl] for r in ranks] for impl in impls})
        except RuntimeError as e:  # a failed implementation is a result; the other still runs
            results.update({impl: {"error": str(e)} for impl in impls})
        for impl in impls:
            ok = isinstance(results[impl], list)
            print(f"{impl}: " + (f"losses {[r['losses'] for r in results[impl]]}" if ok else results[impl]["error"]), flush=True)
    ours, theirs = results.get("fsdp"), results.get("torch_fsdp1")
    per_rank = []
    if isinstance(ours, list) and isinstance(theirs, list):
        per_rank = [ratio(o["max_allocated"], t["max_allocated"]) for o, t in zip(ours, theirs)]
    print(f"== world size {WORLD_SIZE} on one GPU (gloo, CUDA tensors): GPT {spec}", flush=True)
    for impl in IMPLS:
        r = results[impl]
        cells = "; ".join(f"rank {x['rank']} {_gib(x['max_allocated'])} GiB" for x in r) if isinstance(r, list) else r["error"]
        print(f"  {impl:<12} max allocated: {cells}")
    worst = max((x for x in per_rank if x is not None), default=None)
    print(f"  fsdp / torch_fsdp1 per rank: {', '.join(times(x) for x in per_rank)}; target <= {TARGET}x: "
          + ("n/a" if worst is None else ("met" if worst <= TARGET else "NOT met")))
    if a.json_out:
        with open(a.json_out, "w") as f:
            date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
            targets = [{"target": f"fsdp max allocated <= {TARGET}x torch FSDP1's, every rank", "ratio": worst,
                        "status": "n/a" if worst is None else ("met" if worst <= TARGET else "NOT met")}]
            json.dump({"date": date, "targets": targets, "spec": dataclasses.asdict(spec), "results": results,
                       "ratios": per_rank, "target": TARGET}, f, indent=1)
    return 0 if all(isinstance(r, list) for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
