"""Flat-shard checkpoints (fsdp.checkpoint.save_sharded / load_sharded, issue 33 item 1).

- Saving moves no parameter or optimizer-state bytes: no all-gather, reduce-scatter, all-reduce
  or broadcast of tensors from fsdp or torch.distributed during the save; DCP's planning (object
  collectives of metadata) is counted and bounded.
- The checkpoint loads bit for bit (model and AdamW state, compared through FULL state dicts)
  at another world size and another wrap policy into fsdp (into existing optimizer state, and
  into a fresh optimizer), into torch FSDP1 (its SHARDED state dict as DCP's target), into torch
  FSDP2 (DCP's get_state_dict / set_state_dict) and into a plain model (full tensors).
- Only the ranks that should write do: every rank of a sharding unit, rank 0 for NO_SHARD, the
  first replica under HYBRID_SHARD (read from the checkpoint's metadata).
- Configurations: use_orig_params both ways, FULL_SHARD, SHARD_GRAD_OP with CPU offload,
  NO_SHARD, mixed precision, HYBRID_SHARD on a (2, 2) mesh (only the first replica writes).
- A re-save into the same folder replaces the checkpoint whatever DCP's writer default is;
  ``overwrite=False`` refuses with DCP's sentence before anything is written.
- Trainable-only (``ignore_frozen_params=True``): the frozen base is not written; loading needs
  the flag (the base from elsewhere), and without it the error names the missing parameters.

Save and load run in pools of different sizes that share the directory, each its own job.
"""

from __future__ import annotations

import collections
import os
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests._harness import get_pool
from tests._models import Block, global_batch, make_toy

# name -> (use_orig_params, strategy, mixed precision, cpu offload, hybrid mesh)
CONFIGS_2 = {
    "flat": (False, "FULL_SHARD", False, False, False),
    "orig_mp": (True, "FULL_SHARD", True, False, False),
    "zero2_offload": (False, "SHARD_GRAD_OP", False, True, False),
    "orig_no_shard": (True, "NO_SHARD", False, False, False),
}
CONFIGS_4 = {
    "hybrid_orig": (True, "HYBRID_SHARD", False, False, True),
    "flat4": (False, "FULL_SHARD", True, False, False),
}


def _ours(config: tuple[bool, str, bool, bool, bool], seed: int, policy: set[type] | None = None) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp import CPUOffload, MixedPrecision, ShardingStrategy
    from fsdp import FullyShardedDataParallel as FSDP
    from fsdp.wrap import ModuleWrapPolicy

    orig, strategy, mp, offload, hybrid = config
    kw: dict[str, Any] = {"use_orig_params": orig, "sharding_strategy": ShardingStrategy[strategy]}
    if mp:
        kw["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if offload:
        kw["cpu_offload"] = CPUOffload(offload_params=True)
    if hybrid:
        kw["device_mesh"] = init_device_mesh("cpu", (2, dist.get_world_size() // 2))
    return FSDP(make_toy(seed=seed), auto_wrap_policy=ModuleWrapPolicy(policy or {Block}), **kw)


def _train(model: nn.Module, steps: int, lr: float = 1e-2) -> torch.optim.Optimizer:
    optim = torch.optim.AdamW(model.parameters(), lr=lr)
    rank, ws = dist.get_rank(), dist.get_world_size()
    for step in range(steps):
        tokens, targets = global_batch(step, ws)
        rows = slice(rank * 4, (rank + 1) * 4)
        logits = model(tokens[rows])
        nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets[rows].reshape(-1)).backward()
        optim.step()
        optim.zero_grad()
    return optim


def _full(model: nn.Module, optim: torch.optim.Optimizer, lib: str = "ours") -> tuple[dict[str, Any], dict[str, Any]]:
    """FULL model and optimizer state dicts (on every rank)."""
    if lib == "ours":
        from fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
        from fsdp import FullyShardedDataParallel as FSDP
    else:
        from torch.distributed.fsdp import (  # type: ignore[assignment]
            FullOptimStateDictConfig,
            FullStateDictConfig,
            StateDictType,  # type: ignore[assignment]
        )
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # type: ignore[assignment]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with FSDP.state_dict_type(
            model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False), FullOptimStateDictConfig(rank0_only=False)
        ):
            return model.state_dict(), FSDP.optim_state_dict(model, optim)


