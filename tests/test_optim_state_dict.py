"""Optimizer state dicts: every API against torch FSDP1, round trips, interop, errors.

Each scenario trains the same model with the same optimizer for a few steps through fsdp and
through torch FSDP1 (the oracle), then compares what both return: keys (in order), parameter
groups and every value bit for bit (ShardedTensor / DTensor: metadata and local shards).
Round trips save a full optimizer state dict, load it into a fresh model and optimizer and
check that training on gives exactly what training straight on gives.
"""

from __future__ import annotations

import re
import warnings
from typing import Any, Callable, Optional

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests._harness import RankPool
from tests._models import Block, global_batch, lm_loss, local_rows, make_toy

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)


# ----------------------------------------------------------------------------- scenario helpers
def _lib(lib: str) -> Any:
    if lib == "ours":
        import fsdp as m
        import fsdp.wrap as w
    else:
        import torch.distributed.fsdp as m  # type: ignore[no-redef]
        import torch.distributed.fsdp.wrap as w  # type: ignore[no-redef]
    return m, w


def _wrap(lib: str, strategy: str, uop: bool, mesh: bool = False, ignored: bool = False, seed: int = 0, full: Optional[dict] = None) -> nn.Module:
    m, w = _lib(lib)
    model = make_toy(seed)
    if full is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(full[name])
    kwargs: dict[str, Any] = dict(
        auto_wrap_policy=w.ModuleWrapPolicy({Block}),
        sharding_strategy=m.ShardingStrategy[strategy],
        use_orig_params=uop,
    )
    if lib == "torch":
        kwargs["device_id"] = torch.device("cpu")
    if mesh:
        from torch.distributed.device_mesh import init_device_mesh

        kwargs["device_mesh"] = init_device_mesh("cpu", (dist.get_world_size(),))
    if ignored:
        kwargs["ignored_modules"] = [model.head]
    return m.FullyShardedDataParallel(model, **kwargs)


def _groups(model: nn.Module, uop: bool, missing: bool = False) -> list[dict[str, Any]]:
    """Two parameter groups; ``missing`` leaves blocks.2 out."""
    g0, g1 = [], []
    for pname, p in model.named_parameters():
        if missing and "blocks.2." in pname:
            continue
        second = ("bias" in pname) if uop else ("blocks.1." in pname or "blocks.2." in pname)
        (g1 if second else g0).append(p)
    return [{"params": g0}, {"params": g1, "lr": 0.02}]


def _optim(name: str, model: nn.Module, uop: bool, missing: bool = False) -> torch.optim.Optimizer:
    """Two parameter groups; ``missing`` leaves blocks.2 out of the optimizer."""
    groups = _groups(model, uop, missing)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=0.05, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(groups, lr=0.01)
    return torch.optim.AdamW(groups, lr=0.01, weight_decay=0.1)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    rank, ws = dist.get_rank(), dist.get_world_size()
    for step in steps:
        tokens, targets = global_batch(step, ws)
        lm_loss(model(local_rows(tokens, rank, ws)), local_rows(targets, rank, ws)).backward()
        opt.step()
        # A _NamedOptimizer has no zero_grad of its own (it lacks ``defaults``): its inner one's.
        getattr(opt, "_optimizer", opt).zero_grad()


def _pair(strategy: str, uop: bool, optim: str, steps: int = 2, **kw: Any) -> tuple[Any, Any]:
    """(ours model, ours optim), (torch model, torch optim), trained alike."""
    missing = kw.pop("missing", False)
    out = []
    for lib in ("ours", "torch"):
        model = _wrap(lib, strategy, uop, **kw)
        opt = _optim(optim, model, uop, missing)
        _train(model, opt, range(steps))
        out.append((model, opt))
    return out[0], out[1]


def _full_params(model: nn.Module, fsdp_cls: Any) -> dict[str, torch.Tensor]:
    with fsdp_cls.summon_full_params(model, writeback=False):
        return {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in model.named_parameters()}


