"""Communication is exactly what the strategy needs, and resharding really frees memory."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests._comm_count import count_collectives
from tests._harness import RankPool
from tests._models import global_batch, lm_loss, local_rows, make_toy
from tests.test_parity import _wrap


def _one_step(model: torch.nn.Module, step: int = 0) -> None:
    rank, ws = dist.get_rank(), dist.get_world_size()
    tokens, targets = global_batch(step, ws)
    lm_loss(model(local_rows(tokens, rank, ws)), local_rows(targets, rank, ws)).backward()


def step_counts(strategy: str, freeze_block: bool) -> dict[str, Any]:
    from fsdp import FullyShardedDataParallel as FSDP

    result: dict[str, Any] = {}
    for lib in ("ours", "torch"):
        model = make_toy()
        if freeze_block:
            model.blocks[1].requires_grad_(False)
        model = _wrap(lib, model, strategy, "module")
        _one_step(model)  # warm-up: lazy init, first-iteration bookkeeping
        with count_collectives() as counts:
            _one_step(model, 1)
        result[lib] = (dict(counts.calls), dict(counts.bytes))
        if lib == "ours":
            handles = [m._fsdp_state.handle for m in FSDP.fsdp_modules(model)]
            result["padded_bytes"] = [h.shard_layout.padded_unsharded_numel * 4 for h in handles]
            result["sharded_bytes"] = [h.shard_layout.sharded_numel * 4 for h in handles]
    return result


@pytest.mark.parametrize("freeze_block", [False, True])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
@pytest.mark.parametrize("dist_pool", [2, 4], indirect=True)
def test_collectives_per_step(dist_pool: RankPool, strategy: str, freeze_block: bool) -> None:
    res = dist_pool.run(step_counts, strategy, freeze_block)[0]
    calls, nbytes = res["ours"]
    padded = res["padded_bytes"]  # root unit first, then the 3 blocks
    root, blocks = padded[0], padded[1:]
    trained_blocks = [b for i, b in enumerate(blocks) if not (freeze_block and i == 1)]
    trained = [root] + trained_blocks
    if strategy == "FULL_SHARD":
        # Each non-root unit twice (forward, backward), except the last block: its backward comes
        # right after the root's, so it stays unsharded from its forward into its backward
        # ([Note: The first backward unit stays gathered]), as the root does.
        expected_calls = {"all_gather": 2 * len(blocks) + 1 - 1, "reduce_scatter": len(trained)}
        expected_bytes = {"all_gather": 2 * sum(blocks) + root - blocks[-1], "reduce_scatter": sum(res["sharded_bytes"][i] for i in range(len(padded)) if not (freeze_block and i == 2))}
    elif strategy == "SHARD_GRAD_OP":
        expected_calls = {"all_gather": len(padded), "reduce_scatter": len(trained)}
        expected_bytes = {"all_gather": sum(padded), "reduce_scatter": sum(res["sharded_bytes"][i] for i in range(len(padded)) if not (freeze_block and i == 2))}
    else:
        expected_calls = {"all_reduce": len(trained)}
        expected_bytes = {"all_reduce": sum(trained)}
    assert calls == expected_calls
    assert nbytes == expected_bytes
    torch_calls, torch_bytes = res["torch"]
    if strategy == "FULL_SHARD":
        # torch FSDP1 frees the last block after its forward and gathers it again at once.
        assert torch_calls == {**calls, "all_gather": calls["all_gather"] + 1}
        assert torch_bytes == {**nbytes, "all_gather": nbytes["all_gather"] + blocks[-1]}
    else:
        # torch FSDP1 issues the same collectives with the same sizes.
        assert res["torch"] == res["ours"]


def memory_lifecycle(strategy: str) -> None:
    from fsdp import FullyShardedDataParallel as FSDP

    model = _wrap("ours", make_toy(), strategy, "module")
    units = FSDP.fsdp_modules(model)
    root, blocks = units[0], units[1:]

    def nbytes(unit: Any) -> int:
        return unit._fsdp_state.handle.storage.unsharded_storage_nbytes()

    assert all(nbytes(u) == 0 for u in units), "nothing is unsharded before the first forward"
    rank, ws = dist.get_rank(), dist.get_world_size()
    tokens, targets = global_batch(0, ws)
    loss = lm_loss(model(local_rows(tokens, rank, ws)), local_rows(targets, rank, ws))
    if strategy == "FULL_SHARD":
        assert all(nbytes(b) == 0 for b in blocks), "FULL_SHARD frees non-root units after forward"
        assert nbytes(root) > 0, "the root stays unsharded for its backward"
    else:
        assert all(nbytes(u) == u._fsdp_state.handle.shard_layout.padded_unsharded_numel * 4 for u in units)
    loss.backward()
    for unit in units:
        handle = unit._fsdp_state.handle
        assert nbytes(unit) == 0, f"{unit._fsdp_state.unit_name} still holds unsharded storage"
        assert handle.flat_param.numel() == handle.shard_layout.sharded_numel
        assert handle.flat_param.grad.shape == (handle.shard_layout.sharded_numel,)
    # Steady state (from the second iteration): the last block, whose backward comes right
    # after the root's, stays unsharded from its forward into its backward.
    x = local_rows(tokens, rank, ws)
    loss = lm_loss(model(x), local_rows(targets, rank, ws))
    if strategy == "FULL_SHARD":
        assert all(nbytes(b) == 0 for b in blocks[:-1]), "FULL_SHARD frees the other blocks"
        assert nbytes(blocks[-1]) > 0, "the first unit of the backward stays gathered"
    loss.backward()
    assert all(nbytes(u) == 0 for u in units), "the backward frees the kept block"
    if strategy == "FULL_SHARD":
        # A forward whose backward never comes: the next forward frees the kept block and
        # gathers the blocks' parameters as they are now (changed in between, here by hand; no
        # optimizer step has run, so the root's own parameters are still make_toy()'s).
        # (SHARD_GRAD_OP keeps every unit gathered until a backward, as torch FSDP1 does.)
        model(x)
        with torch.no_grad():
            for block in blocks:
                block._fsdp_state.handle._local_shard.fill_(0.01)  # the local shards
        out_after_change = model(x)
        plain = make_toy()
        with torch.no_grad():
            for param in plain.blocks.parameters():
                param.fill_(0.01)
        # The same ops on the same values as the plain model: bit-identical.
        assert torch.equal(out_after_change, plain(x)), "a forward used parameters gathered before the change"
    # eval / no_grad: forward frees everything and leaves no backward state behind.
    model.eval()
    with torch.no_grad():
        model(x)
    assert all(nbytes(u) == 0 for u in units)
    assert all(u.training_state.name == "IDLE" for u in units)


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_memory_lifecycle(pool2: RankPool, strategy: str) -> None:
    pool2.run(memory_lifecycle, strategy)


def deleted_model_is_freed(train: bool, orig: bool) -> int:
    """``del model`` frees every FlatParameter (hooks in C++ must not keep them alive)."""
    import gc
    import weakref

    from fsdp import FullyShardedDataParallel as FSDP
    from fsdp.wrap import ModuleWrapPolicy

    from tests._models import Block

    model = FSDP(make_toy(), auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=orig)
    refs = [weakref.ref(h.flat_param) for u in FSDP.fsdp_modules(model) for h in u._fsdp_state.handles]
    if train:
        opt = torch.optim.AdamW(model.parameters())
        _one_step(model)
        opt.step()
        del opt
    del model
    gc.collect()
    return sum(ref() is not None for ref in refs)


@pytest.mark.parametrize("orig", [False, True])
@pytest.mark.parametrize("train", [False, True])
def test_deleted_model_is_freed(pool2: RankPool, train: bool, orig: bool) -> None:
    assert pool2.run(deleted_model_is_freed, train, orig) == [0, 0]