def _assert_equal(loaded: dict[str, Any], expected: dict[str, Any], what: str) -> None:
    """Same keys (another wrap policy orders them otherwise) and values bit for bit."""
    if "state" not in expected:
        assert sorted(loaded) == sorted(expected), what
        for key, value in expected.items():
            assert torch.equal(loaded[key], value), (what, key)
        return
    assert sorted(loaded["state"]) == sorted(expected["state"]), what
    for fqn, entry in expected["state"].items():
        assert sorted(loaded["state"][fqn]) == sorted(entry), (what, fqn)
        for name, value in entry.items():
            assert torch.equal(loaded["state"][fqn][name], value), (what, fqn, name)
    loaded_names = [sorted(g["params"]) for g in loaded["param_groups"]]
    assert loaded_names == [sorted(g["params"]) for g in expected["param_groups"]], what


_DATA_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")
def _save_moving_no_tensor(model: Any, optim: Any, path: str, name: str) -> tuple[dict[str, int], dict[str, int]]:
    """save_sharded, asserting it issues no tensor collective at all, and of object messages
    only each rank's report to the coordinator (received one at a time) and one broadcast of the
    outcome ([Note: A save without a global plan]: no plan travels). Returns the data
    collectives (none) and the object ones."""
    from fsdp.checkpoint import save_sharded
    from tests._comm_count import count_collectives, count_object_messages

    with count_collectives() as counts, count_object_messages() as objects, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_sharded(model, optim, checkpoint_id=path)
    data = {kind: counts.calls[kind] for kind in _DATA_KINDS if counts.calls[kind]}
    assert data == {} and counts.total_bytes() == 0, (name, dict(counts.calls), dict(counts.bytes))
    rank, ws = dist.get_rank(), dist.get_world_size()
    sent = {"recv_object_list": ws - 1, "send_object_list": 0} if rank == 0 else {"recv_object_list": 0, "send_object_list": 1}
    assert objects == {"gather_object": 0, "scatter_object_list": 0, "all_gather_object": 0, "broadcast_object_list": 1, **sent}
    return data, dict(objects)


def save_all(directory: str, configs: dict[str, tuple[bool, str, bool, bool, bool]]) -> dict[str, Any]:
    """Each config: train 2 steps, save_sharded (counted), keep the FULL states to compare."""

    report = {}
    for name, config in configs.items():
        model = _ours(config, seed=5)
        optim = _train(model, 2)
        path = os.path.join(directory, name)
        data, objects = _save_moving_no_tensor(model, optim, path, name)
        report[name] = {"data": data, "objects": objects}
        _check_writers(path, config)
        if name == next(iter(configs)):
            _assert_metadata_as_dcp_builds_it(model, optim, path)
        model_sd, optim_sd = _full(model, optim)
        if dist.get_rank() == 0:
            torch.save({"model": model_sd, "optim": optim_sd}, os.path.join(directory, f"{name}.pt"))
        dist.barrier()
    return report


def _assert_metadata_as_dcp_builds_it(model: Any, optim: Any, path: str) -> None:
    """[Note: A save without a global plan]: the metadata the coordinator builds from the ranks'
    reports is what DCP's own protocol builds of the same state dict (``save_sharded`` with a
    plain ``FileSystemWriter`` runs ``dcp.save``): the same keys, tensor properties, shapes and
    chunks in the same order, flattening paths and storage entries; the coordinator returns it,
    the other ranks None."""
    import torch.distributed.checkpoint as dcp

    from fsdp.checkpoint import save_sharded

    dist.barrier()  # rank 0 has checked the first save's files
    ours = save_sharded(model, optim, checkpoint_id=path)
    theirs_path = path + "-dcp"
    theirs = save_sharded(model, optim, checkpoint_id=theirs_path, storage_writer=dcp.FileSystemWriter(theirs_path))
    if dist.get_rank() != 0:
        assert ours is None
        return
    assert ours is not None and ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.planner_data == theirs.planner_data
    assert set(ours.storage_data) == set(theirs.storage_data)  # (fqn, offsets): the index hint is not compared
    assert dcp.FileSystemReader(path).read_metadata().state_dict_metadata == ours.state_dict_metadata


