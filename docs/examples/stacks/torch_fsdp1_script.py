"""A training script in the style of pytorch/examples ``distributed/FSDP``, written for torch's FSDP1.

It imports everything from ``torch.distributed.fsdp`` and nothing from ``fsdp``: it is the kind
of script users already have. It runs on torch's FSDP1 as is, and on ``fsdp`` unchanged through
the runner::

    torchrun --nproc_per_node 2 docs/examples/stacks/torch_fsdp1_script.py --out /tmp/t5
    torchrun --nproc_per_node 2 -m fsdp.torch_alias docs/examples/stacks/torch_fsdp1_script.py --out /tmp/t5

What it does, as pytorch/examples' T5 script does (with a small GPT-like model defined here):
``transformer_auto_wrap_policy`` through ``functools.partial``, bf16 ``MixedPrecision``,
non-reentrant activation checkpointing on the blocks (``apply_activation_checkpointing``),
AdamW with a ``StepLR`` schedule; then

* a FULL_STATE_DICT checkpoint (``FullStateDictConfig(offload_to_cpu=True, rank0_only=True)``
  and ``FSDP.optim_state_dict``), saved by rank 0 with ``torch.save``;
* a SHARDED_STATE_DICT checkpoint of model and optimizer through
  ``torch.distributed.checkpoint`` (``dcp.save``);
* more training, then each checkpoint loaded back (``dcp.load`` / ``load_state_dict`` and
  ``FSDP.optim_state_dict_to_load``) and the same steps trained again; with ``--resume-from``,
  also another run's two checkpoints (e.g. torch's FSDP1's, loaded by fsdp).

Rank 0 writes the losses to ``--out``/result.json and the full checkpoint to
``--out``/full_checkpoint.pt.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
from typing import Any, Dict, List

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.fsdp import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

VOCAB = 64
SEQ = 16
D_MODEL = 32
BATCH = 4


class Block(nn.Module):
    """A pre-norm decoder block: causal self-attention and an MLP (the FSDP unit)."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(D_MODEL)
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL)
        self.proj = nn.Linear(D_MODEL, D_MODEL)
        self.ln2 = nn.LayerNorm(D_MODEL)
        self.fc = nn.Linear(D_MODEL, 4 * D_MODEL)
        self.out = nn.Linear(4 * D_MODEL, D_MODEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, 4, c // 4).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class SmallGPT(nn.Module):
    """Token and position embeddings, three blocks, a final norm and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Embedding(SEQ, D_MODEL)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.ln = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def batch_for(step: int, rank: int) -> torch.Tensor:
    """This rank's batch at ``step`` (the same on every run)."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    steps: range,
) -> List[float]:
    """Trains ``steps``; returns the loss averaged over ranks at each step."""
    losses = []
    model.train()
    for step in steps:
        batch = batch_for(step, dist.get_rank())
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        reduced = loss.detach().clone()
        dist.all_reduce(reduced)
        losses.append(reduced.item() / dist.get_world_size())
    return losses


def build(args: argparse.Namespace) -> Any:
    """The wrapped model, its optimizer and schedule (the same initial weights on every rank)."""
    torch.manual_seed(0)
    model = SmallGPT()
    auto_wrap_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
    model = FSDP(
        model,
        auto_wrap_policy=auto_wrap_policy,
        mixed_precision=bf16,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=torch.device("cpu"),  # torch.cuda.current_device() on GPUs
    )
    non_reentrant = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=non_reentrant, check_fn=lambda module: isinstance(module, Block)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    return model, optimizer, scheduler


def save_full(model: FSDP, optimizer: torch.optim.Optimizer, path: str, offload_to_cpu: bool) -> None:
    """Rank 0 saves the full model and optimizer state dicts (pytorch/examples' save)."""
    config = FullStateDictConfig(offload_to_cpu=offload_to_cpu, rank0_only=True)
    optim_config = FullOptimStateDictConfig(offload_to_cpu=offload_to_cpu, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config, optim_config):
        model_state = model.state_dict()
        optim_state = FSDP.optim_state_dict(model, optimizer)
    if dist.get_rank() == 0:
        torch.save({"model": model_state, "optim": optim_state}, path)
    dist.barrier()


def load_full(model: FSDP, optimizer: torch.optim.Optimizer, path: str) -> None:
    """Every rank loads the full checkpoint that rank 0 saved."""
    checkpoint = torch.load(path, weights_only=False)
    config = FullStateDictConfig(rank0_only=False)
    optim_config = FullOptimStateDictConfig(rank0_only=False)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config, optim_config):
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(FSDP.optim_state_dict_to_load(model, optimizer, checkpoint["optim"]))


def save_sharded(model: FSDP, optimizer: torch.optim.Optimizer, path: str) -> None:
    """Model and optimizer shards through torch.distributed.checkpoint."""
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optimizer)}
        dcp.save(state, checkpoint_id=path)


def load_sharded(model: FSDP, optimizer: torch.optim.Optimizer, path: str) -> None:
    """Loads what :func:`save_sharded` saved (at any world size)."""
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optimizer)}
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(FSDP.optim_state_dict_to_load(model, optimizer, state["optim"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for the checkpoints and result.json")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument(
        "--no-offload-to-cpu",
        action="store_true",
        help="save the full checkpoint with offload_to_cpu=False (torch's FSDP1 supports "
        "offload_to_cpu=True on GPUs only)",
    )
    parser.add_argument(
        "--resume-from",
        default=None,
        help="another run's --out folder: also resume from its two checkpoints (e.g. ones torch's "
        "FSDP1 saved) and train the second part again",
    )
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)  # every rank: each writes into it (the sharded checkpoint)
    dist.init_process_group("gloo")  # "nccl" on GPUs; torchrun sets the rendezvous variables
    model, optimizer, scheduler = build(args)

    first, second = range(args.steps), range(args.steps, 2 * args.steps)
    result: Dict[str, Any] = {"backend": type(model).__module__, "losses": train(model, optimizer, scheduler, first)}
    full_path = os.path.join(args.out, "full_checkpoint.pt")
    sharded_path = os.path.join(args.out, "sharded_checkpoint")
    save_full(model, optimizer, full_path, offload_to_cpu=not args.no_offload_to_cpu)
    save_sharded(model, optimizer, sharded_path)
    scheduler_state = scheduler.state_dict()
    result["continued"] = train(model, optimizer, scheduler, second)

    folders = {"": args.out} if args.resume_from is None else {"": args.out, "other_": args.resume_from}
    for prefix, folder in folders.items():
        for kind, load in (("sharded", load_sharded), ("full", load_full)):
            name = "sharded_checkpoint" if kind == "sharded" else "full_checkpoint.pt"
            load(model, optimizer, os.path.join(folder, name))
            scheduler.load_state_dict(scheduler_state)
            result[f"resumed_{prefix}{kind}"] = train(model, optimizer, scheduler, second)
    if dist.get_rank() == 0:
        with open(os.path.join(args.out, "result.json"), "w", encoding="utf-8") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
