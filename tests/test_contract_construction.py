"""Contract: construction behaves as torch FSDP1's does, checked against torch on the same input.

- The attributes torch's FSDP1 instances carry (and stacks such as accelerate and Lightning
  read) exist on ours with torch's values, unit by unit, before and after lazy init, inside
  ``no_sync``, after ``set_state_dict_type`` and ``register_comm_hook``.
- ``device_id`` takes an int, a str or a torch.device, like torch's.
- The warnings torch emits for arguments we accept are emitted by ours too, with the same
  category.
- An ignored module that contains an FSDP unit is accepted, with torch's semantics: the unit
  inside keeps working, the rest of the ignored subtree is left alone; training matches torch
  bit for bit.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests._harness import RankPool
from tests._models import Block, global_batch, lm_loss, local_rows, make_toy


def _libs() -> tuple[Any, Any]:
    import fsdp
    import torch.distributed.fsdp as tfsdp

    return fsdp, tfsdp


def _units(model: nn.Module, cls: type) -> list[tuple[str, nn.Module]]:
    return [(n.replace("_fsdp_wrapped_module.", ""), m) for n, m in model.named_modules() if isinstance(m, cls)]


def _dataclass_fields(config: Any) -> dict[str, Any]:
    """The config's fields; fsdp's own optional fields (test_api_surface) only when set."""
    from tests.test_api_surface import FSDP_EXTENSION_FIELDS

    extensions = FSDP_EXTENSION_FIELDS.get(type(config).__name__, [])
    return {
        name: getattr(config, name)
        for name in config.__dataclass_fields__
        if name not in extensions or getattr(config, name) is not None
    }


def _names(objs: set[Any], model: nn.Module, params: bool) -> list[str]:
    """Qualified names (wrapper segments removed) of the ignored modules or parameters."""
    items = model.named_parameters(remove_duplicate=False) if params else model.named_modules()
    return sorted({n.replace("_fsdp_wrapped_module.", "") for n, o in items if o in objs})


def _attributes(unit: nn.Module, root: nn.Module) -> dict[str, Any]:
    """Torch FSDP1's public attributes of ``unit``, as comparable plain values."""
    flat = unit._flat_param
    return {
        "cpu_offload": _dataclass_fields(unit.cpu_offload),
        "mixed_precision": {k: v for k, v in _dataclass_fields(unit.mixed_precision).items() if k != "_module_classes_to_ignore"},
        "backward_prefetch": None if unit.backward_prefetch is None else unit.backward_prefetch.name,
        "forward_prefetch": unit.forward_prefetch,
        "limit_all_gathers": unit.limit_all_gathers,
        "sharding_strategy": unit.sharding_strategy.name,
        "process_group_is_world": unit.process_group is dist.group.WORLD,
        "rank": unit.rank,
        "world_size": unit.world_size,
        "compute_device": unit.compute_device,
        "training_state": unit.training_state.name,
        "_use_orig_params": unit._use_orig_params,
        "_has_params": unit._has_params,
        # (torch's FlatParameter reports type name "Parameter"; with use_orig_params torch pads
        # each original parameter to an alignment boundary, ours does not, so the flat sizes
        # are compared without use_orig_params only.)
        "_flat_param": None if flat is None else (isinstance(flat, nn.Parameter), flat.dim(), flat.dtype),
        "_handle": unit._handle is not None,
        "params": [p.dim() for p in unit.params],
        "flat_numels": None if unit._use_orig_params else [p.numel() for p in unit.params],
        "_is_root": unit._is_root,
        "_ignored_modules": _names(unit._ignored_modules, root, params=False),
        "_ignored_params": _names(unit._ignored_params, root, params=True),
        "_sync_gradients": unit._sync_gradients,
        "_device_mesh": unit._device_mesh,
        "_state_dict_type": unit._state_dict_type.name,
        "_state_dict_config": (type(unit._state_dict_config).__name__, _dataclass_fields(unit._state_dict_config)),
        "_optim_state_dict_config": (type(unit._optim_state_dict_config).__name__, _dataclass_fields(unit._optim_state_dict_config)),
        "_comm_hook": None if unit._comm_hook is None else unit._comm_hook.__name__,
        "_comm_hook_state": type(unit._comm_hook_state).__name__,
        "_use_full_prec_in_eval": unit._use_full_prec_in_eval,
        "module_is_wrapped": unit.module is unit._fsdp_wrapped_module,
    }