def _check_writers(path: str, config: tuple[bool, str, bool, bool, bool]) -> None:
    """Parameter and optimizer-state chunks come only from the ranks that write them: a hybrid
    model's first replica (global ranks 0 and 1 of the (2, 2) mesh), NO_SHARD's rank 0. What
    every rank holds alike is written once ([Note: Who writes a replicated value]): buffers and
    param groups by rank 0, a parameter's ``step`` by the rank that writes its first element.
    Nothing is written twice: each data file holds exactly the bytes the metadata names."""
    import torch.distributed.checkpoint as dcp

    if dist.get_rank() != 0:
        return
    ws = dist.get_world_size()
    writers = {0, 1} if config[4] else {0} if config[1] == "NO_SHARD" else set(range(ws))
    params = {n for n, _ in make_toy().named_parameters()}
    metadata = dcp.FileSystemReader(path).read_metadata()
    seen: set[int] = set()
    origin: dict[str, int] = {}
    steps: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        name = index.fqn.removeprefix("model.").removeprefix("optim.state.")
        for suffix in (".exp_avg", ".exp_avg_sq"):
            name = name.removesuffix(suffix)
        writer = int(info.relative_path.split("_")[2])  # __<rank>_<tag>_<n>.distcp
        if name in params:
            seen.add(writer)
            if index.fqn.startswith("model.") and not any(index.offset):
                origin[name] = writer
        elif name.removesuffix(".step") in params:
            steps[name.removesuffix(".step")] = writer
        else:  # buffers, optim.param_groups' entries
            assert writer == 0 and index.fqn.startswith(("model.", "optim.param_groups")), (config, index.fqn, writer)
    assert seen == writers, (config, seen, writers)
    assert steps and all(origin[name] == writer for name, writer in steps.items()), (config, steps, origin)
    _assert_files_hold_only_named_bytes(path, metadata)


def _assert_files_hold_only_named_bytes(path: str, metadata: Any) -> None:
    """Nothing is written twice: each data file's size is the sum of the lengths the metadata
    names in it (a value planned by two ranks would leave an unnamed copy in one file)."""
    named: collections.Counter[str] = collections.Counter()
    for info in metadata.storage_data.values():
        named[info.relative_path] += info.length
    on_disk = {f: os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".distcp")}
    assert dict(named) == on_disk, (path, dict(named), on_disk)


def load_all(directory: str, configs: dict[str, tuple[bool, str, bool, bool, bool]]) -> None:
    """Each saved config loads here (another world size) bit for bit: into fsdp with another
    wrap policy (one root unit), into torch FSDP1 through DCP, into a plain model through DCP."""
    from fsdp.checkpoint import load_sharded

    for name, config in configs.items():
        path = os.path.join(directory, name)
        expected = torch.load(os.path.join(directory, f"{name}.pt"), weights_only=False)
        flat_config = (config[0], "FULL_SHARD", False, False, False)
        for policy in ({Block}, {nn.Embedding}):
            model = _ours(flat_config, seed=9, policy=policy)
            if policy == {Block}:
                optim = _train(model, 1, lr=0.5)  # optimizer state to load into
            else:  # a fresh optimizer: load_sharded gives it state first
                optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                load_sharded(model, optim, checkpoint_id=path)
            model_sd, optim_sd = _full(model, optim)
            _assert_equal(model_sd, expected["model"], f"{name} model into fsdp {policy}")
            _assert_equal(optim_sd, expected["optim"], f"{name} optim into fsdp {policy}")
        _load_into_torch_fsdp1(path, expected, config[0], name)
        _load_into_fsdp2(path, expected, name)
        _load_into_plain(path, expected, name)


