"""Parity: fsdp against torch FSDP1 (bit for bit) and single-process training (to tolerance).

Each case trains the same model on the same data for several optimizer steps in four ways:
torch's FSDP1 and ours on each rank's slice (float32, compared bit for bit), and a plain module
on the global batch (the single-process reference) and ours again, both in float64 (compared to
``FP64_TOL``). Losses and parameters are compared after every run.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests._harness import RankPool
from tests._models import Block, ToyLM, global_batch, lm_loss, local_rows, make_toy

STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]

# fsdp against the plain module, both float64: the same arithmetic in another summation order
# (the batch split over ranks, the reduction's order), so a gradient element differs by at most
# about n u sum|terms| (n < 100 terms, u = 2**-53: ~1e-14 of the summed magnitudes). SGD's step
# is linear in it; AdamW's normalized step turns a relative gradient error e into at most ~lr e,
# large only where the gradient is cancelled: with lr = 0.01, an element moves by more than 1e-8
# only if its gradient is below ~1e-8 of its terms' magnitudes, about one chance in 1e4 over a
# case's few thousand element-steps. In float32 the same bound would be ~1e-7 relative, and
# AdamW could turn a cancelled element's sign into a difference of 2 lr: no tolerance follows.
FP64_TOL = {"rtol": 1e-8, "atol": 1e-8}
POLICIES = ["none", "module", "transformer", "size", "lambda", "always", "custom", "manual", "enable_wrap"]


def _policy(lib: str, name: str) -> Any:
    """The auto_wrap_policy called ``name`` from ``fsdp.wrap`` or torch's wrap module."""
    if lib == "ours":
        import fsdp.wrap as w
        from fsdp import ShardingStrategy
    else:
        import torch.distributed.fsdp.wrap as w  # type: ignore[no-redef]
        from torch.distributed.fsdp import ShardingStrategy  # type: ignore[no-redef]
    if name == "module":
        return w.ModuleWrapPolicy({Block})
    if name == "transformer":
        return functools.partial(w.transformer_auto_wrap_policy, transformer_layer_cls={Block})
    if name == "size":
        return functools.partial(w.size_based_auto_wrap_policy, min_num_params=100)
    if name == "lambda":
        return functools.partial(w.lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, (Block, nn.Embedding)))
    if name == "always":
        return w.always_wrap_policy
    if name == "custom":
        return w.CustomPolicy(
            lambda m: {"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP} if isinstance(m, Block) else isinstance(m, nn.Embedding)
        )
    return None


def _wrap(lib: str, model: ToyLM, strategy: str, policy: str) -> nn.Module:
    if lib == "ours":
        from fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
        from fsdp.wrap import enable_wrap, wrap

        extra: dict[str, Any] = {}
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # type: ignore[no-redef]
        from torch.distributed.fsdp import ShardingStrategy  # type: ignore[no-redef]
        from torch.distributed.fsdp.wrap import enable_wrap, wrap  # type: ignore[no-redef]

        extra = {"device_id": torch.device("cpu")}
    kwargs = dict(sharding_strategy=ShardingStrategy[strategy], **extra)
    if policy == "manual":
        for i in range(model.n_blocks):
            model.blocks[i] = FSDP(model.blocks[i], **kwargs)
        return FSDP(model, **kwargs)
    if policy == "enable_wrap":
        with enable_wrap(wrapper_cls=FSDP, **kwargs):
            for i in range(model.n_blocks):
                model.blocks[i] = wrap(model.blocks[i])
            model.embed = wrap(model.embed)
            return wrap(model)
    return FSDP(model, auto_wrap_policy=_policy(lib, policy), **kwargs)


def _optim(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def _full_params(model: nn.Module, fsdp_cls: Any) -> dict[str, torch.Tensor]:
    with fsdp_cls.summon_full_params(model, writeback=False):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def run_parity(strategy: str, policy: str, optim: str, steps: int = 4, tie: bool = False, unused: bool = False) -> int:
    from fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    rank, ws = dist.get_rank(), dist.get_world_size()
    ref = make_toy(tie=tie, unused=unused).double()
    ours = _wrap("ours", make_toy(tie=tie, unused=unused), strategy, policy)
    theirs = _wrap("torch", make_toy(tie=tie, unused=unused), strategy, policy)
    ours64 = _wrap("ours", make_toy(tie=tie, unused=unused).double(), strategy, policy)
    # Same units as torch picks.
    assert [n for n, m in ours.named_modules() if isinstance(m, FSDP)] == [
        n for n, m in theirs.named_modules() if isinstance(m, TorchFSDP)
    ]
    models = (ref, ours, theirs, ours64)
    opts = [_optim(optim, m.parameters()) for m in models]
    for step in range(steps):
        tokens, targets = global_batch(step, ws)
        losses = []
        for i, (model, opt) in enumerate(zip(models, opts)):
            x, y = (tokens, targets) if i == 0 else (local_rows(tokens, rank, ws), local_rows(targets, rank, ws))
            loss = lm_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        assert torch.equal(losses[1], losses[2]), f"step {step}: loss {losses[1]} != torch FSDP1 {losses[2]}"
    mine, torch_full, ref_full = _full_params(ours, FSDP), _full_params(theirs, TorchFSDP), dict(ref.named_parameters())
    mine64 = _full_params(ours64, FSDP)
    assert list(mine) == list(torch_full) == list(mine64), (list(mine), list(torch_full))
    for name in mine:
        assert torch.equal(mine[name], torch_full[name]), f"{name} differs from torch FSDP1"
        if unused and name.startswith("unused.") and optim == "adamw":
            # FSDP1 semantics (torch's too): an unused parameter inside a flat unit gets a zero
            # gradient, not None, so AdamW's weight decay still moves it. Torch parity above.
            continue
        torch.testing.assert_close(mine64[name], ref_full[name].detach(), **FP64_TOL, msg=name)
    if unused and optim == "sgd":
        # The unused Linear never saw a gradient: it keeps its initial values everywhere.
        init = make_toy(tie=tie, unused=unused)
        assert torch.equal(mine["unused.weight"], init.unused.weight)  # type: ignore[union-attr]
    return len(mine)


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("dist_pool", [1, 2, 3, 4], indirect=True)
def test_strategies(dist_pool: RankPool, strategy: str, optim: str) -> None:
    assert dist_pool.run(run_parity, strategy, "module", optim) == [20] * dist_pool.world_size


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("dist_pool", [2, 4], indirect=True)
def test_wrap_policies(dist_pool: RankPool, policy: str) -> None:
    assert dist_pool.run(run_parity, "FULL_SHARD", policy, "adamw") == [20] * dist_pool.world_size


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("dist_pool", [2, 3], indirect=True)
def test_tied_weights_in_one_unit(dist_pool: RankPool, strategy: str) -> None:
    # head.weight is embed.weight; both live in the root unit and are stored once.
    assert dist_pool.run(run_parity, strategy, "module", "sgd", tie=True) == [19] * dist_pool.world_size


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_unused_parameters(pool2: RankPool, strategy: str, optim: str) -> None:
    assert pool2.run(run_parity, strategy, "module", optim, unused=True) == [22, 22]


def tied_storage_once() -> tuple[int, int]:
    from fsdp import FullyShardedDataParallel as FSDP

    model = FSDP(make_toy(tie=True))
    handle = model._fsdp_state.handle
    untied = sum(p.numel() for p in make_toy(tie=False).parameters())
    return handle.shard_layout.unpadded_unsharded_numel, untied - 13 * 7


def test_tied_weight_stored_once(pool2: RankPool) -> None:
    for stored, expected in pool2.run(tied_storage_once):
        assert stored == expected
