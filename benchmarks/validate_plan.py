"""``python -m benchmarks.validate_plan``: the planner's prediction against a measured CPU run, 10M to 1B.

Each point builds the example GPT on the meta device, wraps it with ``FullyShardedDataParallel``
on ``world_size`` spawned CPU ranks (gloo), which materializes only each unit's parameters, one
unit at a time, and keeps only the rank's shard ([Note: Meta-device materialization order]):
no rank ever holds the whole model. It then trains two steps and measures the busiest rank's
peak RSS above its baseline during the second ([Note: Measuring peak RSS] in
``fsdp/plan/_measure.py``), and compares it with ``fsdp.estimate_memory`` on a meta copy with
the same keywords.

Examples::

    python -m benchmarks.validate_plan --list
    python -m benchmarks.validate_plan 10M 50M 100M
    python -m benchmarks.validate_plan 1B --max-total 9GiB

Memory safety: before starting a point, the predicted peaks of all its ranks (plus each
process's own start-up footprint) must fit under ``--max-total`` and under the machine's
available memory; otherwise the point is refused, not run. Run the big points one at a time:
they are not for a test suite.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from fsdp.plan._schedule import WORKSPACES

from benchmarks.local_ranks import run_local_ranks, write_rank_result

__all__ = ["ValidationPoint", "POINTS", "predict", "measure", "main"]

# The per-process start-up footprint (interpreter, torch, gloo) that the measurement's baseline
# excludes but the machine still pays; used only for the memory-safety check.
_PROCESS_OVERHEAD_BYTES = 400 * 2**20


@dataclass(frozen=True)
class ValidationPoint:
    """One model size and FSDP configuration to predict and measure.

    Attributes:
        layers, d_model, heads, vocab, seq_len, batch_size: The example GPT and its micro-batch.
        world_size: Ranks (CPU processes).
        strategy: A ``ShardingStrategy`` name.
        model_dtype: The model's own dtype (``"bfloat16"``: pure bf16 training, bf16 shards).
        bf16_mixed: ``MixedPrecision(param_dtype=torch.bfloat16)``.
        checkpointing: Activation checkpointing of every block.
        optimizer: ``"AdamW"`` or ``"SGD"`` (plain SGD: no momentum, no state).
        intra_node_size: Hybrid strategies: the shard group size.
        device: ``"cpu"`` (peak RSS) or ``"cuda"`` (``torch.cuda.max_memory_allocated``; the
            ranks share the visible GPUs round-robin, NCCL when each rank has its own, else gloo
            with CUDA tensors).
    """

    layers: int
    d_model: int
    heads: int
    vocab: int
    seq_len: int
    batch_size: int
    world_size: int = 2
    strategy: str = "FULL_SHARD"
    model_dtype: str = "float32"
    bf16_mixed: bool = False
    checkpointing: bool = False
    optimizer: str = "AdamW"
    intra_node_size: Optional[int] = None
    device: str = "cpu"

    def num_params(self) -> int:
        """Parameters of the GPT (blocks, both embeddings, final LayerNorm, untied head)."""
        d = self.d_model
        block = 12 * d * d + 13 * d
        return self.layers * block + 2 * self.vocab * d + self.seq_len * d + 2 * d

    def describe(self) -> str:
        parts = [
            f"{self.num_params() / 1e6:,.1f} M params",
            f"L{self.layers} d{self.d_model} V{self.vocab}",
            f"batch {self.batch_size}x{self.seq_len}",
            f"ws{self.world_size} {self.strategy}",
        ]
        if self.intra_node_size:
            parts[-1] += f" ({self.world_size // self.intra_node_size}x{self.intra_node_size})"
        if self.model_dtype != "float32":
            parts.append(f"{self.model_dtype} model")
        if self.bf16_mixed:
            parts.append("bf16 mixed precision")
        if self.checkpointing:
            parts.append("activation checkpointing")
        parts.append(self.optimizer if self.optimizer == "AdamW" else "SGD (no momentum)")
        if self.device != "cpu":
            parts.append(self.device)
        return ", ".join(parts)


#: The validation points: GPTs of about 10M, 50M, 100M, 350M and 1B parameters (world size 2,
#: FULL_SHARD), and other strategies and precisions at about 100M. The 1B point trains in pure
#: bf16 with plain SGD so that all ranks together stay under about 6 GiB.
POINTS: dict[str, ValidationPoint] = {
    "10M": ValidationPoint(layers=8, d_model=256, heads=4, vocab=8192, seq_len=256, batch_size=4),
    "50M": ValidationPoint(layers=14, d_model=512, heads=8, vocab=8192, seq_len=256, batch_size=2),
    "100M": ValidationPoint(layers=12, d_model=768, heads=12, vocab=8192, seq_len=128, batch_size=2),
    "100M SHARD_GRAD_OP": ValidationPoint(
        layers=12, d_model=768, heads=12, vocab=8192, seq_len=128, batch_size=2, strategy="SHARD_GRAD_OP"
    ),
    "100M NO_SHARD": ValidationPoint(
        layers=12, d_model=768, heads=12, vocab=8192, seq_len=128, batch_size=2, strategy="NO_SHARD"
    ),
    "100M bf16 mixed": ValidationPoint(
        layers=12, d_model=768, heads=12, vocab=8192, seq_len=128, batch_size=2, bf16_mixed=True
    ),
    "100M checkpointing": ValidationPoint(
        layers=12, d_model=768, heads=12, vocab=8192, seq_len=128, batch_size=2, checkpointing=True
    ),
    "100M HYBRID_SHARD": ValidationPoint(
        layers=12, d_model=768, heads=12, vocab=8192, seq_len=128, batch_size=2, world_size=4,
        strategy="HYBRID_SHARD", intra_node_size=2,
    ),
    "350M": ValidationPoint(layers=24, d_model=1024, heads=16, vocab=16384, seq_len=64, batch_size=1),
    "1B": ValidationPoint(
        layers=20, d_model=2048, heads=16, vocab=8192, seq_len=16, batch_size=1, model_dtype="bfloat16",
        optimizer="SGD",
    ),
}


# ---------------------------------------------------------------------- the shared set-up
def _build_model(point: ValidationPoint) -> nn.Module:
    """The GPT on the meta device, in the point's dtype, checkpointed if asked."""

    from fsdp.plan.gpt import GPT, Block, GPTConfig, checkpoint_blocks

    config = GPTConfig(
        vocab_size=point.vocab, block_size=point.seq_len, n_layer=point.layers, n_head=point.heads, d_model=point.d_model
    )
    with torch.device("meta"):
        model = GPT(config).to(getattr(torch, point.model_dtype))
    if point.checkpointing:
        checkpoint_blocks(model, Block)
    return model


