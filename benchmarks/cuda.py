"""``python -m benchmarks --device cuda``: the GPU benchmark's process group, measurements and
``--profile``.

One process, world size 1 (NCCL on ``cuda:0``; gloo on CPU for ``--cpu-dry-run``). Each *run*
builds one implementation from scratch, so every implementation starts from the same state:
build the seeded fp32 model on the GPU, wrap it, make the optimizer, reset the peak-memory
counters, run the warm-up steps and then the timed ones (a CUDA event pair around each step,
one synchronization after the loop), read the peaks (over warm-up and timed steps), then drop
everything, ``gc.collect()`` and ``torch.cuda.empty_cache()``. The training comparison
alternates implementations within each round (the order rotates by one each round) and the
report takes medians over rounds; see :mod:`benchmarks.report`.

A run that fails (out of memory, or an exception from an implementation) is recorded with the
end of its traceback and that implementation is skipped in later rounds; the others go on.

``--offload`` first measures, in this process and in a few seconds, what the limits of
[Note: Offload limits] (``benchmarks/report.py``) need: the pinned host<->device bandwidth each
way and the host's memcpy bandwidth, and one CPU AdamW step (torch's default and ``fused=True``)
over a shard of each unit size (:func:`measure_offload_rates`).
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import gc
import json
import os
import socket
import sys
import time
import traceback
import warnings
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.config import CudaBenchConfig, gpt_params, layers_for_size, parse_cuda_args
from benchmarks.core import WrapOptions, build_model, make_batches, make_optimizer, train_step, wrap
from benchmarks.report import (
    evaluate_targets,
    format_gpu_report,
    format_offload,
    format_offload_rates,
    model_unit_numels,
    peak_flops,
    summarize_gpu,
    summarize_offload,
)

__all__ = ["main_cuda", "cuda_unavailable_message", "measure_offload_rates"]

#: Host bytes per parameter an offloaded run needs, to skip sizes that cannot fit before the
#: kernel's OOM killer ends the whole process: fp32 parameter, gradient and two AdamW moments
#: (16) plus the model as built while it is flattened (4).
_HOST_BYTES_PER_PARAM = 20


def cuda_unavailable_message() -> str:
    """The one-line error of ``--device cuda`` on a machine without a usable GPU."""
    return (
        f"python -m benchmarks: error: --device cuda: CUDA is not available (torch "
        f"{torch.__version__}, built for CUDA {torch.version.cuda}, "
        f"{torch.cuda.device_count()} GPUs visible); run it on a machine with an NVIDIA GPU, "
        f"or use --device cpu"
    )


def _wrap_options(cfg: CudaBenchConfig, device: torch.device, offload: bool) -> WrapOptions:
    """FULL_SHARD (both FSDP1 designs run NO_SHARD at world size 1), bf16, and the flags."""
    return WrapOptions(strategy="FULL_SHARD", device=device, bf16=True, offload=offload, compile=cfg.compile,
                       compile_backend=cfg.compile_backend)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _process_group(cfg: CudaBenchConfig) -> Iterator[torch.device]:
    """World size 1: NCCL on ``cuda:0`` (gloo on CPU for the dry run); yields the device."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if cfg.device_type == "cuda":
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    try:
        yield device
    finally:
        dist.destroy_process_group()


class _StepTimer:
    """Per-step seconds: a CUDA event pair around each step (no synchronization until
    :meth:`seconds`), or ``time.perf_counter`` on CPU. Also the host's own time per step
    (``perf_counter``, no synchronization): on a GPU, a host time close to the step time means
    the step is bound by the CPU issuing work (Python, hooks, launches), not by the GPU."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._marks: list[Any] = []
        self._host_marks: list[float] = []

    def mark(self) -> None:
        self._host_marks.append(time.perf_counter())
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)
        else:
            self._marks.append(self._host_marks[-1])

    def host_seconds(self) -> list[float]:
        """Host seconds of each (start, end) pair of marks."""
        return [end - start for start, end in zip(self._host_marks[0::2], self._host_marks[1::2])]

    def seconds(self) -> list[float]:
        """Seconds of each (start, end) pair of marks; synchronizes the GPU."""
        pairs = list(zip(self._marks[0::2], self._marks[1::2]))
        if self._cuda:
            torch.cuda.synchronize()
            return [start.elapsed_time(end) / 1000.0 for start, end in pairs]
        return [end - start for start, end in pairs]


def _proc_bytes(path: str, field: str) -> Optional[int]:
    """A kB field of a /proc file (``/proc/self/status``'s VmRSS, ``/proc/meminfo``'s
    MemAvailable) in bytes; ``None`` where /proc is missing."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _host_rss() -> Optional[int]:
    """This process's resident host memory in bytes (``None`` where /proc is missing)."""
    return _proc_bytes("/proc/self/status", "VmRSS")