def _construct(lib: Any, wrap: Any, config: str) -> nn.Module:
    model = make_toy()
    # device_id="cpu" for both: torch FSDP1 needs it on CPU (ours does not).
    kwargs: dict[str, Any] = {"auto_wrap_policy": wrap.ModuleWrapPolicy({Block}), "device_id": "cpu"}
    if config == "configured":
        kwargs.update(
            sharding_strategy=lib.ShardingStrategy.SHARD_GRAD_OP,
            # (offload_params=True: torch FSDP1 pins memory at lazy init, which needs an
            # accelerator; "offload" below checks the attributes at construction.)
            cpu_offload=lib.CPUOffload(offload_params=False),
            mixed_precision=lib.MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32),
            backward_prefetch=lib.BackwardPrefetch.BACKWARD_POST,
            forward_prefetch=True,
            limit_all_gathers=False,
            use_orig_params=True,
        )
    elif config == "offload":
        kwargs.update(cpu_offload=lib.CPUOffload(offload_params=True))
    elif config == "ignored":
        kwargs.update(ignored_modules=[model.blocks[1].fc2, model.embed])
    elif config == "no_prefetch":
        kwargs.update(backward_prefetch=None, sharding_strategy=lib.ShardingStrategy.NO_SHARD)
    return lib.FullyShardedDataParallel(model, **kwargs)


def _compare_attributes(config: str) -> int:
    import fsdp.wrap as wrap
    import torch.distributed.fsdp.wrap as twrap
    from torch.distributed.algorithms._comm_hooks import default_hooks

    fsdp, tfsdp = _libs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # NO_SHARD's deprecation (checked below)
        ours = _construct(fsdp, wrap, config)
        theirs = _construct(tfsdp, twrap, config)
    ours_units, torch_units = _units(ours, fsdp.FullyShardedDataParallel), _units(theirs, tfsdp.FullyShardedDataParallel)
    assert [n for n, _ in ours_units] == [n for n, _ in torch_units]
    checked = 0

    def compare(phase: str) -> None:
        nonlocal checked
        for (name, mine), (_, torch_unit) in zip(ours_units, torch_units):
            a, b = _attributes(mine, ours), _attributes(torch_unit, theirs)
            if phase == "inside summon_full_params":
                # The flat tensor's unsharded form then: torch's is unpadded, ours padded.
                a.pop("flat_numels"), b.pop("flat_numels")
            assert a == b, f"{config} {phase} unit '{name}': " + "; ".join(
                f"{k}: ours {a[k]!r} torch {b[k]!r}" for k in a if a[k] != b.get(k)
            )
            checked += 1

    compare("constructed")
    if config == "offload":
        return checked
    tokens, _ = global_batch(0, dist.get_world_size())
    x = local_rows(tokens, dist.get_rank(), dist.get_world_size())
    for model in (ours, theirs):
        model(x).float().sum().backward()
    compare("after a step")  # _is_root set
    with ours.no_sync(), theirs.no_sync():
        compare("inside no_sync")
    with fsdp.FullyShardedDataParallel.summon_full_params(ours), tfsdp.FullyShardedDataParallel.summon_full_params(theirs):
        compare("inside summon_full_params")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch deprecates set_state_dict_type
        fsdp.FullyShardedDataParallel.set_state_dict_type(
            ours, fsdp.StateDictType.SHARDED_STATE_DICT, fsdp.ShardedStateDictConfig(offload_to_cpu=True)
        )
        tfsdp.FullyShardedDataParallel.set_state_dict_type(
            theirs, tfsdp.StateDictType.SHARDED_STATE_DICT, tfsdp.ShardedStateDictConfig(offload_to_cpu=True)
        )
    if config == "default":
        for model in (ours, theirs):
            model.register_comm_hook(default_hooks.DefaultState(dist.group.WORLD), default_hooks.reduce_scatter_hook)
    compare("after set_state_dict_type and register_comm_hook")
    # _sync_gradients can be set (as torch's attribute).
    ours._sync_gradients = False
    assert ours._fsdp_state.sync_gradients is False
    ours._sync_gradients = True
    return checked


@pytest.mark.parametrize("config", ["default", "configured", "offload", "ignored", "no_prefetch"])
def test_attributes_match_torch_fsdp1(pool2: RankPool, config: str) -> None:
    counts = pool2.run(_compare_attributes, config)
    phases = 1 if config == "offload" else 5
    assert counts[0] == counts[1] == phases * 4  # 4 units


