"""HYBRID_SHARD and _HYBRID_SHARD_ZERO2 on 4 ranks: shard in pairs, replicate across pairs.

Layouts: a 2-D DeviceMesh, an (intra, inter) process-group tuple, and torchrun's
LOCAL_WORLD_SIZE. Results equal torch FSDP1 given the same groups, and single-process training.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests._comm_count import count_collectives
from tests._harness import RankPool
from tests._models import Block, global_batch, lm_loss, local_rows, make_toy
from tests.test_parity import _full_params

_GROUPS: dict[str, Any] = {}


def _layouts() -> dict[str, Any]:
    """Groups are made once per rank process (every rank must create every group in order)."""
    if not _GROUPS:
        from torch.distributed.device_mesh import init_device_mesh

        intra, _ = dist.new_subgroups_by_enumeration([[0, 1], [2, 3]])
        inter, _ = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])
        _GROUPS["tuple"] = {"process_group": (intra, inter)}
        _GROUPS["mesh"] = {"device_mesh": init_device_mesh("cpu", (2, 2))}
    return _GROUPS


def _assert_matches_torch_and_reference(ours: Any, theirs: Any, ref: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Our full parameters equal torch FSDP1's bit for bit and the reference's within fp32
    tolerance; returns ours."""
    from fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    mine, torch_full, ref_full = _full_params(ours, FSDP), _full_params(theirs, TorchFSDP), dict(ref.named_parameters())
    for name in mine:
        assert torch.equal(mine[name], torch_full[name]), name
        torch.testing.assert_close(mine[name], ref_full[name].detach(), rtol=5e-5, atol=5e-6, msg=name)
    return mine


def run_hybrid(strategy: str, layout: str, accumulate: bool, steps: int = 3) -> None:
    from fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
    from fsdp.wrap import ModuleWrapPolicy
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import ShardingStrategy as TorchStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy

    rank, ws = dist.get_rank(), dist.get_world_size()
    layouts = _layouts()
    ours_kwargs = dict(layouts["mesh" if layout == "env" else layout])
    if layout == "env":
        ours_kwargs = {}
        os.environ["LOCAL_WORLD_SIZE"] = "2"
    try:
        ours = FSDP(make_toy(), auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=ShardingStrategy[strategy], **ours_kwargs)
    finally:
        os.environ.pop("LOCAL_WORLD_SIZE", None)
    torch_kwargs = layouts["mesh" if layout == "env" else layout]
    theirs = TorchFSDP(make_toy(), auto_wrap_policy=TorchPolicy({Block}), sharding_strategy=TorchStrategy[strategy], device_id=torch.device("cpu"), **torch_kwargs)
    ref = make_toy()
    assert dist.get_world_size(ours._fsdp_state.process_group) == 2
    assert dist.get_world_size(ours._fsdp_state.replicate_group) == 2
    models = (ref, ours, theirs)
    opts = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in models]
    for step in range(steps):
        tokens, targets = global_batch(step, ws)
        for i, (model, opt) in enumerate(zip(models, opts)):
            x, y = (tokens, targets) if i == 0 else (local_rows(tokens, rank, ws), local_rows(targets, rank, ws))
            if accumulate and i > 0:
                half = x.shape[0] // 2
                with model.no_sync():
                    (lm_loss(model(x[:half]), y[:half]) / 2).backward()
                (lm_loss(model(x[half:]), y[half:]) / 2).backward()
            else:
                lm_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    _assert_matches_torch_and_reference(ours, theirs, ref)


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("layout", ["mesh", "tuple", "env"])
@pytest.mark.parametrize("strategy", ["HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"])
def test_hybrid_parity(pool4: RankPool, strategy: str, layout: str, accumulate: bool) -> None:
    pool4.run(run_hybrid, strategy, layout, accumulate)


def hybrid_collectives(strategy: str) -> tuple[dict[str, int], dict[str, int]]:
    from fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
    from fsdp.wrap import ModuleWrapPolicy

    model = FSDP(make_toy(), auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=ShardingStrategy[strategy], **_layouts()["mesh"])
    rank, ws = dist.get_rank(), dist.get_world_size()
    tokens, targets = global_batch(0, ws)
    lm_loss(model(local_rows(tokens, rank, ws)), local_rows(targets, rank, ws)).backward()
    with count_collectives() as counts:
        lm_loss(model(local_rows(tokens, rank, ws)), local_rows(targets, rank, ws)).backward()
    return dict(counts.calls), {"units": len(FSDP.fsdp_modules(model))}


