"""``python -m fsdp.plan``: predicted per-rank memory of FSDP training, and configurations that fit.

Examples::

    python -m fsdp.plan --layers 80 --d-model 8192 --heads 64 --vocab 32000 --seq-len 4096 \\
        --batch-size 1 --world-size 64 --bf16
    python -m fsdp.plan --layers 32 --d-model 4096 --heads 32 --budget 80GiB --max-world-size 64
    python -m fsdp.plan --model mypkg.models:make --world-size 8

A user model is ``module:factory`` where ``factory()`` returns ``(model, example_inputs)``
(the model preferably on the meta device); the wrap policy is then ``--wrap-class`` (a class
name of one of its modules), else no auto-wrapping.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from fsdp.api import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from fsdp.plan._api import estimate_memory
from fsdp.plan._estimate import format_bytes

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(text: str) -> int:
    """``'80GiB' -> 85899345920``; decimal (GB) and binary (GiB) units."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 80GiB, 40GB, 1024MiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


#: Builds ``(model, example_inputs)``; its argument: activation checkpointing of every block.
Builder = Callable[[bool], tuple[nn.Module, Any]]


def _gpt_builder(args: argparse.Namespace) -> Builder:
    from fsdp.plan.gpt import GPT, Block, GPTConfig, checkpoint_blocks

    def build(checkpointing: bool) -> tuple[nn.Module, Any]:
        config = GPTConfig(
            vocab_size=args.vocab, block_size=args.seq_len, n_layer=args.layers, n_head=args.heads, d_model=args.d_model
        )
        with torch.device("meta"):
            model = GPT(config)
        if checkpointing:
            checkpoint_blocks(model, Block)
        return model, torch.zeros(args.batch_size, args.seq_len, dtype=torch.long, device="meta")

    return build


def _user_builder(spec: str, wrap_class: Optional[str]) -> tuple[Builder, Optional[type]]:
    module_name, _, factory_name = spec.partition(":")
    if not module_name or not factory_name:
        raise SystemExit(f"fsdp.plan: --model must be 'module:factory', got {spec!r}")
    try:
        factory = getattr(importlib.import_module(module_name), factory_name)
    except (ImportError, AttributeError) as exc:
        raise SystemExit(f"fsdp.plan: cannot load --model {spec!r}: {exc}") from exc
    block_cls: list[Optional[type]] = [None]

    def build(checkpointing: bool) -> tuple[nn.Module, Any]:
        made = factory()
        if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module)):
            raise SystemExit(f"fsdp.plan: {spec}() must return (model, example_inputs)")
        model, inputs = made
        if wrap_class is not None:
            classes = {type(m) for m in model.modules() if type(m).__name__ == wrap_class}
            if not classes:
                raise SystemExit(f"fsdp.plan: --wrap-class {wrap_class!r}: no module of that class in the model")
            block_cls[0] = classes.pop()
            if checkpointing:
                from fsdp.plan.gpt import checkpoint_blocks

                checkpoint_blocks(model, block_cls[0])
        return model, inputs

    build(False)  # resolves the wrap class now
    return build, block_cls[0]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fsdp.plan", description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--heads", type=int, default=None, help="default: d_model / 128 (at least 1)")
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=8, help="micro-batch per rank")
    parser.add_argument("--model", help="module:factory returning (model, example_inputs)")
    parser.add_argument("--wrap-class", help="class name of the blocks to wrap (with --model)")
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--strategy", default="FULL_SHARD", choices=[s.name for s in ShardingStrategy])
    parser.add_argument("--intra-node-size", type=int, default=None, help="hybrid strategies")
    parser.add_argument("--bf16", action="store_true", help="MixedPrecision(param_dtype=bfloat16)")
    parser.add_argument("--offload", action="store_true", help="CPUOffload(offload_params=True)")
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing of each block")
    parser.add_argument("--backward-prefetch", default="BACKWARD_PRE", choices=["BACKWARD_PRE", "BACKWARD_POST", "none"])
    parser.add_argument("--forward-prefetch", action="store_true")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="the training device")
    parser.add_argument("--budget", type=parse_bytes, help="per-rank device memory: list what fits")
    parser.add_argument("--max-world-size", type=int, default=64)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    return parser