def _load_into_fsdp2(path: str, expected: dict[str, Any], name: str) -> None:
    """Into torch FSDP2 (``fully_shard`` per block and the root) through DCP's state-dict helpers."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    model = make_toy(seed=9)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optim = _train(model, 1, lr=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model_sd, optim_sd = get_state_dict(model, optim)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        full_model, full_optim = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
    _assert_equal(full_model, expected["model"], f"{name} model into torch FSDP2")
    _assert_equal(full_optim, expected["optim"], f"{name} optim into torch FSDP2")


def _load_into_torch_fsdp1(path: str, expected: dict[str, Any], orig: bool, name: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import StateDictType
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = TorchFSDP(make_toy(seed=9), auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=orig, device_id=torch.device("cpu"))
    optim = _train(model, 1, lr=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with TorchFSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            state = {"model": model.state_dict(), "optim": TorchFSDP.optim_state_dict(model, optim)}
            dcp.load(state, checkpoint_id=path)
            model.load_state_dict(state["model"])
            optim.load_state_dict(TorchFSDP.optim_state_dict_to_load(model, optim, state["optim"]))
    model_sd, optim_sd = _full(model, optim, "torch")
    _assert_equal(model_sd, expected["model"], f"{name} model into torch FSDP1")
    if not orig:
        _assert_equal(optim_sd, expected["optim"], f"{name} optim into torch FSDP1")
        return
    # torch FSDP1's FULL optim_state_dict with use_orig_params gives exp_avg_sq's values for
    # exp_avg too (its own model, no checkpoint involved, torch 2.13 on gloo): read the
    # optimizer's own per-parameter state, each the part its shard holds.
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    checked = 0
    for unit in TorchFSDP.fsdp_modules(model):
        flat = getattr(unit, "_flat_param", None)
        if flat is None:
            continue
        for param, fqn, info in zip(flat._params, flat._fqns, flat._shard_param_infos):
            if not info.in_shard:
                continue
            full_fqn = _torch_unit_fqn(model, unit, fqn)
            for state_name, value in expected["optim"]["state"][full_fqn].items():
                want = value if value.dim() == 0 else value.flatten()[info.intra_param_start_idx : info.intra_param_end_idx + 1]
                assert torch.equal(optim.state[param][state_name], want), (name, full_fqn, state_name)
                checked += 1
    assert checked > 0


def _torch_unit_fqn(model: nn.Module, unit: nn.Module, fqn: str) -> str:
    """A torch FSDP1 unit's parameter name ``fqn`` as the unwrapped model names it."""
    for name, module in model.named_modules():
        if module is unit:
            full = f"{name}.{fqn}" if name else fqn
            return ".".join(part for part in full.split(".") if part != "_fsdp_wrapped_module")
    raise AssertionError(fqn)


def _load_into_plain(path: str, expected: dict[str, Any], name: str) -> None:
    import torch.distributed.checkpoint as dcp

    plain = make_toy(seed=9)
    state: dict[str, Any] = {"model": plain.state_dict()}
    state["optim"] = {"state": {fqn: {"exp_avg": torch.zeros_like(v)} for fqn, v in plain.named_parameters()}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=path)
    plain.load_state_dict(state["model"])
    _assert_equal(plain.state_dict(), expected["model"], f"{name} into a plain model")
    for fqn, entry in state["optim"]["state"].items():
        assert torch.equal(entry["exp_avg"], expected["optim"]["state"][fqn]["exp_avg"]), (name, fqn)


def test_flat_checkpoint_2_to_4(tmp_path: Any) -> None:
    reports = get_pool(2).run(save_all, str(tmp_path), CONFIGS_2, _timeout=300)
    for report in reports:
        for name, counts in report.items():
            assert set(counts["data"]) <= {"all_reduce", "broadcast"}, (name, counts)
    print("collectives during save_sharded (rank 0):", reports[0])
    get_pool(4).run(load_all, str(tmp_path), CONFIGS_2, _timeout=300)


def test_flat_checkpoint_hybrid_4_to_2(tmp_path: Any) -> None:
    get_pool(4).run(save_all, str(tmp_path), CONFIGS_4, _timeout=300)
    get_pool(2).run(load_all, str(tmp_path), CONFIGS_4, _timeout=300)


