"""SHARDED state-dict value types, against torch FSDP1 run on the same model (the oracle).

Torch FSDP1 gives a ``ShardedTensor`` for every sharded model and optimizer value of a model built
without ``device_mesh``, and a ``DTensor`` on the mesh (``Shard(0)``, hybrid ``(Replicate(),
Shard(0))``) for one built with it ([Note: Sharded value forms] in fsdp/state_dict/_values.py).
Each scenario runs through both libraries, the same model, data and AdamW step, and compares the
types, what user code reads of them (metadata, local shards, local tensor, placements, mesh,
device) and the values bit for bit; then loads them back (ours into ours, and across the two
libraries in memory). Also: LOCAL_STATE_DICT refused on a mesh-built model with torch's error,
and ``state_dict()`` inside ``summon_full_params`` as torch FSDP1 returns it.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from tests._harness import RankPool
from tests._models import Block, global_batch, lm_loss, local_rows, make_toy
from tests.test_parity import _full_params

_GROUPS: dict[str, Any] = {}


def _groups(name: str) -> Any:
    """Process groups and meshes, made once per rank process in one fixed order (every rank
    creates every group)."""
    ws = dist.get_world_size()
    if not _GROUPS.get("ws") == ws:
        from torch.distributed.device_mesh import init_device_mesh

        _GROUPS.clear()
        _GROUPS["ws"] = ws
        if ws == 2:
            intra, _ = dist.new_subgroups_by_enumeration([[0, 1]])
            inter, _ = dist.new_subgroups_by_enumeration([[0], [1]])
            _GROUPS["hybrid"] = (intra, inter)
            _GROUPS["mesh1d"] = init_device_mesh("cpu", (2,))
            _GROUPS["mesh2d"] = init_device_mesh("cpu", (1, 2))
        else:
            from tests.test_hybrid_shard import _layouts

            layouts = _layouts()
            _GROUPS["hybrid"] = layouts["tuple"]["process_group"]
            _GROUPS["mesh2d"] = layouts["mesh"]["device_mesh"]
            _GROUPS["mesh1d"] = init_device_mesh("cpu", (4,))
    return _GROUPS[name]


def _build(lib: Any, strategy: str, orig: bool, mesh: bool, seed: int = 0, **model_kw: Any) -> tuple[nn.Module, Any]:
    """A wrapped ToyLM and its AdamW, through fsdp or torch FSDP1 (``lib``: the package)."""
    hybrid = strategy in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
    kw: dict[str, Any] = {"sharding_strategy": lib.ShardingStrategy[strategy], "use_orig_params": orig}
    if mesh:
        kw["device_mesh"] = _groups("mesh2d" if hybrid else "mesh1d")
    elif hybrid:
        kw["process_group"] = _groups("hybrid")
    if lib.__name__ != "fsdp":
        kw["device_id"] = torch.device("cpu")
    policy = lib.wrap.ModuleWrapPolicy({Block})
    model = lib.FullyShardedDataParallel(make_toy(seed=seed, **model_kw), auto_wrap_policy=policy, **kw)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _step(model: nn.Module, optim: Any) -> None:
    rank, ws = dist.get_rank(), dist.get_world_size()
    tokens, targets = global_batch(0, ws)
    lm_loss(model(local_rows(tokens, rank, ws)), local_rows(targets, rank, ws)).backward()
    optim.step()
    optim.zero_grad()


def _sharded(lib: Any, model: nn.Module, optim: Any, offload: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """The SHARDED model and optimizer state dicts (``offload_to_cpu`` both)."""
    fsdp_cls = lib.FullyShardedDataParallel
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # NO_SHARD's "full_state_dict will be returned", deprecations
        with fsdp_cls.state_dict_type(
            model,
            lib.StateDictType.SHARDED_STATE_DICT,
            lib.ShardedStateDictConfig(offload_to_cpu=offload),
            lib.ShardedOptimStateDictConfig(offload_to_cpu=offload),
        ):
            return model.state_dict(), fsdp_cls.optim_state_dict(model, optim)


def _assert_same_value(ours: Any, theirs: Any, where: str) -> None:
    """``ours`` is what ``theirs`` is to user code: type, layout, device, values bit for bit."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    assert type(ours) is type(theirs), (where, type(ours), type(theirs))
    if isinstance(theirs, ShardedTensor):
        assert ours.metadata() == theirs.metadata(), (where, ours.metadata(), theirs.metadata())
        assert ours.sharding_spec() == theirs.sharding_spec(), (where, ours.sharding_spec(), theirs.sharding_spec())
        assert ours._process_group == theirs._process_group or dist.get_process_group_ranks(
            ours._process_group
        ) == dist.get_process_group_ranks(theirs._process_group), where
        mine, other = ours.local_shards(), theirs.local_shards()
        assert [s.metadata for s in mine] == [s.metadata for s in other], where
        for a, b in zip(mine, other):
            assert a.tensor.device == b.tensor.device and a.tensor.dtype == b.tensor.dtype, where
            assert a.tensor.shape == b.tensor.shape and torch.equal(a.tensor, b.tensor), where
        if len(other) == 1:
            assert torch.equal(ours.local_tensor(), theirs.local_tensor()), where
    elif isinstance(theirs, DTensor):
        assert ours.placements == theirs.placements, (where, ours.placements, theirs.placements)
        assert ours.device_mesh == theirs.device_mesh, (where, ours.device_mesh, theirs.device_mesh)
        assert ours.shape == theirs.shape and ours.stride() == theirs.stride(), where
        a, b = ours.to_local(), theirs.to_local()
        assert a.device == b.device and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(theirs, torch.Tensor):
        assert ours.device == theirs.device and ours.dtype == theirs.dtype and torch.equal(ours, theirs), where
    else:
        assert ours == theirs, where


