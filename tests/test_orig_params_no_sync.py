"""use_orig_params=True with no_sync() accumulation and gradients set by hand before backward:
the original parameters' ``.grad`` inside and after no_sync, against torch FSDP1.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests._harness import RankPool
from tests._models import global_batch, lm_loss, local_rows, make_toy
from tests.test_orig_params_torch_attrs import _wrap
from tests.test_parity import _full_params


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    # Known difference, open: a parameter with no element on this rank has a 0-element grad in
    # ours and None in torch's (the optimizer-state-dict code relies on ours); compared as None.
    return {
        n: (None if p.grad is None or p.grad.numel() == 0 else p.grad.clone())
        for n, p in model.named_parameters()
    }


def _assert_same(mine: dict, theirs: dict, exact: bool, where: str) -> None:
    assert list(mine) == list(theirs), where
    for name in mine:
        a, b = mine[name], theirs[name]
        assert (a is None) == (b is None), (where, name)
        if a is None:
            continue
        assert a.shape == b.shape and a.dtype == b.dtype, (where, name, a.shape, b.shape)
        if exact:
            assert torch.equal(a, b), (where, name)
        else:  # torch pads each parameter for alignment with 4 ranks: another chunking of the
            # reduce-scatter, so another order of the ws-term sums (a few float32 ulps).
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"{where} {name}")


def no_sync_accumulation(strategy: str) -> None:
    from fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    rank, ws = dist.get_rank(), dist.get_world_size()
    # With <= 2 ranks each element's reduction is one addition, whatever the layout: exact.
    exact_sync = ws <= 2
    models = [_wrap("ours", make_toy(), strategy, True), _wrap("torch", make_toy(), strategy, True)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]

    def backward(model: nn.Module, step: int) -> None:
        tokens, targets = global_batch(step, ws)
        lm_loss(model(local_rows(tokens, rank, ws)), local_rows(targets, rank, ws)).backward()

    for step in range(4):
        for micro in range(2):
            for model in models:
                with model.no_sync():
                    backward(model, 10 * step + micro)
            # Inside no_sync: the unsharded accumulated local gradient, as torch shows it
            # (the same local arithmetic on both sides: exact).
            _assert_same(_grads(models[0]), _grads(models[1]), True, f"no_sync step {step}.{micro}")
        for model in models:
            backward(model, 10 * step + 2)
        if ws <= 2:  # with 4 ranks torch's aligned layout shards other elements to each rank
            _assert_same(_grads(models[0]), _grads(models[1]), exact_sync, f"synced step {step}")
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=step % 2 == 1)
    mine, theirs = _full_params(models[0], FSDP), _full_params(models[1], TorchFSDP)
    _assert_same(mine, theirs, exact_sync, "parameters")


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
@pytest.mark.parametrize("dist_pool", [1, 2, 4], indirect=True)
def test_no_sync_accumulation(dist_pool: RankPool, strategy: str) -> None:
    dist_pool.run(no_sync_accumulation, strategy)


def hand_set_grads(strategy: str) -> None:
    """A constant gradient set by hand on every original parameter (any shape: a constant is
    the same whatever the shard), then two no_sync micro-batches and a synchronized one; or
    the same without no_sync. Compared with single-process training on the global batches
    (and with torch FSDP1 without no_sync; with no_sync torch FSDP1 loses the hand-set
    gradient of a unit that stays unsharded, e.g. its root with NO_SHARD)."""
    from fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    rank, ws = dist.get_rank(), dist.get_world_size()
    for use_no_sync in [True, False]:
        ref = make_toy()
        models = [_wrap("ours", make_toy(), strategy, True), _wrap("torch", make_toy(), strategy, True)]
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in [ref] + models]
        for step in range(2):
            for model in [ref] + models:
                for p in model.parameters():
                    p.grad = torch.full_like(p, 0.25)
            for micro in range(3):
                tokens, targets = global_batch(10 * step + micro, ws)
                lm_loss(ref(tokens), targets).backward()
                for model in models:
                    sync_ctx = model.no_sync() if use_no_sync and micro < 2 else _nullcontext()
                    with sync_ctx:
                        lm_loss(model(local_rows(tokens, rank, ws)), local_rows(targets, rank, ws)).backward()
            for opt in opts:
                opt.step()
                opt.zero_grad(set_to_none=True)
        mine, theirs = _full_params(models[0], FSDP), _full_params(models[1], TorchFSDP)
        for name, value in ref.named_parameters():
            # The reference sums the same 3 * ws per-rank terms in another order (one backward
            # over all rows, then no division by ws): float32 reassociation of a few terms, a
            # few ulps of the gradient's magnitude, scaled by lr; 1e-6 absolute on parameters
            # of magnitude < 1 leaves a margin of ~10x.
            torch.testing.assert_close(mine[name], value.detach(), rtol=1e-5, atol=1e-6, msg=name)
            if not use_no_sync:  # full parameters: layout-free
                _assert_same({name: mine[name]}, {name: theirs[name]}, ws <= 2, "hand-set")


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
@pytest.mark.parametrize("dist_pool", [1, 2, 4], indirect=True)
def test_hand_set_grads(dist_pool: RankPool, strategy: str) -> None:
    dist_pool.run(hand_set_grads, strategy)
