"""Faults that must surface as one clear error on every rank, within seconds, instead of a hang, an
abort or another rank's IndexError ([Note: Execution order check], [Note: Layout agreement])."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests._harness import RankPool
from tests._models import Block, global_batch, lm_loss, local_rows, make_toy


def _wrapped(model: nn.Module) -> nn.Module:
    from fsdp import FullyShardedDataParallel as FSDP
    from fsdp.wrap import ModuleWrapPolicy

    return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}))


def _step(model: nn.Module) -> None:
    rank, ws = dist.get_rank(), dist.get_world_size()
    tokens, targets = global_batch(0, ws)
    lm_loss(model(local_rows(tokens, rank, ws)), local_rows(targets, rank, ws)).backward()


def _group_in_step() -> None:
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == dist.get_world_size()


def different_models() -> list[str]:
    """Each scenario: every rank raises the same message, naming each rank's unit; the group
    stays usable afterwards."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    messages = []

    def padded(hidden: int) -> int:  # a block unit's flat size, padded to divide by the world size
        numel = sum(p.numel() for p in Block(hidden=hidden).parameters())
        return -(-numel // ws) * ws

    scenarios = [
        # rank 0 two blocks, rank 1 three (different unit counts: torch gives rank 0 an IndexError)
        (
            lambda: make_toy(n_blocks=2 + rank),
            r"ranks wrapped different models: FSDP unit #3 \(pre-order\) differs: rank 0: <no such "
            rf"unit> \(3 units\); rank 1: 'blocks.2' \[torch.float32 x {padded(11)}\] \(4 units\)",
        ),
        # same number of units, one rank's second block wider (gloo aborts the process on the size mismatch)
        (
            lambda: _widened(make_toy(n_blocks=3), index=1, hidden=11 + 2 * rank),
            rf"FSDP unit #2 \(pre-order\) differs: rank 0: 'blocks.1' \[torch.float32 x {padded(11)}\] \(4 units\); "
            rf"rank 1: 'blocks.1' \[torch.float32 x {padded(13)}\] \(4 units\)",
        ),
    ]
    for build, pattern in scenarios:
        model = _wrapped(build())
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=pattern) as caught:
            _step(model)
        assert time.monotonic() - start < 10
        messages.append(str(caught.value))
        _group_in_step()
    # The same models on every rank pass the check and train.
    _step(_wrapped(make_toy(n_blocks=3)))
    _group_in_step()
    return messages


def _widened(model: nn.Module, index: int, hidden: int) -> nn.Module:
    model.blocks[index] = Block(hidden=hidden)
    return model


def test_ranks_with_different_models_get_the_same_clear_error(pool2: RankPool) -> None:
    per_rank = pool2.run(different_models, _timeout=60)
    assert per_rank[0] == per_rank[1]  # word for word on every rank


def optimizer_before_wrapping() -> None:
    from fsdp import FullyShardedDataParallel as FSDP
    from fsdp.wrap import ModuleWrapPolicy

    # Without use_orig_params the optimizer holds replaced parameters: a clear error at step(),
    # before any state changes.
    model = make_toy(n_blocks=2)
    early = torch.optim.AdamW(model.parameters(), lr=0.1)
    wrapped = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}))
    _step(wrapped)
    with pytest.raises(RuntimeError, match=r"AdamW.step\(\) would train nothing: the optimizer holds the "
                       r"parameter 'embed.weight' \(shape \[13, 7\]\) of the wrapped module ToyLM.*"
                       r"Create the optimizer after wrapping"):
        early.step()
    assert not early.state  # nothing was stepped
    # Created after wrapping: trains (and the check does not fire again for it).
    late = torch.optim.AdamW(wrapped.parameters(), lr=0.1)
    before = [p.detach().clone() for p in wrapped.parameters()]
    late.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, wrapped.parameters()))
    # With use_orig_params=True the original parameters stay in use (as in torch FSDP1): no error,
    # and the early optimizer trains the model.
    model = make_toy(n_blocks=2)
    early = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True)
    before = {n: p.detach().clone() for n, p in wrapped.named_parameters() if p.numel()}
    _step(wrapped)
    early.step()
    after = dict(wrapped.named_parameters())
    assert all(not torch.equal(before[n], after[n]) for n in before)


def test_optimizer_created_before_wrapping_is_an_error(pool2: RankPool) -> None:
    pool2.run(optimizer_before_wrapping, _timeout=60)
