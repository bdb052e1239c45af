"""Fractional CPU offload: ``CPUOffload(offload_params=True, fraction=...)`` or
``offload_module=...`` offloads some units ([Note: Fractional offload] in
``fsdp/flat_param/_policy.py``).

Offload changes where a unit's shard, gradient and optimizer state live, never a value: so a
mix trains bit for bit as fsdp without offload (and as torch FSDP1, which is bit-identical to
it; torch refuses CPU offload itself without an accelerator, see test_cpu_offload.py). On a CPU
compute device the host buffers are real copies ([Note: CPU offload]): an offloaded unit's
reduced gradient is copied out of the reduction's output into a host buffer of its own, a unit
that stays keeps the reduction's output; that is what the placement checks look at.
"""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests._harness import RankPool
from tests._models import Block, global_batch, lm_loss, local_rows, make_toy
from tests.test_cpu_offload import _reduction_outputs
from tests.test_parity import _full_params

# ToyLM's units under ModuleWrapPolicy({Block}), in module pre-order, and their parameter
# elements: the root (embedding 13x7 and head 7x13) 182, each block 186; 740 in all.
UNITS = ["", "blocks.0", "blocks.1", "blocks.2"]


def _unit_names(model: nn.Module) -> dict[str, Any]:
    from fsdp import FullyShardedDataParallel as FSDP

    return {
        name.replace("_fsdp_wrapped_module.", "").replace("_fsdp_wrapped_module", "").rstrip("."): m
        for name, m in model.named_modules()
        if isinstance(m, FSDP)
    }


def _configs(model: nn.Module) -> list[tuple[str, Any, dict[str, bool]]]:
    """(label, CPUOffload, expected choice per unit) for a fresh ToyLM ``model``."""
    from fsdp import CPUOffload

    blocks = model.blocks  # type: ignore[attr-defined]
    every = dict.fromkeys(UNITS, True)
    return [
        ("none", None, dict.fromkeys(UNITS, False)),
        ("all", CPUOffload(offload_params=True), every),
        # Half of 740 is 370: blocks.2 (186), then blocks.1 (372 >= 370), from the last unit back.
        ("half", CPUOffload(offload_params=True, fraction=0.5), {"": False, "blocks.0": False, "blocks.1": True, "blocks.2": True}),
        ("tiny", CPUOffload(offload_params=True, fraction=0.01), {"": False, "blocks.0": False, "blocks.1": False, "blocks.2": True}),
        ("zero", CPUOffload(offload_params=True, fraction=0.0), dict.fromkeys(UNITS, False)),
        ("one", CPUOffload(offload_params=True, fraction=1.0), every),
        # A predicate on the unit's module: the root and the first block.
        (
            "module",
            CPUOffload(offload_params=True, offload_module=lambda m: m is model or m is blocks[0]),
            {"": True, "blocks.0": True, "blocks.1": False, "blocks.2": False},
        ),
    ]


def _check_placement(model: nn.Module, expected: dict[str, bool], reduced: list[torch.Tensor]) -> None:
    """Each unit's shard, gradient and optimizer state are where its choice puts them."""
    written = {t.untyped_storage().data_ptr() for t in reduced}
    units = _unit_names(model)
    assert sorted(units) == sorted(expected)
    for name, unit in units.items():
        state = unit._fsdp_state
        assert state.policy.offload_params is expected[name], name
        for handle in state.handles:
            assert handle.storage.offload_params is expected[name], name
            grad = handle.flat_param.grad
            assert grad is not None and grad.device == handle.flat_param.device == torch.device("cpu")
            # Offloaded: the reduced gradient copied into a host buffer of its own; else the
            # reduction's output itself is kept (no host copy alive).
            assert (grad.untyped_storage().data_ptr() not in written) is expected[name], name


