"""Model state dicts: FULL, SHARDED (with torch.distributed.checkpoint) and LOCAL.

Compared with torch FSDP1 (keys and values) and the unwrapped model; checkpoints move between
world sizes (through DCP pools of different sizes sharing a directory) and between torch FSDP1
and fsdp.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests._harness import RankPool
from tests._models import Block, global_batch, lm_loss, local_rows, make_toy
from tests.test_parity import _full_params

STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]


def _ours(strategy: str = "FULL_SHARD", seed: int = 0, orig: bool = False, **kw: Any) -> nn.Module:
    from fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
    from fsdp.wrap import ModuleWrapPolicy

    return FSDP(make_toy(seed=seed, **kw), auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=ShardingStrategy[strategy], use_orig_params=orig)


def _theirs(strategy: str = "FULL_SHARD", seed: int = 0, orig: bool = False) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP, ShardingStrategy as TS
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TP

    return TorchFSDP(make_toy(seed=seed), auto_wrap_policy=TP({Block}), sharding_strategy=TS[strategy], use_orig_params=orig, device_id=torch.device("cpu"))


def _train(models: list[nn.Module], steps: range, data_ws: int = 0) -> None:
    """SGD steps; the plain model sees the global batch of ``data_ws`` ranks (default: this run's)."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    for model in models:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)  # stateless: resume needs no optimizer state
        for step in steps:
            tokens, targets = global_batch(step, data_ws or ws)
            if isinstance(model, type(make_toy())):
                lm_loss(model(tokens), targets).backward()
            else:
                lm_loss(model(local_rows(tokens, rank, ws)), local_rows(targets, rank, ws)).backward()
            opt.step()
            opt.zero_grad()


# ------------------------------------------------------------------ FULL_STATE_DICT
def full_parity(strategy: str, orig: bool) -> None:
    from fsdp import FullStateDictConfig, FullyShardedDataParallel as FSDP, StateDictType
    from torch.distributed.fsdp import FullStateDictConfig as TorchCfg
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import StateDictType as TorchType

    ref, ours, theirs = make_toy(), _ours(strategy, orig=orig), _theirs(strategy, orig=orig)
    _train([ref, ours, theirs], range(2))
    mine, torchs, plain = ours.state_dict(), theirs.state_dict(), ref.state_dict()
    assert list(mine) == list(torchs) == list(plain)  # keys (and order) of the unwrapped model
    for key in mine:
        assert torch.equal(mine[key], torchs[key]), key
        torch.testing.assert_close(mine[key], plain[key], rtol=5e-5, atol=5e-6, msg=key)
    before = {k: v.clone() for k, v in mine.items()}
    _train([ours, theirs], range(2, 3))
    assert all(torch.equal(before[k], mine[k]) for k in mine), "state dict values are owned copies"
    rank = dist.get_rank()
    with FSDP.state_dict_type(ours, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
        r0 = ours.state_dict()
    with TorchFSDP.state_dict_type(theirs, TorchType.FULL_STATE_DICT, TorchCfg(offload_to_cpu=False, rank0_only=True)):
        t0 = theirs.state_dict()
    now = ours.state_dict()  # every rank (a collective)
    if rank == 0:
        assert list(r0) == list(plain) and all(v.device.type == "cpu" for v in r0.values())
        assert all(torch.equal(r0[k], t0[k]) and torch.equal(r0[k], now[k]) for k in r0)
        for value in r0.values():  # owned: changing what was returned changes nothing else
            value.add_(1000.0)
    assert all(torch.equal(v, now[k]) for k, v in ours.state_dict().items())
    if rank != 0:
        assert r0 == {}
        # torch FSDP1 ignores rank0_only for NO_SHARD (it warns and returns everything).
        assert t0 == {} or strategy == "NO_SHARD"
    assert FSDP.get_state_dict_type(ours).state_dict_type is StateDictType.FULL_STATE_DICT  # restored
    # Load into another strategy, into the plain model, and across torch <-> fsdp.
    target = _ours("SHARD_GRAD_OP" if strategy != "SHARD_GRAD_OP" else "NO_SHARD", seed=5, orig=not orig)
    result = target.load_state_dict(mine)
    assert list(result.missing_keys) == [] and list(result.unexpected_keys) == []
    loaded = target.state_dict()
    assert all(torch.equal(loaded[k], mine[k]) for k in mine)
    plain_model = make_toy(seed=9)
    plain_model.load_state_dict(mine)
    assert all(torch.equal(v, mine[k]) for k, v in plain_model.state_dict().items())
    from_torch = _ours(strategy, seed=7, orig=orig)
    from_torch.load_state_dict(torchs)
    to_torch = _theirs(strategy, seed=7)
    to_torch.load_state_dict(mine)
    a, b = from_torch.state_dict(), to_torch.state_dict()
    assert all(torch.equal(a[k], b[k]) and torch.equal(a[k], mine[k]) for k in a)


@pytest.mark.parametrize("orig", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("dist_pool", [1, 2, 4], indirect=True)
def test_full_state_dict(dist_pool: RankPool, strategy: str, orig: bool) -> None:
    dist_pool.run(full_parity, strategy, orig)


def rank0_only_memory() -> dict[str, Any]:
    """What a rank0_only save gathers where, and rank 1's extra memory while saving.

    Each unit is gathered once, straight into a tensor of the result on rank 0; the other
    ranks send their shards and never hold an unsharded unit (the bound that matters: at most
    one, see [Note: State dict gathers]).
    """
    import fsdp.state_dict._model_state_dict as model_sd
    from fsdp import FullStateDictConfig, FullyShardedDataParallel as FSDP, StateDictType
    from benchmarks.memory import MemoryTrace
    from fsdp.flat_param.flat_param import FlatParamHandle

    model = _ours("FULL_SHARD")
    _train([model], range(1))
    handles = [h for m in FSDP.fsdp_modules(model) for h in m._fsdp_state.handles]
    unsharded: list[int] = []  # handles holding unsharded storage, at every unshard and gather
    received: list[bool] = []  # per gather: whether this rank got the full tensor
    original_unshard, original_gather = FlatParamHandle.unshard, model_sd.gather

    def unshard_spy(self: FlatParamHandle) -> None:
        original_unshard(self)
        unsharded.append(sum(h.storage.unsharded_storage_nbytes() > 0 for h in handles))

    def gather_spy(*args: Any, **kwargs: Any) -> Any:
        out = original_gather(*args, **kwargs)
        received.append(out is not None)
        unsharded.append(sum(h.storage.unsharded_storage_nbytes() > 0 for h in handles))
        return out

    FlatParamHandle.unshard = unshard_spy  # type: ignore[method-assign]
    model_sd.gather = gather_spy  # type: ignore[assignment]
    try:
        with MemoryTrace() as trace, trace.window("save"):
            with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True, offload_to_cpu=True)):
                sd = model.state_dict()
            del sd
    finally:
        FlatParamHandle.unshard = original_unshard  # type: ignore[method-assign]
        model_sd.gather = original_gather  # type: ignore[assignment]
    assert all(h.storage.unsharded_storage_nbytes() == 0 for h in handles)
    return {
        "unsharded": unsharded,
        "received": received,
        "save_extra_bytes": trace.peaks["save"] - trace.starts["save"],
        "unit_bytes": max(h.shard_layout.padded_unsharded_numel * h.flat_param.element_size() for h in handles),
    }


def test_rank0_only_holds_one_unit_at_a_time(pool2: RankPool) -> None:
    rank0, rank1 = pool2.run(rank0_only_memory)
    assert max(rank1["unsharded"], default=0) <= 1
    assert rank0["received"] == [True] * 4 and rank1["received"] == [False] * 4  # each unit once
    assert rank1["save_extra_bytes"] <= rank1["unit_bytes"], rank1


def tied_and_keep_vars(rank0_only: bool) -> None:
    """Tied weights (one unit holds both names) and keep_vars, against torch FSDP1."""
    from fsdp import FullStateDictConfig, FullyShardedDataParallel as FSDP, StateDictType
    from torch.distributed.fsdp import FullStateDictConfig as TorchCfg
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import StateDictType as TorchType
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy

    ours = _ours(tie=True)
    theirs = TorchFSDP(make_toy(tie=True), auto_wrap_policy=TorchPolicy({Block}), device_id=torch.device("cpu"))
    ref = make_toy(tie=True)
    _train([ref, ours, theirs], range(2))
    with FSDP.state_dict_type(ours, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=True, rank0_only=rank0_only)):
        mine, mine_vars = ours.state_dict(), ours.state_dict(keep_vars=True)
    with TorchFSDP.state_dict_type(theirs, TorchType.FULL_STATE_DICT, TorchCfg(offload_to_cpu=False, rank0_only=rank0_only)):
        torchs = theirs.state_dict()
    if rank0_only and dist.get_rank() != 0:
        assert mine == {} and mine_vars == {} and torchs == {}
        return
    assert list(mine) == list(torchs) == list(ref.state_dict()) == list(mine_vars)
    assert torch.equal(mine["head.weight"], mine["embed.weight"])
    for key in mine:
        assert torch.equal(mine[key], torchs[key]) and torch.equal(mine_vars[key], mine[key]), key
        assert not isinstance(mine_vars[key], nn.Parameter), key


