"""``python -m fsdp.plan``: predicted per-rank memory of FSDP training, and configurations that fit.

Examples::

    python -m fsdp.plan --layers 80 --d-model 8192 --heads 64 --vocab 32000 --seq-len 4096 \\
        --batch-size 1 --world-size 64 --bf16
    python -m fsdp.plan --layers 32 --d-model 4096 --heads 32 --budget 80GiB --max-world-size 64
    python -m fsdp.plan --model mypkg.models:make --wrap-class DecoderLayer --world-size 8

Without ``--budget`` one configuration is planned: the flags' values, their defaults where not
given. With ``--budget`` every configuration is tried along each dimension whose flag is not
given (``--world-size``, ``--strategy``, ``--bf16/--no-bf16``, ``--offload/--no-offload``,
``--checkpointing/--no-checkpointing``) and fixed along each one that is.

A user model is ``--model module:factory`` where ``factory()`` returns ``(model,
example_inputs)`` or ``(model, example_inputs, loss_fn)`` (the model preferably on the meta
device; ``loss_fn(output)`` returns the scalar loss). Without a ``loss_fn`` the plan's loss is
the sum of the model's output tensors, which holds no copy of the output: a real loss such as a
cross-entropy over a large vocabulary may need more. The wrap policy is ``--wrap-class`` (a
class name of one of its modules), else no auto-wrapping.

Sizes take a unit: ``80GiB`` (binary: KiB, MiB, GiB, TiB) or ``80GB`` (decimal: KB, MB, GB, TB)
or ``512B``; a bare number is refused, since ``--budget 80`` could mean 80 GiB or 80 bytes.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
import time
from dataclasses import dataclass
# Any below: the FSDP constructor's keyword arguments (mixed types; torch's wrap policies type them
# so) and ``loss_fn``'s argument, the model's output (torch types nn.Module.__call__'s as Any).
from typing import Any, Callable, Optional, TypedDict

import torch
import torch.nn.functional as F
from torch import nn

from fsdp.api import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
# The GPT that plans when no --model is given (the example trainer's and the benchmarks' model).
from fsdp.plan import gpt
from fsdp.plan._api import estimate_memory
from fsdp.plan._estimate import format_bytes, format_count
from fsdp.flat_param._policy import HYBRID_STRATEGIES
from fsdp.plan._search import STRATEGY_COST, Candidate, SearchSpace


_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}

# The example GPT's defaults (its flags default to None, to tell "given" from "not given").
_GPT_DEFAULTS = {"layers": 12, "d_model": 768, "vocab": 50304, "seq_len": 1024, "batch_size": 8}
class _Defaults(TypedDict):
    world_size: int
    strategy: str
    max_world_size: int
    gpus_per_node: int


_DEFAULTS: _Defaults = {"world_size": 8, "strategy": "FULL_SHARD", "max_world_size": 64, "gpus_per_node": 8}
_SEARCHED_STRATEGIES = ("NO_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "FULL_SHARD")


def parse_bytes(text: str) -> int:
    """``'80GiB' -> 85899345920``; decimal (GB) and binary (GiB) units; a unit is required.

    Raises:
        argparse.ArgumentTypeError: Not a size, no unit, or not positive.
    """
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        if match and not match.group(2):
            raise argparse.ArgumentTypeError(
                f"{text!r} has no unit: write {match.group(1)}GiB (binary), {match.group(1)}GB "
                f"(decimal) or {match.group(1)}B (bytes)"
            )
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 80GiB, 40GB, 1024MiB)")
    nbytes = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if nbytes < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a memory size must be at least 1 byte")
    return nbytes


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


#: Builds ``(model, example_inputs)``; its argument: activation checkpointing of every block.
Builder = Callable[[bool], tuple[nn.Module, object]]


@dataclass
class _Request:
    """What the command line plans, whatever the report.

    Attributes:
        build: Builds the model and its example inputs.
        base_kwargs: The wrapper keywords every planned configuration shares.
        loss_fn: The loss of the model's output (None: the output's sum).
        can_checkpoint: Whether ``build(True)`` checkpoints anything (it needs block classes).
        description: What is planned, in words (model, inputs, loss, wrapping).
    """

    build: Builder
    base_kwargs: dict[str, Any]
    loss_fn: Optional[Callable[[Any], torch.Tensor]]
    can_checkpoint: bool
    description: list[str]


def _gpt_loss(logits: torch.Tensor) -> torch.Tensor:
    """The example GPT's next-token loss (the targets' values do not matter to the plan)."""
    targets = torch.empty(logits.shape[:-1], dtype=torch.long)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _wrap_kwargs(args: argparse.Namespace, block_cls: Optional[type]) -> dict[str, Any]:
    """The wrapper keywords every planned configuration shares (wrapping, prefetching)."""
    from fsdp.wrap import ModuleWrapPolicy

    base: dict[str, Any] = {}
    if block_cls is not None:
        base["auto_wrap_policy"] = ModuleWrapPolicy({block_cls})
    base["backward_prefetch"] = None if args.backward_prefetch == "none" else BackwardPrefetch[args.backward_prefetch]
    base["forward_prefetch"] = args.forward_prefetch
    return base


def _gpt_request(args: argparse.Namespace) -> _Request:
    def build(checkpointing: bool) -> tuple[nn.Module, object]:
        config = gpt.GPTConfig(
            vocab_size=args.vocab, block_size=args.seq_len, n_layer=args.layers, n_head=args.heads, d_model=args.d_model
        )
        with torch.device("meta"):
            model = gpt.GPT(config)
        if checkpointing:
            gpt.checkpoint_blocks(model, gpt.Block)
        return model, torch.zeros(args.batch_size, args.seq_len, dtype=torch.long, device="meta")

    params = sum(p.numel() for p in build(False)[0].parameters())
    description = [
        f"model: the example GPT (fsdp.plan.gpt): {args.layers} layers, d_model {args.d_model}, "
        f"{args.heads} heads, vocab {args.vocab}: {format_count(params)} parameters ({params:,})",
        f"inputs: micro-batch {args.batch_size} x sequence {args.seq_len} tokens per rank; "
        f"loss: next-token cross-entropy over the vocabulary; optimizer: AdamW",
        f"wrapping: one FSDP unit per Block ({args.layers}) and the root",
    ]
    return _Request(build, _wrap_kwargs(args, gpt.Block), _gpt_loss, True, description)


def _describe_inputs(inputs: object) -> str:
    from torch.utils._pytree import tree_flatten

    shapes = [
        f"[{', '.join(map(str, t.shape))}] {str(t.dtype).replace('torch.', '')}"
        for t in tree_flatten(inputs)[0]
        if isinstance(t, torch.Tensor)
    ]
    return ", ".join(shapes) or "no tensors"


def _user_request(args: argparse.Namespace, parser: argparse.ArgumentParser) -> _Request:
    spec = args.model
    module_name, _, factory_name = spec.partition(":")
    if not module_name or not factory_name:
        parser.error(f"--model must be 'module:factory', got {spec!r}")
    try:
        factory = getattr(importlib.import_module(module_name), factory_name)
    except (ImportError, AttributeError) as exc:
        parser.error(f"cannot load --model {spec!r}: {exc}")

    def make() -> tuple[nn.Module, object, Optional[Callable[[Any], torch.Tensor]]]:
        made = factory()
        if not (isinstance(made, tuple) and len(made) in (2, 3) and isinstance(made[0], nn.Module)):
            raise SystemExit(f"fsdp.plan: {spec}() must return (model, example_inputs) or (model, example_inputs, loss_fn)")
        return made[0], made[1], made[2] if len(made) == 3 else None

    first = make()
    model, inputs, loss_fn = first
    block_cls: Optional[type] = None
    if args.wrap_class is not None:
        classes = {type(m) for m in model.modules() if type(m).__name__ == args.wrap_class}
        if not classes:
            parser.error(f"--wrap-class {args.wrap_class!r}: no module of that class in the {spec} model")
        block_cls = classes.pop()
    kept: list[tuple[nn.Module, object, Optional[Callable[[Any], torch.Tensor]]]] = [first]  # the first build serves the first request

    def build(checkpointing: bool) -> tuple[nn.Module, object]:
        model, inputs, _ = kept.pop() if kept else make()
        if checkpointing and block_cls is not None:
            gpt.checkpoint_blocks(model, block_cls)
        return model, inputs

    params = sum(p.numel() for p in model.parameters())
    loss = (
        "loss: the factory's loss_fn"
        if loss_fn is not None
        else "loss: the sum of the model's output tensors (the factory returned no loss_fn; return "
        "(model, inputs, loss_fn) to plan with your loss)"
    )
    wrapping = (
        f"one FSDP unit per {block_cls.__name__} and the root"
        if block_cls is not None
        else "none: the whole model is one FSDP unit (pass --wrap-class)"
    )
    description = [
        f"model: {spec}() -> {type(model).__name__}: {format_count(params)} parameters ({params:,})",
        f"inputs: {_describe_inputs(inputs)} per rank (as the factory returned them); {loss}; optimizer: AdamW",
        f"wrapping: {wrapping}",
    ]
    return _Request(build, _wrap_kwargs(args, block_cls), loss_fn, block_cls is not None, description)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's layout (examples, user models, sizes)."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fsdp.plan", description=__doc__.split("\n", 1)[1], formatter_class=_HelpFormatter
    )
    d, g = _DEFAULTS, _GPT_DEFAULTS
    model = parser.add_argument_group("the model (default: the example GPT)")
    model.add_argument("--layers", type=_positive_int, help=f"GPT blocks (default: {g['layers']})")
    model.add_argument("--d-model", type=_positive_int, help=f"GPT width (default: {g['d_model']})")
    model.add_argument("--heads", type=_positive_int, help="GPT attention heads; must divide --d-model (default: d_model / 128, at least 1)")
    model.add_argument("--vocab", type=_positive_int, help=f"GPT vocabulary (default: {g['vocab']})")
    model.add_argument("--seq-len", type=_positive_int, help=f"GPT sequence length (default: {g['seq_len']})")
    model.add_argument("--batch-size", type=_positive_int, help=f"GPT micro-batch per rank (default: {g['batch_size']})")
    model.add_argument(
        "--model",
        metavar="MODULE:FACTORY",
        help="a user model instead of the GPT: factory() returns (model, example_inputs[, loss_fn]); "
        "without loss_fn the loss planned is the sum of the outputs (default: the example GPT)",
    )
    model.add_argument("--wrap-class", help="with --model: class name of the blocks to wrap and checkpoint (default: no auto-wrapping)")
    config = parser.add_argument_group("the configuration (with --budget: searched unless given)")
    config.add_argument("--world-size", type=_positive_int, help=f"ranks (default: {d['world_size']}; with --budget: 1, 2, 4, ... --max-world-size)")
    config.add_argument(
        "--strategy",
        choices=[s.name for s in ShardingStrategy],
        help=f"sharding strategy (default: {d['strategy']}; with --budget: {', '.join(_SEARCHED_STRATEGIES)})",
    )
    config.add_argument("--intra-node-size", type=_positive_int, help="HYBRID_SHARD: ranks per shard group (default: none, required for hybrid strategies without --budget; with --budget: --gpus-per-node)")
    boolean = argparse.BooleanOptionalAction
    config.add_argument("--bf16", action=boolean, help="MixedPrecision(param_dtype=bfloat16) (default: off; with --budget: both)")
    config.add_argument("--offload", action=boolean, help="CPUOffload(offload_params=True) (default: off; with --budget: both on cuda)")
    config.add_argument("--checkpointing", action=boolean, help="activation checkpointing of each wrapped block (default: off; with --budget: both)")
    config.add_argument("--backward-prefetch", default="BACKWARD_PRE", choices=["BACKWARD_PRE", "BACKWARD_POST", "none"], help="(default: %(default)s)")
    config.add_argument("--forward-prefetch", action="store_true", help="(default: off)")
    config.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="the training device (default: %(default)s)")
    search = parser.add_argument_group("the search")
    search.add_argument("--budget", type=parse_bytes, metavar="SIZE", help="device memory per rank, e.g. 80GiB: list what fits (default: plan one configuration)")
    search.add_argument("--host-budget", type=parse_bytes, metavar="SIZE", help="with --budget: host memory per rank for CPU offload, e.g. 200GiB (default: unlimited)")
    search.add_argument("--max-world-size", type=_positive_int, help=f"with --budget: the largest world size tried (default: {d['max_world_size']})")
    search.add_argument("--gpus-per-node", type=_positive_int, help=f"with --budget: the node size HYBRID_SHARD is tried with (default: {d['gpus_per_node']})")
    return parser


def _check_model_flags(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Rejects the GPT's flags with ``--model`` (and ``--wrap-class`` without it); fills defaults."""
    gpt_flags = [name for name in (*_GPT_DEFAULTS, "heads") if getattr(args, name) is not None]
    if args.model:
        if gpt_flags:
            flags = ", ".join("--" + name.replace("_", "-") for name in gpt_flags)
            parser.error(f"{flags} configure the example GPT, not --model {args.model} (its factory decides)")
        if args.checkpointing and args.wrap_class is None:
            parser.error("--checkpointing needs --wrap-class: the class of the blocks to checkpoint")
        return
    if args.wrap_class is not None:
        parser.error("--wrap-class applies to --model; the example GPT wraps its Blocks")
    for name, default in _GPT_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.heads is None:
        args.heads = max(1, args.d_model // 128)
    if args.d_model % args.heads:
        parser.error(f"--heads {args.heads} must divide --d-model {args.d_model}")


def _check_configuration(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Rejects flags that contradict each other or the mode, before any planning."""
    search_only = ("host_budget", "max_world_size", "gpus_per_node")
    if args.budget is None:
        given = ["--" + name.replace("_", "-") for name in search_only if getattr(args, name) is not None]
        if given:
            parser.error(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} to the --budget search only")
    if args.world_size is not None and args.max_world_size is not None:
        parser.error("--world-size fixes the world size; --max-world-size bounds the search over it: give one")
    if args.device == "cpu":
        if args.offload:
            parser.error("--offload with --device cpu: the parameters already live in host memory (offload applies to cuda)")
        if args.host_budget is not None:
            parser.error("--host-budget with --device cpu: the training device is host memory; --budget bounds it")
    strategy = ShardingStrategy[args.strategy] if args.strategy else None
    fixed_world_size = args.world_size or (None if args.budget else _DEFAULTS["world_size"])
    if strategy is ShardingStrategy.NO_SHARD and args.offload and (fixed_world_size or 1) > 1:
        parser.error("--strategy NO_SHARD with --offload: fsdp's CPU offload needs a sharded strategy on more than one rank (FULL_SHARD or SHARD_GRAD_OP)")
    if args.intra_node_size is not None and strategy not in (None if args.budget else (), *HYBRID_STRATEGIES):
        shown = strategy.name if strategy else _DEFAULTS["strategy"] + " (the default)"
        parser.error(f"--intra-node-size applies to hybrid strategies (--strategy HYBRID_SHARD), not {shown}")
    if strategy in HYBRID_STRATEGIES:
        intra, flag = args.intra_node_size, "--intra-node-size"
        if intra is None and args.budget:
            intra, flag = args.gpus_per_node or _DEFAULTS["gpus_per_node"], "--gpus-per-node"
        if intra is None:
            parser.error(f"--strategy {strategy.name} needs --intra-node-size (ranks per node, the shard group size)")
        if fixed_world_size is not None and (fixed_world_size % intra or (args.budget and fixed_world_size <= intra)):
            parser.error(
                f"{flag} {intra} and --world-size {fixed_world_size}: {strategy.name} needs whole nodes "
                f"(and, with --budget, more than one; one node is FULL_SHARD)"
            )


def _progress(line: str) -> None:
    """One progress line on stderr (a line per phase or per configuration, never per step):
    a large model's trace takes minutes, and stdout keeps only the result."""
    print(f"fsdp.plan: {line}", file=sys.stderr, flush=True)


def _print_estimate(args: argparse.Namespace, request: _Request) -> int:
    """One configuration's estimate, from the command line's flags."""
    checkpointing = bool(args.checkpointing)
    _progress("building the model on the meta device")
    model, inputs = request.build(checkpointing)
    world_size = args.world_size or _DEFAULTS["world_size"]
    strategy = ShardingStrategy[args.strategy or _DEFAULTS["strategy"]]
    kwargs = dict(request.base_kwargs)
    kwargs["sharding_strategy"] = strategy
    kwargs["device_id"] = torch.device(args.device)
    if args.bf16:
        kwargs["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16)
    if args.offload:
        kwargs["cpu_offload"] = CPUOffload(offload_params=True)
    _progress("tracing one forward and backward on fake tensors, then replaying the FSDP schedule")
    estimate = estimate_memory(
        model, inputs, world_size=world_size, loss_fn=request.loss_fn, intra_node_size=args.intra_node_size, **kwargs
    )
    print(
        f"configuration: world size {world_size}, {strategy.name}"
        + (f" in nodes of {args.intra_node_size}" if args.intra_node_size else "")
        + f", {'bf16' if args.bf16 else 'fp32'}, {'CPU offload' if args.offload else 'no offload'}, "
        f"{'activation checkpointing' if checkpointing else 'no checkpointing'}, device {args.device}"
    )
    print(estimate)
    return 0


def _search_space(args: argparse.Namespace, request: _Request) -> SearchSpace:
    """The configurations ``--budget`` tries: each flag given fixes its dimension."""
    max_world_size = args.max_world_size or _DEFAULTS["max_world_size"]
    if args.world_size is not None:
        world_sizes = [args.world_size]
    else:
        world_sizes = [1 << i for i in range(max_world_size.bit_length())]
    strategies = [ShardingStrategy[args.strategy]] if args.strategy else [ShardingStrategy[s] for s in _SEARCHED_STRATEGIES]

    def both(flag: Optional[bool], possible: bool = True) -> list[bool]:
        return [flag] if flag is not None else ([False, True] if possible else [False])

    return SearchSpace(
        world_sizes=world_sizes,
        strategies=strategies,
        bf16=both(args.bf16),
        offload=both(args.offload, args.device != "cpu"),
        checkpointing=both(args.checkpointing, request.can_checkpoint),
        intra_node_size=args.intra_node_size or args.gpus_per_node or _DEFAULTS["gpus_per_node"],
        device=args.device,
    )


def _describe_space(space: SearchSpace) -> str:
    def yes_no(values: list[bool], yes: str, no: str) -> str:
        return ", ".join(yes if v else no for v in values)

    tried = {s for ws in space.world_sizes for offload in space.offload for s in space.strategies_at(ws, offload)}
    strategies = ", ".join(
        s.name + (f" (nodes of {space.intra_node_size})" if s in HYBRID_STRATEGIES else "")
        for s in sorted(tried, key=STRATEGY_COST.__getitem__)
    )
    return (
        f"searched: world size {', '.join(map(str, space.world_sizes))}; {strategies}; "
        f"{yes_no(space.bf16, 'bf16', 'fp32')}; offload {yes_no(space.offload, 'yes', 'no')}; "
        f"checkpointing {yes_no(space.checkpointing, 'yes', 'no')}; device {space.device}"
    )


def _print_search(args: argparse.Namespace, request: _Request) -> int:
    """``--budget``: the table of configurations that fit; exit status 1 when none does."""
    from fsdp.plan._search import search_configurations

    space = _search_space(args, request)
    if space.size() == 0:
        raise SystemExit(
            f"fsdp.plan: no configuration to try: {_describe_space(space)} "
            f"(hybrid strategies need a world size that is a multiple of the node size, above it)"
        )
    print(_describe_space(space))
    _progress(f"searching {space.size()} configurations (the first of each model traces it; the rest reuse the trace)")
    candidates = search_configurations(
        request.build, space, fsdp_kwargs=request.base_kwargs, loss_fn=request.loss_fn, progress=_progress
    )
    fits = [c for c in candidates if c.fits(args.budget, args.host_budget)]
    limits = f"<= {format_bytes(args.budget)} {'device' if args.device == 'cuda' else 'host'} memory per rank"
    if args.host_budget is not None:
        limits += f" and <= {format_bytes(args.host_budget)} host memory per rank"
    if fits:
        print(f"{len(fits)} of {len(candidates)} configurations fit {limits}, cheapest first:")
        _print_table(fits, args.device)
        return 0
    print(f"none of the {len(candidates)} configurations fits {limits}; the smallest peak tried:")
    _print_table([min(candidates, key=lambda c: c.estimate.peak_bytes)], args.device)
    return 1


def _print_table(rows: list[Candidate], device: str) -> None:
    host = device == "cuda"  # on a CPU training device the peak is host memory itself
    header = f"  {'ranks':>5}  {'strategy':<18} {'precision':<9} {'offload':<7} {'ckpt':<5} {'peak':>11}"
    print(header + (f"  {'host (offload)':>14}" if host else "") + "  phase")
    for c in rows:
        line = (
            f"  {c.world_size:>5}  {c.strategy.name:<18} {'bf16' if c.bf16 else 'fp32':<9} "
            f"{'yes' if c.offload else 'no':<7} {'yes' if c.checkpointing else 'no':<5} "
            f"{format_bytes(c.estimate.peak_bytes):>11}"
        )
        if host:
            line += f"  {format_bytes(c.estimate.cpu_peak_bytes) if c.offload else '-':>14}"
        print(line + f"  {c.estimate.peak_phase}")


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m fsdp.plan``; returns the exit status (1 when ``--budget`` finds nothing).

    Argument mistakes exit with status 2 and argparse's usage line.
    """
    parser = _parser()
    args = parser.parse_args(argv)
    _check_model_flags(args, parser)
    _check_configuration(args, parser)
    request = _user_request(args, parser) if args.model else _gpt_request(args)
    for line in request.description:
        print(line)
    start = time.perf_counter()
    try:
        status = _print_search(args, request) if args.budget is not None else _print_estimate(args, request)
    except (ValueError, TypeError, NotImplementedError) as exc:
        if not str(exc).startswith("fsdp"):
            raise  # not a planning error: the user's model failed, its traceback says where
        raise SystemExit(f"python -m fsdp.plan: cannot plan this model: {exc}") from exc
    print(f"(planned in {time.perf_counter() - start:.1f} s)")
    return status


if __name__ == "__main__":
    sys.exit(main())
