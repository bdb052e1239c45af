"""The GPU benchmark's model, data, training step, and how each implementation wraps the model.

Every implementation trains the example GPT (:mod:`fsdp.examples.model`) from the same weights
(seeded construction) on the same token batches with AdamW (lr 1e-4, torch's default
``foreach`` implementation) and bf16 compute:

* ``fsdp`` and ``torch_fsdp1``: ``ModuleWrapPolicy({Block})``, ``MixedPrecision(param_dtype=
  bfloat16, reduce_dtype=float32)``, FULL_SHARD (both switch to NO_SHARD at world size 1, with a
  warning), ``BACKWARD_PRE``, ``limit_all_gathers=True``, ``device_id`` the current GPU.
* ``torch_fsdp2``: ``fully_shard`` on each Block, then on the root, with
  ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``.
* ``local``: the unwrapped model with fp32 parameters under ``torch.autocast(bfloat16)``, the
  usual single-GPU mixed-precision recipe: the same bf16 matmuls and fp32 master weights, and
  no wrapper at all (autocast keeps LayerNorm and the residual stream in fp32, so its
  activations are somewhat larger than the FSDP runs' all-bf16 ones).

The loss is the cross entropy of the logits cast to fp32, for every implementation.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any, ContextManager

import torch
import torch.nn.functional as F
from torch import nn

from fsdp.bench._cuda_config import CudaBenchConfig
from fsdp.bench._model import torch_fsdp
from fsdp.examples.model import GPT, Block, GPTConfig

__all__ = ["build_model", "make_batches", "wrap", "make_optimizer", "train_step", "torch_fsdp2_api"]

Batch = tuple[torch.Tensor, torch.Tensor]


def build_model(cfg: CudaBenchConfig, layers: int, device: torch.device) -> GPT:
    """A freshly initialized fp32 example GPT built directly on ``device``, the same weights on
    every call with the same ``device`` (seeded)."""
    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=cfg.vocab, block_size=cfg.seq, n_layer=layers, n_head=cfg.n_head, d_model=cfg.d_model
    )
    with device:
        return GPT(config)


def make_batches(cfg: CudaBenchConfig, n: int, device: torch.device) -> list[Batch]:
    """``n`` (tokens, next-token targets) batches of shape ``(batch, seq)``, the same every call."""
    assert cfg.batch is not None
    g = torch.Generator().manual_seed(1234)
    shape = (cfg.batch, cfg.seq)
    return [
        (
            torch.randint(0, cfg.vocab, shape, generator=g).to(device),
            torch.randint(0, cfg.vocab, shape, generator=g).to(device),
        )
        for _ in range(n)
    ]


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW, lr 1e-4, torch's defaults otherwise (``foreach`` on the GPU, weight decay 0.01)."""
    return torch.optim.AdamW(model.parameters(), lr=1e-4)


def train_step(
    model: nn.Module, opt: torch.optim.Optimizer, batch: Batch, autocast: bool, device_type: str
) -> torch.Tensor:
    """One forward, backward and optimizer step; returns the (detached, unsynchronized) loss.

    ``autocast``: run forward and loss under ``torch.autocast(device_type, bfloat16)`` (the
    unwrapped model); the FSDP implementations cast through their mixed-precision settings.
    """
    tokens, targets = batch
    context: ContextManager[Any] = (
        torch.autocast(device_type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    )
    with context:
        logits = model(tokens)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def torch_fsdp2_api() -> tuple[Any, Any]:
    """``(fully_shard, MixedPrecisionPolicy)`` from torch's FSDP package, or from its older
    ``_composable`` home."""
    tf = torch_fsdp()
    if hasattr(tf, "fully_shard") and hasattr(tf, "MixedPrecisionPolicy"):
        return tf.fully_shard, tf.MixedPrecisionPolicy
    old = importlib.import_module("torch.distributed._composable" + ".fsdp")
    return old.fully_shard, old.MixedPrecisionPolicy


def _fsdp1_kwargs(api: Any, wrap_policy_cls: Any, device: torch.device, offload: bool) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        auto_wrap_policy=wrap_policy_cls({Block}),
        mixed_precision=api.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        sharding_strategy=api.ShardingStrategy.FULL_SHARD,
        backward_prefetch=api.BackwardPrefetch.BACKWARD_PRE,
        limit_all_gathers=True,
        device_id=torch.cuda.current_device() if device.type == "cuda" else device,
    )
    if offload:
        kwargs["cpu_offload"] = api.CPUOffload(offload_params=True)
    return kwargs


def _wrap_fsdp(model: nn.Module, device: torch.device, offload: bool) -> nn.Module:
    import fsdp
    from fsdp.wrap import ModuleWrapPolicy

    return fsdp.FullyShardedDataParallel(model, **_fsdp1_kwargs(fsdp, ModuleWrapPolicy, device, offload))


def _wrap_torch_fsdp1(model: nn.Module, device: torch.device, offload: bool) -> nn.Module:
    tf = torch_fsdp()
    wrap_mod = importlib.import_module(tf.__name__ + ".wrap")
    return tf.FullyShardedDataParallel(model, **_fsdp1_kwargs(tf, wrap_mod.ModuleWrapPolicy, device, offload))


def _wrap_torch_fsdp2(model: GPT, device: torch.device) -> nn.Module:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    fully_shard, policy_cls = torch_fsdp2_api()
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = policy_cls(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def wrap(impl: str, model: GPT, device: torch.device, offload: bool = False) -> nn.Module:
    """``model`` wrapped by implementation ``impl`` (``offload``: with CPU offload of parameters,
    fsdp and torch_fsdp1 only)."""
    if impl == "fsdp":
        return _wrap_fsdp(model, device, offload)
    if impl == "torch_fsdp1":
        return _wrap_torch_fsdp1(model, device, offload)
    if offload:
        raise ValueError(f"CPU offload is measured for fsdp and torch_fsdp1 only, not {impl!r}")
    if impl == "torch_fsdp2":
        return _wrap_torch_fsdp2(model, device)
    if impl == "local":
        return model
    raise ValueError(f"unknown implementation {impl!r}")