@pytest.mark.parametrize("rank0_only", [False, True])
@pytest.mark.parametrize("dist_pool", [2, 4], indirect=True)
def test_tied_weights_and_keep_vars(dist_pool: RankPool, rank0_only: bool) -> None:
    dist_pool.run(tied_and_keep_vars, rank0_only)


def hybrid_full_state_dict(rank0_only: bool) -> None:
    """HYBRID_SHARD (shard in pairs): the same full state dict as torch FSDP1 on every rank."""
    from fsdp import FullStateDictConfig, FullyShardedDataParallel as FSDP, ShardingStrategy, StateDictType
    from fsdp.wrap import ModuleWrapPolicy
    from torch.distributed.fsdp import FullStateDictConfig as TorchCfg
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import ShardingStrategy as TS
    from torch.distributed.fsdp import StateDictType as TorchType
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy

    from tests.test_hybrid_shard import _layouts

    mesh = _layouts()["mesh"]
    ours = FSDP(make_toy(), auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=ShardingStrategy.HYBRID_SHARD, **mesh)
    theirs = TorchFSDP(make_toy(), auto_wrap_policy=TorchPolicy({Block}), sharding_strategy=TS.HYBRID_SHARD, device_id=torch.device("cpu"), **mesh)
    _train([ours, theirs], range(2))
    with FSDP.state_dict_type(ours, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=True, rank0_only=rank0_only)):
        mine = ours.state_dict()
    with TorchFSDP.state_dict_type(theirs, TorchType.FULL_STATE_DICT, TorchCfg(offload_to_cpu=False, rank0_only=rank0_only)):
        torchs = theirs.state_dict()
    assert list(mine) == list(torchs)
    assert all(torch.equal(mine[k], torchs[k]) for k in mine)
    assert (mine != {}) == (not rank0_only or dist.get_rank() == 0 or dist.get_rank(ours._fsdp_state.process_group) == 0)
    # SHARDED round trip: DTensors over each replica's shard group load back (layout check).
    with FSDP.state_dict_type(ours, StateDictType.SHARDED_STATE_DICT):
        sharded = ours.state_dict()
    fresh = FSDP(make_toy(seed=4), auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=ShardingStrategy.HYBRID_SHARD, **mesh)
    with FSDP.state_dict_type(fresh, StateDictType.SHARDED_STATE_DICT):
        fresh.load_state_dict(sharded)
    a, b = ours.state_dict(), fresh.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("rank0_only", [False, True])
