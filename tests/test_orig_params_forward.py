"""use_orig_params=True inside forward: named_parameters() from a forward hook lists the
parameters (unsharded views) as torch FSDP1 does; a parameter replaced between forward and
backward raises RuntimeError naming it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests._harness import RankPool
from tests._models import global_batch, lm_loss, local_rows, make_toy
from tests.test_orig_params_torch_attrs import _wrap


def named_in_forward(strategy: str) -> None:
    rank, ws = dist.get_rank(), dist.get_world_size()
    seen: dict[str, list[tuple[str, torch.Tensor]]] = {}
    models = {lib: _wrap(lib, make_toy(), strategy, True) for lib in ["ours", "torch"]}
    for lib, model in models.items():
        block = model.module.blocks[0].module  # the Block itself: runs while unsharded

        def hook(mod: nn.Module, inp: object, out: object, lib: str = lib) -> None:
            seen[lib] = [(n, p.detach().clone()) for n, p in mod.named_parameters()]

        block.register_forward_hook(hook)
        tokens, targets = global_batch(0, ws)
        lm_loss(model(local_rows(tokens, rank, ws)), local_rows(targets, rank, ws)).backward()
    assert [n for n, _ in seen["ours"]] == [n for n, _ in seen["torch"]]
    assert len(seen["ours"]) == 6
    for (name, mine), (_, theirs) in zip(seen["ours"], seen["torch"]):
        # Unsharded inside forward (NO_SHARD/1 rank: the whole parameter anyway): the same values.
        assert mine.shape == theirs.shape and torch.equal(mine, theirs), name
    # After backward the original Parameters are back.
    ours = models["ours"]
    assert all(isinstance(p, nn.Parameter) for p in ours.parameters())
    assert len(list(ours.parameters())) == len(list(models["torch"].parameters()))


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
@pytest.mark.parametrize("dist_pool", [1, 2, 4], indirect=True)
def test_named_parameters_inside_forward(dist_pool: RankPool, strategy: str) -> None:
    dist_pool.run(named_in_forward, strategy)


def replaced_between_forward_and_backward(strategy: str) -> None:
    rank, ws = dist.get_rank(), dist.get_world_size()
    model = _wrap("ours", make_toy(), strategy, True)
    tokens, targets = global_batch(0, ws)
    loss = lm_loss(model(local_rows(tokens, rank, ws)), local_rows(targets, rank, ws))
    model.module.blocks[0].module.fc1.weight = nn.Parameter(torch.zeros(11, 7))
    # torch FSDP1 raises RuntimeError here too (an autograd error about views; with more than
    # one rank it then hangs). Every rank replaced it: every rank raises, before any collective.
    with pytest.raises(RuntimeError, match=r"'fc1\.weight'.*replaced by a new nn\.Parameter between forward and backward.*before forward"):
        loss.backward()


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
@pytest.mark.parametrize("dist_pool", [1, 2], indirect=True)
def test_parameter_replaced_between_forward_and_backward(dist_pool: RankPool, strategy: str) -> None:
    dist_pool.run(replaced_between_forward_and_backward, strategy)
