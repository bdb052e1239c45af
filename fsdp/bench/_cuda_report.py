"""The GPU benchmark's arithmetic and report: FLOPs, MFU, medians, ratios, targets, tables.

Everything here is pure (no GPU, no process group), so it is unit-tested on CPU.

One measurement (a *run*: one implementation in one round) is a dict::

    {"impl": "fsdp", "round": 0, "layers": 18, "status": "ok" | "oom" | "error" | "skipped",
     "error": None | "last lines of the error", "setup_s": 2.1,
     "step_s": [0.21, ...],       # each timed step (CUDA events)
     "host_step_s": [0.05, ...],  # the host's time issuing each timed step (perf_counter)
     "losses": [10.83, ...],      # every step's loss, warm-up steps included
     "max_allocated": 3.5e10, "max_reserved": 3.8e10,   # bytes, None on the CPU dry run
     "allocated_before": 0, "host_rss": 1.2e10}
"""

from __future__ import annotations

import statistics
from typing import Any, Optional, Sequence

from fsdp.bench._cuda_config import OFFLOAD_IMPLEMENTATIONS, CudaBenchConfig, gpt_params

__all__ = [
    "PEAK_BF16_FLOPS",
    "peak_flops",
    "flops_per_token",
    "summarize",
    "evaluate_targets",
    "format_report",
    "format_offload",
    "summarize_offload",
]

GIB = 2**30
REFERENCE = "torch_fsdp1"

#: Dense bf16 peak FLOP/s by a substring of ``torch.cuda.get_device_name()`` (first match wins;
#: NVIDIA's datasheets, without sparsity). H100 SXM reports itself as "H100 80GB HBM3".
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989.4e12),
    ("H100 SXM", 989.4e12),
    ("H100 80GB HBM3", 989.4e12),
    ("H100 PCIe", 756.0e12),
)