def test_hybrid_full_state_dict(pool4: RankPool, rank0_only: bool) -> None:
    pool4.run(hybrid_full_state_dict, rank0_only)


def resume(strategy: str, kind: str, directory: str, phase: str, save_ws: int = 0) -> None:
    """Train 2 steps, save; later (fresh model, possibly another world size) load, train 2 more."""
    import torch.distributed.checkpoint as dcp

    from fsdp import FullyShardedDataParallel as FSDP, StateDictType

    sd_type = StateDictType[kind]
    if phase == "save":
        model = _ours(strategy)
        _train([model], range(2))
        with FSDP.state_dict_type(model, sd_type):
            state = model.state_dict()
            if sd_type is StateDictType.SHARDED_STATE_DICT:
                dcp.save(state, checkpoint_id=directory)
            elif dist.get_rank() == 0:
                torch.save(state, os.path.join(directory, "full.pt"))
        dist.barrier()
        return
    model = _ours(strategy, seed=123)  # a fresh, differently initialized model
    with FSDP.state_dict_type(model, sd_type):
        if sd_type is StateDictType.SHARDED_STATE_DICT:
            template = model.state_dict()
            dcp.load(template, checkpoint_id=directory)
            model.load_state_dict(template)
        else:
            model.load_state_dict(torch.load(os.path.join(directory, "full.pt")))
    _train([model], range(2, 4))
    straight = make_toy()  # the first two steps on the saving run's global batches
    _train([straight], range(2), data_ws=save_ws)
    _train([straight], range(2, 4))
    mine = _full_params(model, FSDP)
    for name, value in straight.named_parameters():
        torch.testing.assert_close(mine[name], value.detach(), rtol=5e-5, atol=5e-6, msg=name)


