"""The CPU benchmark's ranks: :func:`launch` spawns them, and each runs the memory phase, the
alternating timing rounds, the communication count and the checkpoint timings (or, with
``--profile``, a profile of one implementation's steps).

Every rank returns a JSON-serializable dict of its own measurements; the parent process
(:mod:`benchmarks.__main__`) combines them (the slowest rank's time, the largest rank's peak).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import os
import sys
import time
import warnings
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.comm import count_collectives
from benchmarks.config import CHECKPOINTED, BenchConfig
from benchmarks.core import Batch, WrapOptions, build_model, make_batches, make_optimizer, torch_fsdp, train_step, wrap
from benchmarks.local_ranks import run_local_ranks, write_rank_result
from benchmarks.memory import MemoryTrace

__all__ = ["launch", "rank_entry"]


def _wrapped(name: str, cfg: BenchConfig) -> nn.Module:
    """A fresh model wrapped by implementation ``name``."""
    return wrap(name, build_model(cfg.spec), WrapOptions(strategy=cfg.strategy, forward_prefetch=cfg.forward_prefetch))


def _batches(cfg: BenchConfig) -> list[Batch]:
    return make_batches(cfg.spec, 2, dist.get_rank())


def _fsdp_api(name: str) -> tuple[Any, bool]:
    """(the FSDP1 API module of ``name``, ``offload_to_cpu`` for its full model state dict).

    torch FSDP1's full model state dict with ``offload_to_cpu=True`` fails on a CPU-only setup
    (``setStorage: ... out of bounds for storage of size 0``), so torch saves its model with
    ``offload_to_cpu=False`` (its values are still cloned); ours uses the usual
    ``offload_to_cpu=True``. The optimizer state dict uses ``offload_to_cpu=True`` for both.
    """
    if name == "fsdp":
        import fsdp

        return fsdp, True
    return torch_fsdp(), False


@contextlib.contextmanager
def _full_state_dict(name: str, model: nn.Module) -> Iterator[Any]:
    api, offload = _fsdp_api(name)
    with api.FullyShardedDataParallel.state_dict_type(
        model,
        api.StateDictType.FULL_STATE_DICT,
        api.FullStateDictConfig(offload_to_cpu=offload, rank0_only=True),
        api.FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True),
    ):
        yield api.FullyShardedDataParallel


def _save_model(name: str, model: nn.Module) -> None:
    with _full_state_dict(name, model):
        sd = model.state_dict()
    del sd


def _save_optim(name: str, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    with _full_state_dict(name, model) as fsdp_cls:
        osd = fsdp_cls.optim_state_dict(model, opt)
    del osd


def _memory_phase(cfg: BenchConfig, name: str) -> dict[str, Any]:
    """Peak live bytes of one training step (and of full saves) with a freshly built ``name``."""
    gc.collect()
    dist.barrier()
    with MemoryTrace() as trace:
        model = _wrapped(name, cfg)
        # The unwrapped model's replaced parameters can sit in reference cycles until Python's
        # cyclic collector happens to run; collect now, for every implementation alike, so the
        # step peak measures the implementation, not when garbage collection last ran.
        gc.collect()
        opt = make_optimizer(model)
        batches = _batches(cfg)
        for i in range(cfg.warmup_steps):
            train_step(model, opt, batches[i % len(batches)])
        # The peak moves a little from step to step (when gloo's threads finish a collective
        # decides when its buffers die), so the window spans several steps.
        with trace.window("step"):
            for i in range(cfg.memory_steps):
                train_step(model, opt, batches[i % len(batches)])
        if cfg.checkpoint and name in CHECKPOINTED:
            dist.barrier()
            with trace.window("save_model"):
                _save_model(name, model)
            with trace.window("save_optim"):
                _save_optim(name, model, opt)
        del model, opt, batches
        gc.collect()
        dist.barrier()
    result = {
        "step_start_bytes": trace.starts["step"],
        "step_peak_bytes": trace.peaks["step"],
        "all_threads": trace.all_threads,
    }
    for key in ("save_model", "save_optim"):
        if key in trace.peaks:
            result[f"{key}_peak_bytes"] = trace.peaks[key]
    result["leftover_bytes"] = trace.final
    return result


def _timed_steps(model: nn.Module, opt: torch.optim.Optimizer, batches: list, n: int, offset: int) -> dict[str, float]:
    """Per-step wall time and CPU time of ``n`` steps: of the whole process and of this thread.

    The process's CPU time covers every thread of the rank (the training thread, gloo's
    communication threads, ...); the training thread's own is ``main_cpu_s``. See
    [Note: CPU floor] in ``report.py`` for what the report makes of them.
    """
    dist.barrier()
    start, cpu_start, main_start = time.perf_counter(), time.process_time(), time.thread_time()
    for i in range(n):
        train_step(model, opt, batches[(offset + i) % len(batches)])
    return {
        "step_s": (time.perf_counter() - start) / n,
        "cpu_s": (time.process_time() - cpu_start) / n,
        "main_cpu_s": (time.thread_time() - main_start) / n,
    }


def _timed(fn: Callable[[], None]) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _timing_rounds(
    cfg: BenchConfig,
    names: list[str],
    models: dict[str, nn.Module],
    opts: dict[str, torch.optim.Optimizer],
    batches: list,
    out: dict[str, Any],
) -> None:
    """The alternating step-time rounds, then one counted step of each implementation."""
    for r in range(cfg.rounds):
        _progress(f"timing round [{r + 1}/{cfg.rounds}] ({cfg.steps_per_round} steps of each implementation)")
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            timing = _timed_steps(models[name], opts[name], batches, cfg.steps_per_round, r)
            for key, value in timing.items():
                out[key][name].append(value)
    for name in names:
        dist.barrier()
        with count_collectives() as counts:
            train_step(models[name], opts[name], batches[0])
        out["comm"][name] = {"calls": dict(counts.calls), "bytes": dict(counts.bytes)}


def _usable_cpus() -> int:
    """The CPUs this rank may run on (all local ranks share them)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)