def mixes() -> None:
    from fsdp import FullyShardedDataParallel as FSDP
    from fsdp.wrap import ModuleWrapPolicy
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy

    rank, ws = dist.get_rank(), dist.get_world_size()
    theirs = TorchFSDP(make_toy(), auto_wrap_policy=TorchPolicy({Block}), device_id=torch.device("cpu"))
    labels = [label for label, _, _ in _configs(make_toy())]
    models: list[nn.Module] = [theirs]
    expected: list[Optional[dict[str, bool]]] = [None]
    for i in range(len(labels)):
        model = make_toy()
        _, config, choice = _configs(model)[i]
        models.append(FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), cpu_offload=config))
        expected.append(choice)
    # torch FSDP1's way, kept: a CustomPolicy overriding cpu_offload per unit (torch only
    # waits for the gradients' host copies, and returns clip_grad_norm_'s norm on the host,
    # when the root offloads; fsdp waits per unit).
    from fsdp import CPUOffload
    from fsdp.wrap import CustomPolicy

    labels.append("custom")
    expected.append({"": False, "blocks.0": False, "blocks.1": True, "blocks.2": False})
    custom = make_toy()
    second = custom.blocks[1]

    def overrides(m: nn.Module) -> Any:
        return {"cpu_offload": CPUOffload(offload_params=True)} if m is second else isinstance(m, Block)

    models.append(FSDP(custom, auto_wrap_policy=CustomPolicy(overrides)))
    # model.cpu_offload reports the constructor's config (the root's), as torch FSDP1.
    assert models[3].cpu_offload.fraction == 0.5  # type: ignore[union-attr]
    opts = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in models]
    for step in range(3):
        tokens, targets = global_batch(step, ws)
        x, y = local_rows(tokens, rank, ws), local_rows(targets, rank, ws)
        losses, norms = [], []
        for model, opt, choice in zip(models, opts, expected):
            with _reduction_outputs() as reduced:
                loss = lm_loss(model(x), y)
                loss.backward()
            if choice is not None:
                _check_placement(model, choice, reduced)
            losses.append(loss.detach())
            norms.append(model.clip_grad_norm_(0.05))  # type: ignore[operator]
            opt.step()
            opt.zero_grad()
        for label, loss, norm in zip(labels, losses[1:], norms[1:]):
            assert torch.equal(loss, losses[0]), (label, step)
            assert torch.equal(norm, norms[0]), (label, step)
    # Optimizer state lives with its flat parameter (host for offloaded units).
    for model, opt in zip(models[1:], opts[1:]):
        for param in model.parameters():
            assert opt.state[param]["exp_avg"].device == param.device
    reference = _full_params(theirs, TorchFSDP)
    for label, model in zip(labels, models[1:]):
        mine = _full_params(model, FSDP)
        assert mine.keys() == reference.keys()
        for name in mine:
            assert torch.equal(mine[name], reference[name]), (label, name)
    _state_dicts_with_a_mix(models[1], opts[1], models[3], opts[3])


def _local(value: Any) -> torch.Tensor:
    """A state-dict value's local tensor (ShardedTensor / DTensor / tensor)."""
    if hasattr(value, "local_shards"):
        return torch.cat([shard.tensor.flatten() for shard in value.local_shards()])
    return value.to_local() if hasattr(value, "to_local") else value


def _state_dicts_with_a_mix(plain: nn.Module, plain_opt: Any, mix: nn.Module, mix_opt: Any) -> None:
    """Full and sharded state dicts, optimizer state dicts and summon_full_params of a mix equal
    those of fsdp without offload."""
    from fsdp import CPUOffload, FullyShardedDataParallel as FSDP, StateDictType
    from fsdp.wrap import ModuleWrapPolicy

    for kind in (StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT):
        with FSDP.state_dict_type(plain, kind), FSDP.state_dict_type(mix, kind):
            a, b = plain.state_dict(), mix.state_dict()
            optim_a, optim_b = FSDP.optim_state_dict(plain, plain_opt), FSDP.optim_state_dict(mix, mix_opt)
        assert a.keys() == b.keys()
        for key in a:
            va, vb = a[key], b[key]
            assert type(va) is type(vb), (kind, key)
            assert torch.equal(_local(va), _local(vb)), (kind, key)
        flat_a = {(k, s): v for k, st in optim_a["state"].items() for s, v in st.items()}
        flat_b = {(k, s): v for k, st in optim_b["state"].items() for s, v in st.items()}
        assert flat_a.keys() == flat_b.keys()
        for key in flat_a:
            va, vb = flat_a[key], flat_b[key]
            assert type(va) is type(vb), (kind, key)
            assert torch.equal(_local(va), _local(vb)), (kind, key)
    # A sharded checkpoint of the mix loads into another mix (other units offloaded).
    with FSDP.state_dict_type(mix, StateDictType.SHARDED_STATE_DICT):
        saved = mix.state_dict()
    other = FSDP(
        make_toy(seed=1),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        cpu_offload=CPUOffload(offload_params=True, offload_module=lambda m: not isinstance(m, Block)),
    )
    with FSDP.state_dict_type(other, StateDictType.SHARDED_STATE_DICT):
        other.load_state_dict(saved)
    expected = _full_params(mix, FSDP)
    for name, value in _full_params(other, FSDP).items():
        assert torch.equal(value, expected[name]), name
    # summon_full_params writes back into host and device shards alike.
    for model in (plain, mix):
        with FSDP.summon_full_params(model, writeback=True):
            for param in model.parameters():
                param.data.mul_(0.5)
    after_plain, after_mix = _full_params(plain, FSDP), _full_params(mix, FSDP)
    for name in after_plain:
        assert torch.equal(after_plain[name], after_mix[name]), name
        assert torch.equal(after_mix[name], expected[name] * 0.5), name
    for name, unit in _unit_names(mix).items():
        for handle in unit._fsdp_state.handles:
            assert handle.storage.offload_params is (name in ("blocks.1", "blocks.2")), name