def resave(directory: str) -> None:
    """A re-save into the same folder replaces the checkpoint under either default of DCP's
    ``FileSystemWriter(overwrite=...)`` (torch PR #191478 flips it to False): save_sharded
    writes with a writer of its own ([Note: Kill-safe re-saves]). ``overwrite=False`` refuses
    before anything is written."""
    import torch.distributed.checkpoint as dcp

    from fsdp.checkpoint import load_sharded, save_sharded

    path = os.path.join(directory, "resaved")
    original = dcp.FileSystemWriter

    class NoOverwriteByDefault(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, overwrite: bool = False, **kwargs: Any) -> None:
            super().__init__(*args, overwrite=overwrite, **kwargs)

    config = CONFIGS_2["orig_mp"]
    model = _ours(config, seed=5)
    optim = _train(model, 1)
    for default in (original, NoOverwriteByDefault):
        dcp.FileSystemWriter = default  # type: ignore[misc]
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                save_sharded(model, optim, checkpoint_id=path)
                _train_more(model, optim)  # new parameters and optimizer state to re-save
                save_sharded(model, optim, checkpoint_id=path)  # the re-save
                # Refused on every rank before anything is written (DCP's sentence, and the fix).
                before = {name: os.stat(os.path.join(path, name)).st_mtime_ns for name in os.listdir(path)}
                with pytest.raises(RuntimeError, match=r"Checkpoint already exists and self.overwrite=False\. fsdp: save_sharded found a complete checkpoint in '.*resaved'.*wrote nothing\. Pass overwrite=True"):
                    save_sharded(model, optim, checkpoint_id=path, overwrite=False)
                assert {name: os.stat(os.path.join(path, name)).st_mtime_ns for name in os.listdir(path)} == before
        finally:
            dcp.FileSystemWriter = original  # type: ignore[misc]
        expected = _full(model, optim)
        target = _ours(config, seed=9)
        target_optim = _train(target, 1, lr=0.5)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load_sharded(target, target_optim, checkpoint_id=path)
        loaded = _full(target, target_optim)
        _assert_equal(loaded[0], expected[0], f"re-saved model, {default.__name__}")
        _assert_equal(loaded[1], expected[1], f"re-saved optimizer, {default.__name__}")


def _train_more(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    tokens, targets = global_batch(7, dist.get_world_size())
    rows = slice(dist.get_rank() * 4, (dist.get_rank() + 1) * 4)
    logits = model(tokens[rows])
    nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets[rows].reshape(-1)).backward()
    optim.step()
    optim.zero_grad()


def test_resave_into_existing_folder(tmp_path: Any) -> None:
    get_pool(2).run(resave, str(tmp_path), _timeout=300)