def _host_available() -> Optional[int]:
    return _proc_bytes("/proc/meminfo", "MemAvailable")


def _record(impl: str, rnd: int, layers: int, status: str = "ok", error: Optional[str] = None) -> dict[str, Any]:
    return {
        "impl": impl, "round": rnd, "layers": layers, "status": status, "error": error, "setup_s": None,
        "step_s": [], "host_step_s": [], "losses": [], "max_allocated": None, "max_reserved": None,
        "allocated_before": None, "host_rss": None,
    }


def _cleanup(device: torch.device) -> None:
    """Frees what the last run left; a GPU error here (a broken CUDA context) is printed and
    left to the next run to record, rather than ending the benchmark."""
    gc.collect()
    if device.type == "cuda":
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"cleanup after a run failed: {type(e).__name__}: {e}", flush=True)


def _error_text(limit: int = 30) -> str:
    """The last ``limit`` lines of the exception being handled."""
    return "".join(traceback.format_exc().splitlines(keepends=True)[-limit:])


def measure(
    cfg: CudaBenchConfig, device: torch.device, impl: str, rnd: int, layers: int, offload: bool,
    warmup: int, steps: int,
) -> dict[str, Any]:
    """One run of ``impl`` from a fresh model: warm-up and timed steps, step times, losses and
    peak memory. Never raises for a failure of the implementation: the run records it."""
    rec = _record(impl, rnd, layers)
    cuda = device.type == "cuda"
    model: Any = None
    opt: Any = None
    losses: list[torch.Tensor] = []
    try:
        start = time.perf_counter()
        rec["allocated_before"] = torch.cuda.memory_allocated() if cuda else None
        model = build_model(cfg.spec(layers), device)
        if offload:  # an fp32 model on the host (built on the GPU: its RNG is far faster)
            model = model.cpu()
            _cleanup(device)
        model = wrap(impl, model, _wrap_options(cfg, device, offload))
        opt = make_optimizer(model, fused=offload and cfg.offload_optimizer == "fused")
        batches = make_batches(cfg.spec(layers), warmup + steps, 0, device)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        rec["setup_s"] = time.perf_counter() - start
        timer = _StepTimer(device)
        for i, batch in enumerate(batches):
            if i >= warmup:
                timer.mark()
            losses.append(train_step(model, opt, batch, autocast=impl == "local"))
            if i >= warmup:
                timer.mark()
        rec["step_s"] = timer.seconds()
        rec["host_step_s"] = timer.host_seconds()
        rec["losses"] = [float(loss) for loss in losses]
        if cuda:
            rec["max_allocated"] = torch.cuda.max_memory_allocated()
            rec["max_reserved"] = torch.cuda.max_memory_reserved()
        rec["host_rss"] = _host_rss()
    except (torch.OutOfMemoryError, MemoryError):
        rec.update(status="oom", error=_error_text(8))
    except Exception as e:  # an implementation's failure is a result to report, not the end of the run
        # An OOM re-raised as another type (from a hook, or pinning host memory) is still an OOM.
        oom = "out of memory" in str(e).lower()
        rec.update(status="oom" if oom else "error", error=_error_text(8 if oom else 30))
    finally:
        model = opt = None
        losses.clear()
        _cleanup(device)
    return rec


def _measure_in_child(cfg: CudaBenchConfig, args: tuple[Any, ...], results: Any) -> None:
    """Child-process body of :func:`measure_isolated`."""
    warnings.filterwarnings("ignore", message=".*NO_SHARD.*")
    try:
        with _process_group(cfg) as device:
            rec = measure(cfg, device, *args)
    except Exception:  # noqa: BLE001 - the process group itself failed: a result to report
        rec = _record(args[0], args[1], args[2], "error", _error_text())
    results.put(rec)