def _assert_same_dicts(ours: tuple[dict[str, Any], dict[str, Any]], theirs: tuple[dict[str, Any], dict[str, Any]], where: str) -> None:
    (sd, osd), (torch_sd, torch_osd) = ours, theirs
    assert list(sd) == list(torch_sd), where
    for key in torch_sd:
        _assert_same_value(sd[key], torch_sd[key], f"{where} model {key}")
    assert osd["param_groups"] == torch_osd["param_groups"], where
    assert list(osd["state"]) == list(torch_osd["state"]), where
    for fqn, states in torch_osd["state"].items():
        assert list(osd["state"][fqn]) == list(states), (where, fqn)
        for name, value in states.items():
            _assert_same_value(osd["state"][fqn][name], value, f"{where} optim {fqn}.{name}")


def _load(lib: Any, model: nn.Module, optim: Any, dicts: tuple[dict[str, Any], dict[str, Any]]) -> None:
    """Loads SHARDED model and optimizer state dicts; fsdp's loading gives only torch FSDP1's
    warnings (it reads ShardedTensors through their metadata and local shards, whose tensor
    methods warn, and says torch's ShardedTensor deprecation once itself)."""
    fsdp_cls = lib.FullyShardedDataParallel
    sd, osd = dicts
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with fsdp_cls.state_dict_type(model, lib.StateDictType.SHARDED_STATE_DICT):
            model.load_state_dict(sd)
            optim.load_state_dict(fsdp_cls.optim_state_dict_to_load(model, optim, osd))
    if lib.__name__ == "fsdp":
        # torch's NO_SHARD warning, and state_dict_type's own deprecation, torch FSDP1's too
        # (tests/test_torch_messages.py checks both against torch).
        setter = "FSDP.state_dict_type() and FSDP.set_state_dict_type() are being deprecated"
        # And torch's ShardedTensor deprecation, once, where the optimizer's values are
        # ShardedTensors, as torch FSDP1's load gives it (tests/test_optim_state_dict_warnings_errors.py).
        deprecation = "Please use DTensor instead and we are deprecating ShardedTensor."
        from torch.distributed._shard.sharded_tensor import ShardedTensor

        sharded = any(isinstance(v, ShardedTensor) for entry in osd["state"].values() for v in entry.values())
        assert [str(w.message) for w in caught if str(w.message) == deprecation] == [deprecation] * sharded
        ours = [
            w for w in caught
            if "NO_SHARD" not in str(w.message) and setter not in str(w.message) and str(w.message) != deprecation
        ]
        assert not ours, [f"{w.filename}:{w.lineno}: {w.message}" for w in ours]


