"""Train a small character-level GPT with ``fsdp.FullyShardedDataParallel``.

Run ``python -m examples.train`` from the repository root (after ``pip install -e .``). With no launcher it starts ``--nprocs`` (default 2) local
CPU ranks itself (``torch.multiprocessing`` spawn, gloo, rendezvous on 127.0.0.1 at a free port).
Under ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` set) it joins that
rendezvous instead, using NCCL and ``device_id=cuda:LOCAL_RANK`` when CUDA is available and gloo
on CPU otherwise::

    torchrun --nproc_per_node=8 -m examples.train --model small --strategy SHARD_GRAD_OP

Each block of the model is one FSDP unit (``ModuleWrapPolicy({Block})``); the optimizer is AdamW
with a warmup + cosine learning-rate schedule and ``clip_grad_norm_(1.0)``. Rank 0 logs the loss
(averaged over ranks), the global tokens/s and each rank's memory, then prints a summary. The exit
status is non-zero when the smoothed loss did not fall, so the command doubles as an end-to-end
check.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import resource
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from fsdp import FullyShardedDataParallel as FSDP
from fsdp import MixedPrecision, ShardingStrategy
from fsdp.plan.gpt import GPT, PRESETS, Block, GPTConfig
from fsdp.wrap import ModuleWrapPolicy

from examples.checkpoint import DEFAULT_KEEP, latest_checkpoint, load_checkpoint, save_checkpoint
from examples.data import CharTokenizer, load_corpus, sample_batch

if TYPE_CHECKING:
    from multiprocessing.sharedctypes import Synchronized

__all__ = ["parse_args", "main", "train_worker"]

#: Strategies the example accepts (the hybrid ones need a 2-D process layout).
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
#: The loss counts as "fallen" when the smoothed last loss is below this fraction of the first.
REQUIRED_LOSS_RATIO = 0.99
#: Seconds a rank waits in a collective for a peer (see ``--timeout``).
DEFAULT_TIMEOUT_S = 600


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the command line (see ``python -m examples.train --help``)."""
    parser = argparse.ArgumentParser(
        prog="python -m examples.train",
        description="Train a character-level GPT with fsdp.FullyShardedDataParallel.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_run_arguments(parser.add_argument_group("ranks, model and sharding"))
    _add_training_arguments(parser.add_argument_group("data and optimization"))
    _add_checkpoint_arguments(parser.add_argument_group("checkpoints"))
    args = parser.parse_args(argv)
    if args.log_every is None:
        args.log_every = max(1, args.steps // 20)
    _check_args(parser, args)
    return args


def _add_run_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--nprocs", type=int, default=2, help="local CPU ranks to spawn (ignored under torchrun)"
    )
    group.add_argument(
        "--strategy", choices=STRATEGIES, default="FULL_SHARD", help="sharding strategy"
    )
    group.add_argument(
        "--model", choices=sorted(PRESETS), default="tiny", help="model size preset"
    )
    group.add_argument(
        "--mixed-precision",
        choices=["none", "bf16"],
        default="none",
        help="bf16: gather parameters and reduce gradients in bfloat16 (shards and optimizer stay fp32)",
    )
    group.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help="seconds a rank waits in a collective for a stalled or dead peer before it fails "
        "with an error naming the FSDP unit and phase (passed to init_process_group). 10 minutes "
        "covers this script's longest legitimate wait, a checkpoint save on a slow disk, many "
        "times over, and reports a stuck rank 3x sooner than torch's 30-minute default",
    )


def _add_training_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--steps", type=int, default=500, help="optimizer steps")
    group.add_argument("--batch-size", type=int, default=16, help="sequences per rank per step")
    group.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    group.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    group.add_argument("--seed", type=int, default=0, help="seed for init and data")
    group.add_argument(
        "--log-every",
        type=int,
        default=None,
        help="log every N steps (default: about 20 lines per run)",
    )