def measure_isolated(
    cfg: CudaBenchConfig, device: torch.device, impl: str, rnd: int, layers: int, offload: bool,
    warmup: int, steps: int,
) -> dict[str, Any]:
    """:func:`measure` in a fresh process (spawned; its own world-size-1 process group).

    [Note: One process per measured run]
    Each run starts from an empty CUDA caching allocator, so no run's peak includes what an
    earlier run left: freeing a torch FSDP1 model does not return all of its memory (measured
    in one process on the H100: about one fp32 copy of the model stayed allocated after each
    FSDP1-design run, gc.collect() notwithstanding; FSDP2 and the unwrapped model returned
    everything). fsdp had the same reference cycle and now breaks it ([Note: Freeing a wrapped
    model] in ``fsdp/flat_param/flat_param.py``). On the CPU dry run the measurement stays in-process.
    """
    if device.type != "cuda":
        return measure(cfg, device, impl, rnd, layers, offload, warmup, steps)
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=_measure_in_child, args=(cfg, (impl, rnd, layers, offload, warmup, steps), results))
    child.start()
    deadline = time.monotonic() + cfg.hang_timeout_s
    rec: Optional[dict[str, Any]] = None
    while rec is None and time.monotonic() < deadline:
        try:
            rec = results.get(timeout=1.0)
        except Exception:  # noqa: BLE001 - queue.Empty: still running
            if not child.is_alive() and results.empty():
                break
    child.join(timeout=30)
    if child.is_alive():
        child.kill()
    if rec is None:
        rec = _record(impl, rnd, layers, "error", f"measuring process ended without a result (exit code {child.exitcode})")
    return rec


def _progress(rec: dict[str, Any], cfg: CudaBenchConfig, tag: str) -> None:
    if rec["status"] != "ok":
        print(f"[{tag}] {rec['impl']:<12} {rec['status'].upper()}\n{rec['error']}", flush=True)
        return
    step = sum(rec["step_s"]) / len(rec["step_s"])
    mem = ""
    if rec["max_allocated"] is not None:
        mem = f"  alloc {rec['max_allocated'] / 2**30:.2f} GiB  resv {rec['max_reserved'] / 2**30:.2f} GiB"
    if (rec["allocated_before"] or 0) > 2**27:  # what an earlier run did not free (a leak)
        mem += f"  (held before the build: {rec['allocated_before'] / 2**30:.2f} GiB)"
    if rec["host_rss"] is not None and cfg.offload:
        mem += f"  host RSS {rec['host_rss'] / 2**30:.1f} GiB"
    host = sum(rec["host_step_s"]) / len(rec["host_step_s"])
    print(
        f"[{tag}] {rec['impl']:<12} step {step:.4f} s (host {host:.4f})  {cfg.tokens_per_step / step:.0f} tok/s{mem}"
        f"  loss {rec['losses'][-1]:.5f}  setup {rec['setup_s']:.1f} s",
        flush=True,
    )


#: Called with the runs so far after each run (the JSON is rewritten, so a run that is killed
#: later still leaves its numbers).
OnRun = Callable[[list[dict[str, Any]]], None]


def _no_op(runs: list[dict[str, Any]]) -> None:
    pass


def _rounds(
    cfg: CudaBenchConfig, device: torch.device, offload: bool, on_run: OnRun = _no_op, start: Optional[float] = None
) -> list[dict[str, Any]]:
    """Alternating rounds of every implementation at ``cfg.layers``; one that fails once is
    skipped afterwards; no round starts after ``cfg.time_budget_s`` from ``start`` (a
    ``perf_counter`` time; default now). Round ``r`` starts with implementation ``r + 1`` (the
    first round measures the torch baselines before fsdp)."""
    runs: list[dict[str, Any]] = []
    failed: set[str] = set()
    start = time.perf_counter() if start is None else start
    impls = list(cfg.impls)
    for rnd in range(cfg.rounds or 1):
        if rnd and time.perf_counter() - start > cfg.time_budget_s:
            print(f"time budget of {cfg.time_budget_s:.0f} s spent: stopping after {rnd} rounds", flush=True)
            break
        first = (rnd + 1) % len(impls)
        order = impls[first:] + impls[:first]
        for impl in order:
            if impl in failed:
                runs.append(_record(impl, rnd, cfg.layers_, "skipped"))
                continue
            rec = measure_isolated(cfg, device, impl, rnd, cfg.layers_, offload, cfg.warmup_steps or 1, cfg.steps or 1)
            _progress(rec, cfg, f"round {rnd + 1}/{cfg.rounds}")
            if rec["status"] != "ok":
                failed.add(impl)
            runs.append(rec)
            on_run(runs)
    return runs


