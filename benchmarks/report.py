"""The benchmarks' reports: combining the measurements, the tables, and where each guard or
target stands. Everything here is pure (no GPU, no process group), so it is unit-tested on CPU.

The CPU benchmark (:func:`summarize`, :func:`format_report`): the ranks' measurements combined
(the slowest rank's time, the largest rank's peak), the minimum communication, the CPU floor.
The GPU benchmark (:func:`summarize_gpu`, :func:`format_gpu_report`, and the offload ones):
medians over rounds, MFU, memory. Both take their ratios to :data:`~benchmarks.core.REFERENCE`
with :func:`~benchmarks.core.ratio` and print them with :func:`~benchmarks.core.times`.

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

[Note: Offload limits]
The physical limits of fsdp's offloaded step on the machine it runs on, measured there and
printed beside its step time:

* **copies**: the bytes that cross PCIe per step over the pinned bandwidth measured at run
  time (:func:`offload_copy_bytes`; the best of a few synchronized copies of a 256 MiB
  pinned buffer each way), H2D and D2H time added (a full-duplex link can overlap the two
  directions; the sum is the time with no overlap between them).
* **CPU AdamW**: one AdamW step (the benchmark's hyperparameters) over CPU tensors of the
  units' fp32 shard sizes, timed on the host at run time for torch's default (one tensor
  after another) and ``fused=True``: each distinct shard size (the root's and a block's) is
  timed alone, on at most 2^26 elements (scaled by elements above: 1 GiB of fp32 parameter,
  gradient and moments keeps it to seconds), and the model's time is the sum over its units.
  The **traffic bound**: a fused AdamW reads
  the parameter, the gradient and both moments and writes the parameter and the moments, 28
  bytes per parameter, at the host's memcpy bandwidth (bytes read and written per second).

``step / (copies + fused AdamW)`` is how far the step is from doing only those two, one
after the other; overlapping them with each other and with the GPU's work goes below 1x.
On the CPU dry run the "copies" are host memcpys (no GPU), the AdamW as on a GPU machine.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Optional, Sequence

import torch

from benchmarks.config import OFFLOAD_IMPLEMENTATIONS, BenchConfig, CudaBenchConfig, gpt_params
from benchmarks.core import IMPLEMENTATIONS, REFERENCE, ModelSpec, blocks, build_model, median, ratio, times

__all__ = [
    "TARGETS",
    "summarize",
    "format_report",
    "format_profile",
    "minimum_bytes",
    "unit_numels",
    "model_unit_numels",
    "GPU_TARGETS",
    "PEAK_BF16_FLOPS",
    "peak_flops",
    "flops_per_token",
    "summarize_gpu",
    "evaluate_targets",
    "format_gpu_report",
    "offload_copy_bytes",
    "offload_limits",
    "summarize_offload",
    "format_offload",
    "format_offload_rates",
]

MiB = 1024 * 1024
def _met(value: Any, threshold: float) -> Optional[bool]:
    """Whether a measured ratio is within its guard (None when it was not measured)."""
    return None if value is None else float(value) <= threshold


#: The CPU benchmark's guards (what a change must not make worse), as (key,
#: description, threshold): each holds when the measured ratio is <= the threshold. A fifth,
#: ``comm_minimum``, holds when fsdp's bytes per step are the strategy's minimum.
TARGETS = (
    ("step_vs_fsdp1", "step time <= torch FSDP1's", 1.0),
    ("peak_vs_torch", "training peak <= min(torch FSDP1, torch FSDP2) (same run)", 1.0),
    ("model_sd_vs_fsdp1", "rank0_only full model state dict time <= 0.5x torch FSDP1", 0.50),
    ("optim_sd_vs_fsdp1", "optim_state_dict time <= 0.5x torch FSDP1", 0.50),
)

#: The guards ``--checkpoint-only`` measures.
CHECKPOINT_TARGETS = ("model_sd_vs_fsdp1", "optim_sd_vs_fsdp1")


def model_unit_numels(spec: ModelSpec) -> tuple[int, list[int]]:
    """Parameters owned by the root unit and by each block unit (the model built on the meta
    device: no memory, no initialization)."""
    model = build_model(spec, torch.device("meta"))
    layers = [sum(p.numel() for p in layer.parameters()) for layer in blocks(model)]
    total = sum(p.numel() for p in model.parameters())
    return total - sum(layers), layers


def unit_numels(cfg: BenchConfig) -> tuple[int, list[int]]:
    """Parameters owned by the root unit and by each layer unit."""
    return model_unit_numels(cfg.spec)


def minimum_bytes(cfg: BenchConfig) -> dict[str, int]:
    """The fewest bytes per step (float32, output-tensor convention of :mod:`benchmarks.comm`).

    A unit's flat parameter is padded to a multiple of the world size (``padded``), so each rank
    holds ``padded / world_size`` elements. FULL_SHARD: every layer unit is all-gathered twice
    (forward and backward, since it is freed after its forward) except the last, and the root
    once: those two stay gathered from their forward into their backward, which comes first
    ([Note: The first backward unit stays gathered]; torch FSDP1 gathers the last layer twice);
    each unit's gradient is reduce-scattered once. SHARD_GRAD_OP: one all-gather per unit, one reduce-scatter per unit. NO_SHARD: one
    all-reduce of each unit's gradient.
    """
    ws = cfg.world_size
    root, layers = unit_numels(cfg)

    def padded(n: int) -> int:
        return math.ceil(n / ws) * ws

    units = [root, *layers]
    if cfg.strategy == "FULL_SHARD":
        ag = 2 * sum(padded(n) for n in layers) - padded(layers[-1]) + padded(root)
        return {"all_gather": 4 * ag, "reduce_scatter": 4 * sum(padded(n) // ws for n in units)}
    if cfg.strategy == "SHARD_GRAD_OP":
        return {
            "all_gather": 4 * sum(padded(n) for n in units),
            "reduce_scatter": 4 * sum(padded(n) // ws for n in units),
        }
    return {"all_reduce": 4 * sum(units)}


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
        entry["peak_vs_fsdp1"] = ratio(entry.get("peak_bytes"), ref.get("peak_bytes")) if ref else None
        entry["comm_vs_fsdp1"] = ratio(entry["comm_bytes"], ref["comm_bytes"]) if ref else None
        entry["peak_vs_torch"] = ratio(entry.get("peak_bytes"), min(torch_peaks)) if torch_peaks else None


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
        "peak_vs_torch": ours.get("peak_vs_torch"),
        "model_sd_vs_fsdp1": ours_ckpt.get("model_vs_fsdp1"),
        "optim_sd_vs_fsdp1": ours_ckpt.get("optim_vs_fsdp1"),
    }
    # The spread says how much one run's median can be trusted on a noisy machine; the floor,
    # how far the CPU work alone puts fsdp above the local baseline ([Note: CPU floor]).
    notes = []
    rounds = ours.get("step_vs_fsdp1_rounds")
    if rounds:
        notes.append(f"rounds {min(rounds):.3f}x-{max(rounds):.3f}x")
    if ours.get("floor_vs_local") is not None:
        notes.append(f"the CPU floor alone is {times(ours['floor_vs_local'], 2)} local")
    details = {"step_vs_fsdp1": f"({'; '.join(notes)})"} if notes else {}
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


def _header(cfg: BenchConfig, s: dict[str, Any]) -> str:
    return (
        f"benchmarks: world size {cfg.world_size} (local CPU ranks, gloo, {cfg.threads} thread/rank), "
        f"{cfg.layers} x TransformerEncoderLayer(d_model={cfg.d_model}, nhead={cfg.nhead}, "
        f"ff={cfg.dim_feedforward}) + LayerNorm, {s['params'] / 1e6:.2f}M params, "
        f"per-rank batch {cfg.batch} x seq {cfg.seq}, AdamW, {cfg.strategy}"
        + (", forward prefetch" if cfg.forward_prefetch else "")
    )


def _memory_source(s: dict[str, Any]) -> str:
    """How the peaks were counted (see [Note: Frees on other threads] in ``memory.py``)."""
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
            f"{name:<14} {e['step_s']:>8.3f} {times(e['step_vs_fsdp1'], 2):>9} {times(e['step_vs_local'], 2):>9} "
            f"{(f'{peak / MiB:.1f}' if peak is not None else 'n/a'):>9} {times(e['peak_vs_fsdp1'], 2):>9} "
            f"{e['comm_bytes'] / 1e6:>9.2f} {times(e['comm_vs_fsdp1'], 2):>9}"
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
            f"{times(e['floor_vs_local'], 2):>9} {_waiting_s(e):>10.3f}"
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
            f"{name:<14} {c['model_s']:>10.4f} {times(c.get('model_vs_fsdp1'), 2):>9} {c['optim_s']:>10.4f} "
            f"{times(c.get('optim_vs_fsdp1'), 2):>9} {save:>21}"
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
            value = times(t["value"])
        detail = f" {t['detail']}" if t.get("detail") else ""
        lines.append(f"  [{status}] {t['description']}: {value}{detail}")
    if "wall_s" in s:
        lines.append(f"\ntotal wall time {s['wall_s']:.0f} s")
    return "\n".join(lines)


def format_profile(cfg: BenchConfig, p: dict[str, Any]) -> str:
    lines = [
        f"benchmarks --profile: {cfg.profile_impl}, rank 0, {cfg.profile_steps} steps after {cfg.warmup_steps} warm-up; "
        f"wall {p['wall_ms_per_step']:.1f} ms/step (profiled), self CPU total {p['self_ms_per_step']:.1f} ms/step",
        f"{'op':<48} {'calls/step':>10} {'self_ms/step':>12} {'self_%':>7}",
    ]
    for row in p["top"]:
        lines.append(f"{row['name'][:48]:<48} {row['calls']:>10} {row['self_ms_per_step']:>12.2f} {row['self_pct']:>7.1f}")
    return "\n".join(lines)


# ------------------------------------------------------------------ the GPU benchmark
#
# One measurement (a *run*: one implementation in one round) is a dict::
#
#     {"impl": "fsdp", "round": 0, "layers": 18, "status": "ok" | "oom" | "error" | "skipped",
#      "error": None | "last lines of the error", "setup_s": 2.1,
#      "step_s": [0.21, ...],       # each timed step (CUDA events)
#      "host_step_s": [0.05, ...],  # the host's time issuing each timed step (perf_counter)
#      "losses": [10.83, ...],      # every step's loss, warm-up steps included
#      "max_allocated": 3.5e10, "max_reserved": 3.8e10,   # bytes, None on the CPU dry run
#      "allocated_before": 0, "host_rss": 1.2e10}

GIB = 2**30

#: Dense bf16 peak FLOP/s by a substring of ``torch.cuda.get_device_name()`` (first match wins;
#: NVIDIA's datasheets, without sparsity). H100 SXM reports itself as "H100 80GB HBM3".
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989.4e12),
    ("H100 SXM", 989.4e12),
    ("H100 80GB HBM3", 989.4e12),
    ("H100 PCIe", 756.0e12),
)

#: The GPU benchmark's targets at world size 1, eager or compiled alike, as
#: (description, implementation, metric, other implementation, factor, direction): the target
#: holds when ``metric(impl) >= factor * metric(other)`` (direction ``">="``) or ``<=``.
GPU_TARGETS: tuple[tuple[str, str, str, str, float, str], ...] = (
    ("fsdp tokens/s >= torch_fsdp1's", "fsdp", "tokens_per_s", "torch_fsdp1", 1.0, ">="),
    ("fsdp tokens/s >= 0.95x local's", "fsdp", "tokens_per_s", "local", 0.95, ">="),
    ("fsdp max allocated <= torch_fsdp2's", "fsdp", "max_allocated", "torch_fsdp2", 1.0, "<="),
)


def peak_flops(device_name: str, override_tflops: Optional[float] = None) -> Optional[float]:
    """The dense bf16 peak FLOP/s: ``override_tflops`` x 1e12 if given, else looked up from the
    device's name, else ``None`` (MFU is then reported as n/a)."""
    if override_tflops is not None:
        return override_tflops * 1e12
    for key, flops in PEAK_BF16_FLOPS:
        if key.lower() in device_name.lower():
            return flops
    return None


