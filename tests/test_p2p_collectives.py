"""The point-to-point all-gather and reduce-scatter on gloo ([Note: Point-to-point collectives
on gloo]): the same values as gloo's own collectives, bit for bit, in every dtype, also with
several collectives in flight at once and over subgroups."""

from __future__ import annotations

from typing import Optional

import pytest
import torch
import torch.distributed as dist

from fsdp._comm import _collectives as comm
from fsdp._comm._p2p import P2PWork
from tests._harness import RankPool

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _data(seed: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Mixed magnitudes, so the order of additions would show in the last bits.
    scale = 10.0 ** torch.randint(-4, 4, (numel,), generator=g).double()
    return (torch.randn(numel, generator=g, dtype=torch.float64) * scale).to(dtype)


def same_as_gloo(group_ranks: Optional[list[int]] = None) -> None:
    group = dist.new_group(group_ranks) if group_ranks else None
    if group_ranks and dist.get_rank() not in group_ranks:
        return
    rank, ws = dist.get_rank(group), dist.get_world_size(group)
    for dtype in DTYPES:
        for shard_numel in (1, 7, 1000):
            shard = _data(rank, shard_numel, dtype)
            mine = torch.empty(shard_numel * ws, dtype=dtype)
            assert comm.all_gather_flat(mine, shard, group) is None
            theirs = torch.empty_like(mine)
            dist.all_gather_into_tensor(theirs, shard, group=group)
            assert torch.equal(mine, theirs), (dtype, shard_numel)

            full = _data(100 + rank, shard_numel * ws, dtype)
            mine_sum = torch.empty(shard_numel, dtype=dtype)
            comm.reduce_scatter_flat(mine_sum, full.clone(), group)
            theirs_sum = torch.empty_like(mine_sum)
            dist.reduce_scatter_tensor(theirs_sum, full.clone(), group=group)
            assert torch.equal(mine_sum, theirs_sum), (dtype, shard_numel)


@pytest.mark.parametrize("dist_pool", [2, 3, 4], indirect=True)
def test_values_equal_gloo_collectives(dist_pool: RankPool) -> None:
    dist_pool.run(same_as_gloo)


def test_subgroup_of_two(pool4: RankPool) -> None:
    pool4.run(same_as_gloo, [1, 3])


def interleaved_in_flight() -> None:
    """Gathers and reductions launched together, completed in another order, pair up right."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    shards = [_data(10 * i + rank, 50 + i, torch.float32) for i in range(3)]
    fulls = [_data(20 * i + rank, (40 + i) * ws, torch.float32) for i in range(3)]
    gathered = [torch.empty(s.numel() * ws) for s in shards]
    reduced = [torch.empty(f.numel() // ws) for f in fulls]
    works = []
    for i in range(3):
        works.append(comm.all_gather_flat(gathered[i], shards[i], None, async_op=True))
        works.append(comm.reduce_scatter_flat(reduced[i], fulls[i].clone(), None, async_op=True))
    assert all(isinstance(w, P2PWork) for w in works[:2]) or ws != 2
    for work in reversed(works):
        work.wait()
    for i in range(3):
        expected = torch.empty_like(gathered[i])
        dist.all_gather_into_tensor(expected, shards[i])
        assert torch.equal(gathered[i], expected)
        expected_sum = torch.empty_like(reduced[i])
        dist.reduce_scatter_tensor(expected_sum, fulls[i].clone())
        assert torch.equal(reduced[i], expected_sum)


@pytest.mark.parametrize("dist_pool", [2, 4], indirect=True)
def test_several_in_flight(dist_pool: RankPool) -> None:
    dist_pool.run(interleaved_in_flight)


def reduction_from_pieces(strategy: str, unused: bool, accumulate: bool) -> None:
    """Two-rank gloo training reduces each unit's gradient straight from the per-parameter
    gradients ([Note: Per-parameter gradient reduction]); the results equal the concatenating
    path bit for bit (and torch FSDP1's, see tests/test_parity.py)."""
    import fsdp.runtime._hooks as hooks
    from fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
    from fsdp.flat_param.flat_param import FlatParamHandle
    from fsdp.wrap import ModuleWrapPolicy
    from tests._models import Block, global_batch, lm_loss, local_rows, make_toy

    rank, ws = dist.get_rank(), dist.get_world_size()
    calls = {"pieces": 0}
    original_reduce = FlatParamHandle._reduce_pieces

    def counting(self: FlatParamHandle) -> None:
        calls["pieces"] += 1
        original_reduce(self)

    original_allowed = hooks._reduction_takes_pieces
    results = {}
    FlatParamHandle._reduce_pieces = counting  # type: ignore[method-assign]
    try:
        for pieces in (True, False):
            hooks._reduction_takes_pieces = original_allowed if pieces else (lambda state: False)  # type: ignore[assignment]
            model = FSDP(
                make_toy(unused=unused),
                auto_wrap_policy=ModuleWrapPolicy({Block}),
                sharding_strategy=ShardingStrategy[strategy],
            )
            opt = torch.optim.AdamW(model.parameters(), lr=0.01)
            before = calls["pieces"]
            for step in range(3):
                tokens, targets = global_batch(step, ws)
                for _ in range(2 if accumulate else 1):
                    lm_loss(model(local_rows(tokens, rank, ws)), local_rows(targets, rank, ws)).backward()
                opt.step()
                opt.zero_grad()
            used = calls["pieces"] - before
            assert (used > 0) == pieces, (pieces, used)
            with FSDP.summon_full_params(model, writeback=False):
                results[pieces] = {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        FlatParamHandle._reduce_pieces = original_reduce  # type: ignore[method-assign]
        hooks._reduction_takes_pieces = original_allowed  # type: ignore[assignment]
    for name, value in results[True].items():
        assert torch.equal(value, results[False][name]), name


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
@pytest.mark.parametrize("unused,accumulate", [(False, False), (True, True)])
def test_reduction_from_pieces_equals_concatenated(pool2: RankPool, strategy: str, unused: bool, accumulate: bool) -> None:
    pool2.run(reduction_from_pieces, strategy, unused, accumulate)
