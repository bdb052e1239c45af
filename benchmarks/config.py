"""The benchmarks' configurations and command lines.

:class:`BenchConfig` is the CPU benchmark's (``python -m benchmarks``): world size ``--world-size``
on local CPU ranks (gloo), the ``"encoder"`` model of :mod:`benchmarks.core`.

:class:`CudaBenchConfig` is the GPU benchmark's (``python -m benchmarks --device cuda``): world
size 1 on one GPU (NCCL), the example GPT (:mod:`fsdp.plan.gpt`) in bf16 mixed precision.
Two modes share one parser: the default training comparison (fsdp, torch FSDP1, torch FSDP2 and
the unwrapped model, world size 1 on one GPU) and ``--offload`` (fsdp against torch FSDP1 with
``CPUOffload(offload_params=True)``, optionally walking model sizes with ``--offload-sizes``).

Default sizes (example GPT of :mod:`fsdp.plan.gpt`, vocabulary 50304, sequence 2048):

* training: 18 blocks of width 2048 (16 heads): 1.12e9 parameters (0.91e9 in the blocks,
  2 x 0.103e9 in the untied token embedding and head). Memory, estimated for the largest case,
  the unwrapped model under ``torch.autocast(bfloat16)``: 16 bytes/parameter of fp32 model
  states (parameter, gradient, two AdamW moments) = 18 GB, the autocast cache of bf16 weights
  2.2 GB, and activations: about 40 bytes per (token x d_model) per block (fp32 residual and
  LayerNorm inputs, bf16 matmul inputs, q/k/v, the 4x-wide MLP input and output; flash
  attention saves no seq x seq matrix) = 40 x 12288 x 2048 x 18 = 18 GB at batch 6, plus the
  logits (bf16, their fp32 copy for the loss, and its log-softmax: 12288 x 50304 x 10 bytes =
  6.2 GB) and their gradients: about 48 GB in all, so batch 6 leaves a wide margin on an 80 GB
  GPU (batch 8 would be about 58 GB). A step is 7.0 GFLOP/token x 12288 tokens = 86 TFLOP,
  about 0.17-0.3 s on an H100 at 30-50% MFU.
* offload: 36 blocks (2.02e9 parameters; host memory holds 16 bytes/parameter = 32 GB of
  model states for one implementation at a time, plus the model as built), batch 2; 2 rounds
  of 1 warm-up and 3 timed steps (a step takes seconds: AdamW runs on the CPU). The CPU AdamW
  is torch's default (``--offload-optimizer default``: one tensor after another on CPU) or
  ``fused=True`` (``--offload-optimizer fused``), the same for fsdp and torch FSDP1.
* ``--compile``: ``torch.compile`` of each wrapped model (fsdp and torch FSDP1 with
  ``use_orig_params=True``), the rest as above.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Optional, Sequence

from benchmarks.core import IMPLEMENTATIONS, ModelSpec

__all__ = [
    "IMPLEMENTATIONS",
    "STRATEGIES",
    "CHECKPOINTED",
    "DEVICES",
    "BenchConfig",
    "parse_args",
    "parse_device",
    "CUDA_IMPLEMENTATIONS",
    "OFFLOAD_IMPLEMENTATIONS",
    "OFFLOAD_OPTIMIZERS",
    "CudaBenchConfig",
    "parse_cuda_args",
    "block_params",
    "gpt_params",
    "layers_for_size",
]

#: Implementations with an FSDP1-style full state dict / optim_state_dict API.
CHECKPOINTED = ("fsdp", "torch_fsdp1")
#: Sharding strategies the benchmark knows the minimum communication of.
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
#: ``--device``: ``cpu`` is this benchmark; ``cuda`` the GPU benchmark (:mod:`benchmarks.cuda`),
#: which has flags of its own (``python -m benchmarks --device cuda --help``).
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

    @property
    def spec(self) -> ModelSpec:
        """The model and per-rank batch (the ``"encoder"`` of :mod:`benchmarks.core`)."""
        return ModelSpec("encoder", self.layers, self.d_model, self.nhead, self.batch, self.seq, ff=self.dim_feedforward)


def parse_device(argv: Optional[Sequence[str]] = None) -> str:
    """The ``--device`` that ``argv`` asks for (``"cpu"`` when absent); exits with status 2 on
    a device not in :data:`DEVICES`. The other flags are left to that device's parser."""
    p = argparse.ArgumentParser(prog="python -m benchmarks", add_help=False)
    p.add_argument("--device", choices=DEVICES, default="cpu")
    known, _ = p.parse_known_args(argv)
    return str(known.device)