def test_fractional_offload_trains_as_without(pool2: RankPool) -> None:
    """Per-unit placement for every way to choose, training bit-identical to torch FSDP1 (and
    fsdp without offload), clip_grad_norm_ and state dicts with a mix."""
    pool2.run(mixes)


def test_planner_chooses_the_runtime_units() -> None:
    """fsdp.estimate_memory resolves the same units as the wrapper, and its host and device
    peaks follow the choice."""
    import fsdp
    from fsdp.wrap import ModuleWrapPolicy

    tokens = torch.zeros(4, 5, dtype=torch.long)
    peaks = {}
    for label, config, choice in _configs(make_toy()):
        model = make_toy()
        if label == "module":  # the predicate names this model's modules
            config = _configs(model)[-1][1]
        estimate = fsdp.estimate_memory(
            model,
            tokens,
            world_size=2,
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            cpu_offload=config,
            loss_fn=lambda out: out.float().sum(),
        )
        got = {u.name if not u.name.startswith("<root") else "": u.offload_params for u in estimate.units}
        assert got == choice, label
        peaks[label] = (estimate.peak_bytes, estimate.cpu_peak_bytes)
    none, half, every = peaks["none"], peaks["half"], peaks["all"]
    assert none[1] == 0 < half[1] < every[1]
    assert none[0] > half[0] > every[0]
    assert peaks["zero"] == none and peaks["one"] == every


def test_cpu_offload_fields_are_checked() -> None:
    from fsdp import CPUOffload

    with pytest.raises(ValueError, match="offload_params is False"):
        CPUOffload(fraction=0.5)
    with pytest.raises(ValueError, match="not both"):
        CPUOffload(offload_params=True, fraction=0.5, offload_module=lambda m: True)
    for bad in (-0.1, 1.5, True, "half"):
        with pytest.raises(ValueError, match="from 0 to 1"):
            CPUOffload(offload_params=True, fraction=bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="callable"):
        CPUOffload(offload_params=True, offload_module=3)  # type: ignore[arg-type]
    assert CPUOffload() == CPUOffload(offload_params=False, fraction=None, offload_module=None)


def host_step_kernels() -> None:
    """torch's fused and foreach AdamW kernels over the offloaded flat shards: bit-identical to
    the same kernel over torch FSDP1's (unoffloaded) flat shards and fsdp's without offload, for
    all units offloaded and for a mix. (The fused kernel rounds differently from the default
    per-tensor loop, by an ulp here and there, so each kernel is compared with itself; foreach
    is the default's arithmetic, bit for bit.)"""
    from fsdp import CPUOffload, FullyShardedDataParallel as FSDP
    from fsdp.wrap import ModuleWrapPolicy
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy

    rank, ws = dist.get_rank(), dist.get_world_size()
    configs = [None, CPUOffload(offload_params=True), CPUOffload(offload_params=True, fraction=0.5)]
    results: dict[str, list[dict[str, torch.Tensor]]] = {}
    for kernel in ("default", "foreach", "fused"):
        models: list[nn.Module] = [TorchFSDP(make_toy(), auto_wrap_policy=TorchPolicy({Block}), device_id=torch.device("cpu"))]
        models += [FSDP(make_toy(), auto_wrap_policy=ModuleWrapPolicy({Block}), cpu_offload=c) for c in configs]
        extra = {} if kernel == "default" else {kernel: True}
        opts = [torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1, **extra) for m in models]
        for step in range(3):
            tokens, targets = global_batch(step, ws)
            for model, opt in zip(models, opts):
                lm_loss(model(local_rows(tokens, rank, ws)), local_rows(targets, rank, ws)).backward()
                opt.step()
                opt.zero_grad()
        results[kernel] = [_full_params(models[0], TorchFSDP)] + [_full_params(m, FSDP) for m in models[1:]]
    for kernel, per_model in results.items():
        for i, params in enumerate(per_model[1:], 1):
            for name, value in params.items():
                assert torch.equal(value, per_model[0][name]), (kernel, i, name)
    for name, value in results["foreach"][0].items():
        assert torch.equal(value, results["default"][0][name]), name


def test_host_step_kernels_on_offloaded_shards(pool2: RankPool) -> None:
    pool2.run(host_step_kernels)