def _add_checkpoint_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--checkpoint-dir",
        default="checkpoints/fsdp-demo",
        help="where sharded checkpoints go ('' disables saving)",
    )
    group.add_argument(
        "--checkpoint-every", type=int, default=250, help="save every N steps (and at the end)"
    )
    group.add_argument(
        "--keep",
        type=int,
        default=DEFAULT_KEEP,
        help="complete checkpoints to keep in --checkpoint-dir (the newest; older ones are deleted)",
    )
    group.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest complete checkpoint in --checkpoint-dir (any world size)",
    )
    group.add_argument(
        "--overwrite",
        action="store_true",
        help="start from step 0 even though --checkpoint-dir holds checkpoints (they are "
        "replaced as this run saves)",
    )


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exits through ``parser.error`` (status 2) on a bad value, before any rank starts."""
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the loss must be able to fall)")
    for name in ("nprocs", "batch_size", "seq_len", "log_every", "keep"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.lr <= 0:
        parser.error("--lr must be positive")
    if not args.timeout > 0:
        parser.error("--timeout must be positive (seconds)")
    if args.resume and args.overwrite:
        parser.error("--resume and --overwrite exclude each other")


def _check_checkpoint_dir(args: argparse.Namespace) -> Optional[str]:
    """Why this run must not start (a message), or None: a run without --resume does not silently
    overwrite another run's checkpoints."""
    if not args.checkpoint_dir or args.resume or args.overwrite:
        return None
    try:
        latest = latest_checkpoint(args.checkpoint_dir)
    except RuntimeError:
        latest = None
    if latest is None:
        return None
    return (
        f"fsdp example: {os.path.abspath(args.checkpoint_dir)} already holds checkpoints of an "
        f"earlier run (latest: {os.path.basename(latest)}). Pass --resume to continue from it, "
        f"--overwrite to start over (its checkpoints are replaced as this run saves), or another "
        f"--checkpoint-dir."
    )


def _launched_by_torchrun() -> bool:
    return all(v in os.environ for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))


def _rss_mib() -> float:
    """Current resident set size of this process in MiB (peak RSS where /proc is missing)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return _peak_rss_mib()


def _peak_rss_mib() -> float:
    """Peak resident set size of this process in MiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB else


def _cuda_peak_mib(device: torch.device) -> float:
    """``torch.cuda.max_memory_allocated`` in MiB (0 off CUDA)."""
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else 0.0


def _all_gather_rows(local: torch.Tensor, world_size: int) -> torch.Tensor:
    """All-gather a 1-D tensor from every rank into a ``(world_size, n)`` CPU tensor."""
    gathered = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(gathered, local)
    return torch.stack(gathered).cpu()


def _fmt_mib(values: Sequence[float]) -> str:
    return "[" + ", ".join(f"{v:.0f}" for v in values) + "]"


def _lr_factor(step: int, total: int) -> float:
    """Linear warmup over the first ~5% of steps, then cosine decay to 10% of the peak."""
    warmup = max(1, min(20, total // 20))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def train_worker(
    rank: int, world_size: int, local_rank: int, args: argparse.Namespace, init_method: str
) -> bool:
    """Join the process group, train, and return whether the loss fell (same on all ranks)."""
    torch.set_num_threads(1)
    use_cuda = _launched_by_torchrun() and torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    backend = "nccl" if use_cuda else "gloo"
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=args.timeout),
    )
    try:
        fell = _train(rank, world_size, device, backend, args)
        # Leave together: rank 0 hosts the rendezvous store, and tearing gloo down while a
        # peer is still finishing its last collective can abort the process at exit.
        dist.barrier()
        return fell
    finally:
        # The model holds the process group. fsdp frees a dropped model at once, but torch's
        # lazy imports on the first step can leave reference cycles through the training
        # frames; collect them, so destroy_process_group() really stops gloo's threads before
        # the interpreter shuts down.
        gc.collect()
        dist.destroy_process_group()


@dataclass
class _Run:
    """One rank's training run: what the set-up made and what the steps share.

    Attributes:
        args: The command line.
        rank, world_size: This rank and the number of ranks.
        device: The training device.
        data: The encoded corpus.
        model: The wrapped GPT.
        optimizer, scheduler: AdamW over the flat (sharded) parameters and its schedule.
        tokens_per_step: Tokens of one global batch.
        start_step: The first step this run trains (after a resume, the checkpoint's step).
        losses: Per step trained here, the loss averaged over ranks.
        first_losses: The first steps' losses of the whole run (kept in checkpoints, so a
            resumed run compares its last losses with the original first ones).
    """

    args: argparse.Namespace
    rank: int
    world_size: int
    device: torch.device
    data: torch.Tensor
    model: FSDP
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    tokens_per_step: int
    start_step: int = 0
    losses: List[float] = field(default_factory=list)
    first_losses: List[float] = field(default_factory=list)

    def checkpoint_extra(self, step: int) -> Dict[str, Any]:
        """What a checkpoint saves besides the model and the optimizer (the template to load)."""
        return {
            "step": step,
            "first_losses": self.first_losses,
            "scheduler": self.scheduler.state_dict(),
            "tokens_per_step": self.tokens_per_step,
        }

    def say(self, text: str) -> None:
        """Prints on rank 0 only."""
        if self.rank == 0:
            print(text, flush=True)


