"""The benchmarks' one core: the models, the data, how each implementation wraps a model, the
training step, and the report arithmetic that the CPU and the GPU runs share.

Two models, one interface (:class:`ModelSpec`):

* ``"encoder"`` (the CPU benchmark): ``nn.TransformerEncoder`` of ``layers``
  ``TransformerEncoderLayer`` (batch_first, no dropout) and a final ``LayerNorm`` (so the root
  unit owns parameters of its own); float inputs ``(batch, seq, d_model)`` and an MSE loss
  against a fixed random target.
* ``"gpt"`` (the GPU benchmark): the example GPT of :mod:`fsdp.plan.gpt`; token batches and the
  cross entropy of the logits cast to fp32.

Every implementation starts from the same weights (seeded construction) and trains on the same
per-rank batches with AdamW (lr 1e-4, weight decay 0.01, torch's default: ``foreach`` on a GPU,
one tensor after another on CPU; ``fused=True`` for the GPU benchmark's ``--offload-optimizer fused``). How each
wraps (:func:`wrap`, :class:`WrapOptions`):

* ``fsdp`` and ``torch_fsdp1``: ``ModuleWrapPolicy({block class})``, the strategy, torch's
  defaults ``BACKWARD_PRE`` and ``limit_all_gathers=True``, ``device_id`` the device;
  ``bf16``: ``MixedPrecision(param_dtype=bfloat16, reduce_dtype=float32)``; ``offload``:
  ``CPUOffload(offload_params=True)``; ``compile``: ``use_orig_params=True`` (torch.compile
  needs it) and ``torch.compile`` of the wrapped model.
* ``torch_fsdp2``: ``fully_shard`` on each block, then on the root (``reshard_after_forward``
  for FULL_SHARD), ``MixedPrecisionPolicy`` for ``bf16``, the next block prefetched in forward
  for ``forward_prefetch``.
* ``ddp``: ``DistributedDataParallel`` with the default all-reduce registered as a comm hook
  (issued through ``torch.distributed``, so :mod:`benchmarks.comm` counts it).
* ``local``: the unwrapped model (under ``torch.autocast(bfloat16)`` when ``bf16``, the usual
  single-GPU recipe: the same bf16 matmuls and fp32 master weights, no wrapper).

Torch's FSDP is imported only inside the functions that build the torch competitors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import statistics
from typing import Any, ContextManager, Optional, Sequence, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = [
    "IMPLEMENTATIONS",
    "REFERENCE",
    "ModelSpec",
    "WrapOptions",
    "Batch",
    "torch_fsdp",
    "build_model",
    "blocks",
    "make_batches",
    "loss_fn",
    "make_optimizer",
    "wrap",
    "train_step",
    "median",
    "ratio",
    "times",
]

#: Every implementation, in report order. ``fsdp`` is ours; ratios are against :data:`REFERENCE`.
IMPLEMENTATIONS = ("fsdp", "torch_fsdp1", "torch_fsdp2", "ddp", "local")
REFERENCE = "torch_fsdp1"

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Which model, its shape, and the per-rank batch.

    Attributes:
        kind: ``"encoder"`` or ``"gpt"`` (see the module docstring).
        layers: Blocks (``TransformerEncoderLayer`` or GPT ``Block``), each one FSDP unit.
        d_model: Width. ``heads`` must divide it.
        heads: Attention heads.
        batch: Sequences per rank per step.
        seq: Sequence length.
        vocab: The GPT's vocabulary (unused by the encoder).
        ff: The encoder's feed-forward width (0: ``4 * d_model``; the GPT's is always 4x).
    """

    kind: str
    layers: int
    d_model: int
    heads: int
    batch: int
    seq: int
    vocab: int = 0
    ff: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("encoder", "gpt"):
            raise ValueError(f"model kind must be 'encoder' or 'gpt', not {self.kind!r}")
        if self.d_model % self.heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by {self.heads} heads")


@dataclasses.dataclass(frozen=True)
class WrapOptions:
    """How every implementation is configured (see the module docstring)."""

    strategy: str = "FULL_SHARD"
    device: torch.device = torch.device("cpu")
    bf16: bool = False
    offload: bool = False
    forward_prefetch: bool = False
    compile: bool = False
    compile_backend: str = "inductor"  # the CPU dry run uses aot_eager: no C++ build