def test_offload_step_benchmark_reports(tmp_path: Any) -> None:
    """benchmarks/offload_step.py at a tiny size: the JSON has its date, kernels and targets,
    and foreach is bit-identical to the default kernel (one process, its own free port)."""
    import json
    import os
    import socket
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "step.json"
    env = {**os.environ, "MASTER_PORT": str(port)}
    cmd = [sys.executable, "-m", "benchmarks.offload_step", "--units", "2", "--unit-params", "400", "--repeats", "1", "--json", str(out)]
    # A fork of an interpreter that imported torch alone ([Note: Test commands forked from a
    # preloaded interpreter] in tests/_preloaded.py).
    from tests._preloaded import run_python

    run_python(cmd[1:], env=env, cwd=os.getcwd(), timeout=120).check_returncode()
    doc = json.loads(out.read_text())
    assert {"date", "targets", "kernels", "params"} <= doc.keys()
    assert set(doc["kernels"]) == {"default", "foreach", "fused"}
    assert doc["params"] == 2 * 20 * 20
    assert doc["bit_identical"]["foreach_vs_default"] is True


def pipelined_host_step() -> None:
    """PipelinedHostStep: bit-identical to one AdamW stepped in place (all offloaded, a mix),
    clip_grad_norm_ before it; the next forward of a unit starts only after its step ended,
    while later units still step ([Note: Pipelined host step])."""
    import threading
    import time

    from fsdp import CPUOffload, FullyShardedDataParallel as FSDP
    from fsdp.runtime._host_step import PipelinedHostStep
    from fsdp.wrap import ModuleWrapPolicy

    rank, ws = dist.get_rank(), dist.get_world_size()
    for config in (CPUOffload(offload_params=True), CPUOffload(offload_params=True, fraction=0.5)):
        plain = FSDP(make_toy(), auto_wrap_policy=ModuleWrapPolicy({Block}), cpu_offload=config)
        piped = FSDP(make_toy(), auto_wrap_policy=ModuleWrapPolicy({Block}), cpu_offload=config)
        opt = torch.optim.AdamW(plain.parameters(), lr=0.01)
        pipeline = PipelinedHostStep(piped, lambda ps: torch.optim.AdamW(ps, lr=0.01))
        # Pre-order (root, blocks 0-2); only offloaded units step on the worker.
        expected = [True] * 4 if config.fraction is None else [False, False, True, True]
        assert [pipelined for _, _, pipelined in pipeline.units] == expected
        for step in range(3):
            tokens, targets = global_batch(step, ws)
            x, y = local_rows(tokens, rank, ws), local_rows(targets, rank, ws)
            losses = []
            for model in (plain, piped):
                loss = lm_loss(model(x), y)
                loss.backward()
                losses.append(loss.detach())
                model.clip_grad_norm_(0.05)
            assert torch.equal(losses[0], losses[1]), step
            opt.step()
            opt.zero_grad()
            pipeline.step()
        # summon_full_params waits (it gathers).
        mine, reference = _full_params(piped, FSDP), _full_params(plain, FSDP)
        for name in reference:
            assert torch.equal(mine[name], reference[name]), (config, name)
        pipeline.close()
    # The waits: every unit's step sleeps; the next forward enters each unit after its step
    # ended, and the first unit before the last unit's step ended (the overlap).
    model = FSDP(make_toy(), auto_wrap_policy=ModuleWrapPolicy({Block}), cpu_offload=CPUOffload(offload_params=True))
    ended: dict[int, float] = {}
    entered: dict[int, float] = {}
    lock = threading.Lock()

    class SlowAdamW(torch.optim.AdamW):
        def step(self, closure: Any = None) -> Any:  # type: ignore[override]
            out = super().step(closure)
            time.sleep(0.15)
            with lock:
                ended[id(self)] = time.perf_counter()
            return out

    pipeline = PipelinedHostStep(model, lambda ps: SlowAdamW(ps, lr=0.01))
    units = FSDP.fsdp_modules(model)
    assert all(pipelined for _, _, pipelined in pipeline.units) and len(pipeline.units) == len(units)
    for unit, opt in zip(units, pipeline.optimizers):
        unit.module.register_forward_pre_hook(lambda m, a, key=id(opt): entered.__setitem__(key, time.perf_counter()))
    tokens, targets = global_batch(0, ws)
    x, y = local_rows(tokens, rank, ws), local_rows(targets, rank, ws)
    lm_loss(model(x), y).backward()
    pipeline.step()
    lm_loss(model(x), y).backward()
    pipeline.close()
    keys = [id(opt) for opt in pipeline.optimizers]
    for key in keys:
        assert entered[key] > ended[key]
    assert entered[keys[0]] < ended[keys[-1]]


def test_pipelined_host_step(pool2: RankPool) -> None:
    pool2.run(pipelined_host_step)