def _progress(line: str) -> None:
    """Rank 0's progress, one line per phase or round on stderr (stdout keeps the report)."""
    if dist.get_rank() == 0:
        print(f"benchmarks: {line}", file=sys.stderr, flush=True)


def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    rank = dist.get_rank()
    names = list(cfg.only)
    out: dict[str, Any] = {
        "rank": rank,
        "cpus": _usable_cpus(),
        "memory": {},
        "step_s": {n: [] for n in names},
        "cpu_s": {n: [] for n in names},
        "main_cpu_s": {n: [] for n in names},
        "comm": {},
        "checkpoint": {},
    }
    if cfg.memory:
        for i, name in enumerate(names):
            _progress(f"memory [{i + 1}/{len(names)}] {name}")
            out["memory"][name] = _memory_phase(cfg, name)
    # Timing: every implementation lives side by side; rounds alternate between them, and the
    # order rotates each round so none is always first after another's cache footprint.
    models = {name: _wrapped(name, cfg) for name in names}
    opts = {name: make_optimizer(models[name]) for name in names}
    batches = _batches(cfg)
    _progress(f"warm-up: {cfg.warmup_steps} steps of each of {len(names)} implementations")
    for name in names:
        for i in range(cfg.warmup_steps):
            train_step(models[name], opts[name], batches[i % len(batches)])
    if not cfg.checkpoint_only:
        _timing_rounds(cfg, names, models, opts, batches, out)
    ckpt_names = [n for n in names if n in CHECKPOINTED] if cfg.checkpoint else []
    if ckpt_names:
        _progress(f"checkpoint saves: {cfg.checkpoint_reps} timed of each of {len(ckpt_names)} implementations")
    for name in ckpt_names:
        out["checkpoint"][name] = {"model_s": [], "optim_s": []}
        # One untimed save of each kind first (lazy imports, first-call caches).
        _save_model(name, models[name])
        _save_optim(name, models[name], opts[name])
    for _ in range(cfg.checkpoint_reps if ckpt_names else 0):
        for name in ckpt_names:
            model, opt = models[name], opts[name]
            out["checkpoint"][name]["model_s"].append(_timed(functools.partial(_save_model, name, model)))
            out["checkpoint"][name]["optim_s"].append(_timed(functools.partial(_save_optim, name, model, opt)))
    dist.barrier()
    return out