# ----------------------------------------------------------------------------- comparisons
def _assert_value_equal(a: Any, b: Any, where: str) -> None:
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor, Shard

    if isinstance(a, DTensor) and isinstance(b, ShardedTensor):
        # Ours is a DTensor where torch FSDP1 gives a ShardedTensor (see [Note: No ShardedTensor]):
        # the same global shape, the same chunk of it on this rank, the same values.
        assert a.placements == (Shard(0),), (where, a.placements)
        size = b.metadata().size
        assert a.shape == size, (where, a.shape, size)
        local, shards = a.to_local(), b.local_shards()
        rows = -(-size[0] // a.device_mesh.size()) if size[0] else 0
        if not shards:
            assert local.numel() == 0, where
        else:
            assert len(shards) == 1, where
            assert shards[0].metadata.shard_offsets[0] == rows * a.device_mesh.get_local_rank(), where
            _assert_value_equal(local, shards[0].tensor, where)
        return
    assert type(a) is type(b), f"{where}: {type(a).__name__} vs torch {type(b).__name__}"
    if isinstance(a, ShardedTensor):
        assert a.size() == b.size(), where
        ma, mb = a.metadata(), b.metadata()
        assert ma.shards_metadata == mb.shards_metadata, (where, ma.shards_metadata, mb.shards_metadata)
        assert ma.tensor_properties.dtype == mb.tensor_properties.dtype, where
        la, lb = a.local_shards(), b.local_shards()
        assert len(la) == len(lb), where
        for sa, sb in zip(la, lb):
            assert sa.metadata == sb.metadata, where
            _assert_value_equal(sa.tensor, sb.tensor, where)
    elif isinstance(a, DTensor):
        assert a.shape == b.shape and a.placements == b.placements, (where, a.placements, b.placements)
        assert a.device_mesh.mesh.tolist() == b.device_mesh.mesh.tolist(), where
        _assert_value_equal(a.to_local(), b.to_local(), where)
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device, (where, a.shape, b.shape)
        assert torch.equal(a, b), f"{where}: values differ from torch FSDP1"
    else:
        assert a == b, (where, a, b)


def _settle_torch_after_error() -> None:
    """After making torch FSDP1 raise mid-call: finalize what that call left behind now.

    torch's optimizer state-dict code profiles itself with a class-level SimpleProfiler whose
    context managers are generators; one abandoned by an exception is finalized whenever the
    garbage collector gets to it, and then removes the profiling mark of whatever torch call is
    running at that moment, which fails with KeyError. Collect now and reset the profiler.
    """
    import gc

    from torch.distributed.fsdp._debug_utils import SimpleProfiler

    gc.collect()
    SimpleProfiler.reset()


def _assert_osd_equal(a: dict, b: dict, where: str, ordered: bool = True) -> None:
    """Same keys (in order if ``ordered``), parameter groups and values (bit for bit).

    Bit for bit with use_orig_params too: the FlatParameter layout is torch FSDP1's (16-byte
    aligned original parameters), so shards, foreach kernels and their roundings are the same.
    """
    assert list(a) == list(b), (where, list(a), list(b))
    if not a:
        return
    if ordered:
        assert list(a["state"]) == list(b["state"]), (where, list(a["state"]), list(b["state"]))
    else:
        assert sorted(a["state"], key=str) == sorted(b["state"], key=str), where
    for key in a["state"]:
        sa, sb = a["state"][key], b["state"][key]
        assert sorted(sa) == sorted(sb), (where, key, list(sa), list(sb))
        if ordered:
            assert list(sa) == list(sb), (where, key, list(sa), list(sb))
        for name in sa:
            _assert_value_equal(sa[name], sb[name], f"{where} [{key}][{name}]")
    assert a["param_groups"] == b["param_groups"], (where, a["param_groups"], b["param_groups"])


def _optim_states_equal(a: torch.optim.Optimizer, b: torch.optim.Optimizer, where: str) -> None:
    _assert_osd_equal(a.state_dict(), b.state_dict(), where)


def _snapshot(optim: torch.optim.Optimizer) -> dict:
    import copy

    return copy.deepcopy(optim.state_dict())


def _torch_full(model: nn.Module, optim: torch.optim.Optimizer, uop: bool, legacy: bool = False, rank0_only: bool = False) -> dict:
    """torch FSDP1's full optimizer state dict, avoiding one of its CPU-only bugs.

    With use_orig_params=True and offload_to_cpu=True (the default, and always for the legacy
    full_optim_state_dict) torch returns views of one all-gather buffer that it reuses for
    every state name, because ``.cpu()`` does not copy on CPU: every state but the last one
    ends up holding the last one's values. offload_to_cpu=False makes it clone, and on CPU
    the result is the same as offloading.
    """
    from torch.distributed.fsdp import FullOptimStateDictConfig as TFOC, FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import StateDictType as TSDT

    if legacy and not uop:
        return TorchFSDP.full_optim_state_dict(model, optim, rank0_only=rank0_only)
    with TorchFSDP.state_dict_type(model, TSDT.FULL_STATE_DICT, None, TFOC(offload_to_cpu=not uop, rank0_only=rank0_only)):
        return TorchFSDP.optim_state_dict(model, optim)


# ----------------------------------------------------------------------------- optim_state_dict vs torch
CASES = [
    # (strategy, use_orig_params, optimizer, extra)
    ("FULL_SHARD", False, "adam", {}),
    ("FULL_SHARD", True, "adamw", {}),
    ("SHARD_GRAD_OP", False, "sgd", {}),
    ("SHARD_GRAD_OP", True, "adam", {}),
    ("NO_SHARD", False, "adamw", {}),
    ("NO_SHARD", True, "sgd", {}),
    ("FULL_SHARD", False, "sgd", {"missing": True}),
    ("FULL_SHARD", True, "adam", {"missing": True}),
    ("FULL_SHARD", False, "adam", {"ignored": True}),
]


# The cases _load_checks also runs (indices into CASES), and _rank0_checks (FULL_SHARD, True, adamw).
_LOAD_CASES = (*range(6), 7)
_RANK0_CASE = 1


def _full_and_sharded_match_torch(loading: bool) -> tuple[int, int, int]:
    """Per case, one trained pair (ours, torch FSDP1's): the saved optimizer state dicts match
    torch's, and (``loading``) the loaders too (_load_checks, the cases of _LOAD_CASES) and the
    rank0_only / offload configs (_rank0_checks, _RANK0_CASE). Returns how many cases each compared."""
    from fsdp import FullyShardedDataParallel as FSDP, ShardedOptimStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import ShardedOptimStateDictConfig as TSOC, StateDictType as TSDT

    checked = loaded = rank0 = 0
    for index, (strategy, uop, optim, extra) in enumerate(CASES):
        where = f"{strategy} uop={uop} {optim} {extra}"
        (m1, o1), (m2, o2) = _pair(strategy, uop, optim, **dict(extra))
        before = _snapshot(o1)
        _assert_osd_equal(FSDP.optim_state_dict(m1, o1), _torch_full(m2, o2, uop), "full " + where)
        with FSDP.state_dict_type(m1, StateDictType.SHARDED_STATE_DICT), TorchFSDP.state_dict_type(m2, TSDT.SHARDED_STATE_DICT):
            _assert_osd_equal(FSDP.optim_state_dict(m1, o1), TorchFSDP.optim_state_dict(m2, o2), "sharded " + where)
        # The legacy APIs.
        _assert_osd_equal(FSDP.full_optim_state_dict(m1, o1), _torch_full(m2, o2, uop, legacy=True, rank0_only=True), "legacy full " + where)
        _assert_osd_equal(
            FSDP.full_optim_state_dict(m1, o1, rank0_only=False),
            _torch_full(m2, o2, uop, legacy=True, rank0_only=False),
            "legacy full all ranks " + where,
        )
        _assert_osd_equal(FSDP.sharded_optim_state_dict(m1, o1), TorchFSDP.sharded_optim_state_dict(m2, o2), "legacy sharded " + where)
        checked += 1
        _assert_osd_equal(o1.state_dict(), before, "optimizer after saving " + where)
        if loading and index in _LOAD_CASES:  # the same pair: loading reads, it changes nothing here
            _load_checks(m1, o1, m2, o2, uop, where)
            loaded += 1
        if loading and index == _RANK0_CASE:  # test_rank0_only_and_offload_configs_match_torch's uop=True pair
            _rank0_checks((m1, o1), (m2, o2), uop)
            rank0 += 1
    # DTensor: torch FSDP1 uses DTensor when built with a device_mesh.
    for uop in (False, True):
        (m1, o1), (m2, o2) = _pair("FULL_SHARD", uop, "adam", mesh=True)
        with FSDP.state_dict_type(m1, StateDictType.SHARDED_STATE_DICT, None, ShardedOptimStateDictConfig(_use_dtensor=True)):
            ours = FSDP.optim_state_dict(m1, o1)
        with TorchFSDP.state_dict_type(m2, TSDT.SHARDED_STATE_DICT):
            theirs = TorchFSDP.optim_state_dict(m2, o2)
        _assert_osd_equal(ours, theirs, f"dtensor uop={uop}")
        checked += 1
    return checked, loaded, rank0


# world size -> each rank's (cases saved, cases loaded, rank0 cases): one job per world size runs
# the saving, loading and rank0_only checks on the same trained pairs (each built and trained once).
_SAVE_AND_LOAD: dict[int, list[tuple[int, ...]]] = {}


def _save_and_load(pool: RankPool) -> list[tuple[int, ...]]:
    if pool.world_size not in _SAVE_AND_LOAD:
        _SAVE_AND_LOAD[pool.world_size] = [tuple(r) for r in pool.run(_full_and_sharded_match_torch, pool.world_size > 1)]
    return _SAVE_AND_LOAD[pool.world_size]


@pytest.mark.parametrize("dist_pool", [1, 2, 4], indirect=True)
def test_optim_state_dict_full_and_sharded_match_torch(dist_pool: RankPool) -> None:
    assert [saved for saved, _, _ in _save_and_load(dist_pool)] == [len(CASES) + 2] * dist_pool.world_size


def _rank0_only_and_offload(uops: tuple[bool, ...]) -> None:
    for uop in uops:
        _rank0_checks(*_pair("FULL_SHARD", uop, "adamw"), uop)


def _rank0_checks(ours_pair: tuple[Any, Any], torch_pair: tuple[Any, Any], uop: bool) -> None:
    """FULL optimizer state dicts with rank0_only and offload_to_cpu both ways, the SHARDED one
    without offload, equal torch's; the saved copy does not alias the optimizer's state."""
    from fsdp import FullOptimStateDictConfig, FullyShardedDataParallel as FSDP, ShardedOptimStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullOptimStateDictConfig as TFOC, FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import ShardedOptimStateDictConfig as TSOC, StateDictType as TSDT

    (m1, o1), (m2, o2) = ours_pair, torch_pair
    for rank0_only in (False, True):
        for offload in (False, True):
            with FSDP.state_dict_type(m1, StateDictType.FULL_STATE_DICT, None, FullOptimStateDictConfig(offload_to_cpu=offload, rank0_only=rank0_only)):
                ours = FSDP.optim_state_dict(m1, o1)
            # torch with use_orig_params must not offload on CPU (see _torch_full).
            torch_offload = offload and not uop
            with TorchFSDP.state_dict_type(m2, TSDT.FULL_STATE_DICT, None, TFOC(offload_to_cpu=torch_offload, rank0_only=rank0_only)):
                theirs = TorchFSDP.optim_state_dict(m2, o2)
            _assert_osd_equal(ours, theirs, f"uop={uop} rank0_only={rank0_only} offload={offload}")
            if rank0_only and dist.get_rank() != 0:
                assert ours == {}
    with FSDP.state_dict_type(m1, StateDictType.SHARDED_STATE_DICT, None, ShardedOptimStateDictConfig(offload_to_cpu=False)):
        ours = FSDP.optim_state_dict(m1, o1)
    with TorchFSDP.state_dict_type(m2, TSDT.SHARDED_STATE_DICT, None, TSOC(offload_to_cpu=False)):
        theirs = TorchFSDP.optim_state_dict(m2, o2)
    _assert_osd_equal(ours, theirs, f"sharded no offload uop={uop}")
    # The state dict does not alias the optimizer's state.
    before = _snapshot(o1)
    full = FSDP.optim_state_dict(m1, o1)
    for entry in full["state"].values():
        for value in entry.values():
            if isinstance(value, torch.Tensor):
                value.add_(1000.0)
    _assert_osd_equal(o1.state_dict(), before, "optimizer after mutating the saved copy")


@pytest.mark.parametrize("dist_pool", [2, 4], indirect=True)
def test_rank0_only_and_offload_configs_match_torch(dist_pool: RankPool) -> None:
    """use_orig_params=False here; True on CASES[1]'s pair (the same FULL_SHARD AdamW pair) in
    the saving test's job (_save_and_load)."""
    dist_pool.run(_rank0_only_and_offload, (False,))
    assert [rank0 for _, _, rank0 in _save_and_load(dist_pool)] == [1] * dist_pool.world_size


def _hybrid_rank0_only() -> None:
    """HYBRID_SHARD (shard in pairs): rank0_only gathers only within rank 0's pair."""
    from fsdp import FullOptimStateDictConfig, FullyShardedDataParallel as FSDP, ShardingStrategy, StateDictType
    from torch.distributed.fsdp import FullOptimStateDictConfig as TFOC, FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import StateDictType as TSDT

    from tests.test_hybrid_shard import _layouts

    mesh = _layouts()["mesh"]
    for uop in (False, True):
        pairs = []
        for lib in ("ours", "torch"):
            m, w = _lib(lib)
            kwargs: dict[str, Any] = {"device_id": torch.device("cpu")} if lib == "torch" else {}
            model = m.FullyShardedDataParallel(
                make_toy(), auto_wrap_policy=w.ModuleWrapPolicy({Block}), use_orig_params=uop,
                sharding_strategy=m.ShardingStrategy.HYBRID_SHARD, **mesh, **kwargs,
            )
            opt = _optim("adam", model, uop)
            _train(model, opt, range(2))
            pairs.append((model, opt))
        (m1, o1), (m2, o2) = pairs
        assert m1._fsdp_state.sharding_strategy is ShardingStrategy.HYBRID_SHARD
        for rank0_only in (False, True):
            with FSDP.state_dict_type(m1, StateDictType.FULL_STATE_DICT, None, FullOptimStateDictConfig(rank0_only=rank0_only)):
                ours = FSDP.optim_state_dict(m1, o1)
            with TorchFSDP.state_dict_type(m2, TSDT.FULL_STATE_DICT, None, TFOC(offload_to_cpu=not uop, rank0_only=rank0_only)):
                theirs = TorchFSDP.optim_state_dict(m2, o2)
            _assert_osd_equal(ours, theirs, f"hybrid uop={uop} rank0_only={rank0_only}")
            assert (ours == {}) == (rank0_only and dist.get_rank() != 0)


def test_hybrid_rank0_only_matches_torch(pool4: RankPool) -> None:
    pool4.run(_hybrid_rank0_only)


# ----------------------------------------------------------------------------- loading
def _assert_loads_back(out: dict, optim: torch.optim.Optimizer, where: str) -> None:
    """``out`` (from optim_state_dict_to_load) is the optimizer's own state dict."""
    _assert_osd_equal(out, optim.state_dict(), where, ordered=False)


def _load_checks(m1: nn.Module, o1: torch.optim.Optimizer, m2: nn.Module, o2: torch.optim.Optimizer, uop: bool, where: str) -> None:
    """optim_state_dict_to_load and the legacy loaders give what torch's give, from either side.

    The per-rank results must equal torch's bit for bit, with use_orig_params too (the same
    aligned FlatParameter layout), and torch's full state dict loaded through ours gives back
    our optimizer's own state.
    """
    from fsdp import FullyShardedDataParallel as FSDP, OptimStateKeyType, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import OptimStateKeyType as TKey, StateDictType as TSDT

    full1, full2 = FSDP.optim_state_dict(m1, o1), _torch_full(m2, o2, uop)
    rank0_src = full1 if dist.get_rank() == 0 else None
    loaded = [
        ("to_load", FSDP.optim_state_dict_to_load(m1, o1, full1)),
        ("shard_full", FSDP.shard_full_optim_state_dict(full1, m1, optim=o1)),
        ("scatter_full", FSDP.scatter_full_optim_state_dict(rank0_src, m1, optim=o1)),
    ]
    for name, out in loaded:
        _assert_loads_back(out, o1, f"{name} {where}")
    with FSDP.state_dict_type(m1, StateDictType.SHARDED_STATE_DICT), TorchFSDP.state_dict_type(m2, TSDT.SHARDED_STATE_DICT):
        sh1, sh2 = FSDP.optim_state_dict(m1, o1), TorchFSDP.optim_state_dict(m2, o2)
        _assert_loads_back(FSDP.optim_state_dict_to_load(m1, o1, sh1), o1, "sharded to_load " + where)
    _assert_loads_back(FSDP.flatten_sharded_optim_state_dict(sh1, m1, o1), o1, "flatten_sharded " + where)
    for src in (full1, full2):
        _assert_osd_equal(
            FSDP.optim_state_dict_to_load(m1, o1, src),
            TorchFSDP.optim_state_dict_to_load(m2, o2, src),
            "to_load vs torch " + where, ordered=False,
        )
        _assert_osd_equal(
            FSDP.shard_full_optim_state_dict(src, m1, optim=o1),
            TorchFSDP.shard_full_optim_state_dict(src, m2, optim=o2),
            "shard_full vs torch " + where, ordered=False,
        )
        rank0_src = src if dist.get_rank() == 0 else None
        _assert_osd_equal(
            FSDP.scatter_full_optim_state_dict(rank0_src, m1, optim=o1),
            TorchFSDP.scatter_full_optim_state_dict(rank0_src, m2, optim=o2),
            "scatter_full vs torch " + where, ordered=False,
        )
    _assert_osd_equal(
        FSDP.flatten_sharded_optim_state_dict(sh1, m1, o1),
        TorchFSDP.flatten_sharded_optim_state_dict(sh2, m2, o2),
        "flatten_sharded vs torch " + where, ordered=False,
    )
    # torch's full state dict loads through ours to our own state.
    _assert_osd_equal(
        FSDP.optim_state_dict_to_load(m1, o1, full2),
        FSDP.optim_state_dict_to_load(m1, o1, full1),
        "torch's state through ours " + where, ordered=False,
    )
    # rekey: names <-> IDs, for the wrapped model (the optimizer's IDs) and an unwrapped one.
    if uop:
        ids1 = FSDP.rekey_optim_state_dict(full1, OptimStateKeyType.PARAM_ID, m1, optim=o1)
        ids2 = TorchFSDP.rekey_optim_state_dict(full2, TKey.PARAM_ID, m2, optim=o2)
        _assert_osd_equal(ids1, ids2, "rekey to IDs " + where)
        names1 = FSDP.rekey_optim_state_dict(ids1, OptimStateKeyType.PARAM_NAME, m1, optim=o1)
        names2 = TorchFSDP.rekey_optim_state_dict(ids2, TKey.PARAM_NAME, m2, optim=o2)
        _assert_osd_equal(names1, names2, "rekey to names " + where)
    plain = make_toy()
    ids1 = FSDP.rekey_optim_state_dict(full1, OptimStateKeyType.PARAM_ID, plain)
    ids2 = TorchFSDP.rekey_optim_state_dict(full2, TKey.PARAM_ID, plain)
    _assert_osd_equal(ids1, ids2, "rekey unwrapped " + where)
    assert FSDP.rekey_optim_state_dict(full1, OptimStateKeyType.PARAM_NAME, m1) is full1


@pytest.mark.parametrize("dist_pool", [2, 4], indirect=True)
def test_loading_matches_torch(dist_pool: RankPool) -> None:
    """_load_checks on CASES[:6] and CASES[7], run in the saving test's job (_save_and_load)."""
    assert [loaded for _, loaded, _ in _save_and_load(dist_pool)] == [len(_LOAD_CASES)] * dist_pool.world_size


def _round_trip(strategy: str, uop: bool, optim: str, lib_save: str, lib_load: str, rank0_only: bool) -> None:
    """Save after 2 steps, load into a fresh model and optimizer, 2 more steps == 4 steps straight."""
    m_ours, _ = _lib("ours")
    m_torch, _ = _lib("torch")
    cls = {"ours": m_ours.FullyShardedDataParallel, "torch": m_torch.FullyShardedDataParallel}
    mod = {"ours": m_ours, "torch": m_torch}
    straight = _wrap(lib_load, strategy, uop)
    so = _optim(optim, straight, uop)
    _train(straight, so, range(4))

    saver = _wrap(lib_save, strategy, uop)
    sopt = _optim(optim, saver, uop)
    _train(saver, sopt, range(2))
    S = mod[lib_save]
    # torch with use_orig_params must not offload on CPU (see _torch_full).
    offload = not (lib_save == "torch" and uop)
    with S.FullyShardedDataParallel.state_dict_type(
        saver, S.StateDictType.FULL_STATE_DICT, None, S.FullOptimStateDictConfig(offload_to_cpu=offload, rank0_only=rank0_only)
    ):
        osd = S.FullyShardedDataParallel.optim_state_dict(saver, sopt)
    params = _full_params(saver, cls[lib_save])

    fresh = _wrap(lib_load, strategy, uop, seed=123, full=params)
    fopt = _optim(optim, fresh, uop)
    L = mod[lib_load]
    with L.FullyShardedDataParallel.state_dict_type(
        fresh, L.StateDictType.FULL_STATE_DICT, None, L.FullOptimStateDictConfig(rank0_only=rank0_only)
    ):
        L.FullyShardedDataParallel.optim_state_dict_to_load(fresh, fopt, osd, load_directly=True)
    _train(fresh, fopt, range(2, 4))
    a, b = _full_params(fresh, cls[lib_load]), _full_params(straight, cls[lib_load])
    # Bit for bit, between libraries too (the same flat layout, also with use_orig_params).
    for name in a:
        _assert_value_equal(a[name], b[name], f"{name}: resumed training vs training straight")
    _assert_osd_equal(fopt.state_dict(), so.state_dict(), "resumed optimizer", ordered=False)


@pytest.mark.parametrize(
    "strategy,uop,optim",
    [("FULL_SHARD", False, "adam"), ("FULL_SHARD", True, "adamw"), ("SHARD_GRAD_OP", False, "sgd"), ("NO_SHARD", True, "adam")],
)
def test_round_trip_resumes_bit_for_bit(pool2: RankPool, strategy: str, uop: bool, optim: str) -> None:
    pool2.run(_round_trip, strategy, uop, optim, "ours", "ours", False)
    pool2.run(_round_trip, strategy, uop, optim, "ours", "ours", True)


@pytest.mark.parametrize("uop", [False, True])
def test_round_trip_between_fsdp_and_torch(pool2: RankPool, uop: bool) -> None:
    pool2.run(_round_trip, "FULL_SHARD", uop, "adam", "ours", "torch", False)
    pool2.run(_round_trip, "FULL_SHARD", uop, "adam", "torch", "ours", False)


def test_round_trip_world_sizes_1_and_4(pool1: RankPool, pool4: RankPool) -> None:
    pool1.run(_round_trip, "FULL_SHARD", False, "adam", "ours", "ours", False)
    pool4.run(_round_trip, "FULL_SHARD", True, "adam", "ours", "ours", True)


def _save_full(uop: bool) -> dict:
    from fsdp import FullyShardedDataParallel as FSDP

    model = _wrap("ours", "FULL_SHARD", uop)
    opt = _optim("adam", model, uop)
    _train(model, opt, range(2))
    return FSDP.optim_state_dict(model, opt)


def _load_full(osd: dict, uop: bool) -> None:
    """A state dict saved at another world size loads to the same full state."""
    from fsdp import FullyShardedDataParallel as FSDP

    model = _wrap("ours", "FULL_SHARD", uop)
    opt = _optim("adam", model, uop)
    FSDP.optim_state_dict_to_load(model, opt, osd, load_directly=True)
    _assert_osd_equal(FSDP.optim_state_dict(model, opt), osd, "reloaded at another world size")


def test_full_state_dict_moves_between_world_sizes(pool2: RankPool, pool4: RankPool) -> None:
    for uop in (False, True):
        osd = pool4.run(_save_full, uop)[0]
        pool2.run(_load_full, osd, uop)


# ----------------------------------------------------------------------------- named optimizers
def _named_optim(model: nn.Module, uop: bool) -> Any:
    """torch's _NamedOptimizer (Adam, _optim's two groups): its state dict is keyed by the
    names ``model.named_parameters()`` gives (FlatParameters' or original parameters')."""
    from torch.distributed.optim import _NamedOptimizer

    return _NamedOptimizer(model.named_parameters(), torch.optim.Adam, param_groups=_groups(model, uop), lr=0.01)


def _gathered_pieces(osd: dict) -> dict[str, dict[str, torch.Tensor]]:
    """Each positive-dimension state of a per-rank state dict, its ranks' pieces concatenated."""
    local = {
        key: {name: v.reshape(-1) for name, v in entry.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
        for key, entry in osd["state"].items()
    }
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key in sorted({key for pieces in everyone for key in pieces}):
        names = sorted({name for pieces in everyone if key in pieces for name in pieces[key]})
        out[key] = {name: torch.cat([p[key][name] for p in everyone if name in p.get(key, {})]) for name in names}
    return out


def _assert_named_uop_like_torch(ours: dict, theirs: dict, where: str) -> None:
    """use_orig_params: optim_state_dict_to_load's results against torch's, rank by rank.

    The same flat layout gives each rank the same pieces, bit for bit; where a rank holds no
    part of a parameter both keep the named optimizer's current state for it (``init_state``).
    The pieces concatenated over ranks must also be the whole loaded state.
    """
    _assert_osd_equal(ours, theirs, where, ordered=False)
    full_a, full_b = _gathered_pieces(ours), _gathered_pieces(theirs)
    assert list(full_a) == list(full_b), where
    for key in full_a:
        assert list(full_a[key]) == list(full_b[key]), (where, key)
        for name in full_a[key]:
            _assert_value_equal(full_a[key][name], full_b[key][name], f"{where} gathered [{key}][{name}]")


def _named_optimizer_round_trip(uop: bool) -> None:
    """NamedOptimizer: save, load with is_named_optimizer=True, train on; against torch FSDP1.

    Saving from the named optimizer (keyed by its names) gives what torch gives; loading gives
    a state dict keyed by the optimizer's names, as torch's does; resuming after 2 steps gives
    exactly the parameters of 4 steps straight, and (here, even with use_orig_params) exactly
    torch's.
    """
    from fsdp import FullOptimStateDictConfig, FullyShardedDataParallel as FSDP, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import StateDictType as TSDT

    straight = _wrap("ours", "FULL_SHARD", uop)
    so = _named_optim(straight, uop)
    _train(straight, so, range(4))

    models, opts = {}, {}
    for lib in ("ours", "torch"):
        models[lib] = _wrap(lib, "FULL_SHARD", uop)
        opts[lib] = _named_optim(models[lib], uop)
        _train(models[lib], opts[lib], range(2))
    own = opts["ours"].state_dict()
    names = dict(models["ours"].named_parameters())
    assert own["state"] and set(own["state"]) <= set(names), list(own["state"])
    assert all(set(g["params"]) <= set(names) for g in own["param_groups"])
    before = _snapshot(opts["ours"])
    osd = FSDP.optim_state_dict(models["ours"], opts["ours"])
    _assert_osd_equal(osd, _torch_full(models["torch"], opts["torch"], uop), f"named save uop={uop}")
    with FSDP.state_dict_type(models["ours"], StateDictType.SHARDED_STATE_DICT), TorchFSDP.state_dict_type(models["torch"], TSDT.SHARDED_STATE_DICT):
        sharded = FSDP.optim_state_dict(models["ours"], opts["ours"])
        theirs = TorchFSDP.optim_state_dict(models["torch"], opts["torch"])
        _assert_osd_equal(sharded, theirs, f"named sharded save uop={uop}")
    _assert_osd_equal(opts["ours"].state_dict(), before, "named optimizer after saving")
    params = _full_params(models["ours"], FSDP)

    # Fresh models with the saved parameters; a _NamedOptimizer loads only into initialized state.
    fresh, fopts, outs = {}, {}, {}
    for lib, cls in (("ours", FSDP), ("torch", TorchFSDP)):
        fresh[lib] = _wrap(lib, "FULL_SHARD", uop, seed=123, full=params)
        fopts[lib] = _named_optim(fresh[lib], uop)
        fopts[lib].init_state()
        fopts[lib]._optimizer.zero_grad()
        outs[lib] = cls.optim_state_dict_to_load(fresh[lib], fopts[lib], osd, is_named_optimizer=True)
    out = outs["ours"]
    optim_names = {n for n, _ in fresh["ours"].named_parameters()}
    assert set(out["state"]) <= optim_names and out["state"], list(out["state"])
    if uop:
        _assert_named_uop_like_torch(out, outs["torch"], "named to_load vs torch")
    else:
        _assert_osd_equal(out, outs["torch"], "named to_load vs torch", ordered=False)
    # Saved from a plain optimizer (its groups list parameters in ID order, not by name), the
    # same training loads to the same, groups sorted by name.
    plain = _wrap("ours", "FULL_SHARD", uop)
    popt = _optim("adam", plain, uop)
    _train(plain, popt, range(2))
    from_plain = FSDP.optim_state_dict_to_load(fresh["ours"], fopts["ours"], FSDP.optim_state_dict(plain, popt), is_named_optimizer=True)
    _assert_osd_equal(from_plain, out, "a plain optimizer's state into the named one", ordered=False)
    for group in out["param_groups"]:
        assert group["params"] == sorted(group["params"]), group["params"]
    for lib in ("ours", "torch"):
        fopts[lib].load_state_dict(outs[lib])
        _assert_osd_equal(fopts[lib].state_dict(), outs[lib], f"{lib} named optimizer after loading", ordered=False)
    # The sharded state dict and rank0_only (with load_directly) give the same.
    with FSDP.state_dict_type(fresh["ours"], StateDictType.SHARDED_STATE_DICT):
        _assert_osd_equal(
            FSDP.optim_state_dict_to_load(fresh["ours"], fopts["ours"], sharded, is_named_optimizer=True),
            out, "named sharded to_load",
        )
    with FSDP.state_dict_type(fresh["ours"], StateDictType.FULL_STATE_DICT, None, FullOptimStateDictConfig(rank0_only=True)):
        src = osd if dist.get_rank() == 0 else None
        again = FSDP.optim_state_dict_to_load(fresh["ours"], fopts["ours"], src, is_named_optimizer=True, load_directly=True)
    _assert_osd_equal(again, out, "named rank0_only to_load")
    _assert_osd_equal(fopts["ours"].state_dict(), out, "named optimizer after load_directly", ordered=False)

    for lib in ("ours", "torch"):
        _train(fresh[lib], fopts[lib], range(2, 4))
    a, b = _full_params(fresh["ours"], FSDP), _full_params(straight, FSDP)
    c = _full_params(fresh["torch"], TorchFSDP)
    assert list(a) == list(b) == list(c)
    for name in a:
        _assert_value_equal(a[name], b[name], f"{name}: resumed vs straight (uop={uop})")
        _assert_value_equal(a[name], c[name], f"{name}: resumed vs torch resumed (uop={uop})")
    resumed, straight_osd = fopts["ours"].state_dict(), so.state_dict()
    _assert_osd_equal(resumed, fopts["torch"].state_dict(), "resumed named optimizer vs torch's", ordered=False)
    # As training straight on, except that init_state gave both libraries' resumed named
    # optimizers state for the parameters this rank holds none of (use_orig_params: their
    # .grad is None here, so the straight run's optimizer never made any; empty tensors).
    extra = {k: v for k, v in resumed["state"].items() if k not in straight_osd["state"]}
    assert not extra or uop, list(extra)
    assert all(v.numel() == 0 for entry in extra.values() for v in entry.values() if isinstance(v, torch.Tensor) and v.dim() > 0), list(extra)
    held = {"state": {k: v for k, v in resumed["state"].items() if k not in extra}, "param_groups": resumed["param_groups"]}
    _assert_osd_equal(held, straight_osd, "resumed named optimizer vs straight", ordered=False)


@pytest.mark.parametrize("uop", [False, True])
@pytest.mark.parametrize("dist_pool", [2, 4], indirect=True)
def test_named_optimizer_round_trip_matches_torch(dist_pool: RankPool, uop: bool) -> None:
    dist_pool.run(_named_optimizer_round_trip, uop)


# ----------------------------------------------------------------------------- errors
def _expect(exc: type, match: str, fn: Callable[[], Any]) -> None:
    with pytest.raises(exc, match=match):
        fn()


def _errors() -> None:
    from fsdp import FullyShardedDataParallel as FSDP, FullOptimStateDictConfig, OptimStateKeyType, StateDictType

    for uop in (False, True):
        model = _wrap("ours", "FULL_SHARD", uop)
        opt = _optim("adam", model, uop)
        _train(model, opt, range(1))
        full = FSDP.optim_state_dict(model, opt)
        before = {k: {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in s.items()} for k, s in opt.state_dict()["state"].items()}

        def check_unchanged() -> None:
            now = opt.state_dict()["state"]
            assert list(now) == list(before)
            for k in now:
                for n in now[k]:
                    assert torch.equal(torch.as_tensor(now[k][n]), torch.as_tensor(before[k][n]))

        wrong_name = {"state": {**full["state"], "blocks.9.fc1.weight": full["state"]["blocks.0.fc1.weight"]}, "param_groups": full["param_groups"]}
        _expect(
            ValueError,
            r"fsdp: the optimizer state dict has state for 'blocks\.9\.fc1\.weight', which is not a "
            r"parameter of this model\. Was it saved from another model\? The model's parameters "
            r"are: 'embed\.weight' \(13, 7\), ",
            lambda: FSDP.optim_state_dict_to_load(model, opt, wrong_name, load_directly=True),
        )
        bad_state = dict(full["state"])
        bad_state["blocks.1.fc1.weight"] = {**bad_state["blocks.1.fc1.weight"], "exp_avg": torch.zeros(7, 11)}
        wrong_shape = {"state": bad_state, "param_groups": full["param_groups"]}
        _expect(
            ValueError,
            r"fsdp: optimizer state 'exp_avg' of parameter 'blocks\.1\.fc1\.weight' has shape \(7, 11\), "
            r"but the parameter has shape \(11, 7\)\. Was it saved from another model\?",
            lambda: FSDP.optim_state_dict_to_load(model, opt, wrong_shape, load_directly=True),
        )
        # (The first ID with state differs by rank with use_orig_params: a parameter a rank
        # holds none of has no state there.)
        _expect(
            ValueError,
            r"fsdp: optimizer state key \d+ is not a parameter name\. .*rekey_optim_state_dict\(osd, "
            r"OptimStateKeyType\.PARAM_NAME, model\)",
            lambda: FSDP.optim_state_dict_to_load(model, opt, opt.state_dict()),
        )
        bad_group = {"state": full["state"], "param_groups": [{**full["param_groups"][0], "params": ["nope.weight"]}]}
        _expect(
            ValueError,
            r"fsdp: a parameter group of the optimizer state dict lists 'nope\.weight', which is not a parameter",
            lambda: FSDP.optim_state_dict_to_load(model, opt, bad_group, load_directly=True),
        )
        _expect(
            ValueError,
            r"fsdp: the optimizer state dict to load must be a dict with the key 'state'",
            lambda: FSDP.optim_state_dict_to_load(model, opt, {"param_groups": []}),
        )
        # rank0_only: rank 0's error reaches every rank (no hang), nothing changes.
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, None, FullOptimStateDictConfig(rank0_only=True)):
            src = wrong_shape if dist.get_rank() == 0 else {}
            _expect(
                ValueError,
                r"fsdp: optimizer state 'exp_avg' of parameter 'blocks\.1\.fc1\.weight' has shape \(7, 11\)",
                lambda: FSDP.optim_state_dict_to_load(model, opt, src, load_directly=True),
            )
        _expect(
            ValueError,
            r"fsdp: parameter ID 99 is out of range: the optimizer has",
            lambda: FSDP.rekey_optim_state_dict({"state": {99: {}}, "param_groups": []}, OptimStateKeyType.PARAM_NAME, model, optim=opt),
        )
        _expect(
            ValueError,
            r"fsdp: optim_state_key_type must be OptimStateKeyType\.PARAM_NAME or PARAM_ID",
            lambda: FSDP.rekey_optim_state_dict(full, "names", model),
        )
        check_unchanged()
        _named_errors(model, uop, full, wrong_name)
    # Flat parameters share scalar state: differing 'step's cannot be flattened.
    model = _wrap("ours", "FULL_SHARD", False)
    opt = _optim("adam", model, False)
    _train(model, opt, range(1))
    full = FSDP.optim_state_dict(model, opt)
    full["state"]["blocks.0.fc1.bias"]["step"] = torch.tensor(7.0)
    _expect(
        ValueError,
        r"^All unflattened parameters comprising a single flat parameter must have scalar state "
        r"with the same value and dtype \(fsdp: the parameters \['blocks\.0\.norm\.weight', .*\] "
        r"share a FlatParameter, so their scalar optimizer state 'step' must be present for all "
        r"of them and equal",
        lambda: FSDP.optim_state_dict_to_load(model, opt, full),
    )
    _expect(
        ValueError,
        r"fsdp: the model contains no FullyShardedDataParallel instance",
        lambda: FSDP.optim_state_dict(make_toy(), opt),
    )
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == dist.get_world_size()


def _named_errors(model: nn.Module, uop: bool, full: dict, wrong_name: dict) -> None:
    """A named optimizer: bad keys and foreign parameters are named; nothing changes."""
    from fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.optim import _NamedOptimizer

    nopt = _named_optim(model, uop)
    nopt.init_state()
    nopt._optimizer.zero_grad()
    before = _snapshot(nopt)
    own = nopt.state_dict()
    _expect(
        ValueError,
        r"fsdp: the optimizer state dict has state for 'blocks\.9\.fc1\.weight', which is not a "
        r"parameter of this model",
        lambda: FSDP.optim_state_dict_to_load(model, nopt, wrong_name, is_named_optimizer=True, load_directly=True),
    )
    bad_group = {"state": full["state"], "param_groups": [{**full["param_groups"][0], "params": ["nope.weight"]}]}
    _expect(
        ValueError,
        r"fsdp: a parameter group of the optimizer state dict lists 'nope\.weight', which is not a parameter",
        lambda: FSDP.optim_state_dict_to_load(model, nopt, bad_group, is_named_optimizer=True, load_directly=True),
    )
    # Saving: the named optimizer's own state dict keyed by cleaned FQNs instead of its names.
    name = next(iter(own["state"]))
    clean = name.replace("_fsdp_wrapped_module.", "")
    by_fqn = {"state": {clean: own["state"][name]}, "param_groups": own["param_groups"]}
    _expect(
        ValueError,
        rf"fsdp: the named optimizer's state dict has state for '{re.escape(clean)}', which is not "
        rf"the name of a parameter the optimizer holds\. Its keys must be the names "
        rf"model\.named_parameters\(\) gives the optimizer's parameters: '_fsdp_wrapped_module\.",
        lambda: FSDP.optim_state_dict(model, nopt, by_fqn),
    )
    mixed = {"state": {0: own["state"][name], name: own["state"][name]}, "param_groups": []}
    _expect(
        ValueError,
        r"fsdp: the optimizer state dict mixes parameter names \(\['.*'\]\) and other keys \(\[0\]\)",
        lambda: FSDP.optim_state_dict(model, nopt, mixed),
    )
    stray = _NamedOptimizer([("stray", nn.Parameter(torch.zeros(3)))], torch.optim.Adam, lr=0.01)
    _expect(
        ValueError,
        r"fsdp: the named optimizer holds a parameter of shape \(3,\) \(ID 0\) that is not a "
        r"parameter of the model",
        lambda: FSDP.optim_state_dict_to_load(model, stray, full, is_named_optimizer=True),
    )
    _assert_osd_equal(nopt.state_dict(), before, f"named optimizer after errors uop={uop}")


def test_errors_are_clear_and_change_nothing(pool2: RankPool) -> None:
    pool2.run(_errors)


def _saved_state_aliases() -> list[tuple[str, bool, bool, int]]:
    """(strategy, use_orig_params, offload_to_cpu, entries sharing storage with the optimizer)."""
    m, _ = _lib("ours")
    rows = []
    for strategy in ("FULL_SHARD", "NO_SHARD"):
        for uop in (False, True):
            model = _wrap("ours", strategy, uop)
            opt = _optim("adamw", model, uop)
            _train(model, opt, range(2))
            own = {t.untyped_storage().data_ptr() for s in opt.state.values() for t in s.values() if torch.is_tensor(t)}
            for offload in (False, True):
                configs = (m.FullStateDictConfig(offload_to_cpu=offload), m.FullOptimStateDictConfig(offload_to_cpu=offload))
                with m.FullyShardedDataParallel.state_dict_type(model, m.StateDictType.FULL_STATE_DICT, *configs):
                    osd = m.FullyShardedDataParallel.optim_state_dict(model, opt)
                shared = sum(
                    1
                    for state in osd["state"].values()
                    for value in state.values()
                    if torch.is_tensor(value) and value.untyped_storage().data_ptr() in own
                )
                rows.append((strategy, uop, offload, shared))
    return rows


@pytest.mark.parametrize("dist_pool", [1, 2], indirect=True)
def test_saved_state_is_not_aliased(dist_pool: RankPool) -> None:
    """The saved optimizer state shares no storage with the optimizer's own state, so loading it
    into another optimizer (or editing it) never moves this one. Found by the CUDA lane: at world
    size 1 torch FSDP1 returns its optimizer's own tensors (views of the flat state, and the step
    tensors themselves), and a second optimizer loaded from that dict stepped the first one too."""
    for rows in dist_pool.run(_saved_state_aliases):
        assert [row for row in rows if row[3]] == [], rows
        assert len(rows) == 8