def flops_per_token(layers: int, d_model: int, vocab: int, seq: int) -> int:
    """Model FLOPs of one training step per token: ``6 N + 12 L d T``.

    ``N`` is the number of matmul parameters (every parameter but the token and position
    embedding tables: the blocks, the final LayerNorm and the untied output head), each costing
    2 FLOPs per token forward and 4 backward. ``12 L d T`` is attention's two seq x seq matmuls
    (q k^T and attention x v), ``2 T d`` FLOPs each per token and layer forward, times 3 for
    forward plus backward, counted in full although the causal mask lets flash attention skip
    half (the usual MFU convention, PaLM appendix B). Recomputation is not counted.
    """
    _, matmul_params = gpt_params(layers, d_model, vocab, seq)
    return 6 * matmul_params + 12 * layers * d_model * seq


def _entry(cfg: CudaBenchConfig, impl: str, runs: list[dict[str, Any]], flops_token: int, peak: Optional[float]) -> dict[str, Any]:
    """One implementation's medians over its successful rounds."""
    ok = [r for r in runs if r["status"] == "ok"]
    failed = [r for r in runs if r["status"] not in ("ok", "skipped")]
    step_s = median([statistics.mean(r["step_s"]) for r in ok])
    host_step_s = median([statistics.mean(r["host_step_s"]) for r in ok if r.get("host_step_s")])
    tokens_per_s = cfg.tokens_per_step / step_s if step_s else None
    alloc = [r["max_allocated"] for r in ok if r["max_allocated"] is not None]
    reserved = [r["max_reserved"] for r in ok if r["max_reserved"] is not None]
    return {
        "impl": impl,
        "status": "ok" if ok else (failed[0]["status"] if failed else "skipped"),
        "error": failed[0]["error"] if failed else None,
        "rounds": len(ok),
        "step_s": step_s,
        "host_step_s": host_step_s,
        "tokens_per_s": tokens_per_s,
        "mfu": tokens_per_s * flops_token / peak if tokens_per_s and peak else None,
        "max_allocated": median(alloc),
        "max_reserved": median(reserved),
        "losses": ok[0]["losses"] if ok else [],
    }