def _frozen_base(orig: bool, seed: int, policy: set[type] | None = None) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A toy whose embedding and first two blocks are a frozen base (whole units without
    use_orig_params, which needs uniform requires_grad per unit), trained 2 steps."""
    from fsdp import FullyShardedDataParallel as FSDP
    from fsdp.wrap import ModuleWrapPolicy

    toy = make_toy(seed=seed)
    frozen = [toy.blocks[0], toy.blocks[1]] + ([toy.embed] if orig else [])
    for module in frozen:
        module.requires_grad_(False)
    model = FSDP(toy, auto_wrap_policy=ModuleWrapPolicy(policy or {Block}), use_orig_params=orig)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    rank, ws = dist.get_rank(), dist.get_world_size()
    for step in range(2):
        tokens, targets = global_batch(step, ws)
        logits = model(tokens[rank * 4 : (rank + 1) * 4])
        nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets[rank * 4 : (rank + 1) * 4].reshape(-1)).backward()
        optim.step()
        optim.zero_grad()
    return model, optim


_FROZEN = {True: ["embed.weight"], False: []}


def trainable_only_save(directory: str) -> None:
    """ignore_frozen_params=True: the frozen base's parameters are not in the checkpoint."""
    import torch.distributed.checkpoint as dcp

    from fsdp.checkpoint import save_sharded

    for orig in (True, False):
        model, optim = _frozen_base(orig, seed=5)
        path = os.path.join(directory, f"adapter_{orig}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            save_sharded(model, optim, checkpoint_id=path, ignore_frozen_params=True)
        keys = set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
        frozen = [f"blocks.{i}.{p}" for i in (0, 1) for p in ("norm.weight", "norm.bias", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")]
        frozen += _FROZEN[orig]
        assert not {f"model.{k}" for k in frozen} & keys, sorted(keys)
        assert "model.blocks.2.fc1.weight" in keys and "optim.state.blocks.2.fc1.weight.exp_avg" in keys
        model_sd, optim_sd = _full(model, optim)
        if dist.get_rank() == 0:
            torch.save({"model": model_sd, "optim": optim_sd}, path + ".pt")
        dist.barrier()


def trainable_only_load(directory: str) -> None:
    """Into a model whose base came from elsewhere (the same seed: the same frozen values), at
    another world size and wrap policy: bit for bit with ignore_frozen_params=True; without it,
    the error names the missing frozen parameters, and nothing changed."""
    from fsdp.checkpoint import load_sharded

    for orig in (True, False):
        path = os.path.join(directory, f"adapter_{orig}")
        expected = torch.load(path + ".pt", weights_only=False)
        model, optim = _frozen_base(orig, seed=5)  # the base "from elsewhere"; trained on 2 steps
        before = _full(model, optim)[0]
        with pytest.raises(RuntimeError, match=r"holds no values for the frozen parameters ('embed\.weight', )?'blocks\.0\.norm\.weight'.*ignore_frozen_params=True"):
            load_sharded(model, optim, checkpoint_id=path)
        assert all(torch.equal(v, before[k]) for k, v in _full(model, optim)[0].items()), "nothing changed"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _train(model, 1, lr=0.5)  # move the trainable part away from the saved state
            load_sharded(model, optim, checkpoint_id=path, ignore_frozen_params=True)
        model_sd, optim_sd = _full(model, optim)
        _assert_equal(model_sd, expected["model"], f"trainable-only orig={orig}")
        _assert_equal(optim_sd, expected["optim"], f"trainable-only optim orig={orig}")


def test_trainable_only_checkpoint(tmp_path: Any) -> None:
    get_pool(2).run(trainable_only_save, str(tmp_path), _timeout=300)
    get_pool(4).run(trainable_only_load, str(tmp_path), _timeout=300)


def buffers_as_state_dict() -> None:
    """Buffers (BatchNorm's, cast by mixed precision) go in under the SHARDED state dict's keys
    with its full-precision values."""
    from fsdp import FullyShardedDataParallel as FSDP
    from fsdp import MixedPrecision, StateDictType
    from fsdp.state_dict._flat_checkpoint import flat_shard_state_dict
    from fsdp.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    mp = MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
    model = FSDP(net, auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}), mixed_precision=mp)
    model(torch.randn(3, 4)).sum().backward()
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        reference = model.state_dict()
    ours = flat_shard_state_dict(model)["model"]
    assert sorted(ours) == sorted(reference)
    buffers = [k for k in reference if "running" in k or "num_batches" in k]
    assert len(buffers) == 6
    for key in buffers:
        assert ours[key].dtype == reference[key].dtype and torch.equal(ours[key], reference[key]), key


def test_buffers_as_state_dict() -> None:
    get_pool(2).run(buffers_as_state_dict, _timeout=120)


# ----------------------------------------------------------------------------- tensor parallelism
# name -> (strategy, nested wrap, use_orig_params, hidden size: 11 splits over tp unevenly)
TP_CONFIGS = {
    "tp_nested_orig": ("FULL_SHARD", True, True, 12),
    "tp_flat": ("SHARD_GRAD_OP", False, False, 12),
    "tp_uneven": ("FULL_SHARD", True, False, 11),
}
# tp_uneven's (2, 2) layout (FULL_SHARD, nested, flat, hidden 11) is the one
# tests/test_flat_checkpoint_load.py's uneven test saves (with AdamW state) and loads into
# SHARD_GRAD_OP use_orig_params at (1, 4) and (2, 1) and into fsdp without tp, the targets tp_load
# gives it here: those loads run there only (model and optimizer); here tp_uneven keeps its
# model-only save (no tensor collective, async alike, chunks tiling) and its model-only loads
# into (2, 2), (1, 2) and a plain model.
_TP_LOADED_ELSEWHERE = {"tp_uneven": {(1, 4), (2, 1), "fsdp without tp"}}


def _tp_ours(strategy: str, nested: bool, orig: bool, hidden: int, shape: tuple[int, int]) -> nn.Module:
    from tests.test_tensor_parallel import _tp_model, _wrap

    return _wrap("ours", _tp_model(shape=shape, hidden=hidden), strategy, nested, orig, shape=shape)


def _tp_expected(model: nn.Module, optim: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Every full (TP-unsharded) parameter and optimizer state (torch's DCP state-dict API,
    checked against torch FSDP1 in tests/test_tensor_parallel.py)."""
    from tests.test_tensor_parallel import _full_state

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        params, states = _full_state(model, optim if optim is not None else torch.optim.AdamW(model.parameters()))
    return {"model": params, "optim": states}


def _check_tp_chunks(path: str, expected: dict[str, Any]) -> None:
    """Every parameter's and state's chunks tile its full shape exactly once, and each is written
    once: the tp replicas of a ``Replicate`` or plain parameter leave it to the first ([Note: Who
    writes a replicated value]), so each data file holds exactly the bytes the metadata names."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(path).read_metadata()
    _assert_files_hold_only_named_bytes(path, metadata)
    for key, meta in metadata.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata) or not meta.size:
            continue
        fqn = key.removeprefix("model.")
        if fqn in expected["model"]:
            assert meta.size == expected["model"][fqn].shape, (key, meta.size)
        covered = torch.zeros(meta.size, dtype=torch.int32)
        for chunk in meta.chunks:
            covered[tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))] += 1
        assert bool((covered == 1).all()), (key, [(c.offsets, c.sizes) for c in meta.chunks])