def _hybrid_attributes() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    fsdp, tfsdp = _libs()
    mesh = init_device_mesh("cpu", (2, 1))
    ours = fsdp.FullyShardedDataParallel(make_toy(), sharding_strategy=fsdp.ShardingStrategy.HYBRID_SHARD, device_mesh=mesh)
    theirs = tfsdp.FullyShardedDataParallel(
        make_toy(), sharding_strategy=tfsdp.ShardingStrategy.HYBRID_SHARD, device_mesh=mesh, device_id=torch.device("cpu")
    )
    for model in (ours, theirs):
        assert model._device_mesh is mesh
        assert model.process_group is mesh.get_group(1) and model._inter_node_pg is mesh.get_group(0)
        assert (model.rank, model.world_size) == (0, 1)
    plain = fsdp.FullyShardedDataParallel(make_toy())
    assert not hasattr(plain, "_inter_node_pg")  # as torch: only hybrid units have one


def test_hybrid_attributes_match_torch_fsdp1(pool2: RankPool) -> None:
    pool2.run(_hybrid_attributes)


# ------------------------------------------------------------------ device_id
def _device_ids() -> None:
    fsdp, tfsdp = _libs()
    for device_id in ("cpu", torch.device("cpu"), "cpu:0"):
        ours = fsdp.FullyShardedDataParallel(make_toy(), device_id=device_id)
        assert ours.compute_device == torch.device("cpu"), device_id
        assert all(p.device.type == "cpu" for p in ours.parameters())
    theirs = tfsdp.FullyShardedDataParallel(make_toy(), device_id="cpu")
    assert theirs.compute_device == torch.device("cpu")
    # Training with a string device_id matches torch's.
    ours = fsdp.FullyShardedDataParallel(make_toy(), device_id="cpu")
    for step in range(2):
        tokens, targets = global_batch(step, dist.get_world_size())
        x = local_rows(tokens, dist.get_rank(), dist.get_world_size())
        y = local_rows(targets, dist.get_rank(), dist.get_world_size())
        losses = []
        for model in (ours, theirs):
            loss = lm_loss(model(x), y)
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None
            losses.append(loss.detach())
        assert torch.equal(losses[0], losses[1]), losses
    with pytest.raises(RuntimeError, match=r"device_id='not-a-device' is not a device"):
        fsdp.FullyShardedDataParallel(make_toy(), device_id="not-a-device")
    with pytest.raises(TypeError, match=r"device_id must be an int \(CUDA index\), a str or a torch\.device, got float"):
        fsdp.FullyShardedDataParallel(make_toy(), device_id=1.5)
    with pytest.raises(ValueError, match=r"device_id='meta': FSDP cannot compute on the meta device"):
        fsdp.FullyShardedDataParallel(make_toy(), device_id="meta")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match=r"device_id='cuda:0' names a CUDA device, but CUDA is not available"):
            fsdp.FullyShardedDataParallel(make_toy(), device_id="cuda:0")
    else:
        ours = fsdp.FullyShardedDataParallel(make_toy(), device_id=f"cuda:{torch.cuda.current_device()}")
        assert ours.compute_device == torch.device("cuda", torch.cuda.current_device())


def test_device_id_forms(pool2: RankPool) -> None:
    pool2.run(_device_ids)