def _gpt_loss(logits: torch.Tensor) -> torch.Tensor:
    """The example GPT's next-token loss (the targets' values do not matter to the plan)."""
    targets = torch.empty(logits.shape[:-1], dtype=torch.long)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _model_and_loss(
    args: argparse.Namespace,
) -> tuple[Builder, Optional[type], Optional[Callable[[Any], torch.Tensor]]]:
    """``(model builder, block class to wrap, loss_fn)``: the user's ``--model`` or the example GPT."""
    if args.model:
        build, block_cls = _user_builder(args.model, args.wrap_class)
        return build, block_cls, None
    from fsdp.plan.gpt import Block

    return _gpt_builder(args), Block, _gpt_loss


def _base_kwargs(args: argparse.Namespace, block_cls: Optional[type]) -> dict[str, Any]:
    """The wrapper keywords every planned configuration shares (wrapping, prefetching)."""
    from fsdp.wrap import ModuleWrapPolicy

    base: dict[str, Any] = {}
    if block_cls is not None:
        base["auto_wrap_policy"] = ModuleWrapPolicy({block_cls})
    base["backward_prefetch"] = None if args.backward_prefetch == "none" else BackwardPrefetch[args.backward_prefetch]
    base["forward_prefetch"] = args.forward_prefetch
    return base


@dataclass
class _Request:
    """What the command line plans, whatever the report.

    Attributes:
        build: Builds the model and its example inputs.
        base_kwargs: The wrapper keywords every planned configuration shares.
        loss_fn: The loss of the model's output (None: the output's sum).
    """

    build: Builder
    base_kwargs: dict[str, Any]
    loss_fn: Optional[Callable[[Any], torch.Tensor]]


def _print_search(args: argparse.Namespace, request: _Request, start: float) -> int:
    """``--budget``: the table of configurations that fit; exit status 1 when none does."""
    from fsdp.plan._search import search_configurations

    fits = search_configurations(
        request.build,
        budget_bytes=args.budget,
        max_world_size=args.max_world_size,
        gpus_per_node=args.gpus_per_node,
        device=args.device,
        fsdp_kwargs=request.base_kwargs,
        loss_fn=request.loss_fn,
    )
    print(f"configurations with a predicted peak <= {format_bytes(args.budget)} per rank, cheapest first:")
    print(f"  {'ranks':>5}  {'strategy':<14} {'precision':<9} {'offload':<7} {'ckpt':<5} {'peak':>11}  phase")
    for c in fits:
        print(
            f"  {c.world_size:>5}  {c.strategy.name:<14} {'bf16' if c.bf16 else 'fp32':<9} "
            f"{'yes' if c.offload else 'no':<7} {'yes' if c.checkpointing else 'no':<5} "
            f"{format_bytes(c.estimate.peak_bytes):>11}  {c.estimate.peak_phase}"
        )
    if not fits:
        print(f"  none up to {args.max_world_size} ranks")
    print(f"(searched in {time.perf_counter() - start:.1f} s)")
    return 0 if fits else 1


def _print_estimate(args: argparse.Namespace, request: _Request, start: float) -> int:
    """One configuration's estimate, from the command line's flags."""
    model, inputs = request.build(args.checkpointing)
    kwargs = dict(request.base_kwargs)
    kwargs["sharding_strategy"] = ShardingStrategy[args.strategy]
    kwargs["device_id"] = torch.device(args.device)
    if args.bf16:
        kwargs["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16)
    if args.offload:
        kwargs["cpu_offload"] = CPUOffload(offload_params=True)
    estimate = estimate_memory(
        model, inputs, world_size=args.world_size, loss_fn=request.loss_fn, intra_node_size=args.intra_node_size, **kwargs
    )
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e9:.3f} B parameters")
    print(estimate)
    print(f"(planned in {time.perf_counter() - start:.1f} s)")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m fsdp.plan``; returns the exit status (1 when ``--budget`` finds nothing)."""
    args = _parser().parse_args(argv)
    if args.heads is None:
        args.heads = max(1, args.d_model // 128)
    build, block_cls, loss_fn = _model_and_loss(args)
    request = _Request(build, _base_kwargs(args, block_cls), loss_fn)
    start = time.perf_counter()
    if args.budget is not None:
        return _print_search(args, request, start)
    return _print_estimate(args, request, start)


if __name__ == "__main__":
    sys.exit(main())
