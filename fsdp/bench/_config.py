"""Benchmark configuration: the command-line flags and the implementation names."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Optional, Sequence

__all__ = ["IMPLEMENTATIONS", "STRATEGIES", "CHECKPOINTED", "DEVICES", "BenchConfig", "parse_args", "parse_device"]

#: Every implementation, in report order. ``fsdp`` is ours; the ratios are against ``torch_fsdp1``.
IMPLEMENTATIONS = ("fsdp", "torch_fsdp1", "torch_fsdp2", "ddp", "local")
#: Implementations with an FSDP1-style full state dict / optim_state_dict API.
CHECKPOINTED = ("fsdp", "torch_fsdp1")
#: Sharding strategies the benchmark knows the minimum communication of.
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
#: ``--device``: ``cpu`` is this benchmark; ``cuda`` the GPU benchmark (:mod:`fsdp.bench._cuda`),
#: which has flags of its own (``python -m fsdp.bench --device cuda --help``).
DEVICES = ("cpu", "cuda")


@dataclasses.dataclass
class BenchConfig:
    """What to run. The defaults are the project's target configuration."""

    world_size: int = 2
    layers: int = 6
    d_model: int = 512
    nhead: int = 8
    dim_feedforward: int = 0  # 0: 4 * d_model
    batch: int = 4  # per rank
    seq: int = 64
    rounds: int = 7
    steps_per_round: int = 3
    warmup_steps: int = 2
    memory_steps: int = 3
    checkpoint_reps: int = 3
    strategy: str = "FULL_SHARD"
    only: tuple[str, ...] = IMPLEMENTATIONS
    threads: int = 1
    forward_prefetch: bool = False
    checkpoint: bool = True
    checkpoint_only: bool = False
    memory: bool = True
    profile: bool = False
    profile_steps: int = 3
    profile_impl: str = "fsdp"
    json_out: Optional[str] = None
    timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        if self.dim_feedforward <= 0:
            self.dim_feedforward = 4 * self.d_model
        unknown = [name for name in self.only if name not in IMPLEMENTATIONS]
        if unknown:
            raise ValueError(f"unknown implementation(s) {unknown}; choose from {list(IMPLEMENTATIONS)}")
        self.only = tuple(name for name in IMPLEMENTATIONS if name in self.only)
        if self.checkpoint_only:
            if not self.checkpoint:
                raise ValueError("--checkpoint-only and --no-checkpoint contradict each other")
            self.only = tuple(name for name in self.only if name in CHECKPOINTED)
            if not self.only:
                raise ValueError(f"--checkpoint-only needs one of {list(CHECKPOINTED)} in --only")
        if self.strategy == "NO_SHARD":  # FSDP2 has no unsharded mode (that is DDP / replicate)
            self.only = tuple(name for name in self.only if name != "torch_fsdp2")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"--strategy must be one of {list(STRATEGIES)}, not {self.strategy!r}")
        if self.profile_impl not in IMPLEMENTATIONS:
            raise ValueError(f"--profile-impl must be one of {list(IMPLEMENTATIONS)}")
        if self.d_model % self.nhead:
            raise ValueError(f"--d-model {self.d_model} is not divisible by nhead {self.nhead}")
        if self.world_size < 1 or self.rounds < 1 or self.steps_per_round < 1 or self.warmup_steps < 1:
            raise ValueError("--world-size, --rounds, --steps-per-round and warm-up steps must be >= 1")


def parse_device(argv: Optional[Sequence[str]] = None) -> str:
    """The ``--device`` that ``argv`` asks for (``"cpu"`` when absent); exits with status 2 on
    a device not in :data:`DEVICES`. The other flags are left to that device's parser."""
    p = argparse.ArgumentParser(prog="python -m fsdp.bench", add_help=False)
    p.add_argument("--device", choices=DEVICES, default="cpu")
    known, _ = p.parse_known_args(argv)
    return str(known.device)