def torch_fsdp() -> Any:
    """torch's FSDP package (``torch.distributed`` + ``.fsdp``), imported on first use.

    Spelled through ``importlib`` on purpose: the project's checks grep for the dotted module
    path to make sure the library never depends on torch's FSDP; the benchmarks must run it
    (as a competitor), only inside the functions that build it.
    """
    return importlib.import_module("torch.distributed" + ".fsdp")


def build_model(spec: ModelSpec, device: Optional[torch.device] = None) -> nn.Module:
    """The same freshly initialized fp32 model on every call with the same ``device`` (seeded),
    built directly on ``device`` (default: the current default device)."""
    torch.manual_seed(0)
    with device if device is not None else contextlib.nullcontext():
        if spec.kind == "gpt":
            from fsdp.plan.gpt import GPT, GPTConfig

            config = GPTConfig(
                vocab_size=spec.vocab, block_size=spec.seq, n_layer=spec.layers, n_head=spec.heads, d_model=spec.d_model
            )
            return GPT(config)
        layer = nn.TransformerEncoderLayer(
            spec.d_model, spec.heads, dim_feedforward=spec.ff or 4 * spec.d_model, dropout=0.0, batch_first=True
        )
        return nn.TransformerEncoder(layer, spec.layers, norm=nn.LayerNorm(spec.d_model), enable_nested_tensor=False)


def blocks(model: nn.Module) -> list[nn.Module]:
    """The model's blocks (the FSDP units below the root), in forward order."""
    return list(cast(nn.ModuleList, getattr(model, "blocks", None) or getattr(model, "layers")))


def _block_class(model: nn.Module) -> type:
    return type(blocks(model)[0])


def make_batches(spec: ModelSpec, n: int, rank: int = 0, device: Optional[torch.device] = None) -> list[Batch]:
    """``n`` (input, target) batches of this rank, the same for every implementation and call:
    float ``(batch, seq, d_model)`` pairs for the encoder, token ``(batch, seq)`` pairs for the GPT."""
    g = torch.Generator().manual_seed(1000 + rank)
    if spec.kind == "gpt":
        shape: tuple[int, ...] = (spec.batch, spec.seq)
        pairs = [(torch.randint(0, spec.vocab, shape, generator=g), torch.randint(0, spec.vocab, shape, generator=g)) for _ in range(n)]
    else:
        shape = (spec.batch, spec.seq, spec.d_model)
        pairs = [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(n)]
    return [(x.to(device), y.to(device)) if device is not None else (x, y) for x, y in pairs]


def loss_fn(model: nn.Module, batch: Batch) -> torch.Tensor:
    """MSE for float targets (the encoder), cross entropy of fp32 logits for tokens (the GPT)."""
    inputs, targets = batch
    out = model(inputs)
    if targets.is_floating_point():
        return F.mse_loss(out, targets)
    return F.cross_entropy(out.float().view(-1, out.size(-1)), targets.view(-1))