def summarize_gpu(
    cfg: CudaBenchConfig, runs: list[dict[str, Any]], peak: Optional[float], impls: Optional[Sequence[str]] = None
) -> dict[str, Any]:
    """Per implementation: the medians over rounds, and each figure's ratio to torch_fsdp1's.

    Returns:
        ``{"flops_per_token", "peak_flops", "impls": {impl: entry}, "loss_max_abs_diff"}``
        where an entry has ``status, error, rounds, step_s, host_step_s, tokens_per_s, mfu, max_allocated,
        max_reserved, losses, ratios`` (``ratios[metric]`` is ``None`` when either side is
        missing) and ``loss_max_abs_diff`` is the largest |fsdp loss - torch_fsdp1 loss| over
        the steps of their first successful rounds (``None`` if either is missing).
    """
    assert cfg.layers is not None
    flops_token = flops_per_token(cfg.layers, cfg.d_model, cfg.vocab, cfg.seq)
    names = list(impls if impls is not None else (cfg.only or ()))
    entries = {
        impl: _entry(cfg, impl, [r for r in runs if r["impl"] == impl], flops_token, peak) for impl in names
    }
    ref = entries.get(REFERENCE)
    for entry in entries.values():
        entry["ratios"] = {
            metric: ratio(entry[metric], ref[metric] if ref else None)
            for metric in ("step_s", "tokens_per_s", "mfu", "max_allocated", "max_reserved")
        }
    ours, theirs = entries.get("fsdp"), entries.get(REFERENCE)
    diff = None
    if ours and theirs and ours["losses"] and len(ours["losses"]) == len(theirs["losses"]):
        diff = max(abs(a - b) for a, b in zip(ours["losses"], theirs["losses"]))
    return {"flops_per_token": flops_token, "peak_flops": peak, "impls": entries, "loss_max_abs_diff": diff}