@pytest.mark.parametrize("strategy", ["HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"])
def test_hybrid_collectives(pool4: RankPool, strategy: str) -> None:
    calls, info = pool4.run(hybrid_collectives, strategy)[0]
    units = info["units"]
    # HYBRID_SHARD: each non-root unit twice (forward, backward) but the last block once, the
    # root once: both stay gathered into the backward, which starts with them ([Note: The
    # first backward unit stays gathered]).
    gathers = 2 * (units - 1) + 1 - 1 if strategy == "HYBRID_SHARD" else units
    # Reduce-scatter inside the pair, then all-reduce of the shard across pairs.
    assert calls == {"all_gather": gathers, "reduce_scatter": units, "all_reduce": units}


def hybrid_errors() -> None:
    from fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
    from torch.distributed.device_mesh import init_device_mesh

    layouts = _layouts()
    intra, inter = layouts["tuple"]["process_group"]
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    cases = [
        (dict(sharding_strategy=ShardingStrategy.HYBRID_SHARD), ValueError, "requires explicit specification of process group or device_mesh. .*LOCAL_WORLD_SIZE, which is not set"),
        (dict(sharding_strategy=ShardingStrategy.FULL_SHARD, process_group=(intra, inter)), ValueError, r"tuple needs sharding_strategy=HYBRID_SHARD"),
        (dict(sharding_strategy=ShardingStrategy.HYBRID_SHARD, process_group=(intra, dist.group.WORLD)), ValueError, r"2 x 4 != world size 4"),
        (dict(sharding_strategy=ShardingStrategy.HYBRID_SHARD, process_group=intra), ValueError, "Expected process_group to be passed in as either None or .* needs two groups"),
        (dict(sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_mesh=init_device_mesh("cpu", (4,))), ValueError, "needs a 2-D device_mesh"),
        (dict(sharding_strategy=ShardingStrategy.FULL_SHARD, device_mesh=layouts["mesh"]["device_mesh"]), ValueError, "needs a 1-D device_mesh"),
        (dict(process_group=intra, device_mesh=layouts["mesh"]["device_mesh"]), ValueError, "Cannot pass both process_group and device_mesh at the same time"),
        (dict(sharding_strategy=ShardingStrategy.HYBRID_SHARD, process_group=(intra, "inter")), TypeError, r"process_group\[1\]"),
    ]
    for kwargs, exc, match in cases:
        model = make_toy()
        before = [id(p) for p in model.parameters()]
        with pytest.raises(exc, match=match):
            FSDP(model, **kwargs)
        assert [id(p) for p in model.parameters()] == before  # nothing changed


def test_hybrid_errors(pool4: RankPool) -> None:
    pool4.run(hybrid_errors)


def subgroup_sharding(strategy: str) -> None:
    """A plain subgroup process_group: each pair of ranks trains its own model on its own data."""
    from fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
    from fsdp.wrap import ModuleWrapPolicy
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import ShardingStrategy as TorchStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy

    intra, _ = _layouts()["tuple"]["process_group"]
    rank = dist.get_rank()
    pair, pair_rank = rank // 2, rank % 2
    ours = FSDP(make_toy(), auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=ShardingStrategy[strategy], process_group=intra)
    theirs = TorchFSDP(make_toy(), auto_wrap_policy=TorchPolicy({Block}), sharding_strategy=TorchStrategy[strategy], process_group=intra, device_id=torch.device("cpu"))
    ref = make_toy()
    assert dist.get_world_size(ours._fsdp_state.process_group) == 2 and ours._fsdp_state.replicate_group is None
    models = (ref, ours, theirs)
    opts = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in models]
    for step in range(3):
        tokens, targets = global_batch(10 * pair + step, 2)  # each pair sees its own data
        for i, (model, opt) in enumerate(zip(models, opts)):
            x, y = (tokens, targets) if i == 0 else (local_rows(tokens, pair_rank, 2), local_rows(targets, pair_rank, 2))
            lm_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    mine = _assert_matches_torch_and_reference(ours, theirs, ref)
    # The two pairs trained on different data: their models differ.
    head = mine["head.weight"].contiguous()
    copies = [torch.empty_like(head) for _ in range(4)]
    dist.all_gather(copies, head)
    assert torch.equal(copies[0], copies[1]) and torch.equal(copies[2], copies[3])
    assert not torch.equal(copies[0], copies[2])


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_subgroup_process_group(pool4: RankPool, strategy: str) -> None:
    pool4.run(subgroup_sharding, strategy)