@pytest.mark.parametrize("kind", ["FULL_STATE_DICT", "SHARDED_STATE_DICT"])
@pytest.mark.parametrize("save_ws,load_ws", [(2, 2), (2, 4), (4, 3), (3, 1), (1, 2)])
def test_resume_across_world_sizes(tmp_path: Any, kind: str, save_ws: int, load_ws: int) -> None:
    from tests._harness import get_pool

    get_pool(save_ws).run(resume, "FULL_SHARD", kind, str(tmp_path), "save")
    get_pool(load_ws).run(resume, "SHARD_GRAD_OP", kind, str(tmp_path), "load", save_ws)


def resume_exact(kind: str, directory: str) -> None:
    """At the same world size, resuming is bit-exact."""
    import torch.distributed.checkpoint as dcp

    from fsdp import FullyShardedDataParallel as FSDP, StateDictType

    straight, first = _ours(), _ours()
    _train([straight], range(4))
    _train([first], range(2))
    with FSDP.state_dict_type(first, StateDictType[kind]):
        state = first.state_dict()
        if kind == "SHARDED_STATE_DICT":
            dcp.save(state, checkpoint_id=directory)
    second = _ours(seed=42)
    with FSDP.state_dict_type(second, StateDictType[kind]):
        if kind == "SHARDED_STATE_DICT":
            template = second.state_dict()
            dcp.load(template, checkpoint_id=directory)
            second.load_state_dict(template)
        else:
            second.load_state_dict(state)
    _train([second], range(2, 4))
    a, b = _full_params(straight, FSDP), _full_params(second, FSDP)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("kind", ["FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT"])
def test_resume_bit_exact(pool2: RankPool, tmp_path: Any, kind: str) -> None:
    pool2.run(resume_exact, kind, str(tmp_path))


# ------------------------------------------------------------------ SHARDED <-> torch via DCP
def dcp_interop(directory: str, writer: str) -> None:
    import torch.distributed.checkpoint as dcp

    from fsdp import FullyShardedDataParallel as FSDP, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import StateDictType as TorchType

    ours, theirs = _ours(seed=1), _theirs(seed=2)
    source = ours if writer == "ours" else theirs
    _train([source], range(2))
    expected = source.state_dict()  # FULL, for comparison
    if writer == "ours":
        with FSDP.state_dict_type(ours, StateDictType.SHARDED_STATE_DICT):
            dcp.save(ours.state_dict(), checkpoint_id=directory)
        with TorchFSDP.state_dict_type(theirs, TorchType.SHARDED_STATE_DICT):
            template = theirs.state_dict()
            dcp.load(template, checkpoint_id=directory)
            theirs.load_state_dict(template)
        loaded = theirs.state_dict()
    else:
        with TorchFSDP.state_dict_type(theirs, TorchType.SHARDED_STATE_DICT):
            dcp.save(theirs.state_dict(), checkpoint_id=directory)
        with FSDP.state_dict_type(ours, StateDictType.SHARDED_STATE_DICT):
            template = ours.state_dict()
            dcp.load(template, checkpoint_id=directory)
            ours.load_state_dict(template)
        loaded = ours.state_dict()
    assert list(loaded) == list(expected)
    for key in expected:
        assert torch.equal(loaded[key], expected[key]), key


