"""Train a tiny language model with Lightning's ``FSDPStrategy`` (Fabric and Trainer), save, resume.

A plain Lightning script: nothing in it names the ``fsdp`` package. It runs on torch's FSDP1 as
is, and on ``fsdp`` unchanged through the runner (see docs/stacks.md)::

    torchrun --nproc_per_node 2 docs/examples/stacks/lightning_fsdp.py --out /tmp/pl
    torchrun --nproc_per_node 2 -m fsdp.torch_alias docs/examples/stacks/lightning_fsdp.py --out /tmp/pl

(or ``python docs/examples/stacks/lightning_fsdp.py --out /tmp/pl``: Lightning then starts the
two CPU ranks itself). What it does:

* Fabric (``FSDPStrategy`` with an auto-wrap policy on the blocks, FULL_SHARD, flat parameters
  with ``use_orig_params=False``): trains
  ``--steps`` steps, saves with ``fabric.save`` as a sharded and as a full checkpoint, trains
  ``--steps`` more, then ``fabric.load``-s each checkpoint and trains those steps again;
* Trainer (Lightning's default ``use_orig_params=True``): fits one epoch of ``--steps`` batches and ``trainer.save_checkpoint``-s it (sharded
  and full); fits two epochs straight through with a new Trainer; then a new Trainer resumes
  from each checkpoint (``fit(ckpt_path=...)``) and fits the second epoch, which must repeat
  the straight run's second epoch.

Rank 0 writes every loss to ``--out``/result.json.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Dict, List

import lightning as L
import torch
import torch.nn.functional as F
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies import FSDPStrategy as FabricFSDPStrategy
from lightning.pytorch.strategies import FSDPStrategy as TrainerFSDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

VOCAB = 64
SEQ = 16
D_MODEL = 32
BATCH = 4
WORLD_SIZE = 2


class Block(nn.Module):
    """A pre-norm MLP block with a causal token mix (the FSDP unit)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D_MODEL)
        self.mix = nn.Linear(SEQ, SEQ)
        self.fc = nn.Linear(D_MODEL, 4 * D_MODEL)
        self.out = nn.Linear(4 * D_MODEL, D_MODEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        causal = torch.tril(torch.ones(SEQ, SEQ))
        h = self.norm(x)
        x = x + (self.mix.weight * causal) @ h + self.mix.bias[:, None]
        return x + self.out(F.gelu(self.fc(h)))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(D_MODEL, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))


def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))


def dataset(steps: int) -> TensorDataset:
    """``steps`` global batches (each rank gets every other sample through its sampler)."""
    generator = torch.Generator().manual_seed(99)
    return TensorDataset(torch.randint(0, VOCAB, (steps * BATCH * WORLD_SIZE, SEQ + 1), generator=generator))


# Lightning runs FSDP on GPUs only: it refuses an ``FSDPStrategy`` with a CPU accelerator, by an
# exact-type check. These subclasses (nothing changed) pass it, so the same strategy code runs on
# CPU ranks (gloo) here; on GPUs use FSDPStrategy itself with accelerator="gpu".


class CPUFabricFSDPStrategy(FabricFSDPStrategy):
    """Fabric's FSDPStrategy, allowed on CPU."""


class CPUTrainerFSDPStrategy(TrainerFSDPStrategy):
    """The Trainer's FSDPStrategy, allowed on CPU."""


# ------------------------------------------------------------------------------------------------
# Fabric
# ------------------------------------------------------------------------------------------------