def parse_args(argv: Optional[Sequence[str]] = None) -> BenchConfig:
    """The :class:`BenchConfig` that the command line ``argv`` asks for."""
    d = BenchConfig()
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
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


# ------------------------------------------------------------------ the GPU benchmark

#: The training comparison's implementations, in report order (ratios are against torch_fsdp1).
CUDA_IMPLEMENTATIONS = ("fsdp", "torch_fsdp1", "torch_fsdp2", "local")
#: The CPU-offload comparison's implementations.
OFFLOAD_IMPLEMENTATIONS = ("fsdp", "torch_fsdp1")
#: ``--offload-optimizer``: torch's default AdamW (on CPU tensors: one tensor after another),
#: or ``fused=True`` (torch's one-kernel AdamW, which has a CPU kernel).
OFFLOAD_OPTIMIZERS = ("default", "fused")

# Per mode: (layers, batch, rounds, warm-up steps, timed steps). An offload step takes seconds
# (the AdamW step runs on the CPU), so that mode runs fewer, shorter rounds.
_TRAIN_DEFAULTS = (18, 6, 5, 2, 5)
_OFFLOAD_DEFAULTS = (36, 2, 2, 1, 3)


def block_params(d_model: int) -> int:
    """Parameters of one example-GPT :class:`~fsdp.plan.gpt.Block` of width ``d_model``.

    Two LayerNorms (2 x 2d), qkv (3d^2 + 3d), attention projection (d^2 + d), MLP up
    (4d^2 + 4d) and down (4d^2 + d): 12 d^2 + 13 d.
    """
    return 12 * d_model * d_model + 13 * d_model


def gpt_params(layers: int, d_model: int, vocab: int, seq: int) -> tuple[int, int]:
    """(all parameters, matmul parameters) of the example GPT.

    The matmul parameters are all but the token and position embedding tables (lookups, no
    FLOPs): the blocks, the final LayerNorm and the untied output head (a vocab x d matmul).
    """
    embeddings = vocab * d_model + seq * d_model
    matmul = layers * block_params(d_model) + 2 * d_model + vocab * d_model
    return embeddings + matmul, matmul


def layers_for_size(billions: float, d_model: int, vocab: int, seq: int) -> int:
    """Blocks of width ``d_model`` that bring the example GPT closest to ``billions`` x 1e9
    parameters (at least one)."""
    fixed = gpt_params(0, d_model, vocab, seq)[0]
    return max(1, round((billions * 1e9 - fixed) / block_params(d_model)))