def _device(point: ValidationPoint) -> torch.device:
    """The training device: the CPU, or this rank's GPU (``cuda:0`` when planning)."""
    if point.device == "cpu":
        return torch.device("cpu")
    index = torch.cuda.current_device() if torch.cuda.is_available() else 0
    return torch.device("cuda", index)


def _fsdp_kwargs(point: ValidationPoint) -> dict[str, Any]:
    from fsdp import BackwardPrefetch, MixedPrecision, ShardingStrategy
    from fsdp.plan.gpt import Block
    from fsdp.wrap import ModuleWrapPolicy

    kwargs: dict[str, Any] = {
        "auto_wrap_policy": ModuleWrapPolicy({Block}),
        "sharding_strategy": ShardingStrategy[point.strategy],
        "backward_prefetch": BackwardPrefetch.BACKWARD_PRE,
        "device_id": _device(point),
    }
    if point.bf16_mixed:
        kwargs["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16)
    return kwargs


def _optimizer(point: ValidationPoint) -> tuple[type, dict[str, Any]]:
    if point.optimizer == "AdamW":
        return torch.optim.AdamW, {"lr": 1e-4}
    if point.optimizer == "SGD":
        return torch.optim.SGD, {"lr": 1e-4, "momentum": 0.0}
    raise ValueError(f"benchmarks.validate_plan: optimizer must be 'AdamW' or 'SGD', got {point.optimizer!r}")


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def predict(point: ValidationPoint) -> Any:
    """``fsdp.estimate_memory`` for the point (meta model, no process group)."""
    from fsdp import estimate_memory

    optimizer, optimizer_kwargs = _optimizer(point)
    shape = (point.batch_size, point.seq_len)
    return estimate_memory(
        _build_model(point),
        torch.zeros(shape, dtype=torch.long, device="meta"),
        world_size=point.world_size,
        optimizer=optimizer,
        optimizer_kwargs=optimizer_kwargs,
        loss_fn=lambda out: _loss(out, torch.empty(shape, dtype=torch.long)),
        intra_node_size=point.intra_node_size,
        **_fsdp_kwargs(point),
    )


# ---------------------------------------------------------------------- one rank
def _train(point: ValidationPoint, model: nn.Module, steps: int, on_step: Callable[[int], None]) -> nn.Module:
    import torch.distributed as dist

    from fsdp import FullyShardedDataParallel as FSDP

    kwargs = _fsdp_kwargs(point)
    if point.intra_node_size:
        rank, world_size, intra = dist.get_rank(), dist.get_world_size(), point.intra_node_size
        shard_groups = [dist.new_group(list(range(s, s + intra))) for s in range(0, world_size, intra)]
        replicate_groups = [dist.new_group(list(range(r, world_size, intra))) for r in range(intra)]
        kwargs["process_group"] = (shard_groups[rank // intra], replicate_groups[rank % intra])
    wrapped = FSDP(model, **kwargs)
    optimizer_cls, optimizer_kwargs = _optimizer(point)
    optimizer = optimizer_cls([p for p in wrapped.parameters() if p.requires_grad], **optimizer_kwargs)
    generator = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randint(0, point.vocab, (point.batch_size, point.seq_len), generator=generator).to(_device(point))
    y = torch.randint(0, point.vocab, (point.batch_size, point.seq_len), generator=generator).to(_device(point))
    for step in range(steps):
        on_step(step)
        _loss(wrapped(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return wrapped


class _Meter:
    """The measured figure: peak RSS above a baseline on the CPU ([Note: Measuring peak RSS]),
    or ``torch.cuda.max_memory_allocated`` above the allocated bytes at the baseline on a GPU
    (what the planner's ``peak_bytes`` predicts there, less the cuBLAS workspaces that the
    warm-up made and the baseline holds: tensors, not the CUDA context or the caching
    allocator's reserve)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.base = 0

    def set_baseline(self) -> None:
        from fsdp.plan._measure import rss_bytes

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            self.base = rss_bytes()

    def reset_peak(self) -> None:
        from fsdp.plan._measure import reset_peak_rss

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            reset_peak_rss()

    def peak(self) -> int:
        from fsdp.plan._measure import peak_rss_bytes

        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        return peak_rss_bytes() - self.base


def _join_group(point: ValidationPoint, rank: int, workdir: str) -> None:
    """The rank's process group: gloo on the CPU; on GPUs each rank takes GPU ``rank % count``,
    NCCL when every rank has its own GPU, else gloo with CUDA tensors (NCCL refuses two ranks
    on one GPU)."""
    import torch.distributed as dist

    backend = "gloo"
    if point.device == "cuda":
        count = torch.cuda.device_count()
        torch.cuda.set_device(rank % count)
        backend = "nccl" if point.world_size <= count else "gloo"
    dist.init_process_group(
        backend, init_method=f"file://{workdir}/rendezvous", rank=rank, world_size=point.world_size
    )


def _rank_main(rank: int, point_fields: dict[str, Any], workdir: str) -> None:
    """One spawned rank: warm up, measure two steps, write ``rank{N}.json`` into ``workdir``."""
    import torch.distributed as dist

    from fsdp.plan._measure import set_mmap_threshold

    point = ValidationPoint(**point_fields)
    if point.device == "cpu" and not set_mmap_threshold(65536):
        raise RuntimeError("benchmarks.validate_plan: could not set glibc's mmap threshold (not glibc?)")
    torch.set_num_threads(1)
    _join_group(point, rank, workdir)
    try:
        # Warm-up: a tiny model of the same dtype and configuration trains two steps first, so
        # one-off allocations (kernel libraries' buffers, gloo's threads, lazy imports) are in
        # the baseline, not in the measurement.
        tiny = dataclasses.replace(point, layers=2, d_model=64, heads=4, vocab=128, seq_len=16, batch_size=1)
        _train(tiny, _build_model(tiny), 2, lambda step: None)  # the wrapper is dropped at once
        gc.collect()
        dist.barrier()
        meter = _Meter(_device(point))
        meter.set_baseline()
        marks: dict[str, float] = {}

        def on_step(step: int) -> None:
            if step == 1:
                marks["construction_peak"] = meter.peak()
                gc.collect()
                dist.barrier()
                meter.reset_peak()
                marks["start"] = time.perf_counter()

        wrapped = _train(point, _build_model(point), 2, on_step)
        result = {
            "peak_bytes": meter.peak(),
            "first_step_peak_bytes": marks["construction_peak"],
            "step_seconds": time.perf_counter() - marks["start"],
        }
        del wrapped
        write_rank_result(workdir, rank, result)
    finally:
        dist.destroy_process_group()


def measure(point: ValidationPoint, timeout_s: float = 3600.0) -> list[dict[str, Any]]:
    """Trains the point on ``world_size`` spawned CPU ranks; returns each rank's measurements.

    Raises:
        RuntimeError: A rank failed or the run exceeded ``timeout_s``.
    """
    # Read by glibc when each spawned interpreter starts (the ranks also set it with mallopt).
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return run_local_ranks(
        _rank_main, dataclasses.asdict(point), point.world_size, timeout_s, prog="benchmarks.validate_plan"
    )


# ---------------------------------------------------------------------- the CLI
def _available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("benchmarks.validate_plan: /proc/meminfo has no MemAvailable (not Linux?)")


def _free_gpu_bytes() -> int:
    """Free memory over the visible GPUs (the ranks share them round-robin)."""
    return sum(torch.cuda.mem_get_info(index)[0] for index in range(torch.cuda.device_count()))


def main(argv: Optional[list[str]] = None) -> int:
    from fsdp.plan.__main__ import parse_bytes

    parser = argparse.ArgumentParser(prog="python -m benchmarks.validate_plan", description=__doc__.split("\n")[0])
    parser.add_argument("points", nargs="*", help=f"point names (default: all): {', '.join(POINTS)}")
    parser.add_argument("--list", action="store_true", help="list the points and their predictions, run nothing")
    parser.add_argument("--max-total", type=parse_bytes, default=parse_bytes("9GiB"), help="all ranks together")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per point")
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu",
        help="cpu: peak RSS of CPU ranks; cuda: torch.cuda.max_memory_allocated on the GPUs",
    )
    args = parser.parse_args(argv)
    names = args.points or list(POINTS)
    unknown = [n for n in names if n not in POINTS]
    if unknown:
        parser.error(f"unknown point(s) {unknown}; choose from {list(POINTS)}")
    if args.device == "cuda" and not torch.cuda.is_available() and not args.list:
        parser.error("--device cuda: CUDA is not available (no GPU, or a CPU build of torch)")

    print("| point | model and configuration | predicted | measured | error | construction + first step |")
    print("|---|---|---:|---:|---:|---:|")
    worst = 0.0
    for name in names:
        point = dataclasses.replace(POINTS[name], device=args.device)
        start = time.perf_counter()
        estimate = predict(point)
        plan_s = time.perf_counter() - start
        needed = point.world_size * (estimate.peak_bytes + _PROCESS_OVERHEAD_BYTES)
        # The baseline is taken after a warm-up step, which made the cuBLAS workspaces: they are
        # in the baseline, so not in the measurement ([Note: cuBLAS workspaces]).
        predicted = estimate.peak_bytes - estimate.breakdown.get(WORKSPACES, 0)
        prefix = f"| {name} | {point.describe()} | {predicted / 2**20:,.1f} MiB"
        if args.list:
            print(f"{prefix} | | | (needs about {needed / 2**30:.2f} GiB; planned in {plan_s:.1f} s) |")
            continue
        available = _available_bytes() if args.device == "cpu" else _free_gpu_bytes()
        if needed > args.max_total or needed > 0.8 * available:
            print(
                f"{prefix} | refused: needs about {needed / 2**30:.2f} GiB, limit "
                f"{args.max_total / 2**30:.2f} GiB, available {available / 2**30:.2f} GiB | | |",
                flush=True,
            )
            continue
        ranks = measure(point, args.timeout)
        measured = max(r["peak_bytes"] for r in ranks)  # the busiest rank
        first = max(r["first_step_peak_bytes"] for r in ranks)
        error = (predicted - measured) / measured
        worst = max(worst, abs(error))
        print(
            f"{prefix} | {measured / 2**20:,.1f} MiB | {error:+.1%} | {first / 2**20:,.1f} MiB |",
            flush=True,
        )
    if not args.list:
        print(f"\nworst error {worst:.1%} (target: within 10%)")
    return 0 if worst <= 0.10 else 1


if __name__ == "__main__":
    sys.exit(main())