def fabric_part(args: argparse.Namespace) -> Dict[str, Any]:
    if args.strategy == "fsdp":
        # Flat parameters here (Lightning's default is use_orig_params=True, which the Trainer
        # part below keeps): the optimizer then holds FSDP's flat parameters.
        strategy = CPUFabricFSDPStrategy(
            auto_wrap_policy={Block}, sharding_strategy="FULL_SHARD", state_dict_type="sharded", use_orig_params=False
        )
    else:
        strategy = DDPStrategy()
    fabric = L.Fabric(accelerator="cpu", devices=WORLD_SIZE, strategy=strategy, precision="32-true")
    fabric.launch()
    fabric.seed_everything(0)
    model = fabric.setup_module(TinyLM())
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-2))
    loader = fabric.setup_dataloaders(DataLoader(dataset(2 * args.steps), batch_size=BATCH, shuffle=False))
    batches = [batch[0] for batch in loader]
    first, second = batches[: args.steps], batches[args.steps :]

    def train(part: List[torch.Tensor]) -> List[float]:
        losses = []
        for batch in part:
            loss = lm_loss(model, batch)
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
            losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
        return losses

    result: Dict[str, Any] = {"backend": type(model._forward_module).__module__, "losses": train(first)}
    paths = {}
    for kind in args.state_dict_types:
        strategy._state_dict_type = kind  # FSDPStrategy's setting, switched to save both kinds
        paths[kind] = os.path.join(args.out, f"fabric_{kind}.ckpt")
        fabric.save(paths[kind], {"model": model, "optimizer": optimizer, "step": args.steps})
    result["continued"] = train(second)
    for kind, path in paths.items():
        state = {"model": model, "optimizer": optimizer, "step": 0}
        fabric.load(path, state)
        result[f"resumed_{kind}_step"] = state["step"]
        result[f"resumed_{kind}"] = train(second)
    return result


# ------------------------------------------------------------------------------------------------
# Trainer
# ------------------------------------------------------------------------------------------------


class LitLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = TinyLM()
        self.losses: List[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = lm_loss(self.model, batch[0])
        self.losses.append(self.trainer.strategy.reduce(loss.detach(), reduce_op="mean").item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.trainer.model.parameters(), lr=1e-2)


def trainer_for(epochs: int, state_dict_type: str, strategy_name: str) -> L.Trainer:
    if strategy_name == "fsdp":
        strategy: Any = CPUTrainerFSDPStrategy(
            auto_wrap_policy={Block}, sharding_strategy="FULL_SHARD", state_dict_type=state_dict_type
        )
    else:
        strategy = "ddp"
    return L.Trainer(
        accelerator="cpu",
        devices=WORLD_SIZE,
        strategy=strategy,
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )


def trainer_part(args: argparse.Namespace) -> Dict[str, Any]:
    loader = DataLoader(dataset(args.steps), batch_size=BATCH, shuffle=False)
    L.seed_everything(0)
    module = LitLM()
    trainer = trainer_for(1, "sharded", args.strategy)
    trainer.fit(module, loader)
    result: Dict[str, Any] = {"backend": type(trainer.strategy.model).__module__, "losses": list(module.losses)}
    paths = {}
    for kind in args.state_dict_types:
        trainer.strategy._state_dict_type = kind  # FSDPStrategy's setting, switched to save both kinds
        paths[kind] = os.path.join(args.out, f"trainer_{kind}.ckpt")
        trainer.save_checkpoint(paths[kind])
    # Two epochs straight through (a new Trainer and model: a Trainer is not fit twice with FSDP).
    L.seed_everything(0)
    straight = LitLM()
    trainer_for(2, "sharded", args.strategy).fit(straight, loader)
    result["straight"] = list(straight.losses)
    for kind, path in paths.items():
        # The same seed: Lightning's distributed sampler shuffles with it (PL_GLOBAL_SEED).
        L.seed_everything(0)
        resumed = LitLM()
        trainer_for(2, kind, args.strategy).fit(resumed, loader, ckpt_path=path)
        result[f"resumed_{kind}"] = list(resumed.losses)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for the checkpoints and result.json")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--strategy",
        default="fsdp",
        choices=["fsdp", "ddp"],
        help="ddp: the same training with Lightning's DDP (a reference: torch's FSDP1 cannot run "
        "Lightning's FSDPStrategy on CPU ranks)",
    )
    parser.add_argument("--parts", nargs="+", default=["fabric", "trainer"], choices=["fabric", "trainer"])
    parser.add_argument(
        "--state-dict-types", nargs="+", default=["sharded", "full"], choices=["sharded", "full"]
    )
    args = parser.parse_args()
    result = {}
    if "fabric" in args.parts:
        result["fabric"] = fabric_part(args)
    if "trainer" in args.parts:
        result["trainer"] = trainer_part(args)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(os.path.join(args.out, "result.json"), "w", encoding="utf-8") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