def tp_save(directory: str) -> None:
    """Each TP config on the (2, 2) mesh: one AdamW step (none for the uneven split, which torch
    TP cannot train: see tests/test_export.py), then save_sharded with no tensor collective, and
    async_save_sharded writing the same checkpoint."""
    from fsdp.checkpoint import async_save_sharded
    from tests.test_tensor_parallel import _train

    for name, (strategy, nested, orig, hidden) in TP_CONFIGS.items():
        model = _tp_ours(strategy, nested, orig, hidden, (2, 2))
        optim = torch.optim.AdamW(model.parameters(), lr=0.01) if hidden % 2 == 0 else None
        if optim is not None:
            _train(model, optim, range(2))
        path = os.path.join(directory, name)
        _save_moving_no_tensor(model, optim, path, name)
        # The asynchronous save of the same state writes the same chunks, value for value.
        async_path = os.path.join(directory, f"{name}-async")
        async_save_sharded(model, optim, checkpoint_id=async_path).result()
        expected = _tp_expected(model, optim)
        if dist.get_rank() == 0:
            _check_tp_chunks(path, expected)
            _assert_same_checkpoint(path, async_path, directory, name)
            torch.save(expected, os.path.join(directory, f"{name}.pt"))
        dist.barrier()


def _assert_same_checkpoint(path: str, other: str, directory: str, name: str) -> None:
    """Both DCP checkpoints hold the same keys and, read whole, the same values bit for bit."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    loaded = []
    for i, folder in enumerate((path, other)):
        dcp_to_torch_save(folder, os.path.join(directory, f"{name}-whole{i}.pt"))
        loaded.append(torch.load(os.path.join(directory, f"{name}-whole{i}.pt"), weights_only=False))

    def flat(tree: Any, prefix: str = "") -> dict[str, Any]:
        if isinstance(tree, dict):
            return {k: v for key, value in tree.items() for k, v in flat(value, f"{prefix}{key}.").items()}
        return {prefix: tree}

    first, second = flat(loaded[0]), flat(loaded[1])
    assert sorted(first) == sorted(second), name
    for key, value in first.items():
        same = torch.equal(value, second[key]) if isinstance(value, torch.Tensor) else value == second[key]
        assert same, (name, key)


def _tp_load_plain(path: str, expected: dict[str, Any], name: str, optim: bool, hidden: int | None = None) -> None:
    """Into a plain model (full tensors) through DCP (hidden size: ``name``'s config's)."""
    import torch.distributed.checkpoint as dcp

    from tests.test_tensor_parallel import _make_model

    plain = _make_model(hidden=hidden or TP_CONFIGS[name][3])
    state: dict[str, Any] = {"model": plain.state_dict()}
    if optim:
        zeros = {"exp_avg": torch.zeros_like, "exp_avg_sq": torch.zeros_like}
        state["optim"] = {"state": {fqn: {k: f(v) for k, f in zeros.items()} for fqn, v in plain.named_parameters()}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=path)
    assert sorted(state["model"]) == sorted(expected["model"]), name
    for fqn, value in expected["model"].items():
        assert torch.equal(state["model"][fqn], value), (name, "plain", fqn)
    for (fqn, key), value in expected["optim"].items() if optim else ():
        if key != "step":
            assert torch.equal(state["optim"]["state"][fqn][key], value), (name, "plain", fqn, key)


def tp_load(directory: str, shapes: list[tuple[int, int]], plain_fsdp: bool) -> None:
    """Each TP checkpoint loads bit for bit (every full parameter and optimizer state) into
    fsdp with TP on each (dp, tp) mesh of ``shapes`` (another strategy and use_orig_params, a
    fresh optimizer), into fsdp without TP over every rank (``plain_fsdp``) and into a plain
    model."""
    from fsdp.checkpoint import load_sharded
    from tests.test_tensor_parallel import _plain_fsdp

    for name, (strategy, nested, orig, hidden) in TP_CONFIGS.items():
        path = os.path.join(directory, name)
        expected = torch.load(os.path.join(directory, f"{name}.pt"), weights_only=False)
        with_optim = hidden % 2 == 0
        elsewhere = _TP_LOADED_ELSEWHERE.get(name, set())
        targets = []
        for shape in shapes:  # uneven splits too (tests/test_flat_checkpoint_load.py)
            other = "SHARD_GRAD_OP" if strategy == "FULL_SHARD" else "FULL_SHARD"
            if shape not in elsewhere:
                targets.append((f"tp {shape}", _tp_ours(other, not nested, not orig, hidden, shape)))
        if plain_fsdp and "fsdp without tp" not in elsewhere:
            targets.append(("fsdp without tp", _plain_fsdp("ours", hidden)))
        for what, model in targets:
            optim = torch.optim.AdamW(model.parameters(), lr=0.01) if with_optim else None
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                load_sharded(model, optim, checkpoint_id=path)
            loaded = _tp_expected(model, optim)
            for key in ("model", "optim") if with_optim else ("model",):
                assert sorted(loaded[key]) == sorted(expected[key]), (name, what, key)
                for k, value in expected[key].items():
                    assert torch.equal(loaded[key][k], value), (name, what, k)
        _tp_load_plain(path, expected, name, with_optim)


def test_flat_checkpoint_tensor_parallel(tmp_path: Any) -> None:
    get_pool(4).run(tp_save, str(tmp_path), _timeout=300)
    get_pool(4).run(tp_load, str(tmp_path), [(2, 2), (1, 4)], True, _timeout=300)
    get_pool(2).run(tp_load, str(tmp_path), [(1, 2), (2, 1)], False, _timeout=300)


# ----------------------------------------------------------------------------- boxes, once
def test_param_boxes_once_per_layout() -> None:
    """[Note: A parameter's boxes, once]: ``param_boxes`` is the flat range's boxes, placed by
    the tp-local tensor's global offset (the note's worked example: a (4, 6) weight, Shard(1)
    over 2 tp ranks, tp rank 1's range [2, 8) of its (4, 3) tensor); a placement that is not a
    box raises even where the range is empty (every rank alike); ``layout_param_boxes``
    computes a layout's once and hands out the same answer after."""
    from types import SimpleNamespace

    from torch.distributed.tensor import Partial, Replicate, Shard

    from fsdp.flat_param._shard_map import Box, flat_range_boxes, layout_param_boxes, param_boxes
    from fsdp.flat_param._sharding import ParamShardSlice

    def spec(placement: Any, shape: tuple[int, ...]) -> Any:
        mesh = SimpleNamespace(shape=(2,), get_coordinate=lambda: [1])
        return SimpleNamespace(placements=(placement,), shape=torch.Size(shape), mesh=mesh)

    plain = param_boxes((3, 4), 2, 11)
    assert plain.boxes == plain.global_boxes == tuple(flat_range_boxes((3, 4), 2, 11))
    assert (plain.shape, plain.global_shape, plain.global_offset, plain.placements) == ((3, 4), (3, 4), (0, 0), None)
    tp = param_boxes((4, 3), 2, 8, spec(Shard(1), (4, 6)))
    assert tp.boxes == (Box((0, 2), (1, 1)), Box((1, 0), (1, 3)), Box((2, 0), (1, 2)))
    assert tp.global_boxes == (Box((0, 5), (1, 1)), Box((1, 3), (1, 3)), Box((2, 3), (1, 2)))
    assert (tp.global_shape, tp.global_offset) == ((4, 6), (0, 3))
    assert param_boxes((4, 6), 0, 24, spec(Replicate(), (4, 6))).global_boxes == (Box((0, 0), (4, 6)),)
    with pytest.raises(NotImplementedError, match="not a box"):
        param_boxes((4, 6), 0, 0, spec(Partial(), (4, 6)))

    class Layout:  # what layout_param_boxes reads of a ShardLayout
        param_shapes = (torch.Size([3, 4]), torch.Size([5]))
        shard_slices = (ParamShardSlice(0, 2, 9, 0), None)
        dtensor_specs = (None, None)

    layout = Layout()
    first = layout_param_boxes(layout)
    assert first == (plain, param_boxes((5,), 0, 0)) and first[1].boxes == ()
    assert layout_param_boxes(layout) is first