@dataclasses.dataclass
class CudaBenchConfig:
    """What the GPU benchmark runs. ``layers`` and ``batch`` of ``None`` take the mode's default.

    Attributes:
        cpu_dry_run: run the same code on CPU (gloo, perf_counter timing, no memory figures):
            for tests on machines without a GPU; hidden from ``--help``.
        time_budget_s: no new round starts after this many seconds (the rounds done are
            reported); a stuck run dumps every thread's stack and exits after ``hang_timeout_s``.
        offload_optimizer: one of :data:`OFFLOAD_OPTIMIZERS`, the AdamW of both offloaded
            implementations.
    """

    layers: Optional[int] = None
    d_model: int = 2048
    n_head: int = 16
    vocab: int = 50304
    seq: int = 2048
    batch: Optional[int] = None
    rounds: Optional[int] = None
    warmup_steps: Optional[int] = None
    steps: Optional[int] = None
    only: Optional[tuple[str, ...]] = None
    peak_tflops: Optional[float] = None
    offload: bool = False
    offload_sizes: tuple[float, ...] = ()
    offload_optimizer: str = "default"
    compile: bool = False
    compile_backend: str = "inductor"
    profile: bool = False
    profile_steps: int = 3
    json_out: Optional[str] = None
    time_budget_s: float = 420.0
    hang_timeout_s: float = 570.0
    cpu_dry_run: bool = False

    def __post_init__(self) -> None:
        if self.offload_sizes:
            self.offload = True
        defaults = _OFFLOAD_DEFAULTS if self.offload else _TRAIN_DEFAULTS
        for name, default in zip(("layers", "batch", "rounds", "warmup_steps", "steps"), defaults):
            if getattr(self, name) is None:
                setattr(self, name, default)
        allowed = OFFLOAD_IMPLEMENTATIONS if self.offload else CUDA_IMPLEMENTATIONS
        only = allowed if self.only is None else self.only
        unknown = [name for name in only if name not in allowed]
        if unknown:
            mode = "--offload" if self.offload else "the training comparison"
            raise ValueError(f"--only: {unknown} not in {mode}'s implementations {list(allowed)}")
        if not only:
            raise ValueError(f"--only names no implementation; choose from {list(allowed)}")
        self.only = tuple(name for name in allowed if name in only)
        if self.d_model % self.n_head:
            raise ValueError(f"--d-model {self.d_model} is not divisible by --n-head {self.n_head}")
        positive = {
            "--layers": self.layers, "--d-model": self.d_model, "--n-head": self.n_head,
            "--vocab": self.vocab, "--seq": self.seq, "--batch": self.batch,
            "--rounds": self.rounds, "--warmup-steps": self.warmup_steps, "--steps": self.steps,
            "--profile-steps": self.profile_steps,
        }
        bad = {flag: value for flag, value in positive.items() if value < 1}
        if bad:
            raise ValueError(f"these flags must be >= 1: {bad}")
        if self.time_budget_s <= 0 or self.hang_timeout_s <= 0:
            raise ValueError(f"--time-budget ({self.time_budget_s}) and --hang-timeout ({self.hang_timeout_s}) must be positive")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ValueError(f"--peak-tflops must be positive, not {self.peak_tflops}")
        if any(size <= 0 for size in self.offload_sizes):
            raise ValueError(f"--offload-sizes must be positive billions, not {list(self.offload_sizes)}")
        if self.offload_optimizer not in OFFLOAD_OPTIMIZERS:
            raise ValueError(f"--offload-optimizer must be one of {list(OFFLOAD_OPTIMIZERS)}, not {self.offload_optimizer!r}")
        if self.offload_optimizer != "default" and not self.offload:
            raise ValueError("--offload-optimizer chooses the CPU AdamW of --offload; add --offload or drop it")
        if self.profile and self.offload:
            raise ValueError("--profile profiles the training comparison's fsdp; drop --offload")
        if self.profile and "fsdp" not in self.only:
            raise ValueError("--profile profiles fsdp; keep fsdp in --only")

    @property
    def device_type(self) -> str:
        """``"cuda"``, or ``"cpu"`` for the dry run."""
        return "cpu" if self.cpu_dry_run else "cuda"

    def spec(self, layers: Optional[int] = None) -> ModelSpec:
        """The example GPT at ``layers`` blocks (default ``self.layers``) and the batch."""
        return ModelSpec("gpt", layers or self.layers_, self.d_model, self.n_head, self.batch_, self.seq, vocab=self.vocab)

    @property
    def tokens_per_step(self) -> int:
        """Tokens each training step processes: batch x seq."""
        return self.batch_ * self.seq

    # The mode defaults are filled in by __post_init__; these typed views save the Optional.
    @property
    def layers_(self) -> int:
        assert self.layers is not None
        return self.layers

    @property
    def batch_(self) -> int:
        assert self.batch is not None
        return self.batch

    @property
    def impls(self) -> tuple[str, ...]:
        assert self.only is not None
        return self.only


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers such as 1,2,4, not {text!r}") from None