def parse_args(argv: Optional[Sequence[str]] = None) -> BenchConfig:
    """The :class:`BenchConfig` that the command line ``argv`` asks for."""
    d = BenchConfig()
    p = argparse.ArgumentParser(
        prog="python -m fsdp.bench",
        description="Step time, peak memory, bytes communicated and checkpoint time of fsdp "
        "against torch FSDP1, torch FSDP2, DDP and a no-communication local baseline.",
    )
    p.add_argument("--device", choices=DEVICES, default="cpu", help="cuda: the GPU benchmark (--device cuda --help)")
    p.add_argument("--world-size", type=int, default=d.world_size, help="local CPU ranks (gloo)")
    p.add_argument("--layers", type=int, default=d.layers, help="TransformerEncoderLayers")
    p.add_argument("--d-model", type=int, default=d.d_model)
    p.add_argument("--nhead", type=int, default=d.nhead)
    p.add_argument("--dim-feedforward", type=int, default=0, help="default 4 * d_model")
    p.add_argument("--batch", type=int, default=d.batch, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=d.seq, help="sequence length")
    p.add_argument("--rounds", type=int, default=d.rounds, help="alternating rounds (median reported)")
    p.add_argument("--steps-per-round", type=int, default=d.steps_per_round)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--memory-steps", type=int, default=d.memory_steps, help="steps whose peak memory is taken (max)")
    p.add_argument("--checkpoint-reps", type=int, default=d.checkpoint_reps)
    p.add_argument("--strategy", default=d.strategy, choices=STRATEGIES)
    p.add_argument(
        "--only",
        default=",".join(IMPLEMENTATIONS),
        help=f"comma-separated subset of {','.join(IMPLEMENTATIONS)}",
    )
    p.add_argument("--threads", type=int, default=d.threads, help="torch.set_num_threads per rank")
    p.add_argument(
        "--forward-prefetch",
        action="store_true",
        help="forward_prefetch=True for fsdp and torch FSDP1, and the next layer prefetched in forward for torch FSDP2",
    )
    p.add_argument("--no-checkpoint", action="store_true", help="skip the checkpoint section")
    p.add_argument(
        "--checkpoint-only",
        action="store_true",
        help="only the checkpoint section (fsdp and torch_fsdp1, after the warm-up steps): no "
        "step-time rounds, no communication count; with the memory phase unless --no-memory",
    )
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory phase")
    p.add_argument(
        "--profile",
        action="store_true",
        help="instead of the benchmark: run fsdp under torch.profiler and print the top ops",
    )
    p.add_argument("--profile-impl", default=d.profile_impl, choices=IMPLEMENTATIONS, help="what --profile runs (default fsdp)")
    p.add_argument("--profile-steps", type=int, default=d.profile_steps)
    p.add_argument("--json", dest="json_out", default=None, help="also write the results as JSON here")
    p.add_argument("--timeout", type=float, default=d.timeout_s, help="seconds before the ranks are killed")
    a = p.parse_args(argv)
    return BenchConfig(
        world_size=a.world_size,
        layers=a.layers,
        d_model=a.d_model,
        nhead=a.nhead,
        dim_feedforward=a.dim_feedforward,
        batch=a.batch,
        seq=a.seq,
        rounds=a.rounds,
        steps_per_round=a.steps_per_round,
        warmup_steps=a.warmup_steps,
        memory_steps=a.memory_steps,
        checkpoint_reps=a.checkpoint_reps,
        strategy=a.strategy,
        only=tuple(s.strip() for s in a.only.split(",") if s.strip()),
        threads=a.threads,
        forward_prefetch=a.forward_prefetch,
        checkpoint=not a.no_checkpoint,
        checkpoint_only=a.checkpoint_only,
        memory=not a.no_memory,
        profile=a.profile,
        profile_steps=a.profile_steps,
        profile_impl=a.profile_impl,
        json_out=a.json_out,
        timeout_s=a.timeout,
    )