def sharded_types_sweep(configs: list[tuple[str, bool, bool, bool]], **model_kw: Any) -> None:
    """Per ``(strategy, use_orig_params, offload_to_cpu, device_mesh)``: our SHARDED model and
    optimizer state dicts are torch FSDP1's (types, layout, values); ours load back into a fresh
    fsdp model (its next state dicts equal the saved ones) and, in memory, into torch FSDP1 (and
    torch's into ours), which then train on identically.

    The configs that differ only in ``offload_to_cpu`` share one trained pair of models (the
    option is the state-dict config's, not the model's: the same build and step either way);
    each still takes its own state dicts and loads them into fresh models of its own."""
    import torch.distributed.fsdp as torch_fsdp

    import fsdp

    offloads: dict[tuple[str, bool, bool], list[bool]] = {}
    for strategy, orig, offload, mesh in configs:
        offloads.setdefault((strategy, orig, mesh), []).append(offload)
    for (strategy, orig, mesh), offload_values in offloads.items():
        ours, ours_opt = _build(fsdp, strategy, orig, mesh, **model_kw)
        theirs, theirs_opt = _build(torch_fsdp, strategy, orig, mesh, **model_kw)
        _step(ours, ours_opt)
        _step(theirs, theirs_opt)
        stepped = []
        for offload in offload_values:
            where = f"{strategy} orig={orig} offload={offload} mesh={mesh}"
            saved, torch_saved = _sharded(fsdp, ours, ours_opt, offload), _sharded(torch_fsdp, theirs, theirs_opt, offload)
            _assert_same_dicts(saved, torch_saved, where)
            # Ours into a fresh fsdp model, torch's into another, ours into a fresh torch FSDP1.
            fresh, fresh_opt = _build(fsdp, strategy, orig, mesh, seed=1, **model_kw)
            _load(fsdp, fresh, fresh_opt, saved)
            _assert_same_dicts(_sharded(fsdp, fresh, fresh_opt, offload), torch_saved, f"{where} reloaded")
            from_torch, from_torch_opt = _build(fsdp, strategy, orig, mesh, seed=1, **model_kw)
            _load(fsdp, from_torch, from_torch_opt, torch_saved)
            torch_fresh, torch_fresh_opt = _build(torch_fsdp, strategy, orig, mesh, seed=1, **model_kw)
            _load(torch_fsdp, torch_fresh, torch_fresh_opt, saved)
            for model, opt in ((fresh, fresh_opt), (from_torch, from_torch_opt), (torch_fresh, torch_fresh_opt)):
                _step(model, opt)
            stepped.append((where, ((fresh, fsdp), (from_torch, fsdp), (torch_fresh, torch_fsdp))))
        _step(theirs, theirs_opt)
        expected = _full_params(theirs, torch_fsdp.FullyShardedDataParallel)
        for where, models in stepped:
            for model, cls in models:
                got = _full_params(model, cls.FullyShardedDataParallel)
                assert all(torch.equal(got[n], p) for n, p in expected.items()), (where, cls.__name__)


_STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"]


def test_sharded_values_are_torchs(pool2: RankPool) -> None:
    """Every strategy, use_orig_params both ways, offload_to_cpu both ways, without and with a
    device_mesh (1-D for FULL_SHARD/SHARD_GRAD_OP/NO_SHARD, (1, 2) for hybrid)."""
    configs = [(s, orig, offload, False) for s in _STRATEGIES for orig in (False, True) for offload in (True, False)]
    configs += [(s, orig, True, True) for s in _STRATEGIES for orig in (False, True)]
    pool2.run(sharded_types_sweep, configs)


def test_sharded_value_layout_four_ranks(pool4: RankPool) -> None:
    """Layouts user code can see at 4 ranks: a (5, 3) weight is 3 torch.chunk pieces (rank 3 holds
    none: no local shard), hybrid sharding's group ranks differ from global ranks (placements name
    global ranks), and the (2, 2) mesh's (Replicate(), Shard(0)) DTensors."""
    configs = [
        ("FULL_SHARD", False, True, False),
        ("HYBRID_SHARD", False, True, False),
        ("HYBRID_SHARD", True, False, True),
        ("_HYBRID_SHARD_ZERO2", False, True, True),
    ]
    pool4.run(sharded_types_sweep, configs, unused=True)