def evaluate_targets(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target of :data:`GPU_TARGETS` with its observed ratio and ``"met"``, ``"NOT met"`` or
    ``"n/a"`` (an implementation or a figure is missing)."""
    out = []
    for text, impl, metric, other, factor, direction in GPU_TARGETS:
        a = summary["impls"].get(impl, {}).get(metric)
        b = summary["impls"].get(other, {}).get(metric)
        observed = ratio(a, b)
        if observed is None:
            status = "n/a"
        else:
            holds = observed >= factor if direction == ">=" else observed <= factor
            status = "met" if holds else "NOT met"
        out.append({"target": text, "ratio": observed, "status": status})
    return out


def _f(value: Optional[float], fmt: str, scale: float = 1.0) -> str:
    return "n/a" if value is None else format(value / scale, fmt)


def _last_line(error: Optional[str]) -> str:
    lines = (error or "").strip().splitlines()
    return lines[-1][:200] if lines else ""


def _gpu_header(cfg: CudaBenchConfig, env: dict[str, Any], params: int) -> str:
    return (
        f"{env.get('device_name', '?')}, torch {env.get('torch', '?')}, CUDA {env.get('cuda', '?')}; "
        f"GPT {params / 1e9:.2f}e9 params ({cfg.layers} x {cfg.d_model}, {cfg.n_head} heads, "
        f"vocab {cfg.vocab}), batch {cfg.batch} x seq {cfg.seq}, bf16, AdamW, world size 1 "
        f"(fsdp and torch_fsdp1 run NO_SHARD there)"
    )


def format_gpu_report(cfg: CudaBenchConfig, env: dict[str, Any], summary: dict[str, Any], targets: list[dict[str, Any]]) -> str:
    """The compact end-of-run table (medians over rounds, ratios to torch_fsdp1) and targets."""
    assert cfg.layers is not None
    params = gpt_params(cfg.layers, cfg.d_model, cfg.vocab, cfg.seq)[0]
    peak = summary["peak_flops"]
    lines = [
        "== GPU benchmark: " + _gpu_header(cfg, env, params),
        f"   {summary['flops_per_token'] / 1e9:.2f} GFLOP/token, peak "
        f"{_f(peak, '.1f', 1e12)} TFLOP/s; medians over rounds of {cfg.steps} timed steps "
        f"after {cfg.warmup_steps} warm-up; host_s: the host's time issuing a step; x = ratio to {REFERENCE}",
        f"{'impl':<12} {'rounds':>6} {'step_s':>7} {'host_s':>7} {'tok/s':>8} {'MFU':>6} {'alloc_GiB':>9} "
        f"{'resv_GiB':>8} {'x_tok/s':>8} {'x_alloc':>8} {'x_resv':>8} {'loss_last':>9}",
    ]
    for impl, e in summary["impls"].items():
        if e["status"] != "ok":
            lines.append(f"{impl:<12} {e['status'].upper()}: {_last_line(e['error'])}")
            continue
        r = e["ratios"]
        lines.append(
            f"{impl:<12} {e['rounds']:>6} {_f(e['step_s'], '.4f'):>7} {_f(e['host_step_s'], '.4f'):>7} "
            f"{_f(e['tokens_per_s'], '.0f'):>8} {_f(e['mfu'], '.1%'):>6} {_f(e['max_allocated'], '.2f', GIB):>9} "
            f"{_f(e['max_reserved'], '.2f', GIB):>8} {times(r['tokens_per_s']):>8} "
            f"{times(r['max_allocated']):>8} {times(r['max_reserved']):>8} {_f(e['losses'][-1], '.5f'):>9}"
        )
    for impl, e in summary["impls"].items():
        if e["losses"]:
            lines.append(f"loss per step {impl:<12} " + " ".join(f"{v:.5f}" for v in e["losses"]))
    lines.append(f"max |loss fsdp - loss {REFERENCE}| over the steps: {_f(summary['loss_max_abs_diff'], '.2e')}")
    lines.append("targets:")
    for t in targets:
        lines.append(f"  {t['target']:<44} {times(t['ratio']):>8}  {t['status']}")
    return "\n".join(lines)


#: Bytes of memory traffic of one fused AdamW step per parameter ([Note: Offload limits]).
ADAMW_BYTES_PER_PARAM = 28


def offload_copy_bytes(root_numel: int, block_numels: Sequence[int]) -> dict[str, int]:
    """Bytes fsdp copies host to device and device to host per training step with
    ``CPUOffload(offload_params=True)``, in the GPU benchmark's configuration (world size 1:
    NO_SHARD, fp32 parameters, bf16 compute, fp32 reduction), from the second step on.

    At world size 1 offload takes the sharded path ([Note: CPU offload on one rank] in
    ``fsdp/flat_param/_sharding.py``): a unit's local shard is its whole fp32 flat parameter,
    in pinned host memory. Every unshard copies it to the GPU, then casts it to bf16 there
    (``FlatParamStorage.gather``). NO_SHARD frees an offloaded unit's compute copy after its
    forward, the root's too (``UnitState.frees_after_forward``), so every unit is copied in
    forward and again in backward, except the last block, which stays gathered from its forward
    into its backward ([Note: The first backward unit stays gathered]). Each unit's reduced fp32
    gradient is copied to the host once (``fsdp/flat_param/_reduction.py``). With N parameters
    and the last block's L: ``h2d = 4 (2 N - L)``, ``d2h = 4 N``. For example a root of 100
    and two blocks of 10: 4 x (2 x 120 - 10) = 920 bytes in, 480 out.
    """
    params = root_numel + sum(block_numels)
    last_block = block_numels[-1] if block_numels else 0
    return {"h2d_bytes": 4 * (2 * params - last_block), "d2h_bytes": 4 * params}


def _units_seconds(timed: Sequence[dict[str, Any]], key: str, numels: Sequence[int]) -> float:
    """The sum over units of the AdamW time of their shard size in ``timed`` (a size not timed:
    the nearest timed size's time per element)."""
    by_numel = {row["numel"]: row for row in timed}
    total = 0.0
    for numel in numels:
        row = by_numel.get(numel) or min(timed, key=lambda row: abs(row["numel"] - numel))
        total += row[key] * (numel / row["numel"])
    return total


def offload_limits(rates: Optional[dict[str, Any]], root_numel: int, block_numels: Sequence[int]) -> dict[str, Any]:
    """The limits of [Note: Offload limits] for a model of these units, from the rates measured
    at run time (``benchmarks.cuda.measure_offload_rates``; ``None`` or a failed measurement
    leave the times ``None``)."""
    params = root_numel + sum(block_numels)
    out: dict[str, Any] = {"params": params, **offload_copy_bytes(root_numel, block_numels)}
    out["adamw_traffic_bytes"] = ADAMW_BYTES_PER_PARAM * params
    r = rates if rates is not None and not rates.get("error") else {}
    h2d_s = ratio(out["h2d_bytes"], r.get("h2d_bytes_per_s"))
    d2h_s = ratio(out["d2h_bytes"], r.get("d2h_bytes_per_s"))
    out["copies_s"] = h2d_s + d2h_s if h2d_s is not None and d2h_s is not None else None
    timed = r.get("adamw_units") or []
    for kind in ("default", "fused"):
        out[f"adamw_{kind}_s"] = _units_seconds(timed, f"{kind}_s", [root_numel, *block_numels]) if timed else None
    out["adamw_traffic_s"] = ratio(out["adamw_traffic_bytes"], r.get("host_memcpy_bytes_per_s"))
    fused, copies = out["adamw_fused_s"], out["copies_s"]
    out["copies_plus_fused_adamw_s"] = copies + fused if copies is not None and fused is not None else None
    return out


def summarize_offload(cfg: CudaBenchConfig, runs: list[dict[str, Any]], rates: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The offload comparison (runs at ``cfg.layers``) and the size walk (runs with a
    ``size_b`` key): per size and implementation, fits or not, tokens/s and peak GPU memory;
    beside each, the limits of [Note: Offload limits] from ``rates`` and fsdp's step over
    ``copies + fused AdamW`` (``fsdp_step_vs_limits``)."""
    main_runs = [r for r in runs if "size_b" not in r]
    main = summarize_gpu(cfg, main_runs, None) if main_runs else None
    if main is not None:
        main["limits"] = offload_limits(rates, *model_unit_numels(cfg.spec()))
        main["fsdp_step_vs_limits"] = ratio(main["impls"].get("fsdp", {}).get("step_s"), main["limits"]["copies_plus_fused_adamw_s"])
    walk: dict[str, dict[str, Any]] = {}
    for r in runs:
        if "size_b" not in r:
            continue
        ok = r["status"] == "ok"
        step_s = statistics.mean(r["step_s"]) if ok else None
        row = walk.get(f"{r['size_b']:g}")
        if row is None:
            row = walk[f"{r['size_b']:g}"] = {"layers": r["layers"], "params": r["params"],
                                              "limits": offload_limits(rates, *model_unit_numels(cfg.spec(r["layers"])))}
        row[r["impl"]] = {
            "status": "trains" if ok else ("does not fit" if r["status"] == "oom" else r["status"]),
            "error": r["error"],
            "step_s": step_s,
            "tokens_per_s": cfg.tokens_per_step / step_s if step_s else None,
            "max_allocated": r["max_allocated"],
            "host_rss": r["host_rss"],
        }
        if r["impl"] == "fsdp":
            row["fsdp_step_vs_limits"] = ratio(step_s, row["limits"]["copies_plus_fused_adamw_s"])
    return {"main": main, "sizes": walk, "rates": rates}


def _gb_s(value: Optional[float]) -> str:
    return _f(value, ".1f", 1e9) + " GB/s"


def format_offload_limits(label: str, step_s: Optional[float], limits: dict[str, Any], rates: Optional[dict[str, Any]],
                          step_vs_limits: Optional[float]) -> str:
    """One line: fsdp's step beside the limits of [Note: Offload limits]."""
    r = rates or {}
    if not r or r.get("error"):
        reason = _last_line(r.get("error")) if r else "not measured"
        return f"  offload {label}: step {_f(step_s, '.3f')} s; limits n/a ({reason})"
    how = "" if r.get("copy_how") == "pinned" else f"{r.get('copy_how')}; "
    copies = (
        f"copies {_f(limits['copies_s'], '.3g')} s ({how}H2D {_gb_s(r.get('h2d_bytes_per_s'))}, "
        f"D2H {_gb_s(r.get('d2h_bytes_per_s'))}, {(limits['h2d_bytes'] + limits['d2h_bytes']) / 1e9:.3g} GB)"
    )
    adamw = (
        f"CPU AdamW {_f(limits['adamw_default_s'], '.3g')} s default / {_f(limits['adamw_fused_s'], '.3g')} s fused "
        f"(traffic bound {_f(limits['adamw_traffic_s'], '.3g')} s at {_gb_s(r.get('host_memcpy_bytes_per_s'))})"
    )
    return (
        f"  offload {label}: step {_f(step_s, '.3f')} s; limits: {copies}, {adamw}; "
        f"step / (copies + fused AdamW) = {times(step_vs_limits, 2)}"
    )


def format_offload_rates(r: dict[str, Any]) -> str:
    """One line: what the limits were measured from (``benchmarks.cuda.measure_offload_rates``)."""
    if r.get("error"):
        return f"  offload limits not measured ({r['seconds']:.1f} s): {_last_line(r['error'])}"
    shards = ", ".join(
        f"{row['numel']:,}" + ("" if row["timed_numel"] == row["numel"] else f" (timed on {row['timed_numel']:,})")
        for row in r["adamw_units"]
    )
    return (
        f"  offload limits measured in {r['seconds']:.1f} s: copies of {r['copy_buffer_bytes'] / 2**20:.0f} MiB "
        f"({r['copy_how']}): H2D {_gb_s(r['h2d_bytes_per_s'])}, D2H {_gb_s(r['d2h_bytes_per_s'])}, host memcpy "
        f"{_gb_s(r['host_memcpy_bytes_per_s'])} (read + written); CPU AdamW ({r['threads']} threads) on shards of "
        f"{shards} elements, summed over the units; see [Note: Offload limits] in benchmarks/report.py"
    )


def _optimizer_text(cfg: CudaBenchConfig) -> str:
    if cfg.offload_optimizer == "fused":
        return "CPU AdamW fused=True"
    return "CPU AdamW torch's default (one tensor after another)"


def format_offload(cfg: CudaBenchConfig, env: dict[str, Any], summary: dict[str, Any]) -> str:
    """The offload comparison's table and the size walk's table."""
    assert cfg.layers is not None
    lines = []
    main = summary["main"]
    if main is not None:
        params = gpt_params(cfg.layers, cfg.d_model, cfg.vocab, cfg.seq)[0]
        lines.append(f"== CPU offload (offload_params=True, {_optimizer_text(cfg)}): " + _gpu_header(cfg, env, params))
        lines.append(f"{'impl':<12} {'rounds':>6} {'step_s':>7} {'tok/s':>8} {'alloc_GiB':>9} {'x_step':>8} {'x_alloc':>8}")
        for impl, e in main["impls"].items():
            if e["status"] != "ok":
                lines.append(f"{impl:<12} {e['status'].upper()}: {_last_line(e['error'])}")
                continue
            lines.append(
                f"{impl:<12} {e['rounds']:>6} {_f(e['step_s'], '.3f'):>7} {_f(e['tokens_per_s'], '.0f'):>8} "
                f"{_f(e['max_allocated'], '.2f', GIB):>9} {times(e['ratios']['step_s']):>8} {times(e['ratios']['max_allocated']):>8}"
            )
        lines.append(f"max |loss fsdp - loss {REFERENCE}| over the steps: {_f(main['loss_max_abs_diff'], '.2e')}")
        lines.append(format_offload_limits(
            f"{params / 1e9:.2f}e9", main["impls"].get("fsdp", {}).get("step_s"), main["limits"], summary.get("rates"),
            main["fsdp_step_vs_limits"]))
    if summary["sizes"]:
        lines.append(f"== CPU offload size walk (d_model {cfg.d_model}, batch {cfg.batch} x seq {cfg.seq}, {_optimizer_text(cfg)})")
        for size, row in summary["sizes"].items():
            cells = []
            for impl in OFFLOAD_IMPLEMENTATIONS:
                cell = row.get(impl)
                if cell is None:
                    continue
                if cell["status"] == "trains":
                    cells.append(
                        f"{impl} trains {_f(cell['tokens_per_s'], '.0f')} tok/s, "
                        f"{_f(cell['max_allocated'], '.1f', GIB)} GiB GPU, {_f(cell['host_rss'], '.1f', GIB)} GiB host RSS"
                    )
                else:
                    cells.append(f"{impl} {cell['status'].upper()}")
            lines.append(f"  {size}B ({row['params'] / 1e9:.2f}e9, {row['layers']} layers): " + "; ".join(cells))
        for size, row in summary["sizes"].items():
            fsdp_cell = row.get("fsdp") or {}
            lines.append(format_offload_limits(
                f"{size}B", fsdp_cell.get("step_s"), row["limits"], summary.get("rates"), row.get("fsdp_step_vs_limits")))
    if summary.get("rates"):
        lines.append(format_offload_rates(summary["rates"]))
    return "\n".join(lines)