@pytest.mark.parametrize("writer", ["ours", "torch"])
@pytest.mark.parametrize("dist_pool", [2, 4], indirect=True)
def test_sharded_dcp_interop_with_torch(dist_pool: RankPool, tmp_path: Any, writer: str) -> None:
    dist_pool.run(dcp_interop, str(tmp_path), writer)


def _after_training(lib: Any, orig: bool, mp: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Torch's ``test_save_and_load_after_forward_state_dict`` scenario (SHARDED) through ``lib``.

    Six SGD steps on torch's nested model, a SHARDED state dict taken *without* a defensive copy,
    the model zeroed, the state dict loaded back. Returns the trained full parameters and every
    entry's local piece as saved.
    """
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    fsdp_cls = lib.FullyShardedDataParallel
    policy = lib.MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16, buffer_dtype=torch.float16) if mp else None
    kw: dict[str, Any] = {"mixed_precision": policy, "use_orig_params": orig, "device_id": torch.device("cpu")}
    torch.manual_seed(0)
    inner, outer = nn.Linear(10, 10, bias=False), nn.Linear(10, 10, bias=False)
    model = fsdp_cls(nn.Sequential(fsdp_cls(inner, **kw), outer), **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(6):
        loss = model(torch.randn(1, 10, generator=gen)).sum()
        assert loss.dtype == (torch.float16 if mp else torch.float32)
        loss.backward()
        opt.step()
    trained = _full_params(model, fsdp_cls)
    with fsdp_cls.state_dict_type(model, lib.StateDictType.SHARDED_STATE_DICT):
        saved = model.state_dict()
    # Torch's test snapshots through ShardedTensor internals: both libraries give ShardedTensors.
    assert all(isinstance(value, ShardedTensor) for value in saved.values())
    pieces = {key: value._local_shards[0].tensor.clone() for key, value in saved.items()}
    with fsdp_cls.summon_full_params(model), torch.no_grad():
        for param in model.parameters():
            param.zero_()
    assert all(not torch.equal(p, trained[n]) for n, p in _full_params(model, fsdp_cls).items())
    for key, value in saved.items():
        assert value.dtype == torch.float32, key
        assert torch.equal(value.local_shards()[0].tensor, pieces[key]), f"{key}: the saved value changed with the model (a view, not a copy)"
    with fsdp_cls.state_dict_type(model, lib.StateDictType.SHARDED_STATE_DICT):
        model.load_state_dict(saved, strict=True)
    loaded = _full_params(model, fsdp_cls)
    assert list(loaded) == list(trained) and all(torch.equal(p, trained[n]) for n, p in loaded.items())
    return trained, pieces


def sharded_after_training(orig: bool, mp: bool) -> None:
    import torch.distributed.fsdp as torch_fsdp

    import fsdp

    theirs, ours = _after_training(torch_fsdp, orig, mp), _after_training(fsdp, orig, mp)
    for mine, reference in zip(ours, theirs):
        assert list(mine) == list(reference)
        for key, value in reference.items():
            assert torch.equal(mine[key], value), key


@pytest.mark.parametrize("mp", [False, True])
@pytest.mark.parametrize("orig", [False, True])
def test_sharded_state_dict_after_training(pool2: RankPool, orig: bool, mp: bool) -> None:
    """Torch's ``test_save_and_load_after_forward_state_dict`` with SHARDED state dicts: the same
    trained parameters, the same saved pieces (owned copies in both: zeroing the model after
    saving leaves them as they were), and the load restores the trained model. The values are
    ShardedTensors in both, so the snapshot through ``ShardedTensor._local_shards`` that torch's
    test takes works on ours ([Note: Sharded state dict values] in docs/design.md)."""
    pool2.run(sharded_after_training, orig, mp)


# ------------------------------------------------------------------ LOCAL_STATE_DICT
def local_roundtrip(directory: str, phase: str) -> None:
    from fsdp import FullyShardedDataParallel as FSDP, StateDictType

    rank, ws = dist.get_rank(), dist.get_world_size()
    path = os.path.join(directory, f"local_{ws}_{rank}.pt")
    model = _ours()
    if phase == "save":
        _train([model], range(2))
        with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
            torch.save(model.state_dict(), path)
        fresh = _ours(seed=3)
        with FSDP.state_dict_type(fresh, StateDictType.LOCAL_STATE_DICT):
            # ShardedTensor values, as torch FSDP1's: not loadable with weights_only=True.
            fresh.load_state_dict(torch.load(path, weights_only=False))
        a, b = _full_params(model, FSDP), _full_params(fresh, FSDP)
        assert all(torch.equal(a[k], b[k]) for k in a)
        return
    # Another wrapping at the same world size (a ShardedTensor does not even unpickle at another
    # one): with tied weights the root unit holds fewer elements than the saved one.
    saved = torch.load(path, weights_only=False)
    tied = _ours(tie=True)
    before = _full_params(tied, FSDP)
    with FSDP.state_dict_type(tied, StateDictType.LOCAL_STATE_DICT):
        with pytest.raises(
            ValueError,
            match=r"the LOCAL_STATE_DICT entry '_flat_param' was saved with a different layout "
            r"\(182 elements in 2 shard\(s\) of sizes \[91, 91\] at offsets \[0, 91\]\) than this model "
            r"\(its unit '<root>' holds 91 elements in shards of 46 over 2 rank\(s\)\), whose shards have "
            r"sizes \[46, 45\] at offsets \[0, 46\]. A local state dict only loads at the same world size "
            r"and wrapping; use StateDictType.SHARDED_STATE_DICT to change world size or wrapping",
        ):
            tied.load_state_dict(saved)
    after = _full_params(tied, FSDP)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_local_state_dict(tmp_path: Any) -> None:
    from tests._harness import get_pool

    get_pool(2).run(local_roundtrip, str(tmp_path), "save")
    get_pool(2).run(local_roundtrip, str(tmp_path), "load", _timeout=120)


# ------------------------------------------------------------------ bad input
def bad_input() -> None:
    from fsdp import FullyShardedDataParallel as FSDP

    model = _ours()
    good = model.state_dict()
    before = _full_params(model, FSDP)
    missing = {k: v for k, v in good.items() if k != "head.weight"}
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "head.weight"'):
        model.load_state_dict(missing)
    extra = dict(good, **{"blocks.9.fc1.weight": torch.zeros(1)})
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "blocks.9.fc1.weight"'):
        model.load_state_dict(extra)
    wrong = dict(good, **{"blocks.1.fc2.weight": torch.zeros(3, 3)})
    with pytest.raises(RuntimeError, match=r"size mismatch for blocks.1.fc2.weight: copying a param with shape \(3, 3\) from checkpoint, the shape in current model is \(7, 11\)"):
        model.load_state_dict(wrong, strict=False)
    after = _full_params(model, FSDP)
    assert all(torch.equal(before[k], after[k]) for k in before), "nothing changed"
    result = model.load_state_dict(missing, strict=False)
    assert list(result.missing_keys) == ["head.weight"] and list(result.unexpected_keys) == []
    with pytest.raises(RuntimeError, match="must be called on the root FSDP instance"):
        model.module.blocks[0].load_state_dict({})


def test_bad_input(pool2: RankPool) -> None:
    pool2.run(bad_input)