def _walk_sizes(
    cfg: CudaBenchConfig, device: torch.device, on_run: OnRun = _no_op, start: Optional[float] = None
) -> list[dict[str, Any]]:
    """``--offload-sizes``: each size once per implementation (1 warm-up, 2 timed steps),
    smallest first; an implementation that does not fit a size is not tried at larger ones, and
    no size starts after ``cfg.time_budget_s`` from ``start`` (default now)."""
    runs: list[dict[str, Any]] = []
    too_big: set[str] = set()
    start = time.perf_counter() if start is None else start
    for size in sorted(cfg.offload_sizes):
        if runs and time.perf_counter() - start > cfg.time_budget_s:
            print(f"time budget of {cfg.time_budget_s:.0f} s spent: no sizes above {runs[-1]['size_b']:g}B", flush=True)
            break
        layers = layers_for_size(size, cfg.d_model, cfg.vocab, cfg.seq)
        params = gpt_params(layers, cfg.d_model, cfg.vocab, cfg.seq)[0]
        for impl in cfg.impls:
            available = _host_available()
            need = _HOST_BYTES_PER_PARAM * params
            if impl in too_big:
                rec = _record(impl, 0, layers, "skipped", "a smaller size did not fit")
            elif available is not None and need > available:
                rec = _record(impl, 0, layers, "oom", f"host memory: needs about {need / 2**30:.0f} GiB, {available / 2**30:.0f} GiB available")
            else:
                print(f"[size {size:g}B] {impl}: {layers} layers, {params / 1e9:.2f}e9 params ...", flush=True)
                rec = measure_isolated(cfg, device, impl, 0, layers, True, 1, 2)
            rec.update(size_b=size, params=params)
            _progress(rec, cfg, f"size {size:g}B")
            if rec["status"] == "oom":
                too_big.add(impl)
            runs.append(rec)
            on_run(runs)
    return runs


# ------------------------------------------------------------------ --offload: the limits' rates

#: Bytes of each copy that measures a bandwidth: a pinned host buffer to and from the GPU, and
#: host memcpy (the CPU dry run's "copies" too, with a smaller buffer: its machine is shared).
_RATE_BUFFER_BYTES = {"cuda": 256 * 2**20, "cpu": 16 * 2**20}
#: The CPU AdamW step is timed on at most this many elements of a unit's shard (1 GiB of fp32
#: parameter, gradient and moments) and scaled by elements above; see [Note: Offload limits].
_ADAMW_TIMED_NUMEL = 2**26
#: Timed repetitions of each copy (the best is kept) and of each AdamW step, after one warm-up.
_COPY_REPS, _ADAMW_REPS = 3, 2
#: The rates' measurement stops repeating after this share of ``--time-budget``.
_RATES_SHARE_OF_BUDGET = 0.1


def _best_seconds(fn: Callable[[], object], reps: int, deadline: float, sync: Callable[[], None]) -> float:
    """The fastest of up to ``reps`` timed calls of ``fn`` after one untimed warm-up, each
    bracketed by ``sync`` (``torch.cuda.synchronize`` around GPU copies); after ``deadline``
    (a ``perf_counter`` time) no further repetition starts, but one is always timed."""
    fn()
    sync()
    best = float("inf")
    for _ in range(reps):
        begin = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - begin)
        if time.perf_counter() > deadline:
            break
    return best