# ------------------------------------------------------------------ warnings
def _warnings_of(fn: Callable[[], Any]) -> list[tuple[str, str]]:
    """(category, message) of every warning ``fn`` emits."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [(w.category.__name__, str(w.message)) for w in caught]


def _categories(caught: list[tuple[str, str]], needle: str) -> list[str]:
    return [cat for cat, msg in caught if needle.lower() in msg.lower()]


def _construction_warnings() -> None:
    fsdp, tfsdp = _libs()
    F, TF = fsdp.FullyShardedDataParallel, tfsdp.FullyShardedDataParallel
    cpu = {"device_id": torch.device("cpu")}
    cases: list[tuple[str, Callable[[], Any], Callable[[], Any], str, str]] = []

    def ignore_top(lib_cls: Any, extra: dict[str, Any]) -> Callable[[], Any]:
        def build() -> Any:
            model = make_toy()
            return lib_cls(model, ignored_modules=[model], **extra)

        return build

    cases.append(("top-level module ignored", ignore_top(F, {}), ignore_top(TF, cpu), "ignore", "the top-level module"))
    cases.append((
        "ModuleList wrapped",
        lambda: F(nn.ModuleList([nn.Linear(2, 2)])),
        lambda: TF(nn.ModuleList([nn.Linear(2, 2)]), **cpu),
        "containers that do not implement forward",
        "containers that do not implement forward",
    ))
    cases.append((
        "NO_SHARD deprecated",
        lambda: F(make_toy(), sharding_strategy=fsdp.ShardingStrategy.NO_SHARD),
        lambda: TF(make_toy(), sharding_strategy=tfsdp.ShardingStrategy.NO_SHARD, **cpu),
        "NO_SHARD sharding strategy is deprecated",
        "NO_SHARD` sharding strategy is deprecated",
    ))

    def summon_offload(lib_cls: Any, extra: dict[str, Any]) -> Callable[[], Any]:
        model = lib_cls(make_toy(), **extra)

        def run() -> None:
            try:
                with lib_cls.summon_full_params(model, offload_to_cpu=True, writeback=False):
                    pass
            except RuntimeError:
                # Torch FSDP1's offload path fails on CPU (it frees a storage it never
                # copied), after its warning; ours works on CPU.
                if lib_cls is not TF:
                    raise

        return run

    cases.append((
        "summon offload_to_cpu without rank0_only",
        summon_offload(F, {}),
        summon_offload(TF, cpu),
        "offload_to_cpu=True, rank0_only=False",
        "offload_to_cpu=True and rank0_only=False",
    ))
    for what, ours_fn, torch_fn, ours_needle, torch_needle in cases:
        ours_cats = _categories(_warnings_of(ours_fn), ours_needle)
        torch_cats = _categories(_warnings_of(torch_fn), torch_needle)
        assert torch_cats, f"{what}: torch FSDP1 did not warn (the case is wrong)"
        assert ours_cats == torch_cats[:1] * len(ours_cats) and ours_cats, (what, ours_cats, torch_cats)
    # No such warnings for ordinary construction.
    plain = _warnings_of(lambda: F(make_toy()))
    assert not [msg for _, msg in plain if msg.startswith("fsdp:")], plain


def test_construction_warnings_match_torch_fsdp1(pool2: RankPool) -> None:
    pool2.run(_construction_warnings)


def _world_size_one_warning() -> None:
    fsdp, tfsdp = _libs()
    ours = _warnings_of(lambda: fsdp.FullyShardedDataParallel(make_toy()))
    theirs = _warnings_of(lambda: tfsdp.FullyShardedDataParallel(make_toy(), device_id=torch.device("cpu")))
    assert _categories(theirs, "switching to use `NO_SHARD`") == ["UserWarning"]
    assert _categories(ours, "switching to use `NO_SHARD`") == ["UserWarning"]
    none_asked = _warnings_of(
        lambda: fsdp.FullyShardedDataParallel(make_toy(), sharding_strategy=fsdp.ShardingStrategy.NO_SHARD)
    )
    assert not _categories(none_asked, "NO_SHARD"), none_asked  # asked for NO_SHARD: nothing to say


def test_world_size_one_warning_matches_torch_fsdp1(pool1: RankPool) -> None:
    pool1.run(_world_size_one_warning)


# ------------------------------------------------------------------ ignored module containing a unit
def _ignored_module_containing_a_unit(use_orig_params: bool) -> int:
    fsdp, tfsdp = _libs()
    models = []
    for lib, extra in ((fsdp, {}), (tfsdp, {"device_id": torch.device("cpu")})):
        model = make_toy()
        model.blocks[0] = lib.FullyShardedDataParallel(model.blocks[0], use_orig_params=use_orig_params, **extra)
        root = lib.FullyShardedDataParallel(model, ignored_modules=[model.blocks], use_orig_params=use_orig_params, **extra)
        models.append(root)
    ours, theirs = models
    # The same ignored modules and parameters: blocks.1 and blocks.2 (not the unit blocks.0).
    assert _names(ours._ignored_modules, ours, False) == _names(theirs._ignored_modules, theirs, False)
    assert _names(ours._ignored_params, ours, True) == _names(theirs._ignored_params, theirs, True)
    assert "blocks.1.fc1.weight" in _names(ours._ignored_params, ours, True)
    assert not any(n.startswith("blocks.0") for n in _names(ours._ignored_params, ours, True))
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    rank, ws = dist.get_rank(), dist.get_world_size()
    for step in range(3):
        tokens, targets = global_batch(step, ws)
        x, y = local_rows(tokens, rank, ws), local_rows(targets, rank, ws)
        losses = []
        for model, opt in zip(models, opts):
            loss = lm_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        assert torch.equal(losses[0], losses[1]), (step, losses)
    full = []
    for model, cls in zip(models, (fsdp.FullyShardedDataParallel, tfsdp.FullyShardedDataParallel)):
        with cls.summon_full_params(model, writeback=False):
            full.append({n: p.detach().clone() for n, p in model.named_parameters()})
    assert list(full[0]) == list(full[1])
    for name in full[0]:
        assert torch.equal(full[0][name], full[1][name]), name
    return len(full[0])


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_ignored_module_containing_a_unit_matches_torch_fsdp1(pool2: RankPool, use_orig_params: bool) -> None:
    counts = pool2.run(_ignored_module_containing_a_unit, use_orig_params)
    assert counts[0] == counts[1] > 0
