"""Train a few steps, save a flat-shard checkpoint, resume at another world size.

``python -m examples.sharded_checkpoint --save-ranks 2 --load-ranks 3 --dir /tmp/fsdp_ckpt``

Phase 1 runs ``--save-ranks`` local CPU ranks (gloo): a small model wrapped per block, a few
AdamW steps, then ``fsdp.checkpoint.save_sharded`` (every rank writes its own flat shards, no
gather; docs/checkpoints.md). Phase 2 runs ``--load-ranks`` ranks with another wrap policy (one
unit for the whole model), loads with ``fsdp.checkpoint.load_sharded`` and checks that the
parameters and the optimizer state equal the saved ones bit for bit (through FULL state dicts),
then trains on. It prints one line per phase and exits non-zero on a mismatch.

With ``--async-save``, phase 1 saves with ``fsdp.checkpoint.async_save_sharded`` instead: the
call returns once the shards are copied into host staging buffers, phase 1 trains one more step
while the checkpoint is written in the background, then waits for the write
(``future.result()``); phase 2 checks that it holds the state at the moment of the call.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import warnings
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

DIM = 32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, 2 * DIM)
        self.fc2 = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


def _model(per_block: bool) -> nn.Module:
    from fsdp import FullyShardedDataParallel as FSDP
    from fsdp.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(4)])
    return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}) if per_block else None)


def _step(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> float:
    x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(step * 100 + dist.get_rank()))
    loss = model(x).square().mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return float(loss)


def _full_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    from fsdp import FullyShardedDataParallel as FSDP, StateDictType

    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        return {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}


def _run(rank: int, world_size: int, phase: str, directory: str, steps: int, async_save: bool = False) -> None:
    from fsdp.checkpoint import async_save_sharded, load_sharded, save_sharded

    warnings.simplefilter("ignore")  # DCP's notes about re-saving into a folder
    dist.init_process_group("gloo", init_method=f"file://{directory}/rendezvous_{phase}", rank=rank, world_size=world_size)
    checkpoint = os.path.join(directory, "checkpoint")
    try:
        if phase == "save":
            model = _model(per_block=True)
            optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
            for step in range(steps):
                loss = _step(model, optim, step)
            state = _full_state(model, optim)
            if async_save:
                future = async_save_sharded(model, optim, checkpoint_id=checkpoint)  # returns once staged
                _step(model, optim, steps)  # training goes on while the checkpoint is written
                future.result()  # wait for the write (before exiting, or before the next save)
            else:
                save_sharded(model, optim, checkpoint_id=checkpoint)
            if rank == 0:
                torch.save(state, os.path.join(directory, "expected.pt"))
                how = "async-saved (one more step trained during the write)" if async_save else "saved"
                print(f"{how} after {steps} steps at {world_size} ranks (loss {loss:.4f})")
        else:
            model = _model(per_block=False)
            optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
            _step(model, optim, 0)  # the optimizer state DCP loads into
            load_sharded(model, optim, checkpoint_id=checkpoint)
            loaded = _full_state(model, optim)
            expected = torch.load(os.path.join(directory, "expected.pt"), weights_only=False)
            same = all(torch.equal(loaded["model"][k], v) for k, v in expected["model"].items()) and all(
                torch.equal(loaded["optim"]["state"][fqn][name], value)
                for fqn, entry in expected["optim"]["state"].items()
                for name, value in entry.items()
            )
            if not same:
                raise RuntimeError("the loaded state differs from the saved one")
            loss = _step(model, optim, steps)
            if rank == 0:
                print(f"resumed at {world_size} ranks, state bit-exact; next step's loss {loss:.4f}")
    finally:
        dist.destroy_process_group()


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="examples.sharded_checkpoint", description=__doc__.split("\n")[0])
    parser.add_argument("--save-ranks", type=int, default=2)
    parser.add_argument("--load-ranks", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dir", default=None, help="checkpoint folder (default: a temporary one)")
    parser.add_argument("--async-save", action="store_true", help="save with async_save_sharded, training during the write")
    a = parser.parse_args(argv)
    directory = a.dir or tempfile.mkdtemp(prefix="fsdp_ckpt_")
    os.makedirs(directory, exist_ok=True)
    mp.spawn(_run, args=(a.save_ranks, "save", directory, a.steps, a.async_save), nprocs=a.save_ranks)
    mp.spawn(_run, args=(a.load_ranks, "load", directory, a.steps), nprocs=a.load_ranks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