def _adamw_seconds(unit_numels: Sequence[int], deadline: float) -> list[dict[str, float]]:
    """One CPU AdamW step (the benchmark's, :func:`~benchmarks.core.make_optimizer`) over one
    fp32 tensor of each distinct unit shard size, torch's default and ``fused=True``, best of
    :data:`_ADAMW_REPS` after a warm-up step (which allocates the moments); a shard above
    :data:`_ADAMW_TIMED_NUMEL` elements is timed on that many and scaled by elements.

    Returns:
        Per distinct size: ``{"numel", "timed_numel", "default_s", "fused_s"}``.
    """
    rows: list[dict[str, float]] = []
    for numel in sorted(set(unit_numels)):
        timed = min(numel, _ADAMW_TIMED_NUMEL)
        param = nn.Parameter(torch.empty(timed).uniform_(-0.1, 0.1))
        param.grad = torch.empty_like(param).uniform_(-1e-3, 1e-3)
        row: dict[str, float] = {"numel": numel, "timed_numel": timed}
        for kind in ("default", "fused"):
            opt = make_optimizer(nn.ParameterList([param]), fused=kind == "fused")
            row[f"{kind}_s"] = _best_seconds(opt.step, _ADAMW_REPS, deadline, lambda: None) * numel / timed
            del opt  # its moments freed before the next one's
        rows.append(row)
    return rows


def _copy_seconds(device: torch.device, nbytes: int, deadline: float) -> tuple[float, float]:
    """Seconds of the best copy of ``nbytes`` from a host buffer (pinned for a GPU) to
    ``device`` and of the best copy back (``non_blocking``, as fsdp's copies; synchronized)."""
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    host = torch.ones(nbytes, dtype=torch.uint8, pin_memory=cuda)
    other = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    to_device = _best_seconds(lambda: other.copy_(host, non_blocking=True), _COPY_REPS, deadline, sync)
    to_host = _best_seconds(lambda: host.copy_(other, non_blocking=True), _COPY_REPS, deadline, sync)
    return to_device, to_host


def _copy_rates(device: torch.device, nbytes: int, deadline: float) -> dict[str, Union[str, float]]:
    """Bytes per second host to device and back, and of a host memcpy (bytes read and written:
    what AdamW's memory traffic is divided by). On the CPU dry run the device copies are host
    memcpys too."""
    h2d, d2h = _copy_seconds(device, nbytes, deadline)
    memcpy, _ = _copy_seconds(torch.device("cpu"), nbytes, deadline)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        getattr(torch._C, "_host_emptyCache", lambda: None)()  # the pinned buffer back to the host
    return {
        "copy_how": "pinned" if device.type == "cuda" else "no GPU: host memcpy",
        "copy_buffer_bytes": nbytes,
        "h2d_bytes_per_s": nbytes / h2d,
        "d2h_bytes_per_s": nbytes / d2h,
        "host_memcpy_bytes_per_s": 2 * nbytes / memcpy,
    }


def measure_offload_rates(cfg: CudaBenchConfig, device: torch.device, root_numel: int, block_numels: Sequence[int]) -> dict[str, Any]:
    """What [Note: Offload limits] (``benchmarks/report.py``) needs, measured on this machine:
    the copy and memcpy bandwidths, and one CPU AdamW step over a shard of each unit size
    (``root_numel`` and ``block_numels``: the units of the smallest model measured; every size
    has the same width, so the same two shard sizes). A few seconds at 1e9 parameters (at most
    :data:`_ADAMW_TIMED_NUMEL` elements per timed AdamW step); no repetition starts after :data:`_RATES_SHARE_OF_BUDGET` of
    ``--time-budget``.

    Returns:
        ``{"copy_how", "copy_buffer_bytes", "h2d_bytes_per_s", "d2h_bytes_per_s",
        "host_memcpy_bytes_per_s", "adamw_units", "threads", "seconds", "error"}``
        (``adamw_units``: see :func:`_adamw_seconds`); a failure is recorded in ``"error"``
        (the end of its traceback), never raised: the offload runs go on without limits.
    """
    start = time.perf_counter()
    deadline = start + _RATES_SHARE_OF_BUDGET * cfg.time_budget_s
    rates: dict[str, Any] = {"threads": torch.get_num_threads(), "error": None}
    try:
        rates.update(_copy_rates(device, _RATE_BUFFER_BYTES[device.type], deadline))
        rates["adamw_units"] = _adamw_seconds([root_numel, *block_numels], deadline)
    except Exception:  # noqa: BLE001 - the limits are context; the runs are the benchmark
        rates["error"] = _error_text(8)
    finally:
        gc.collect()
    rates["seconds"] = time.perf_counter() - start
    return rates


