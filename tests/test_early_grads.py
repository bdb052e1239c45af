"""Per-parameter gradients taken as autograd computes them ([Note: Early per-parameter
gradients]): training results equal, bit for bit, those of the path that collects the
gradients at the end of each unit's backward, in the cases that stress the hooks (tied weights,
an unused parameter, a unit run twice in one forward, ``no_sync`` accumulation, use_orig_params,
both sharding strategies)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests._harness import RankPool


class _TwiceToy(nn.Module):
    """ToyLM whose first block runs twice per forward (one FSDP unit used twice)."""

    def __init__(self) -> None:
        super().__init__()
        from tests._models import make_toy

        self.toy = make_toy(unused=True)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.toy.embed(tokens)
        x = self.toy.blocks[0](x)
        x = self.toy.blocks[0](x)
        for i in range(1, self.toy.n_blocks):
            x = self.toy.blocks[i](x)
        return self.toy.head(x)


class _Reuse(nn.Module):
    """One weight used twice per call."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(torch.tanh(self.lin(x))))


class _ReuseTwiceToy(_TwiceToy):
    """A unit whose weight has two users per call, called twice per forward: the order in
    which its gradient contributions are summed (within each call first, then the calls) must be
    the collecting path's (and torch FSDP1's), not their arrival order."""

    def __init__(self) -> None:
        super().__init__()
        self.reuse = _Reuse(self.toy.embed.embedding_dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.reuse(self.reuse(self.toy.embed(tokens)))
        for i in range(self.toy.n_blocks):
            x = self.toy.blocks[i](x)
        return self.toy.head(x)


def _train(model_kind: str, strategy: str, orig: bool, accumulate_no_sync: bool) -> dict[str, torch.Tensor]:
    from fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
    from fsdp.wrap import ModuleWrapPolicy
    from tests._models import Block, global_batch, lm_loss, local_rows, make_toy

    rank, ws = dist.get_rank(), dist.get_world_size()
    if model_kind == "reuse_twice":
        module: nn.Module = _ReuseTwiceToy()
    elif model_kind == "twice":
        module = _TwiceToy()
    else:
        module = make_toy(tie=model_kind == "tied", unused=True)
    model = FSDP(
        module,
        auto_wrap_policy=ModuleWrapPolicy({Block, _Reuse}),
        sharding_strategy=ShardingStrategy[strategy],
        use_orig_params=orig,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(3):
        tokens, targets = global_batch(step, ws)
        if accumulate_no_sync and step == 0:
            # This step's synchronized backward reduces the held gradient (the collecting
            # path); the later steps take the early path again.
            with model.no_sync():
                lm_loss(model(local_rows(tokens, rank, ws)), local_rows(targets, rank, ws)).backward()
        elif accumulate_no_sync:  # plain accumulation: two synchronized backwards
            lm_loss(model(local_rows(tokens, rank, ws)), local_rows(targets, rank, ws)).backward()
        lm_loss(model(local_rows(tokens, rank, ws)), local_rows(targets, rank, ws)).backward()
        opt.step()
        opt.zero_grad()
    with FSDP.summon_full_params(model, writeback=False):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def early_equals_late(model_kind: str, strategy: str, orig: bool, accumulate_no_sync: bool) -> None:
    import fsdp.flat_param.flat_param as flat_param_mod
    import fsdp.runtime._early_grads as runtime_early

    taken = {"calls": 0}
    original_take = runtime_early.take_param_grad
    original_allowed = flat_param_mod.takes_early_grads_at_forward

    def counting_take(*args: Any) -> None:
        taken["calls"] += 1
        original_take(*args)

    results = {}
    runtime_early.take_param_grad = counting_take  # type: ignore[assignment]
    try:
        for early in (True, False):
            flat_param_mod.takes_early_grads_at_forward = original_allowed if early else (lambda handle: False)  # type: ignore[assignment]
            before = taken["calls"]
            results[early] = _train(model_kind, strategy, orig, accumulate_no_sync)
            # The early path ran where it applies (two gloo ranks) and only there.
            assert (taken["calls"] > before) == (early and dist.get_world_size() == 2), (early, taken)
    finally:
        runtime_early.take_param_grad = original_take  # type: ignore[assignment]
        flat_param_mod.takes_early_grads_at_forward = original_allowed  # type: ignore[assignment]
    assert results[True].keys() == results[False].keys()
    for name, value in results[True].items():
        # Same operations on the same values (a + b for a parameter used twice, then the same
        # b + a / 2 reduction): exact equality.
        assert torch.equal(value, results[False][name]), name


@pytest.mark.parametrize(
    "model_kind,strategy,orig,accumulate_no_sync",
    [
        ("tied", "FULL_SHARD", False, False),
        ("twice", "FULL_SHARD", False, True),
        ("twice", "SHARD_GRAD_OP", True, False),
        ("reuse_twice", "FULL_SHARD", False, False),
        ("plain", "FULL_SHARD", True, True),
    ],
)
def test_early_gradients_equal_collected(
    pool2: RankPool, model_kind: str, strategy: str, orig: bool, accumulate_no_sync: bool
) -> None:
    pool2.run(early_equals_late, model_kind, strategy, orig, accumulate_no_sync)


def early_gradients_leave_views_node_nothing() -> None:
    """The hooks take every gradient before the views node runs: that node gets only None,
    and each unit's gradients are kept one parameter at a time (none held by autograd)."""
    import fsdp.flat_param.flat_param as flat_param_mod
    from fsdp import FullyShardedDataParallel as FSDP
    from fsdp.flat_param._early_grads import settle_open_run
    from fsdp.wrap import ModuleWrapPolicy
    from tests._models import Block, global_batch, lm_loss, local_rows, make_toy

    rank, ws = dist.get_rank(), dist.get_world_size()
    seen: list[tuple[bool, int]] = []  # (all grads None at the views node, kept gradients)
    original_backward = flat_param_mod._UnflattenParams.backward

    def recording_backward(ctx: Any, *grads: Any) -> Any:
        handle = ctx.handle_ref()
        settle_open_run(handle)  # what the views node's backward does first
        kept = sum(g is not None for g in handle._param_grads) if handle._param_grads else 0
        seen.append((all(g is None for g in grads), kept))
        return original_backward(ctx, *grads)

    flat_param_mod._UnflattenParams.backward = staticmethod(recording_backward)  # type: ignore[method-assign]
    try:
        model = FSDP(make_toy(), auto_wrap_policy=ModuleWrapPolicy({Block}))
        tokens, targets = global_batch(0, ws)
        lm_loss(model(local_rows(tokens, rank, ws)), local_rows(targets, rank, ws)).backward()
    finally:
        flat_param_mod._UnflattenParams.backward = staticmethod(original_backward)  # type: ignore[method-assign]
    # Root unit (embedding, head) and the 3 blocks (6 parameters each).
    assert len(seen) == 4, seen
    assert all(all_none for all_none, _ in seen), seen
    assert sorted(kept for _, kept in seen) == [2, 6, 6, 6], seen


def test_early_gradients_leave_views_node_nothing(pool2: RankPool) -> None:
    pool2.run(early_gradients_leave_views_node_nothing)