def _error_of(fn: Any) -> Optional[BaseException]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fn()
    except Exception as exc:  # the error is the result compared
        return exc
    return None


def _local_calls(lib: Any, model: nn.Module, optim: Any, full_sd: dict[str, Any]) -> dict[str, Optional[BaseException]]:
    """Each LOCAL_STATE_DICT API on ``model``, and the error it raised (None: none)."""
    fsdp_cls = lib.FullyShardedDataParallel
    calls = {
        "state_dict": lambda: model.state_dict(),
        "load_state_dict": lambda: model.load_state_dict(full_sd),
        "optim_state_dict": lambda: fsdp_cls.optim_state_dict(model, optim),
        "optim_state_dict_to_load": lambda: fsdp_cls.optim_state_dict_to_load(model, optim, {"state": {}, "param_groups": []}),
    }
    errors = {}
    for name, call in calls.items():
        with fsdp_cls.state_dict_type(model, lib.StateDictType.LOCAL_STATE_DICT):
            errors[name] = _error_of(call)
    return errors


def local_with_mesh(strategies: list[str]) -> None:
    """LOCAL_STATE_DICT on a model built with a device_mesh: every API raises torch FSDP1's
    exception type with its sentence (ours adds the unit and the fix) where torch raises, before
    anything changes; a NO_SHARD model's state dicts are FULL (torch's warning), its optimizer
    APIs raise as torch's do."""
    import torch.distributed.fsdp as torch_fsdp

    import fsdp
    from fsdp._common import clean_fqn

    for strategy in strategies:
        ours, ours_opt = _build(fsdp, strategy, False, True)
        theirs, theirs_opt = _build(torch_fsdp, strategy, False, True)
        full = {clean_fqn(k): v.detach().clone() for k, v in make_toy(seed=1).state_dict().items()}
        before = _full_params(ours, fsdp.FullyShardedDataParallel)
        mine, torchs = _local_calls(fsdp, ours, ours_opt, full), _local_calls(torch_fsdp, theirs, theirs_opt, full)
        for call, expected in torchs.items():
            got = mine[call]
            if expected is None:
                assert got is None, (strategy, call, got)
                continue
            assert type(got) is type(expected), (strategy, call, got, expected)
            assert str(expected) in str(got) and "device_mesh=" in str(got), (strategy, call, str(got))
        after = _full_params(ours, fsdp.FullyShardedDataParallel)
        if strategy != "NO_SHARD":  # nothing loaded, nothing changed
            assert all(torch.equal(after[n], p) for n, p in before.items()), strategy
        _assert_same_dicts(_sharded(fsdp, ours, ours_opt, True), _sharded(torch_fsdp, theirs, theirs_opt, True), strategy)


def test_local_state_dict_with_device_mesh(pool2: RankPool) -> None:
    pool2.run(local_with_mesh, ["FULL_SHARD", "HYBRID_SHARD", "NO_SHARD"])


def _summoned_state_dict(lib: Any, model: nn.Module, kind: str) -> dict[str, Any]:
    fsdp_cls = lib.FullyShardedDataParallel
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with fsdp_cls.state_dict_type(model, lib.StateDictType[kind]), fsdp_cls.summon_full_params(model):
            values = model.state_dict()
            ptrs = {p.untyped_storage().data_ptr() for p in model.parameters() if p.numel()}
            for key, value in values.items():
                if isinstance(value, torch.Tensor) and not hasattr(value, "local_shards") and value.numel():
                    assert value.untyped_storage().data_ptr() not in ptrs, f"{key} views the summoned parameter"
            return values


