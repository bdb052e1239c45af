"""Optimizer state dicts when ranks list their parameters in different orders, or lack some.

torch FSDP1 keys everything that crosses ranks by parameter names, so an optimizer built from
``reversed(list(model.parameters()))`` on odd ranks, or with its parameter groups in another
order, saves and loads as usual. Each scenario here trains fsdp and torch FSDP1 (the oracle)
with the same per-rank orders and checks every optimizer state-dict API: saved values equal
torch's; every loader gives back exactly the optimizer's own state; and training on after a
load equals training straight on, bit for bit.

When a rank's optimizer lacks state another rank has, every rank raises torch FSDP1's exception
type naming the ranks and parameters, before any collective could go out of step (each run has
a bounded time: a hang fails the test instead of stalling it).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests._harness import RankPool
from tests.test_optim_state_dict import (
    _assert_osd_equal,
    _assert_value_equal,
    _full_params,
    _groups,
    _lib,
    _settle_torch_after_error,
    _torch_full,
    _train,
    _wrap,
)

# Each run is bounded: a rank left waiting in a collective fails the test in this time.
_BOUND_S = 240.0


# ----------------------------------------------------------------------------- per-rank orders
def _optim_in_order(model: nn.Module, uop: bool, scenario: str) -> torch.optim.Optimizer:
    """Adam over the model's parameters; odd ranks list them differently.

    ``reversed``: one group, ``reversed(list(model.parameters()))`` on odd ranks.
    ``groups_reversed``: two groups (the second with lr 0.02), whose order and whose parameters'
    order are reversed on odd ranks.
    ``same``: model order everywhere.
    """
    odd = dist.get_rank() % 2 == 1
    if scenario == "reversed":
        params = list(model.parameters())
        return torch.optim.Adam(list(reversed(params)) if odd else params, lr=0.01)
    groups = _groups(model, uop)
    if scenario == "groups_reversed" and odd:
        groups = [{**g, "params": list(reversed(g["params"]))} for g in reversed(groups)]
    return torch.optim.Adam(groups, lr=0.01)


def _pair_in_order(uop: bool, scenario: str, steps: int = 2) -> list[tuple[nn.Module, torch.optim.Optimizer]]:
    out = []
    for lib in ("ours", "torch"):
        model = _wrap(lib, "FULL_SHARD", uop)
        opt = _optim_in_order(model, uop, scenario)
        _train(model, opt, range(steps))
        out.append((model, opt))
    return out


def _state_only(osd: dict) -> dict:
    return {"state": osd["state"], "param_groups": []}


def _assert_groups_follow_optimizer(out: dict, optim: torch.optim.Optimizer, where: str) -> None:
    """A loaded state dict's groups pair with the optimizer's own by position (each its own lr)."""
    assert len(out["param_groups"]) == len(optim.param_groups), where
    own = optim.state_dict()["param_groups"]
    for loaded, mine in zip(out["param_groups"], own):
        assert loaded["params"] == mine["params"], (where, loaded["params"], mine["params"])
        assert loaded["lr"] == mine["lr"], (where, loaded["lr"], mine["lr"])


def _saves_match_torch(uop: bool, scenario: str) -> int:
    """Every save API gives torch FSDP1's values; every loader gives back our optimizer's state."""
    from fsdp import FullOptimStateDictConfig, FullyShardedDataParallel as FSDP, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import StateDictType as TSDT

    warnings.filterwarnings("ignore", category=FutureWarning)  # the legacy APIs' deprecation
    (m1, o1), (m2, o2) = _pair_in_order(uop, scenario)
    where = f"uop={uop} {scenario} rank {dist.get_rank()}"
    before = copy.deepcopy(o1.state_dict())
    checked = 0
    # --- saving
    full1 = FSDP.optim_state_dict(m1, o1)
    full2 = _torch_full(m2, o2, uop)
    _assert_osd_equal(full1, full2, "full " + where)
    with FSDP.state_dict_type(m1, StateDictType.FULL_STATE_DICT, None, FullOptimStateDictConfig(rank0_only=True)):
        rank0 = FSDP.optim_state_dict(m1, o1)
    _assert_osd_equal(rank0, _torch_full(m2, o2, uop, rank0_only=True), "rank0_only " + where)
    with FSDP.state_dict_type(m1, StateDictType.SHARDED_STATE_DICT), TorchFSDP.state_dict_type(m2, TSDT.SHARDED_STATE_DICT):
        sharded1 = FSDP.optim_state_dict(m1, o1)
        _assert_osd_equal(sharded1, TorchFSDP.optim_state_dict(m2, o2), "sharded " + where)
    legacy_full = FSDP.full_optim_state_dict(m1, o1, rank0_only=False)
    _assert_osd_equal(legacy_full, _torch_full(m2, o2, uop, legacy=True), "legacy full " + where)
    legacy_sharded = FSDP.sharded_optim_state_dict(m1, o1)
    _assert_osd_equal(legacy_sharded, TorchFSDP.sharded_optim_state_dict(m2, o2), "legacy sharded " + where)
    checked += 5
    _assert_osd_equal(o1.state_dict(), before, "optimizer after saving " + where)

    # --- loading: each loader gives back exactly this rank's own optimizer state dict
    def loads_back(out: dict, what: str) -> None:
        _assert_osd_equal(_state_only(out), _state_only(o1.state_dict()), f"{what} {where}", ordered=False)
        _assert_groups_follow_optimizer(out, o1, f"{what} {where}")

    loads_back(FSDP.optim_state_dict_to_load(m1, o1, full1), "to_load")
    with FSDP.state_dict_type(m1, StateDictType.FULL_STATE_DICT, None, FullOptimStateDictConfig(rank0_only=True)):
        loads_back(FSDP.optim_state_dict_to_load(m1, o1, rank0 if dist.get_rank() == 0 else None), "rank0_only to_load")
    with FSDP.state_dict_type(m1, StateDictType.SHARDED_STATE_DICT):
        loads_back(FSDP.optim_state_dict_to_load(m1, o1, sharded1), "sharded to_load")
    loads_back(FSDP.shard_full_optim_state_dict(legacy_full, m1, optim=o1), "shard_full")
    loads_back(FSDP.scatter_full_optim_state_dict(full1 if dist.get_rank() == 0 else None, m1, optim=o1), "scatter_full")
    loads_back(FSDP.flatten_sharded_optim_state_dict(legacy_sharded, m1, o1), "flatten_sharded")
    checked += 6
    # torch's saved state dicts load through ours to the same.
    loads_back(FSDP.optim_state_dict_to_load(m1, o1, full2), "torch's full through ours")
    checked += 1
    if not uop:
        # Against torch's loaders (same layout without use_orig_params): the same state; torch
        # keeps the saved group order, ours this optimizer's (they differ in groups_reversed).
        for name, ours, theirs in (
            ("to_load", FSDP.optim_state_dict_to_load(m1, o1, full1), TorchFSDP.optim_state_dict_to_load(m2, o2, full1)),
            ("shard_full", FSDP.shard_full_optim_state_dict(full1, m1, optim=o1), TorchFSDP.shard_full_optim_state_dict(full1, m2, optim=o2)),
        ):
            _assert_osd_equal(_state_only(ours), _state_only(theirs), f"{name} vs torch {where}", ordered=False)
            if scenario != "groups_reversed":
                assert ours["param_groups"] == theirs["param_groups"], (name, where)
            checked += 1
    # --- rekey (local): IDs of this rank's optimizer, as torch's.
    from fsdp import OptimStateKeyType
    from torch.distributed.fsdp import OptimStateKeyType as TKey

    if uop:  # (without use_orig_params the optimizer holds FlatParameters: nothing to rekey)
        ids1 = FSDP.rekey_optim_state_dict(full1, OptimStateKeyType.PARAM_ID, m1, optim=o1)
        ids2 = TorchFSDP.rekey_optim_state_dict(full2, TKey.PARAM_ID, m2, optim=o2)
        _assert_osd_equal(ids1, ids2, "rekey to IDs " + where)
        back1 = FSDP.rekey_optim_state_dict(ids1, OptimStateKeyType.PARAM_NAME, m1, optim=o1)
        _assert_osd_equal(_state_only(back1), _state_only(full1), "rekey back to names " + where, ordered=False)
        checked += 1
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == dist.get_world_size()
    return checked


@pytest.mark.parametrize("scenario", ["reversed", "groups_reversed"])
@pytest.mark.parametrize("uop", [False, True])
def test_rank_orders_save_and_load_match_torch(pool2: RankPool, uop: bool, scenario: str) -> None:
    results = pool2.run(_saves_match_torch, uop, scenario, _timeout=_BOUND_S)
    assert results == [results[0]] * 2 and results[0] >= 12


@pytest.mark.parametrize("uop", [False, True])
def test_rank_orders_match_torch_at_world_size_4(pool4: RankPool, uop: bool) -> None:
    results = pool4.run(_saves_match_torch, uop, "groups_reversed", _timeout=_BOUND_S)
    assert results == [results[0]] * 4 and results[0] >= 12


def _resume(uop: bool, scenario: str, api: str) -> None:
    """Save after 2 steps, load into a fresh model and optimizer (same per-rank orders), 2 more
    steps: the parameters and optimizer state equal 4 steps straight, bit for bit."""
    from fsdp import FullOptimStateDictConfig, FullyShardedDataParallel as FSDP, StateDictType

    warnings.filterwarnings("ignore", category=FutureWarning)  # the legacy APIs' deprecation
    straight = _wrap("ours", "FULL_SHARD", uop)
    so = _optim_in_order(straight, uop, scenario)
    _train(straight, so, range(4))
    saver = _wrap("ours", "FULL_SHARD", uop)
    sopt = _optim_in_order(saver, uop, scenario)
    _train(saver, sopt, range(2))
    params = _full_params(saver, FSDP)
    fresh = _wrap("ours", "FULL_SHARD", uop, seed=123, full=params)
    fopt = _optim_in_order(fresh, uop, scenario)
    rank0 = dist.get_rank() == 0
    if api == "full":
        FSDP.optim_state_dict_to_load(fresh, fopt, FSDP.optim_state_dict(saver, sopt), load_directly=True)
    elif api == "rank0_only":
        cfg = FullOptimStateDictConfig(rank0_only=True)
        with FSDP.state_dict_type(saver, StateDictType.FULL_STATE_DICT, None, cfg):
            osd = FSDP.optim_state_dict(saver, sopt)
        with FSDP.state_dict_type(fresh, StateDictType.FULL_STATE_DICT, None, cfg):
            FSDP.optim_state_dict_to_load(fresh, fopt, osd if rank0 else None, load_directly=True)
    elif api == "sharded":
        with FSDP.state_dict_type(saver, StateDictType.SHARDED_STATE_DICT):
            osd = FSDP.optim_state_dict(saver, sopt)
        with FSDP.state_dict_type(fresh, StateDictType.SHARDED_STATE_DICT):
            FSDP.optim_state_dict_to_load(fresh, fopt, osd, load_directly=True)
    elif api == "scatter_full":
        osd = FSDP.full_optim_state_dict(saver, sopt)
        fopt.load_state_dict(FSDP.scatter_full_optim_state_dict(osd if rank0 else None, fresh, optim=fopt))
    else:  # flatten_sharded
        fopt.load_state_dict(FSDP.flatten_sharded_optim_state_dict(FSDP.sharded_optim_state_dict(saver, sopt), fresh, fopt))
    _train(fresh, fopt, range(2, 4))
    a, b = _full_params(fresh, FSDP), _full_params(straight, FSDP)
    for name in a:
        _assert_value_equal(a[name], b[name], f"{name}: resumed ({api}, {scenario}, uop={uop}) vs straight")
    _assert_osd_equal(fopt.state_dict(), so.state_dict(), f"resumed optimizer ({api}, {scenario}, uop={uop})", ordered=False)


@pytest.mark.parametrize("uop", [False, True])
def test_rank_orders_resume_bit_for_bit(pool2: RankPool, uop: bool) -> None:
    for api in ("full", "rank0_only", "sharded", "scatter_full", "flatten_sharded"):
        pool2.run(_resume, uop, "groups_reversed", api, _timeout=_BOUND_S)
    pool2.run(_resume, uop, "reversed", "sharded", _timeout=_BOUND_S)


# ----------------------------------------------------------------------------- missing parameters
class _Raised(Exception):
    """What a call raised (its type and message), without its traceback and frames."""

    def __init__(self, raised_type: type, message: str) -> None:
        super().__init__(message)
        self.raised_type = raised_type

    def __str__(self) -> str:
        return str(self.args[0])


def _optim_lacking(model: nn.Module, uop: bool, lacking_rank: int) -> torch.optim.Optimizer:
    """Adam over the model's parameters; ``lacking_rank``'s leaves out blocks.2 (its
    FlatParameter, or with use_orig_params its original parameters)."""
    named = list(model.named_parameters())
    if dist.get_rank() == lacking_rank:
        named = [(n, p) for n, p in named if "blocks.2." not in n.replace("_fsdp_wrapped_module.", "")]
    return torch.optim.Adam([p for _, p in named], lr=0.01)


def _save_outcome(lib: str, uop: bool, lacking_rank: int, sharded: bool) -> tuple[Any, Any]:
    m, _ = _lib(lib)
    model = _wrap(lib, "FULL_SHARD", uop)
    opt = _optim_lacking(model, uop, lacking_rank)
    _train(model, opt, range(1))
    try:
        if sharded:
            with m.FullyShardedDataParallel.state_dict_type(model, m.StateDictType.SHARDED_STATE_DICT):
                return m.FullyShardedDataParallel.optim_state_dict(model, opt), None
        return m.FullyShardedDataParallel.optim_state_dict(model, opt), None
    except Exception as exc:  # noqa: BLE001 - the outcome is what we compare
        outcome = _Raised(type(exc), str(exc))
    if lib == "torch":
        _settle_torch_after_error()
    return None, outcome


def _missing_params() -> None:
    """A rank's optimizer lacks blocks.2: every rank raises RuntimeError (torch's type), naming it.

    Where torch FSDP1 saves (use_orig_params=False, rank 0 the one lacking: its state dict is
    rank 0's), we save the same values.
    """
    ws = dist.get_world_size()
    for uop in (False, True):
        for lacking_rank in (1, 0):
            for sharded in (False, True):
                where = f"uop={uop} lacking rank {lacking_rank} sharded={sharded}"
                ours, error = _save_outcome("ours", uop, lacking_rank, sharded)
                # torch FSDP1 as the oracle where it does not hang: with use_orig_params at 4
                # ranks, rank 1 lacking, it fails inside its all-gather on rank 1 only.
                if not uop or ws == 2 or lacking_rank == 0:
                    theirs, torch_error = _save_outcome("torch", uop, lacking_rank, sharded)
                    if not uop and lacking_rank == 0:
                        assert error is None and torch_error is None, (where, error, torch_error)
                        _assert_osd_equal(ours, theirs, where)
                        assert not any("blocks.2." in k for k in ours["state"]), where
                        continue
                    assert issubclass(torch_error.raised_type, RuntimeError), (where, torch_error)
                assert error.raised_type is RuntimeError, (where, error)
                message = str(error)
                assert f"rank {lacking_rank} has none for" in message, (where, message)
                assert "'blocks.2." in message and "the order may differ between ranks" in message, message
                others = [r for r in range(ws) if r != lacking_rank]
                assert all(f"rank {r} has none" not in message for r in others), message
                # The ranks are still in step: a collective after the error completes.
                t = torch.ones(1)
                dist.all_reduce(t)
                assert t.item() == ws


@pytest.mark.parametrize("dist_pool", [2, 4], indirect=True)
def test_missing_parameters_raise_runtime_error_on_every_rank(dist_pool: RankPool) -> None:
    dist_pool.run(_missing_params, _timeout=_BOUND_S)


def _mismatched_loads() -> None:
    """Loading: a mistake on one rank raises on every rank, in bounded time."""
    from fsdp import FullOptimStateDictConfig, FullyShardedDataParallel as FSDP, StateDictType

    rank = dist.get_rank()
    for uop in (False, True):
        model = _wrap("ours", "FULL_SHARD", uop)
        opt = _optim_in_order(model, uop, "reversed")
        _train(model, opt, range(1))
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            sharded = FSDP.optim_state_dict(model, opt)
            # Rank 1 passes a state dict without blocks.1's state (each rank's valid by itself).
            bad = {"state": {k: v for k, v in sharded["state"].items() if not (rank == 1 and k.startswith("blocks.1."))}, "param_groups": sharded["param_groups"]}
            with pytest.raises(ValueError, match=r"fsdp: the sharded optimizer state dicts passed on the ranks do not match: rank 1 has sharded values \[\] that rank 0's lacks and lacks \[\('blocks\.1\.fc1\.bias', 'exp_avg'"):
                FSDP.optim_state_dict_to_load(model, opt, bad)
            # Rank 1's has a misshaped state: every rank raises ValueError, rank 1 its own message.
            if rank == 1:
                entry = dict(sharded["state"]["blocks.0.fc1.weight"])
                entry["exp_avg"] = torch.zeros(3)
                bad = {"state": {**sharded["state"], "blocks.0.fc1.weight": entry}, "param_groups": sharded["param_groups"]}
            else:
                bad = sharded
            expected = (
                r"fsdp: optimizer state 'exp_avg' of parameter 'blocks\.0\.fc1\.weight' has shape \(3,\)"
                if rank == 1 else r"fsdp: rank 1 could not load its sharded optimizer state dict, so no rank goes on: fsdp: optimizer state 'exp_avg'"
            )
            with pytest.raises(ValueError, match=expected):
                FSDP.optim_state_dict_to_load(model, opt, bad)
        # rank0_only: a rank whose optimizer holds a parameter of no model raises; so do the others.
        full = FSDP.optim_state_dict(model, opt)
        stray = nn.Parameter(torch.zeros(3))
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, None, FullOptimStateDictConfig(rank0_only=True)):
            from torch.distributed.optim import _NamedOptimizer

            named = _NamedOptimizer([("stray", stray)], torch.optim.Adam, lr=0.01) if rank == 1 else None
            if rank == 1:
                with pytest.raises(KeyError, match=r"fsdp: the named optimizer holds a parameter of shape \(3,\)"):
                    FSDP.optim_state_dict_to_load(model, named, None, is_named_optimizer=True)
            else:
                with pytest.raises(KeyError, match=r"fsdp: rank 1 could not match its optimizer to the model"):
                    FSDP.optim_state_dict_to_load(model, opt, full, is_named_optimizer=False)
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == dist.get_world_size()


def test_mismatched_loads_raise_on_every_rank(pool2: RankPool) -> None:
    pool2.run(_mismatched_loads, _timeout=_BOUND_S)