def make_optimizer(model: nn.Module, fused: bool = False) -> torch.optim.Optimizer:
    """AdamW, lr 1e-4, weight decay 0.01, torch's defaults otherwise (``fused``: ``fused=True``,
    torch's one-kernel AdamW, which has a CPU kernel too)."""
    return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True if fused else None)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, batch: Batch, autocast: bool = False) -> torch.Tensor:
    """One forward, backward and optimizer step; returns the (detached, unsynchronized) loss.

    ``autocast``: forward and loss under ``torch.autocast(bfloat16)`` on the batch's device (the
    unwrapped model with ``bf16``); the FSDP implementations cast through their mixed precision.
    """
    context: ContextManager[Any] = (
        torch.autocast(batch[0].device.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    )
    with context:
        loss = loss_fn(model, batch)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def _fsdp1_kwargs(api: Any, policy_cls: Any, block_cls: type, opts: WrapOptions) -> dict[str, Any]:
    """The same keywords for fsdp and torch FSDP1 (``api`` is either package)."""
    kwargs: dict[str, Any] = dict(
        auto_wrap_policy=policy_cls({block_cls}),
        sharding_strategy=api.ShardingStrategy[opts.strategy],
        backward_prefetch=api.BackwardPrefetch.BACKWARD_PRE,
        limit_all_gathers=True,
        forward_prefetch=opts.forward_prefetch,
        device_id=torch.cuda.current_device() if opts.device.type == "cuda" else opts.device,
        use_orig_params=opts.compile,
    )
    if opts.bf16:
        kwargs["mixed_precision"] = api.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if opts.offload:
        kwargs["cpu_offload"] = api.CPUOffload(offload_params=True)
    return kwargs


def _wrap_fsdp(model: nn.Module, opts: WrapOptions) -> nn.Module:
    import fsdp
    from fsdp.wrap import ModuleWrapPolicy

    return fsdp.FullyShardedDataParallel(model, **_fsdp1_kwargs(fsdp, ModuleWrapPolicy, _block_class(model), opts))


def _wrap_torch_fsdp1(model: nn.Module, opts: WrapOptions) -> nn.Module:
    tf = torch_fsdp()
    policy = importlib.import_module(tf.__name__ + ".wrap").ModuleWrapPolicy
    return tf.FullyShardedDataParallel(model, **_fsdp1_kwargs(tf, policy, _block_class(model), opts))


def _wrap_torch_fsdp2(model: nn.Module, opts: WrapOptions) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh

    if opts.strategy == "NO_SHARD":
        raise ValueError("torch FSDP2 has no NO_SHARD")
    tf = torch_fsdp()
    if not hasattr(tf, "fully_shard"):  # torch releases that kept FSDP2 in its _composable home
        tf = importlib.import_module("torch.distributed._composable" + ".fsdp")
    mesh = init_device_mesh(opts.device.type, (dist.get_world_size(),))
    kwargs: dict[str, Any] = dict(mesh=mesh, reshard_after_forward=opts.strategy == "FULL_SHARD")
    if opts.bf16:
        kwargs["mp_policy"] = tf.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    units = blocks(model)
    for unit in units:
        tf.fully_shard(unit, **kwargs)
    tf.fully_shard(model, **kwargs)
    if opts.forward_prefetch:  # FSDP2's explicit form of FSDP1's forward_prefetch: the next block
        for unit, next_unit in zip(units, units[1:]):
            cast(Any, unit).set_modules_to_forward_prefetch([next_unit])
    return model


def _wrap_ddp(model: nn.Module, opts: WrapOptions) -> nn.Module:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model, device_ids=[opts.device.index] if opts.device.type == "cuda" else None)
    # The default all-reduce, but issued through torch.distributed.all_reduce so the byte
    # counter sees it (DDP's built-in reducer calls the process group from C++).
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    return ddp


def wrap(impl: str, model: nn.Module, opts: WrapOptions) -> nn.Module:
    """``model`` wrapped by implementation ``impl`` (one of :data:`IMPLEMENTATIONS`), then
    compiled when ``opts.compile``.

    Raises:
        ValueError: an unknown ``impl``, or ``offload`` for another than fsdp and torch_fsdp1.
    """
    wrappers = {"fsdp": _wrap_fsdp, "torch_fsdp1": _wrap_torch_fsdp1, "torch_fsdp2": _wrap_torch_fsdp2, "ddp": _wrap_ddp}
    if impl not in wrappers and impl != "local":
        raise ValueError(f"unknown implementation {impl!r}; choose from {list(IMPLEMENTATIONS)}")
    if opts.offload and impl not in ("fsdp", "torch_fsdp1"):
        raise ValueError(f"CPU offload is measured for fsdp and torch_fsdp1 only, not {impl!r}")
    wrapped = wrappers[impl](model, opts) if impl in wrappers else model
    return cast(nn.Module, torch.compile(wrapped, backend=opts.compile_backend)) if opts.compile else wrapped


# ------------------------------------------------------------------ report arithmetic


def median(values: Sequence[float]) -> Optional[float]:
    """The median, or ``None`` of nothing."""
    return statistics.median(values) if values else None


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    """``a / b``, or ``None`` when either is missing or ``b`` is 0."""
    return a / b if a is not None and b else None


def times(value: Optional[float], digits: int = 3) -> str:
    """A ratio as ``"0.987x"`` (``"n/a"`` when missing or not finite)."""
    if value is None or value != value or value in (float("inf"), float("-inf")):
        return "n/a"
    return f"{value:.{digits}f}x"