def state_dict_in_summon(configs: list[tuple[str, bool, str]]) -> None:
    """``model.state_dict()`` inside ``summon_full_params(model)``: what torch FSDP1 returns (the
    unwrapped model's names, types, values, owned copies), FULL and SHARDED."""
    import torch.distributed.fsdp as torch_fsdp

    import fsdp

    for strategy, orig, kind in configs:
        where = f"{strategy} orig={orig} {kind}"
        ours, ours_opt = _build(fsdp, strategy, orig, False)
        theirs, theirs_opt = _build(torch_fsdp, strategy, orig, False)
        _step(ours, ours_opt)
        _step(theirs, theirs_opt)
        mine, torchs = _summoned_state_dict(fsdp, ours, kind), _summoned_state_dict(torch_fsdp, theirs, kind)
        assert list(mine) == list(torchs), where
        for key, value in torchs.items():
            _assert_same_value(mine[key], value, f"{where} {key}")
        # The summon ended as the user opened it: training goes on identically.
        _step(ours, ours_opt)
        _step(theirs, theirs_opt)
        got, expected = _full_params(ours, fsdp.FullyShardedDataParallel), _full_params(theirs, torch_fsdp.FullyShardedDataParallel)
        assert all(torch.equal(got[n], p) for n, p in expected.items()), where


def test_state_dict_inside_summon_full_params(pool2: RankPool) -> None:
    configs = [(s, orig, "FULL_STATE_DICT") for s in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD") for orig in (False, True)]
    configs += [("FULL_SHARD", orig, "SHARDED_STATE_DICT") for orig in (False, True)]
    pool2.run(state_dict_in_summon, configs)


def _full_optim(lib: Any, model: nn.Module, optim: Any) -> dict[str, Any]:
    fsdp_cls = lib.FullyShardedDataParallel
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with fsdp_cls.state_dict_type(model, lib.StateDictType.FULL_STATE_DICT):
            return fsdp_cls.optim_state_dict(model, optim)["state"]


def hsdp_to_fsdp(directory: str, saver_name: str = "fsdp") -> None:
    """A hybrid-sharded model built with a (2, 2) mesh saves its SHARDED model and optimizer
    state dicts ((Replicate(), Shard(0)) DTensors) with DCP; they load through DCP into FULL_SHARD
    models over the 4 ranks (fsdp without and with a 1-D mesh, torch FSDP1 without), whose full
    parameters and optimizer states then equal the hybrid model's bit for bit."""
    import torch.distributed.checkpoint as dcp
    import torch.distributed.fsdp as torch_fsdp

    import fsdp

    saver = fsdp if saver_name == "fsdp" else torch_fsdp
    for orig in (False, True):
        path = f"{directory}/hsdp_{saver_name}_{orig}"
        hybrid, hybrid_opt = _build(saver, "HYBRID_SHARD", orig, True)
        _step(hybrid, hybrid_opt)
        sd, osd = _sharded(saver, hybrid, hybrid_opt, True)
        dcp.save({"model": sd, "optim": osd}, checkpoint_id=path)
        expected, expected_optim = _full_params(hybrid, saver.FullyShardedDataParallel), _full_optim(saver, hybrid, hybrid_opt)
        loaded: dict[Any, Any] = {}
        for lib, mesh in ((fsdp, False), (fsdp, True), (torch_fsdp, False)):
            where = f"orig={orig} into {lib.__name__} mesh={mesh}"
            model, optim = _build(lib, "FULL_SHARD", orig, mesh, seed=1)
            _step(model, optim)  # optimizer states exist to be loaded into
            template_sd, template_osd = _sharded(lib, model, optim, True)
            template = {"model": template_sd, "optim": template_osd}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.load(template, checkpoint_id=path)
            _load(lib, model, optim, (template["model"], template["optim"]))
            got = _full_params(model, lib.FullyShardedDataParallel)
            assert list(got) == list(expected) and all(torch.equal(got[n], p) for n, p in expected.items()), where
            loaded[(lib, mesh)] = _sharded(lib, model, optim, True)
            if lib is torch_fsdp:
                # torch FSDP1's FULL optimizer state dict after this load is not the state it
                # loaded with use_orig_params=True (its exp_avg reads exp_avg_sq's values), so
                # its SHARDED state dict, what it loaded, is compared with ours instead.
                _assert_same_dicts(loaded[(fsdp, False)], loaded[(lib, mesh)], where)
                continue
            got_optim = _full_optim(lib, model, optim)
            assert list(got_optim) == list(expected_optim), where
            for fqn, states in expected_optim.items():
                for name, value in states.items():
                    assert torch.equal(got_optim[fqn][name], value), (where, fqn, name)


def test_hsdp_to_fsdp_through_dcp(pool4: RankPool, tmp_path: Any) -> None:
    pool4.run(hsdp_to_fsdp, str(tmp_path))
