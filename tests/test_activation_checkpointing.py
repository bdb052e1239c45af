"""Activation checkpointing with fsdp: a checkpointed submodule inside a unit, a checkpoint
wrapper inside each unit (apply_activation_checkpointing on the blocks) and a checkpoint wrapper
around each unit. Same results as torch FSDP1 and single-process training; each unit is gathered
once for its backward (serving the recomputation too) and freed right after.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from tests._comm_count import count_collectives
from tests._harness import RankPool
from tests._models import DIM, Block, global_batch, lm_loss, local_rows, make_toy
from tests.test_parity import _full_params


class CheckpointedBlock(Block):
    """A Block whose MLP is recomputed in backward (non-reentrant checkpoint inside the unit)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def mlp(h: torch.Tensor) -> torch.Tensor:
            return self.fc2(torch.tanh(self.fc1(self.norm(h))))

        return x + checkpoint(mlp, x, use_reentrant=False)


class ScaledCheckpointedBlock(Block):
    """A Block with an RMSNorm and a learned elementwise gain, its whole body recomputed in
    backward (``reentrant``: torch's reentrant checkpoint). Ops whose saved tensors depend on
    whether their inputs are recorded by autograd (``rms_norm``, ``x * weight``) recompute the
    same saves only if backward reads the parameters through the same recorded views as forward
    ([Note: Backward reads forward's views] in fsdp/flat_param/_views.py)."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(DIM)  # type: ignore[assignment]
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, DIM))
        self.reentrant = reentrant

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gain * self.fc2(torch.tanh(self.fc1(self.norm(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self._body, x, use_reentrant=self.reentrant)


def _toy(mode: str) -> nn.Module:
    model = make_toy()
    if mode.startswith("scaled"):
        torch.manual_seed(1)
        for i in range(model.n_blocks):
            model.blocks[i] = ScaledCheckpointedBlock(reentrant=mode == "scaled_reentrant")
    if mode == "inside":
        for i in range(model.n_blocks):
            block = CheckpointedBlock()
            block.load_state_dict(model.blocks[i].state_dict())
            model.blocks[i] = block
    return model


def _apply_ac(model: nn.Module, mode: str, fsdp_cls: type) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    if mode == "wrap_blocks":  # checkpoint inside each unit, around its Block
        apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: isinstance(m, Block))
    elif mode == "wrap_units":  # checkpoint around each nested unit
        root = model
        apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: isinstance(m, fsdp_cls) and m is not root)


def run(mode: str, strategy: str) -> list[int]:
    from fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
    from fsdp.wrap import ModuleWrapPolicy
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import ShardingStrategy as TS
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TP

    rank, ws = dist.get_rank(), dist.get_world_size()
    classes = {Block, CheckpointedBlock, ScaledCheckpointedBlock}
    ref = _toy(mode)
    ours = FSDP(_toy(mode), auto_wrap_policy=ModuleWrapPolicy(classes), sharding_strategy=ShardingStrategy[strategy])
    theirs = TorchFSDP(_toy(mode), auto_wrap_policy=TP(classes), sharding_strategy=TS[strategy], device_id=torch.device("cpu"))
    _apply_ac(ours, mode, FSDP)
    _apply_ac(theirs, mode, TorchFSDP)
    units = [u for u in FSDP.fsdp_modules(ours)]
    models = [ref, ours, theirs]
    opts = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in models]
    gathers = []
    for step in range(3):
        tokens, targets = global_batch(step, ws)
        for i, (model, opt) in enumerate(zip(models, opts)):
            x, y = (tokens, targets) if i == 0 else (local_rows(tokens, rank, ws), local_rows(targets, rank, ws))
            with count_collectives() as counts:
                lm_loss(model(x), y).backward()
            if i == 1 and step > 0:  # the first iteration also runs the execution-order check
                gathers.append(counts.calls.get("all_gather", 0))
                if strategy != "NO_SHARD":
                    handles = [u._fsdp_state.handle for u in units if u._fsdp_state.handle]
                    assert all(h.storage.unsharded_storage_nbytes() == 0 for h in handles)
            opt.step()
            opt.zero_grad()
    mine, torch_full, ref_full = _full_params(ours, FSDP), _full_params(theirs, TorchFSDP), dict(ref.named_parameters())
    assert list(mine) == list(torch_full)
    for name in mine:
        assert torch.equal(mine[name], torch_full[name]), name
        plain = name.replace("_checkpoint_wrapped_module.", "")  # the reference is not wrapped
        torch.testing.assert_close(mine[name], ref_full[plain].detach(), rtol=5e-5, atol=5e-6, msg=name)
    return gathers


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
@pytest.mark.parametrize("mode", ["inside", "wrap_blocks", "wrap_units", "scaled", "scaled_reentrant"])
def test_activation_checkpointing(pool2: RankPool, mode: str, strategy: str) -> None:
    gathers = pool2.run(run, mode, strategy)[0]
    units = 4  # root + 3 blocks
    # FULL_SHARD: the blocks twice but the last once (kept gathered into its backward, which
    # comes right after the root's: [Note: The first backward unit stays gathered]), the root once.
    expected = {"FULL_SHARD": 2 * (units - 1) + 1 - 1, "SHARD_GRAD_OP": units, "NO_SHARD": 0}[strategy]
    assert gathers == [expected] * 2  # recomputation gathers nothing extra