def run_profile(cfg: BenchConfig) -> dict[str, Any]:
    """``cfg.profile_impl``'s (default fsdp) steps under torch.profiler; the top ops by self CPU time.

    Waiting for a gloo collective is not an op of its own: it shows up as self time of the op
    or autograd node that waits (e.g. ``AccumulateGrad``, whose post-accumulate hook
    reduce-scatters, or the backward node whose pre-hook all-gathers).
    """
    from torch.profiler import ProfilerActivity, profile

    model = _wrapped(cfg.profile_impl, cfg)
    opt = make_optimizer(model)
    batches = _batches(cfg)
    for i in range(cfg.warmup_steps):
        train_step(model, opt, batches[i % len(batches)])
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for i in range(cfg.profile_steps):
            train_step(model, opt, batches[i % len(batches)])
        wall = (time.perf_counter() - start) / cfg.profile_steps
    averages = prof.key_averages()
    rows = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)
    total_self = sum(e.self_cpu_time_total for e in averages)
    top = [
        {
            "name": e.key,
            "calls": e.count // cfg.profile_steps,
            "self_ms_per_step": e.self_cpu_time_total / 1000 / cfg.profile_steps,
            "self_pct": 100.0 * e.self_cpu_time_total / max(total_self, 1),
        }
        for e in rows[:25]
    ]
    return {
        "rank": dist.get_rank(),
        "profile": {"top": top, "wall_ms_per_step": wall * 1000, "self_ms_per_step": total_self / 1000 / cfg.profile_steps},
    }


def rank_entry(rank: int, cfg_dict: dict[str, Any], workdir: str) -> None:
    """Process entry point of rank ``rank``: joins the gloo group and writes ``rank<N>.json``."""
    # torch's FSDP1 warns on every state-dict call (gloo's default device, the deprecation of
    # state_dict_type); the benchmark's output should be its table.
    warnings.filterwarnings("ignore", module=r"torch\.distributed\..*")
    cfg = BenchConfig(**{**cfg_dict, "only": tuple(cfg_dict["only"])})
    torch.set_num_threads(cfg.threads)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(workdir, 'rendezvous')}",
        rank=rank,
        world_size=cfg.world_size,
    )
    try:
        result = run_profile(cfg) if cfg.profile else run_bench(cfg)
        write_rank_result(workdir, rank, result)
        # Both ranks are done with every exchange before either tears its group down (a rank
        # whose peer closed its connections while its own gloo threads still held work could
        # abort); the runner then ends the process without finalizing the interpreter, see
        # [Note: Rank exit without interpreter finalization] in benchmarks/local_ranks.py.
        dist.barrier()
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def launch(cfg: BenchConfig) -> list[dict[str, Any]]:
    """Runs :func:`rank_entry` on ``cfg.world_size`` spawned processes.

    Ranks rendezvous through a file in a fresh temporary folder ([Note: Local rank protocol] in
    ``benchmarks/local_ranks.py``). Returns each rank's result in rank order; raises ``RuntimeError``
    if a rank fails or the run exceeds ``cfg.timeout_s`` (the other ranks are then terminated,
    they would block in a collective).
    """
    # The profiler's kineto backend logs every start/stop (at its USDT level, 5) unless told otherwise;
    # the spawned ranks inherit this before they import torch.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    return run_local_ranks(
        rank_entry, dataclasses.asdict(cfg), cfg.world_size, cfg.timeout_s, prog="benchmarks"
    )