def _loss_window(steps: int) -> int:
    """How many steps the first and the last loss are averaged over."""
    return max(1, min(10, steps // 10))


def _train(
    rank: int, world_size: int, device: torch.device, backend: str, args: argparse.Namespace
) -> bool:
    start = time.perf_counter()
    run = _setup(rank, world_size, device, backend, args)
    if args.resume and args.checkpoint_dir:
        _resume(run)
    run.model.train()
    train_start = time.perf_counter()
    for step in range(run.start_step, args.steps):
        _step(run, step, train_start)
        done = step + 1
        if args.checkpoint_dir and (done % args.checkpoint_every == 0 or done == args.steps):
            path = save_checkpoint(
                args.checkpoint_dir, done, run.model, run.optimizer, run.checkpoint_extra(done), keep=args.keep
            )
            run.say(f"saved checkpoint {path}")
    return _summarize(run, time.perf_counter() - train_start, start)


def _setup(
    rank: int, world_size: int, device: torch.device, backend: str, args: argparse.Namespace
) -> _Run:
    """Corpus, wrapped model, optimizer and schedule; rank 0 prints what runs."""
    text = load_corpus()
    tokenizer = CharTokenizer(text)
    data = tokenizer.encode_tensor(text)

    torch.manual_seed(args.seed)  # identical initial weights on every rank
    config = GPTConfig.from_preset(
        args.model, vocab_size=tokenizer.vocab_size, block_size=args.seq_len
    )
    gpt = GPT(config)
    n_params = gpt.num_parameters()
    strategy = ShardingStrategy[args.strategy]
    model = FSDP(
        gpt,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        sharding_strategy=strategy,
        mixed_precision=(
            MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
            if args.mixed_precision == "bf16"
            else None
        ),
        # torch's FSDP1 needs device_id=cpu to train on CPU (without it, it looks for an
        # accelerator); fsdp accepts the same.
        device_id=device,
    )
    # Created after wrapping: it sees the flat (sharded) parameters.
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _lr_factor(s, args.steps))
    run = _Run(
        args, rank, world_size, device, data, model, optimizer, scheduler,
        tokens_per_step=args.batch_size * args.seq_len * world_size,
    )
    run.say(
        f"fsdp example: model {args.model} ({n_params / 1e6:.2f}M params, "
        f"{config.n_layer} blocks, d_model {config.d_model}), vocab {tokenizer.vocab_size}, "
        f"corpus {data.numel():,} chars\n"
        f"  {world_size} ranks ({backend}, {device.type}), strategy {strategy.name}, "
        f"batch {args.batch_size}x{args.seq_len} per rank ({run.tokens_per_step:,} tokens/step), "
        f"lr {args.lr:g}, {args.steps} steps\n"
        f"  collective timeout {args.timeout:g} s (--timeout): a rank stuck longer than that "
        f"makes the others fail with an error naming the FSDP unit and phase"
    )
    if args.checkpoint_dir:
        run.say(
            f"  checkpoints: {os.path.abspath(args.checkpoint_dir)} every "
            f"{args.checkpoint_every} steps and at the end (keeping the newest {args.keep})"
        )
    return run


def _resume(run: _Run) -> None:
    """Loads the latest checkpoint of ``--checkpoint-dir``, if any, and says what changes."""
    args = run.args
    path = latest_checkpoint(args.checkpoint_dir)
    if path is None:
        run.say(f"no checkpoint in {args.checkpoint_dir}: starting from step 0")
        return
    extra = load_checkpoint(path, run.model, run.optimizer, run.checkpoint_extra(0))
    run.start_step, run.first_losses = int(extra["step"]), list(extra["first_losses"])
    run.scheduler.load_state_dict(extra["scheduler"])
    run.say(f"resumed from {path} at step {run.start_step}")
    saved_tokens = int(extra["tokens_per_step"])
    if saved_tokens != run.tokens_per_step:
        per_rank_needed = saved_tokens / (args.seq_len * run.world_size)
        hint = (
            f"pass --batch-size {per_rank_needed:g} to keep it"
            if per_rank_needed.is_integer()
            else "no per-rank batch size keeps it at this world size"
        )
        run.say(
            f"  note: the global batch changes from {saved_tokens:,} to "
            f"{run.tokens_per_step:,} tokens/step ({run.world_size} ranks x "
            f"{args.batch_size}x{args.seq_len}); {hint}"
        )


def _step(run: _Run, step: int, train_start: float) -> None:
    """One optimizer step, its loss (averaged over ranks) recorded, and rank 0's log line."""
    args, device, optimizer = run.args, run.device, run.optimizer
    t0 = time.perf_counter()
    inputs, targets = sample_batch(
        run.data, args.batch_size, args.seq_len, seed=args.seed, rank=run.rank, step=step
    )
    inputs, targets = inputs.to(device), targets.to(device)
    logits = run.model(inputs)
    loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = run.model.clip_grad_norm_(1.0)
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    run.scheduler.step()

    # One collective per step: every rank's (loss, RSS, CUDA peak), gathered on all ranks.
    local = torch.tensor(
        [loss.item(), _rss_mib(), _cuda_peak_mib(device)], dtype=torch.float64, device=device
    )
    per_rank = _all_gather_rows(local, run.world_size)
    seconds = time.perf_counter() - t0  # ranks are in step: the all-gather synchronises them
    run.losses.append(per_rank[:, 0].mean().item())

    if run.rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
        elapsed = time.perf_counter() - train_start
        eta = elapsed / (step + 1 - run.start_step) * (args.steps - step - 1)
        line = (
            f"step {step + 1:>5}/{args.steps} ({100 * (step + 1) / args.steps:3.0f}%, "
            f"eta {eta:4.0f} s) | loss {run.losses[-1]:.4f} | "
            f"grad norm {float(grad_norm):.3f} | lr {lr:.2e} | "
            f"{run.tokens_per_step / seconds:>9,.0f} tok/s | "
            f"rss MiB {_fmt_mib(per_rank[:, 1].tolist())}"
        )
        if device.type == "cuda":
            line += f" | cuda max MiB {_fmt_mib(per_rank[:, 2].tolist())}"
        print(line, flush=True)
    if len(run.first_losses) < _loss_window(args.steps):
        run.first_losses.append(run.losses[-1])  # kept in checkpoints for the resumed loss check


def _summarize(run: _Run, train_seconds: float, start: float) -> bool:
    """Rank 0 prints the summary; returns whether the loss fell (the same on every rank)."""
    args, device = run.args, run.device
    # Peak memory of every rank (gathered on all ranks; printed by rank 0).
    local = torch.tensor(
        [_peak_rss_mib(), _cuda_peak_mib(device)], dtype=torch.float64, device=device
    )
    peaks = _all_gather_rows(local, run.world_size)

    window = _loss_window(args.steps)
    first = sum(run.first_losses) / max(1, len(run.first_losses))
    last = sum(run.losses[-window:]) / max(1, len(run.losses[-window:]))
    fell = math.isfinite(last) and last < first * REQUIRED_LOSS_RATIO
    steps_run = max(1, args.steps - run.start_step)
    total_tokens = run.tokens_per_step * steps_run
    run.say(
        f"summary ({args.strategy}, {run.world_size} ranks, {args.model} model):\n"
        f"  loss           {first:.4f} (mean of first {window} steps) -> {last:.4f} "
        f"(mean of last {window} steps)\n"
        f"  throughput     {total_tokens / train_seconds:,.0f} tok/s mean (global), "
        f"{train_seconds / steps_run * 1e3:.0f} ms/step\n"
        f"  time           {train_seconds:.1f} s training, "
        f"{time.perf_counter() - start:.1f} s in rank 0\n"
        f"  peak rss MiB   {_fmt_mib(peaks[:, 0].tolist())} (per rank)"
    )
    if device.type == "cuda":
        run.say(f"  peak cuda MiB  {_fmt_mib(peaks[:, 1].tolist())} (per rank, max allocated)")
    if fell:
        run.say(f"OK: loss fell from {first:.4f} to {last:.4f}")
    else:
        run.say(
            f"FAILED: loss did not fall (first {first:.4f}, last {last:.4f}; "
            f"required last < {REQUIRED_LOSS_RATIO} x first)"
        )
    return fell


def _spawn_entry(
    rank: int, world_size: int, store_path: str, args: argparse.Namespace, verdict: Synchronized[int]
) -> None:
    """``mp.spawn`` target: run one local rank; rank 0 stores whether the loss fell."""
    fell = train_worker(rank, world_size, rank, args, init_method=f"file://{store_path}")
    if rank == 0:
        verdict.value = 1 if fell else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point; returns the process exit status (0 when the loss fell)."""
    args = parse_args(argv)
    refusal = _check_checkpoint_dir(args)
    if refusal is not None:
        print(refusal, file=sys.stderr, flush=True)
        return 2
    if _launched_by_torchrun():
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ["LOCAL_RANK"])
        fell = train_worker(rank, world_size, local_rank, args, init_method="env://")
        return 0 if fell else 1

    start = time.perf_counter()
    verdict = mp.get_context("spawn").Value("i", -1)
    # A file rendezvous: no store server thread to outlive (a TCP store hosted by rank 0 can
    # abort rank 0 at interpreter exit when a peer is still disconnecting).
    with tempfile.TemporaryDirectory(prefix="fsdp-demo-") as rendezvous_dir:
        mp.spawn(
            _spawn_entry,
            args=(args.nprocs, os.path.join(rendezvous_dir, "store"), args, verdict),
            nprocs=args.nprocs,
            join=True,
        )
    elapsed = time.perf_counter() - start
    print(f"total wall time (including process start-up): {elapsed:.1f} s", flush=True)
    return 0 if verdict.value == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