def _nccl_version() -> Optional[str]:
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - informational only
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _env(device: torch.device) -> dict[str, Any]:
    cuda = device.type == "cuda"
    return {
        "device_name": torch.cuda.get_device_name(device) if cuda else "cpu (dry run)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": _nccl_version() if cuda else None,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
    }


def _run(cfg: CudaBenchConfig, device: torch.device) -> dict[str, Any]:
    """Everything the configuration asks for; prints as it goes and the report at the end."""
    env = _env(device)
    print(f"benchmarks --device cuda: {env['device_name']}, torch {env['torch']}, CUDA {env['cuda']}", flush=True)
    params, matmul_params = gpt_params(cfg.layers_, cfg.d_model, cfg.vocab, cfg.seq)
    doc: dict[str, Any] = {
        "schema": "benchmarks.cuda/1", "env": env, "config": vars(cfg).copy(),
        "model": {"params": params, "matmul_params": matmul_params}, "runs": [],
    }

    def on_run(runs: list[dict[str, Any]]) -> None:
        doc["runs"] = runs
        _write_json(cfg, doc)

    if cfg.offload:
        start = time.perf_counter()  # the limits' measurement counts against the time budget
        first_layers = layers_for_size(min(cfg.offload_sizes), cfg.d_model, cfg.vocab, cfg.seq) if cfg.offload_sizes else cfg.layers_
        rates = measure_offload_rates(cfg, device, *model_unit_numels(cfg.spec(first_layers)))
        print(format_offload_rates(rates), flush=True)
        doc["offload"] = {"rates": rates}  # replaced by the summary, which keeps them, at the end
        _write_json(cfg, doc)
        if cfg.offload_sizes:
            runs = _walk_sizes(cfg, device, on_run, start)
        else:
            runs = _rounds(cfg, device, True, on_run, start)
        summary = summarize_offload(cfg, runs, rates)
        doc.update(runs=runs, offload=summary)
        print(format_offload(cfg, env, summary), flush=True)
        return doc
    runs = _rounds(cfg, device, False, on_run)
    profile = profile_fsdp(cfg, device) if cfg.profile else None
    peak = peak_flops(env["device_name"], cfg.peak_tflops)
    summary = summarize_gpu(cfg, runs, peak)
    targets = evaluate_targets(summary)
    doc.update(runs=runs, summary=summary, targets=targets, profile=profile)
    if profile is not None:
        print(format_gpu_profile(profile), flush=True)
    print(format_gpu_report(cfg, env, summary, targets), flush=True)
    return doc


def main_cuda(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m benchmarks --device cuda [flags]``; returns the exit status."""
    cfg = parse_cuda_args(argv)
    if not cfg.cpu_dry_run and not torch.cuda.is_available():
        print(cuda_unavailable_message(), file=sys.stderr)
        return 2
    # A hang (a collective that never completes) dumps every thread's stack and exits, so the
    # output shows where, before the caller's own time limit kills the process silently.
    faulthandler.dump_traceback_later(cfg.hang_timeout_s, exit=True)
    warnings.filterwarnings("once")
    # Both FSDP1 implementations warn that they use NO_SHARD at world size 1 (the report says so).
    warnings.filterwarnings("ignore", message=".*NO_SHARD.*")
    try:
        with _process_group(cfg) as device:
            doc = _run(cfg, device)
    finally:
        faulthandler.cancel_dump_traceback_later()
    if cfg.json_out:
        _write_json(cfg, doc)
        print(f"wrote {cfg.json_out}", flush=True)
    return 0


# ------------------------------------------------------------------ --profile

#: Rows of the profile's table.
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
        model = wrap("fsdp", build_model(cfg.spec(), device), _wrap_options(cfg, device, False))
        opt = make_optimizer(model)
        batches = make_batches(cfg.spec(), warmup + cfg.profile_steps, 0, device)
        for batch in batches[:warmup]:
            train_step(model, opt, batch)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=activities) as prof:
            for batch in batches[warmup:]:
                train_step(model, opt, batch)
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


def format_gpu_profile(p: dict[str, Any]) -> str:
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


def _write_json(cfg: CudaBenchConfig, doc: dict[str, Any]) -> None:
    """``doc`` to ``--json`` (if given), its folder created; replaced whole, never half written."""
    if not cfg.json_out:
        return
    path = os.path.abspath(cfg.json_out)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    doc = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **doc}
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(path + ".tmp", path)