def _parser() -> argparse.ArgumentParser:
    d = CudaBenchConfig()
    p = argparse.ArgumentParser(
        prog="python -m benchmarks --device cuda",
        description="GPU benchmark on one GPU (world size 1, NCCL): tokens/s, MFU and peak memory "
        "of fsdp against torch FSDP1, torch FSDP2 and the unwrapped model (bf16 mixed precision, "
        "AdamW), alternating rounds; or, with --offload, fsdp against torch FSDP1 with CPU offload.",
    )
    p.add_argument("--device", choices=("cuda",), default="cuda")
    t, o = _TRAIN_DEFAULTS, _OFFLOAD_DEFAULTS
    p.add_argument("--layers", type=int, default=None, help=f"GPT blocks (default {t[0]}; {o[0]} with --offload)")
    p.add_argument("--d-model", type=int, default=d.d_model)
    p.add_argument("--n-head", type=int, default=d.n_head)
    p.add_argument("--vocab", type=int, default=d.vocab)
    p.add_argument("--seq", type=int, default=d.seq)
    p.add_argument("--batch", type=int, default=None, help=f"sequences per step (default {t[1]}; {o[1]} with --offload)")
    p.add_argument("--rounds", type=int, default=None, help=f"alternating rounds, medians reported (default {t[2]}; {o[2]} with --offload)")
    p.add_argument("--warmup-steps", type=int, default=None, help=f"default {t[3]}; {o[3]} with --offload")
    p.add_argument("--steps", type=int, default=None, help=f"timed steps per implementation per round (default {t[4]}; {o[4]} with --offload)")
    p.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(CUDA_IMPLEMENTATIONS)}")
    p.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak (for MFU) when its name is not known")
    p.add_argument("--offload", action="store_true", help="fsdp vs torch_fsdp1 with CPUOffload(offload_params=True)")
    p.add_argument("--compile", action="store_true", help="torch.compile each wrapped model (fsdp and torch FSDP1 with use_orig_params=True)")
    p.add_argument("--compile-backend", default=d.compile_backend, help="torch.compile's backend with --compile (aot_eager builds no kernels: the CPU dry run's)")
    p.add_argument("--offload-sizes", type=_floats, default=(), help="with --offload: model sizes in billions to walk, e.g. 1,2,4")
    p.add_argument("--offload-optimizer", choices=OFFLOAD_OPTIMIZERS, default=d.offload_optimizer,
                   help="with --offload: the CPU AdamW of fsdp and torch FSDP1 (default: torch's defaults; fused: fused=True)")
    p.add_argument("--profile", action="store_true", help="also profile fsdp's steps (torch.profiler, top 25 ops)")
    p.add_argument("--profile-steps", type=int, default=d.profile_steps)
    p.add_argument("--json", dest="json_out", default=None, help="write every number as JSON here")
    p.add_argument("--time-budget", type=float, default=d.time_budget_s, help="seconds after which no new round starts")
    p.add_argument("--hang-timeout", type=float, default=d.hang_timeout_s, help="seconds after which stacks are dumped and the run exits")
    p.add_argument("--cpu-dry-run", action="store_true", help=argparse.SUPPRESS)
    return p


def parse_cuda_args(argv: Optional[Sequence[str]] = None) -> CudaBenchConfig:
    """The :class:`CudaBenchConfig` that ``argv`` asks for; exits with status 2 on bad flags."""
    p = _parser()
    a = p.parse_args(argv)
    try:
        return CudaBenchConfig(
            layers=a.layers,
            d_model=a.d_model,
            n_head=a.n_head,
            vocab=a.vocab,
            seq=a.seq,
            batch=a.batch,
            rounds=a.rounds,
            warmup_steps=a.warmup_steps,
            steps=a.steps,
            only=None if a.only is None else tuple(s.strip() for s in a.only.split(",") if s.strip()),
            peak_tflops=a.peak_tflops,
            offload=a.offload,
            offload_sizes=a.offload_sizes,
            offload_optimizer=a.offload_optimizer,
            compile=a.compile,
            compile_backend=a.compile_backend,
            profile=a.profile,
            profile_steps=a.profile_steps,
            json_out=a.json_out,
            time_budget_s=a.time_budget,
            hang_timeout_s=a.hang_timeout,
            cpu_dry_run=a.cpu_dry_run,
        )
    except ValueError as e:
        p.error(str(e))
