"""Train a tiny language model with Hugging Face accelerate's FSDP1 plugin, save and resume.

A plain accelerate script: nothing in it names the ``fsdp`` package. It runs on torch's FSDP1
as is, and on ``fsdp`` unchanged when ``fsdp.redirect_torch_fsdp()`` runs before it, for example
through the runner ``python -m fsdp.torch_alias`` (see docs/stacks.md)::

    # torch's FSDP1 (2 CPU ranks)
    accelerate launch --multi_gpu --num_processes 2 docs/examples/stacks/accelerate_fsdp1.py --cpu --out /tmp/acc
    # fsdp, the same script
    accelerate launch --multi_gpu --num_processes 2 -m fsdp.torch_alias docs/examples/stacks/accelerate_fsdp1.py --cpu --out /tmp/acc

``--multi_gpu`` picks accelerate's torchrun launcher, which starts the ``--num_processes``
processes; the script's own ``--cpu`` then runs them on CPU ranks (gloo). Not ``accelerate launch
--cpu``: that picks accelerate's single-process launcher, whatever ``--num_processes`` says.
``torchrun --nproc_per_node 2`` works as well. What it does, with the FSDP1 plugin
(transformer auto-wrap policy, FULL_SHARD, activation checkpointing):

1. trains ``--steps`` steps and saves the training state with ``save_state`` twice, as a
   SHARDED_STATE_DICT checkpoint and as a FULL_STATE_DICT checkpoint;
2. trains ``--steps`` more steps;
3. for each checkpoint: ``load_state`` and trains the same ``--steps`` steps again, which must
   give the same losses as step 2 (a resumed run continues exactly); ``--resume-from`` does the
   same from another run's sharded checkpoint (e.g. torch's FSDP1's, loaded by fsdp);
4. writes the losses, the number of processes and a digest of the full model state dict to
   ``--out``/result.json (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Dict, List

import torch
import torch.nn.functional as F
from accelerate import Accelerator, FullyShardedDataParallelPlugin, PartialState
from accelerate.utils import DistributedType, set_seed
from torch import nn
from torch.distributed.fsdp import FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.utils.data import DataLoader, TensorDataset

VOCAB = 64
SEQ = 16
D_MODEL = 32


class Block(nn.Module):
    """A pre-norm transformer block (the auto-wrap unit)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(D_MODEL)
        self.attn = nn.MultiheadAttention(D_MODEL, 4, batch_first=True)
        self.norm2 = nn.LayerNorm(D_MODEL)
        self.mlp = nn.Sequential(nn.Linear(D_MODEL, 4 * D_MODEL), nn.GELU(), nn.Linear(4 * D_MODEL, D_MODEL))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), diagonal=1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """Embedding, two blocks, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def make_batches(accelerator: Accelerator, steps: int) -> List[torch.Tensor]:
    """The per-rank batches of ``steps`` steps, from a prepared (rank-sharded) DataLoader."""
    generator = torch.Generator().manual_seed(1234)
    data = torch.randint(0, VOCAB, (steps * 4 * accelerator.num_processes, SEQ + 1), generator=generator)
    loader = accelerator.prepare(DataLoader(TensorDataset(data), batch_size=4, shuffle=False))
    return [batch[0] for batch in loader]


def train(
    accelerator: Accelerator, model: nn.Module, optimizer: torch.optim.Optimizer, batches: List[torch.Tensor]
) -> List[float]:
    """Trains on ``batches``; returns the loss averaged over ranks at every step."""
    losses = []
    model.train()
    for batch in batches:
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        optimizer.zero_grad()
        accelerator.backward(loss)
        optimizer.step()
        losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())
    return losses


def state_digest(accelerator: Accelerator, model: nn.Module) -> Dict[str, List[float]]:
    """Per-tensor (sum, sum of squares) of the full model state dict (rank 0; others: {}).

    Through the FSDP API rather than ``accelerator.get_state_dict``, which asks for
    ``offload_to_cpu=True``, a setting torch's FSDP1 fails on CPU ranks.
    """
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True)):
        full = model.state_dict()
    if not accelerator.is_main_process:
        return {}
    return {k: [v.double().sum().item(), v.double().square().sum().item()] for k, v in sorted(full.items())}


def use_state_dict_type(plugin: FullyShardedDataParallelPlugin, kind: str) -> None:
    """Switches the plugin's state dict type, with that type's default configs."""
    plugin.state_dict_config = None  # set_state_dict_type keeps configs already set
    plugin.optim_state_dict_config = None
    plugin.set_state_dict_type(kind)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for the checkpoints and result.json")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cpu", action="store_true", help="run accelerate's FSDP path on CPU ranks (gloo)")
    parser.add_argument(
        "--state-dict-types",
        nargs="+",
        default=["SHARDED_STATE_DICT", "FULL_STATE_DICT"],
        choices=["SHARDED_STATE_DICT", "FULL_STATE_DICT"],
        help="the checkpoints to save and resume from (torch's FSDP1 fails FULL_STATE_DICT on CPU "
        "ranks: accelerate asks for offload_to_cpu, which torch's FSDP1 supports on GPUs only)",
    )
    parser.add_argument(
        "--resume-from",
        default=None,
        help="also resume from this SHARDED_STATE_DICT checkpoint (one another run of this script "
        "saved, e.g. on torch's FSDP1) and train the second part again",
    )
    args = parser.parse_args()

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=1,
        sharding_strategy="FULL_SHARD",
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["Block"],
        state_dict_type="SHARDED_STATE_DICT",
        activation_checkpointing=True,
        use_orig_params=False,
        sync_module_states=False,
        cpu_ram_efficient_loading=False,
    )
    accelerator = Accelerator(cpu=args.cpu, fsdp_plugin=plugin)
    if args.cpu:
        # accelerate takes its FSDP path only on accelerators (on CPU it picks MULTI_CPU, plain
        # DDP); this switches its state to FSDP so that the same path runs on CPU ranks. Its
        # CPU device is "cpu:0", which torch's FSDP1 rejects as device_id ("Inconsistent compute
        # device and `device_id`: cpu vs cpu:0"), so the device is plain "cpu".
        # (PartialState too: every AcceleratorState() copies its fields back from it.)
        for state in (PartialState(), accelerator.state):
            state.distributed_type = DistributedType.FSDP
            state.device = torch.device("cpu")
        accelerator.state.fsdp_plugin = plugin
    set_seed(0)
    model = TinyLM()
    # accelerate needs the model prepared before the optimizer is built on its parameters.
    model = accelerator.prepare(model)
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    batches = make_batches(accelerator, 2 * args.steps)
    first, second = batches[: args.steps], batches[args.steps :]

    result: Dict[str, Any] = {
        "backend": type(model).__module__,
        "num_processes": accelerator.num_processes,
        "losses": train(accelerator, model, optimizer, first),
    }
    checkpoints = {}
    for kind in args.state_dict_types:
        use_state_dict_type(plugin, kind)
        checkpoints[kind] = os.path.join(args.out, kind.lower())
        accelerator.save_state(checkpoints[kind])
    result["continued"] = train(accelerator, model, optimizer, second)
    result["digest"] = state_digest(accelerator, model)
    if "FULL_STATE_DICT" in args.state_dict_types:  # the same, through accelerate's own call
        full = accelerator.get_state_dict(model)
        result["digest_get_state_dict"] = {
            k: [v.double().sum().item(), v.double().square().sum().item()] for k, v in sorted(full.items())
        }
    for kind, path in checkpoints.items():
        use_state_dict_type(plugin, kind)
        accelerator.load_state(path)
        result[f"resumed_{kind}"] = train(accelerator, model, optimizer, second)
        result[f"digest_{kind}"] = state_digest(accelerator, model)
    if args.resume_from:
        use_state_dict_type(plugin, "SHARDED_STATE_DICT")
        accelerator.load_state(args.resume_from)
        result["resumed_from_other"] = train(accelerator, model, optimizer, second)
    if accelerator.is_main_process:
        with open(os.path.join(args.out, "result.json"), "w", encoding="utf-8") as f:
            json.dump(result, f)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