#: (description, implementation, metric, other implementation, factor, direction): the target
#: holds when ``metric(impl) >= factor * metric(other)`` (direction ``">="``) or ``<=``.
TARGETS: tuple[tuple[str, str, str, str, float, str], ...] = (
    ("fsdp tokens/s >= 1.05x torch_fsdp1's", "fsdp", "tokens_per_s", "torch_fsdp1", 1.05, ">="),
    ("fsdp tokens/s >= 0.90x local's", "fsdp", "tokens_per_s", "local", 0.90, ">="),
    ("fsdp max allocated <= torch_fsdp2's", "fsdp", "max_allocated", "torch_fsdp2", 1.0, "<="),
    ("fsdp max allocated <= 0.93x torch_fsdp1's", "fsdp", "max_allocated", "torch_fsdp1", 0.93, "<="),
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


def _median(values: Sequence[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def _entry(cfg: CudaBenchConfig, impl: str, runs: list[dict[str, Any]], flops_token: int, peak: Optional[float]) -> dict[str, Any]:
    """One implementation's medians over its successful rounds."""
    ok = [r for r in runs if r["status"] == "ok"]
    failed = [r for r in runs if r["status"] not in ("ok", "skipped")]
    step_s = _median([statistics.mean(r["step_s"]) for r in ok])
    host_step_s = _median([statistics.mean(r["host_step_s"]) for r in ok if r.get("host_step_s")])
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
        "max_allocated": _median(alloc),
        "max_reserved": _median(reserved),
        "losses": ok[0]["losses"] if ok else [],
    }


def summarize(
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
            metric: _ratio(entry[metric], ref[metric] if ref else None)
            for metric in ("step_s", "tokens_per_s", "mfu", "max_allocated", "max_reserved")
        }
    ours, theirs = entries.get("fsdp"), entries.get(REFERENCE)
    diff = None
    if ours and theirs and ours["losses"] and len(ours["losses"]) == len(theirs["losses"]):
        diff = max(abs(a - b) for a, b in zip(ours["losses"], theirs["losses"]))
    return {"flops_per_token": flops_token, "peak_flops": peak, "impls": entries, "loss_max_abs_diff": diff}


def evaluate_targets(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target of :data:`TARGETS` with its observed ratio and ``"met"``, ``"NOT met"`` or
    ``"n/a"`` (an implementation or a figure is missing)."""
    out = []
    for text, impl, metric, other, factor, direction in TARGETS:
        a = summary["impls"].get(impl, {}).get(metric)
        b = summary["impls"].get(other, {}).get(metric)
        ratio = _ratio(a, b)
        if ratio is None:
            status = "n/a"
        else:
            holds = ratio >= factor if direction == ">=" else ratio <= factor
            status = "met" if holds else "NOT met"
        out.append({"target": text, "ratio": ratio, "status": status})
    return out


def _f(value: Optional[float], fmt: str, scale: float = 1.0) -> str:
    return "n/a" if value is None else format(value / scale, fmt)


def _x(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.3f}x"


def _last_line(error: Optional[str]) -> str:
    lines = (error or "").strip().splitlines()
    return lines[-1][:200] if lines else ""


def _header(cfg: CudaBenchConfig, env: dict[str, Any], params: int) -> str:
    return (
        f"{env.get('device_name', '?')}, torch {env.get('torch', '?')}, CUDA {env.get('cuda', '?')}; "
        f"GPT {params / 1e9:.2f}e9 params ({cfg.layers} x {cfg.d_model}, {cfg.n_head} heads, "
        f"vocab {cfg.vocab}), batch {cfg.batch} x seq {cfg.seq}, bf16, AdamW, world size 1 "
        f"(fsdp and torch_fsdp1 run NO_SHARD there)"
    )


def format_report(cfg: CudaBenchConfig, env: dict[str, Any], summary: dict[str, Any], targets: list[dict[str, Any]]) -> str:
    """The compact end-of-run table (medians over rounds, ratios to torch_fsdp1) and targets."""
    assert cfg.layers is not None
    params = gpt_params(cfg.layers, cfg.d_model, cfg.vocab, cfg.seq)[0]
    peak = summary["peak_flops"]
    lines = [
        "== GPU benchmark: " + _header(cfg, env, params),
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
            f"{_f(e['max_reserved'], '.2f', GIB):>8} {_x(r['tokens_per_s']):>8} "
            f"{_x(r['max_allocated']):>8} {_x(r['max_reserved']):>8} {_f(e['losses'][-1], '.5f'):>9}"
        )
    for impl, e in summary["impls"].items():
        if e["losses"]:
            lines.append(f"loss per step {impl:<12} " + " ".join(f"{v:.5f}" for v in e["losses"]))
    lines.append(f"max |loss fsdp - loss {REFERENCE}| over the steps: {_f(summary['loss_max_abs_diff'], '.2e')}")
    lines.append("targets:")
    for t in targets:
        lines.append(f"  {t['target']:<44} {_x(t['ratio']):>8}  {t['status']}")
    return "\n".join(lines)


def summarize_offload(cfg: CudaBenchConfig, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The offload comparison (runs at ``cfg.layers``) and the size walk (runs with a
    ``size_b`` key): per size and implementation, fits or not, tokens/s and peak GPU memory."""
    main_runs = [r for r in runs if "size_b" not in r]
    main = summarize(cfg, main_runs, None) if main_runs else None
    walk: dict[str, dict[str, Any]] = {}
    for r in runs:
        if "size_b" not in r:
            continue
        ok = r["status"] == "ok"
        step_s = statistics.mean(r["step_s"]) if ok else None
        walk.setdefault(f"{r['size_b']:g}", {"layers": r["layers"], "params": r["params"]})[r["impl"]] = {
            "status": "trains" if ok else ("does not fit" if r["status"] == "oom" else r["status"]),
            "error": r["error"],
            "step_s": step_s,
            "tokens_per_s": cfg.tokens_per_step / step_s if step_s else None,
            "max_allocated": r["max_allocated"],
            "host_rss": r["host_rss"],
        }
    return {"main": main, "sizes": walk}


def format_offload(cfg: CudaBenchConfig, env: dict[str, Any], summary: dict[str, Any]) -> str:
    """The offload comparison's table and the size walk's table."""
    assert cfg.layers is not None
    lines = []
    main = summary["main"]
    if main is not None:
        params = gpt_params(cfg.layers, cfg.d_model, cfg.vocab, cfg.seq)[0]
        lines.append("== CPU offload (offload_params=True): " + _header(cfg, env, params))
        lines.append(f"{'impl':<12} {'rounds':>6} {'step_s':>7} {'tok/s':>8} {'alloc_GiB':>9} {'x_step':>8} {'x_alloc':>8}")
        for impl, e in main["impls"].items():
            if e["status"] != "ok":
                lines.append(f"{impl:<12} {e['status'].upper()}: {_last_line(e['error'])}")
                continue
            lines.append(
                f"{impl:<12} {e['rounds']:>6} {_f(e['step_s'], '.3f'):>7} {_f(e['tokens_per_s'], '.0f'):>8} "
                f"{_f(e['max_allocated'], '.2f', GIB):>9} {_x(e['ratios']['step_s']):>8} {_x(e['ratios']['max_allocated']):>8}"
            )
        lines.append(f"max |loss fsdp - loss {REFERENCE}| over the steps: {_f(main['loss_max_abs_diff'], '.2e')}")
    if summary["sizes"]:
        lines.append(f"== CPU offload size walk (d_model {cfg.d_model}, batch {cfg.batch} x seq {cfg.seq})")
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
    return "\n".join(lines)
