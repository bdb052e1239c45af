"""Optimizer state dicts: torch FSDP1's warnings and exception types; no warnings of our own.

- The deprecated ``optim_input`` argument and the legacy APIs warn with ``FutureWarning``
  exactly where torch FSDP1 warns, attributed to the caller's line.
- A sharded save / ``torch.distributed.checkpoint`` save and load / load round trip emits no
  ``FutureWarning`` or ``DeprecationWarning`` from fsdp's files and none torch FSDP1's does not;
  loading ShardedTensors (torch FSDP1's or ours) gives torch's ShardedTensor deprecation, as
  torch FSDP1's load does, once, attributed to the caller's line.
- Each user mistake raises the exception type torch FSDP1 raises for it (checked against torch
  itself where its call is local), with our message.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests._harness import RankPool
from tests.test_optim_state_dict import _assert_osd_equal, _optim, _settle_torch_after_error, _train, _wrap

_THIS_FILE = os.path.abspath(__file__)


def _future_warnings(fn: Callable[[], Any]) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    # FSDP.state_dict_type's own deprecation is torch FSDP1's too (tests/test_torch_messages.py).
    setter = "FSDP.state_dict_type() and FSDP.set_state_dict_type() are being deprecated"
    return [
        w for w in caught
        if issubclass(w.category, (FutureWarning, DeprecationWarning)) and not str(w.message).startswith(setter)
    ]


def _about(caught: list[warnings.WarningMessage], text: str) -> list[warnings.WarningMessage]:
    return [w for w in caught if text in str(w.message)]


# ----------------------------------------------------------------------------- torch's warnings
def _deprecation_warnings() -> int:
    from fsdp import FullyShardedDataParallel as FSDP, OptimStateKeyType
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import OptimStateKeyType as TKey

    checked = 0
    models = {}
    for lib in ("ours", "torch"):
        # use_orig_params: torch's rekey_optim_state_dict fails on FlatParameters.
        model = _wrap(lib, "FULL_SHARD", True)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        _train(model, opt, range(1))
        models[lib] = (model, opt)
    (m1, o1), (m2, o2) = models["ours"], models["torch"]
    full1 = FSDP.full_optim_state_dict(m1, o1, rank0_only=False)
    sharded1 = FSDP.sharded_optim_state_dict(m1, o1)
    full2 = TorchFSDP.full_optim_state_dict(m2, o2, rank0_only=False)
    sharded2 = TorchFSDP.sharded_optim_state_dict(m2, o2)
    rank0 = dist.get_rank() == 0
    inputs1, inputs2 = list(m1.parameters()), list(m2.parameters())
    calls: list[tuple[str, Callable[[], Any], Callable[[], Any], bool, bool]] = [
        # (what, ours, torch's, passes optim_input, is a legacy API)
        ("full_optim_state_dict", lambda: FSDP.full_optim_state_dict(m1, o1, rank0_only=False),
         lambda: TorchFSDP.full_optim_state_dict(m2, o2, rank0_only=False), False, True),
        ("full_optim_state_dict optim_input", lambda: FSDP.full_optim_state_dict(m1, o1, optim_input=inputs1, rank0_only=False),
         lambda: TorchFSDP.full_optim_state_dict(m2, o2, optim_input=inputs2, rank0_only=False), True, True),
        ("sharded_optim_state_dict", lambda: FSDP.sharded_optim_state_dict(m1, o1),
         lambda: TorchFSDP.sharded_optim_state_dict(m2, o2), False, True),
        ("shard_full_optim_state_dict optim_input", lambda: FSDP.shard_full_optim_state_dict(full1, m1, optim_input=inputs1),
         lambda: TorchFSDP.shard_full_optim_state_dict(full2, m2, optim_input=inputs2), True, True),
        ("shard_full_optim_state_dict", lambda: FSDP.shard_full_optim_state_dict(full1, m1, optim=o1),
         lambda: TorchFSDP.shard_full_optim_state_dict(full2, m2, optim=o2), False, True),
        ("scatter_full_optim_state_dict optim_input",
         lambda: FSDP.scatter_full_optim_state_dict(full1 if rank0 else None, m1, optim_input=inputs1),
         lambda: TorchFSDP.scatter_full_optim_state_dict(full2 if rank0 else None, m2, optim_input=inputs2), True, True),
        ("flatten_sharded_optim_state_dict", lambda: FSDP.flatten_sharded_optim_state_dict(sharded1, m1, o1),
         lambda: TorchFSDP.flatten_sharded_optim_state_dict(sharded2, m2, o2), False, True),
        ("rekey_optim_state_dict optim_input",
         lambda: FSDP.rekey_optim_state_dict(o1.state_dict(), OptimStateKeyType.PARAM_NAME, m1, optim_input=inputs1),
         lambda: TorchFSDP.rekey_optim_state_dict(o2.state_dict(), TKey.PARAM_NAME, m2, optim_input=inputs2), True, False),
        ("rekey_optim_state_dict", lambda: FSDP.rekey_optim_state_dict(o1.state_dict(), OptimStateKeyType.PARAM_NAME, m1, optim=o1),
         lambda: TorchFSDP.rekey_optim_state_dict(o2.state_dict(), TKey.PARAM_NAME, m2, optim=o2), False, False),
        ("optim_state_dict", lambda: FSDP.optim_state_dict(m1, o1), lambda: TorchFSDP.optim_state_dict(m2, o2), False, False),
        ("optim_state_dict_to_load", lambda: FSDP.optim_state_dict_to_load(m1, o1, full1),
         lambda: TorchFSDP.optim_state_dict_to_load(m2, o2, full2), False, False),
    ]
    for what, ours, theirs, passes_input, legacy in calls:
        caught, caught_torch = _future_warnings(ours), _future_warnings(theirs)
        for text, expected in (("optim_input", passes_input), ("deprecated", legacy or passes_input)):
            mine, torch_ones = _about(caught, text), _about(caught_torch, text)
            assert bool(mine) == expected == bool(torch_ones), (what, text, [str(w.message) for w in caught], [str(w.message) for w in caught_torch])
        for w in caught_torch:  # ours contain torch's sentences
            assert any(str(w.message) in str(mine.message) for mine in caught), (what, str(w.message))
        for w in caught:
            assert issubclass(w.category, FutureWarning), (what, w)
            # Attributed to the line that called the API (here: this file), not to fsdp's code.
            assert os.path.abspath(w.filename) == _THIS_FILE, (what, w.filename)
        if passes_input:
            with pytest.warns(FutureWarning, match=r"fsdp: the `optim_input` argument is deprecated"):
                ours()
        if legacy:
            name = what.split()[0]
            with pytest.warns(FutureWarning, match=rf"fsdp: FullyShardedDataParallel\.{name} is deprecated"):
                ours()
        checked += 1
    return checked


def test_deprecation_warnings_match_torch(pool2: RankPool) -> None:
    assert pool2.run(_deprecation_warnings) == [11, 11]


# ----------------------------------------------------------------------------- none of our own
def _no_warnings_in_sharded_round_trip(tmp: str) -> None:
    """Sharded save -> dcp.save -> dcp.load -> load, with and without use_orig_params: not one
    FutureWarning or DeprecationWarning raised in fsdp's files, and none that torch FSDP1's same
    round trip does not give (torch's DCP warns about ShardedTensor values, torch FSDP1's type,
    which ours are: those two sets are compared)."""
    import torch.distributed.checkpoint as dcp

    from fsdp import FullyShardedDataParallel as FSDP, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import StateDictType as TSDT

    import fsdp

    fsdp_dir = os.path.dirname(os.path.abspath(fsdp.__file__)) + os.sep

    def round_trip(lib: str, uop: bool) -> tuple[list[warnings.WarningMessage], Any, Any]:
        cls, kind = (FSDP, StateDictType) if lib == "ours" else (TorchFSDP, TSDT)
        model = _wrap(lib, "FULL_SHARD", uop)
        opt = _optim("adam", model, uop)
        _train(model, opt, range(2))
        path = os.path.join(tmp, f"{lib}_uop{uop}")
        out: dict[str, Any] = {}

        def save_and_load() -> None:  # the APIs and DCP only: the checks below call no torch function
            with cls.state_dict_type(model, kind.SHARDED_STATE_DICT):
                out["saved"] = cls.optim_state_dict(model, opt)
                dcp.save({"optim": out["saved"]}, checkpoint_id=path)
                out["template"] = {"optim": cls.optim_state_dict(model, opt)}
                dcp.load(out["template"], checkpoint_id=path)
                out["loaded"] = cls.optim_state_dict_to_load(model, opt, out["template"]["optim"])

        caught = _future_warnings(save_and_load)
        _assert_osd_equal(out["template"]["optim"], out["saved"], f"dcp round trip {lib} uop={uop}")
        return caught, out["loaded"], opt

    def said(caught: list[warnings.WarningMessage]) -> set[tuple[str, str]]:
        return {(w.category.__name__, str(w.message)) for w in caught}

    for uop in (False, True):
        caught, out, opt = round_trip("ours", uop)
        _assert_osd_equal(out, opt.state_dict(), f"loads back uop={uop}", ordered=False)
        ours_own = [w for w in caught if os.path.abspath(w.filename).startswith(fsdp_dir)]
        assert not ours_own, [f"{w.filename}:{w.lineno}: {w.message}" for w in ours_own]
        torch_caught, _, _ = round_trip("torch", uop)
        assert said(caught) <= said(torch_caught), (said(caught), said(torch_caught))
        model = _wrap("ours", "FULL_SHARD", uop)
        opt = _optim("adam", model, uop)
        _train(model, opt, range(2))
        # torch FSDP1's ShardedTensors (its default) load through ours without a warning from us.
        tmodel = _wrap("torch", "FULL_SHARD", uop)
        topt = _optim("adam", tmodel, uop)
        _train(tmodel, topt, range(2))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with TorchFSDP.state_dict_type(tmodel, TSDT.SHARDED_STATE_DICT):
                theirs = TorchFSDP.optim_state_dict(tmodel, topt)
        from torch.distributed._shard.sharded_tensor import ShardedTensor

        assert any(isinstance(v, ShardedTensor) for e in theirs["state"].values() for v in e.values())

        loaded: dict[str, Any] = {}

        def load_theirs() -> None:
            with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
                loaded["theirs"] = FSDP.optim_state_dict_to_load(model, opt, theirs)

        caught = _future_warnings(load_theirs)
        # torch's ShardedTensor deprecation, which torch FSDP1's load of them gives too, said once
        # and attributed to the caller's line; nothing else.
        assert said(caught) == {("FutureWarning", "Please use DTensor instead and we are deprecating ShardedTensor.")}, said(caught)
        assert [os.path.abspath(w.filename) for w in caught] == [_THIS_FILE], [w.filename for w in caught]
        # Their ShardedTensors load through ours to our own state (bit for bit, with
        # use_orig_params too: the same flat layout), and our ShardedTensors load through torch's
        # loader to what its own give.
        _assert_osd_equal(loaded["theirs"], opt.state_dict(), f"torch's sharded through ours uop={uop}", ordered=False)
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            ours = FSDP.optim_state_dict(model, opt)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with TorchFSDP.state_dict_type(tmodel, TSDT.SHARDED_STATE_DICT):
                through_torch = TorchFSDP.optim_state_dict_to_load(tmodel, topt, ours)
                torch_own = TorchFSDP.optim_state_dict_to_load(tmodel, topt, theirs)
        _assert_osd_equal(through_torch, torch_own, f"our sharded through torch uop={uop}", ordered=False)


def test_no_deprecation_warnings_from_sharded_round_trip(pool2: RankPool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        pool2.run(_no_warnings_in_sharded_round_trip, tmp)


# ----------------------------------------------------------------------------- exception types
def _raises_like_torch(ours: Callable[[], Any], theirs: Any, exc: type, match: str) -> None:
    """``ours`` raises ``exc`` with our message; ``theirs`` (torch's same call, or None where
    torch's call is not local) raises ``exc`` too."""
    with pytest.raises(exc, match=match):
        ours()
    if theirs is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(exc):
                theirs()
        _settle_torch_after_error()


def _exception_types() -> int:
    from fsdp import FullOptimStateDictConfig, FullyShardedDataParallel as FSDP, OptimStateKeyType, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import OptimStateKeyType as TKey

    warnings.filterwarnings("ignore", category=FutureWarning)
    checked = 0
    libs = {}
    for lib in ("ours", "torch"):
        model = _wrap(lib, "FULL_SHARD", True)
        opt = _optim("adam", model, True)
        _train(model, opt, range(1))
        libs[lib] = (model, opt)
    (m1, o1), (m2, o2) = libs["ours"], libs["torch"]
    full1 = FSDP.optim_state_dict(m1, o1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.distributed.fsdp import FullOptimStateDictConfig as TFOC, StateDictType as TSDT

        with TorchFSDP.state_dict_type(m2, TSDT.FULL_STATE_DICT, None, TFOC(offload_to_cpu=False)):
            full2 = TorchFSDP.optim_state_dict(m2, o2)
    stray = nn.Parameter(torch.zeros(3))
    cases: list[tuple[Callable[[], Any], Any, type, str]] = [
        # rekey: a key type that is not an OptimStateKeyType: torch AssertionError.
        (lambda: FSDP.rekey_optim_state_dict(full1, "names", m1, optim=o1),
         lambda: TorchFSDP.rekey_optim_state_dict(full2, "names", m2, optim=o2),
         AssertionError, r"fsdp: optim_state_key_type must be OptimStateKeyType\.PARAM_NAME or PARAM_ID"),
        # rekey to names: an ID the optimizer does not have: torch IndexError.
        (lambda: FSDP.rekey_optim_state_dict({"state": {99: {}}, "param_groups": []}, OptimStateKeyType.PARAM_NAME, m1, optim=o1),
         lambda: TorchFSDP.rekey_optim_state_dict({"state": {99: {}}, "param_groups": []}, TKey.PARAM_NAME, m2, optim=o2),
         IndexError, r"fsdp: parameter ID 99 is out of range: the optimizer has"),
        # rekey to IDs: a name the optimizer does not hold: torch KeyError.
        (lambda: FSDP.rekey_optim_state_dict({"state": {"nope.weight": {}}, "param_groups": []}, OptimStateKeyType.PARAM_ID, m1, optim=o1),
         lambda: TorchFSDP.rekey_optim_state_dict({"state": {"nope.weight": {}}, "param_groups": []}, TKey.PARAM_ID, m2, optim=o2),
         KeyError, r"fsdp: parameter name 'nope\.weight' is not a parameter the optimizer holds"),
        # rekey to names: the optimizer holds a parameter of no model: torch KeyError.
        (lambda: FSDP.rekey_optim_state_dict({"state": {0: {}}, "param_groups": [{"params": [0]}]}, OptimStateKeyType.PARAM_NAME, m1, optim=torch.optim.Adam([stray])),
         lambda: TorchFSDP.rekey_optim_state_dict({"state": {0: {}}, "param_groups": [{"params": [0]}]}, TKey.PARAM_NAME, m2, optim=torch.optim.Adam([stray])),
         KeyError, r"fsdp: the optimizer holds a parameter of shape \(3,\) that is not a parameter of the model"),
        # mixed keys: torch ValueError.
        (lambda: FSDP.rekey_optim_state_dict({"state": {0: {}, "a": {}}, "param_groups": []}, OptimStateKeyType.PARAM_ID, m1, optim=o1),
         lambda: TorchFSDP.rekey_optim_state_dict({"state": {0: {}, "a": {}}, "param_groups": []}, TKey.PARAM_ID, m2, optim=o2),
         ValueError, r"fsdp: invalid parameter keys \(mixed names and IDs\)"),
        # to_load of an ID-keyed (plain optimizer) state dict: torch AttributeError. (The first
        # ID with state differs by rank: a parameter a rank holds none of has no state there.)
        (lambda: FSDP.optim_state_dict_to_load(m1, o1, o1.state_dict()),
         lambda: TorchFSDP.optim_state_dict_to_load(m2, o2, o2.state_dict()),
         AttributeError, r"fsdp: optimizer state key \d+ is not a parameter name"),
        # to_load: a parameter group lists a name of no parameter: torch KeyError.
        (lambda: FSDP.optim_state_dict_to_load(m1, o1, {"state": {}, "param_groups": [{**full1["param_groups"][0], "params": ["nope.weight"]}]}),
         lambda: TorchFSDP.optim_state_dict_to_load(m2, o2, {"state": {}, "param_groups": [{**full2["param_groups"][0], "params": ["nope.weight"]}]}),
         KeyError, r"fsdp: a parameter group of the optimizer state dict lists 'nope\.weight', which is not a parameter"),
        # to_load: a dict without 'state': torch ValueError.
        (lambda: FSDP.optim_state_dict_to_load(m1, o1, {"param_groups": []}),
         lambda: TorchFSDP.optim_state_dict_to_load(m2, o2, {"param_groups": []}),
         ValueError, r"fsdp: the optimizer state dict to load must be a dict with the key 'state'"),
        # Saving a state dict without 'state': torch KeyError.
        (lambda: FSDP.optim_state_dict(m1, o1, {"param_groups": []}),
         lambda: TorchFSDP.optim_state_dict(m2, o2, {"param_groups": []}),
         KeyError, r"fsdp: optim_state_dict must have the key 'state'"),
        # load_directly without an optimizer: torch AttributeError.
        (lambda: FSDP.optim_state_dict_to_load(m1, None, full1, load_directly=True),
         lambda: TorchFSDP.optim_state_dict_to_load(m2, None, full2, load_directly=True),
         AttributeError, r"fsdp: load_directly=True needs the optimizer to load into"),
        # A model without FSDP: torch AttributeError (optim_state_dict), IndexError (legacy APIs).
        (lambda: FSDP.optim_state_dict(nn.Linear(2, 2), torch.optim.Adam(nn.Linear(2, 2).parameters())),
         lambda: TorchFSDP.optim_state_dict(nn.Linear(2, 2), torch.optim.Adam(nn.Linear(2, 2).parameters())),
         AttributeError, r"fsdp: the model contains no FullyShardedDataParallel instance"),
        (lambda: FSDP.full_optim_state_dict(nn.Linear(2, 2), torch.optim.Adam(nn.Linear(2, 2).parameters())),
         lambda: TorchFSDP.full_optim_state_dict(nn.Linear(2, 2), torch.optim.Adam(nn.Linear(2, 2).parameters())),
         IndexError, r"fsdp: the model contains no FullyShardedDataParallel instance"),
        # optim_input that is empty / not iterable / mixed: torch ValueError / TypeError / TypeError.
        (lambda: FSDP.shard_full_optim_state_dict(full1, m1, optim_input=[]),
         lambda: TorchFSDP.shard_full_optim_state_dict(full2, m2, optim_input=[]),
         ValueError, r"fsdp: optim_input is empty"),
        (lambda: FSDP.rekey_optim_state_dict(o1.state_dict(), OptimStateKeyType.PARAM_NAME, m1, optim_input=5),
         lambda: TorchFSDP.rekey_optim_state_dict(o2.state_dict(), TKey.PARAM_NAME, m2, optim_input=5),
         TypeError, r"fsdp: optim_input must be an iterable of tensors or of parameter groups"),
        (lambda: FSDP.rekey_optim_state_dict(o1.state_dict(), OptimStateKeyType.PARAM_NAME, m1, optim_input=[stray, {"params": [stray]}]),
         lambda: TorchFSDP.rekey_optim_state_dict(o2.state_dict(), TKey.PARAM_NAME, m2, optim_input=[stray, {"params": [stray]}]),
         TypeError, r"fsdp: optim_input must hold only tensors or only parameter groups"),
    ]
    for ours, theirs, exc, match in cases:
        _raises_like_torch(ours, theirs, exc, match)
        checked += 1
    # Ours keep being ValueErrors too (what fsdp raised before; code may catch that).
    for ours, _, exc, match in cases:
        with pytest.raises(ValueError if exc is not TypeError else TypeError, match=match):
            ours()
    # rank0_only with nothing on rank 0: TypeError on every rank (torch: on rank 0, the others
    # wait in its broadcast).
    with FSDP.state_dict_type(m1, StateDictType.FULL_STATE_DICT, None, FullOptimStateDictConfig(rank0_only=True)):
        with pytest.raises(TypeError, match=r"fsdp: rank 0 must pass the full optimizer state dict"):
            FSDP.optim_state_dict_to_load(m1, o1, None)
    checked += 1
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == dist.get_world_size()
    return checked


def test_exception_types_match_torch(pool2: RankPool) -> None:
    assert pool2.run(_exception_types) == [16, 16]
