"""Construction features: sync_module_states, meta-device init, ignored states, tied weights
across units, device_id. Each compared with single-process training and, where torch FSDP1 can
run the case on CPU, with torch FSDP1.
"""

from __future__ import annotations

import zlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests._harness import RankPool
from tests._models import train_against_reference, Block, ToyLM, make_toy
from tests.test_parity import _full_params

STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]


def _train(models: list[nn.Module], steps: int = 3, lr: float = 0.05) -> None:
    """Trains models[0] on the global batch and the others on this rank's rows."""
    train_against_reference(models, steps, lr)


def _assert_params(ours: nn.Module, expected: dict[str, torch.Tensor], exact: bool = False) -> None:
    from fsdp import FullyShardedDataParallel as FSDP

    mine = _full_params(ours, FSDP)
    assert list(mine) == list(expected)
    for name, value in expected.items():
        if exact:
            assert torch.equal(mine[name], value), name
        else:
            torch.testing.assert_close(mine[name], value.detach(), rtol=5e-5, atol=5e-6, msg=name)


# ------------------------------------------------------------------ sync_module_states
class WithBuffer(ToyLM):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.rand(1) + 0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return super().forward(tokens) * self.scale


def sync_states(strategy: str, meta_off_rank0: bool) -> None:
    from fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
    from fsdp.wrap import ModuleWrapPolicy

    rank = dist.get_rank()
    torch.manual_seed(0)
    ref = WithBuffer()  # what rank 0 builds
    torch.manual_seed(100 + rank)  # every rank initializes differently
    if meta_off_rank0 and rank != 0:
        with torch.device("meta"):
            model = WithBuffer()
        init = lambda m: m.to_empty(device="cpu", recurse=False)  # noqa: E731 (garbage until synced)
    else:
        model = WithBuffer() if rank != 0 else (torch.manual_seed(0), WithBuffer())[1]
        init = None
    ours = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=ShardingStrategy[strategy], sync_module_states=True, param_init_fn=init)
    assert torch.equal(ours.scale, ref.scale), "buffers come from rank 0"
    _assert_params(ours, dict(ref.named_parameters()), exact=True)
    _train([ref, ours])
    _assert_params(ours, dict(ref.named_parameters()))


@pytest.mark.parametrize("meta_off_rank0", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("dist_pool", [2, 4], indirect=True)
def test_sync_module_states(dist_pool: RankPool, strategy: str, meta_off_rank0: bool) -> None:
    dist_pool.run(sync_states, strategy, meta_off_rank0)


# ------------------------------------------------------------------ meta-device init
def _materialized_numel(model: nn.Module) -> int:
    from fsdp import FlatParameter

    return sum(p.numel() for p in model.parameters() if not p.is_meta and not isinstance(p, FlatParameter))


def meta_init_reset_parameters(strategy: str) -> None:
    """Meta init with reset_parameters equals eager init with the same seed, unit by unit."""
    from fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
    from fsdp.wrap import ModuleWrapPolicy

    ref = make_toy(seed=7)
    with torch.device("meta"):
        meta_model = ToyLM()
    peaks: list[int] = []
    original = Block.reset_parameters if hasattr(Block, "reset_parameters") else None
    assert original is None
    # Record how much is materialized (and not yet flattened) whenever a Linear initializes.
    linear_reset = nn.Linear.reset_parameters

    def spy(self: nn.Linear) -> None:
        peaks.append(_materialized_numel(meta_model))
        linear_reset(self)

    nn.Linear.reset_parameters = spy  # type: ignore[method-assign]
    try:
        torch.manual_seed(7)
        ours = FSDP(meta_model, auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=ShardingStrategy[strategy])
    finally:
        nn.Linear.reset_parameters = linear_reset  # type: ignore[method-assign]
    _assert_params(ours, dict(ref.named_parameters()), exact=True)
    block_numel = sum(p.numel() for p in Block().parameters())
    root_numel = sum(p.numel() for n, p in ref.named_parameters() if not n.startswith("blocks."))
    # Never more than the root unit plus one block materialized and unflattened at once.
    assert max(peaks) <= root_numel + block_numel, (peaks, root_numel, block_numel)
    _train([ref, ours])
    _assert_params(ours, dict(ref.named_parameters()))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_meta_init_equals_eager(pool2: RankPool, strategy: str) -> None:
    pool2.run(meta_init_reset_parameters, strategy)


def _deterministic_init(module: nn.Module) -> None:
    """A param_init_fn whose result does not depend on call order (so torch can be compared)."""
    module.to_empty(device="cpu", recurse=False)
    with torch.no_grad():
        for name, p in module.named_parameters(recurse=False):
            g = torch.Generator().manual_seed(zlib.crc32(f"{type(module).__name__}.{name}.{p.shape}".encode()))
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def meta_init_param_init_fn(use_enable_wrap: bool) -> None:
    from fsdp import FullyShardedDataParallel as FSDP
    from fsdp.wrap import ModuleWrapPolicy, enable_wrap, wrap
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy

    ref = make_toy()
    for m in ref.modules():
        _deterministic_init(m)
    with torch.device("meta"):
        meta_ours, meta_theirs = ToyLM(), ToyLM()
    if use_enable_wrap:
        with enable_wrap(wrapper_cls=FSDP, param_init_fn=_deterministic_init):
            for i in range(meta_ours.n_blocks):
                meta_ours.blocks[i] = wrap(meta_ours.blocks[i])
            ours = wrap(meta_ours)
    else:
        ours = FSDP(meta_ours, auto_wrap_policy=ModuleWrapPolicy({Block}), param_init_fn=_deterministic_init)
    theirs = TorchFSDP(meta_theirs, auto_wrap_policy=TorchPolicy({Block}), param_init_fn=_deterministic_init, device_id=torch.device("cpu"))
    expected = dict(ref.named_parameters())
    _assert_params(ours, expected, exact=True)
    _assert_params(ours, _full_params(theirs, TorchFSDP), exact=True)
    _train([ref, ours, theirs])
    _assert_params(ours, _full_params(theirs, TorchFSDP), exact=True)
    _assert_params(ours, dict(ref.named_parameters()))


@pytest.mark.parametrize("use_enable_wrap", [False, True])
def test_meta_init_param_init_fn(pool2: RankPool, use_enable_wrap: bool) -> None:
    pool2.run(meta_init_param_init_fn, use_enable_wrap)


class NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def meta_init_errors() -> None:
    from fsdp import FullyShardedDataParallel as FSDP

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), NoReset())
    before = list(model.named_parameters())
    with pytest.raises(ValueError, match=r"module '1' \(NoReset\) has parameters or buffers on the meta device but no reset_parameters\(\)"):
        FSDP(model)
    with pytest.raises(ValueError, match="Expected zeros to be callable but got <class 'str'>: param_init_fn must be a callable taking a module"):
        FSDP(model, param_init_fn="zeros")
    with pytest.raises(ValueError, match="param_init_fn left parameters or buffers of module"):
        FSDP(model, param_init_fn=lambda m: None)
    assert [p.is_meta for _, p in model.named_parameters()][1:] == [True] * (len(before) - 1)


def test_meta_init_errors(pool2: RankPool) -> None:
    pool2.run(meta_init_errors)


# ------------------------------------------------------------------ ignored modules / states
def ignored(strategy: str, how: str) -> None:
    from fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
    from fsdp.wrap import ModuleWrapPolicy
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import ShardingStrategy as TorchStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy

    def build() -> tuple[ToyLM, dict[str, Any]]:
        model = make_toy()
        if how == "modules":
            kw: dict[str, Any] = {"ignored_modules": [model.head, model.blocks[1].fc2]}
        elif how == "states_modules":
            kw = {"ignored_states": [model.head, model.blocks[1].fc2]}
        else:
            kw = {"ignored_states": [model.head.weight, model.blocks[1].fc2.weight]}
        return model, kw

    model, kw = build()
    ignored_ptrs = {n: p.data_ptr() for n, p in model.named_parameters() if n.startswith(("head.", "blocks.1.fc2."))}
    if how == "states_params":
        ignored_ptrs = {k: v for k, v in ignored_ptrs.items() if k.endswith("weight")}
    ours = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=ShardingStrategy[strategy], **kw)
    tmodel, tkw = build()
    theirs = TorchFSDP(tmodel, auto_wrap_policy=TorchPolicy({Block}), sharding_strategy=TorchStrategy[strategy], device_id=torch.device("cpu"), **tkw)
    handles = [m._fsdp_state.handle for m in FSDP.fsdp_modules(ours) if m._fsdp_state.handle]
    managed = sum(h.shard_layout.unpadded_unsharded_numel for h in handles)
    total = sum(p.numel() for p in make_toy().parameters())
    assert managed == total - sum(p.numel() for n, p in make_toy().named_parameters() if n in ignored_ptrs)
    for name, ptr in ignored_ptrs.items():  # untouched: same tensors, still registered
        assert dict(ours.named_parameters())[name.replace("blocks.1.", "_fsdp_wrapped_module.blocks.1._fsdp_wrapped_module.").replace("head.", "_fsdp_wrapped_module.head.")].data_ptr() == ptr
    _train([make_toy(), ours, theirs])
    mine, torch_full = _full_params(ours, FSDP), _full_params(theirs, TorchFSDP)
    assert list(mine) == list(torch_full)
    for name in mine:
        assert torch.equal(mine[name], torch_full[name]), name
    # Ignored parameters are not synchronized: each rank trained them on its own data.
    head = mine["head.weight"].clone()
    gathered = [torch.empty_like(head) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, head)
    assert not torch.equal(gathered[0], gathered[1])
    # Managed parameters are synchronized: identical on every rank.
    managed_value = mine["blocks.0.fc1.weight"]
    copies = [torch.empty_like(managed_value) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, managed_value)
    assert all(torch.equal(c, copies[0]) for c in copies)


@pytest.mark.parametrize("how", ["modules", "states_modules", "states_params"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_ignored(pool2: RankPool, strategy: str, how: str) -> None:
    pool2.run(ignored, strategy, how)


def ignored_errors() -> None:
    from fsdp import FullyShardedDataParallel as FSDP

    model = make_toy()
    inner = FSDP(model.blocks[0])
    model.blocks[0] = inner
    # An ignored module that contains an FSDP unit is accepted, as in torch FSDP1
    # (tests/test_contract_construction.py); an FSDP instance itself is not.
    with pytest.raises(ValueError, match=r"should not include FSDP modules, but 'blocks.0' is a FullyShardedDataParallel instance"):
        FSDP(model, ignored_modules=[model.blocks[0]])
    with pytest.raises(ValueError, match="Cannot pass both ignored_modules and ignored_states at the same time"):
        FSDP(model, ignored_modules=[model.head], ignored_states=[model.head])
    with pytest.raises(ValueError, match="ignored_states expects all nn.Parameter or all nn.Module list elements"):
        FSDP(model, ignored_states=[model.head, model.embed.weight])
    with pytest.raises(ValueError, match=r"ignored_modules expects nn.Module list elements but got types \[<class 'str'>\]"):
        FSDP(model, ignored_modules=["head"])
    assert isinstance(model.blocks[1], Block) and not any(isinstance(m, FSDP) for m in model.blocks[1].modules())


def test_ignored_errors(pool2: RankPool) -> None:
    pool2.run(ignored_errors)


# ------------------------------------------------------------------ tied weights across units
class Core(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lm = ToyLM(tie=True)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm(tokens)


class Outer(nn.Module):
    """The tied pair's lowest common unit is ``core`` (a nested unit), not the root."""

    def __init__(self) -> None:
        super().__init__()
        self.core = Core()
        self.post = nn.Linear(13, 13)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.post(self.core(tokens))


def tied_across_units(strategy: str, nested_owner: bool) -> None:
    from fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
    from fsdp.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    ref: nn.Module = Outer() if nested_owner else ToyLM(tie=True)
    torch.manual_seed(0)
    model: nn.Module = Outer() if nested_owner else ToyLM(tie=True)
    classes = {Block, nn.Embedding, nn.Linear} | ({Core} if nested_owner else set())
    ours = FSDP(model, auto_wrap_policy=ModuleWrapPolicy(classes), sharding_strategy=ShardingStrategy[strategy])
    lm = ours.core.lm if nested_owner else ours
    assert isinstance(lm.embed, FSDP) and isinstance(lm.head, FSDP)
    owner = ours.core if nested_owner else ours
    names = [i.fqn for i in owner._fsdp_state.handle.param_infos] + [i.fqn for i in owner._fsdp_state.handle.shared_param_infos]
    assert any(n.endswith("embed.weight") for n in names) and any(n.endswith("head.weight") for n in names)
    _train([ref, ours], steps=4)
    expected = dict(ref.named_parameters())  # tied weight listed once, as in the plain model
    _assert_params(ours, expected)
    with FSDP.summon_full_params(ours):
        assert lm.embed.weight is lm.head.weight


@pytest.mark.parametrize("nested_owner", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("dist_pool", [2, 3], indirect=True)
def test_tied_across_units(dist_pool: RankPool, strategy: str, nested_owner: bool) -> None:
    dist_pool.run(tied_across_units, strategy, nested_owner)


def tied_manual_error() -> None:
    from fsdp import FullyShardedDataParallel as FSDP

    model = make_toy(tie=True)
    model.embed = FSDP(model.embed)  # flattens the shared weight into its own unit by hand
    with pytest.raises(ValueError, match=r"'head.weight' of FSDP unit '<root ToyLM>' is the same Parameter as 'weight' of FSDP unit 'embed'.*Wrap with auto_wrap_policy instead"):
        FSDP(model)


def test_tied_manual_error(pool2: RankPool) -> None:
    pool2.run(tied_manual_error)


# ------------------------------------------------------------------ devices
def devices() -> None:
    from fsdp import FullyShardedDataParallel as FSDP

    ref = make_toy()
    ours = FSDP(make_toy(), device_id=torch.device("cpu"))
    assert ours._fsdp_state.compute_device == torch.device("cpu")
    plain = FSDP(make_toy())  # no device_id needed on CPU (torch FSDP1 requires one)
    assert plain._fsdp_state.compute_device == torch.device("cpu")
    _train([ref, ours, plain])
    _assert_params(ours, dict(ref.named_parameters()))
    _assert_params(plain, dict(ref.named_parameters()))
    as_string = FSDP(make_toy(), device_id="cpu")  # torch FSDP1 takes strings too
    assert as_string._fsdp_state.compute_device == torch.device("cpu")
    with pytest.raises(TypeError, match="device_id must be an int \\(CUDA index\\), a str or a torch.device, got float"):
        FSDP(make_toy(), device_id=1.5)


def test_devices(pool2: RankPool) -> None:
    pool2.run(devices)


class _FakeParam:
    """Stands in for a parameter on some device (no second device type exists on CPU machines)."""

    def __init__(self, device: str) -> None:
        self.device = torch.device(device)
        self.is_meta = False


class _TwoDevices(nn.Module):
    def parameters(self, recurse: bool = True) -> Any:  # type: ignore[override]
        return iter([_FakeParam("cpu"), _FakeParam("cuda:0")])

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return iter([("encoder.weight", _FakeParam("cpu")), ("decoder.weight", _FakeParam("cuda:0"))])


def test_mixed_devices_are_a_clear_error() -> None:
    from fsdp.init._device import resolve_compute_device

    # RuntimeError, as torch FSDP1 raises for params on several devices.
    with pytest.raises(RuntimeError, match=r"_TwoDevices has parameters on several devices \('encoder.weight' on cpu, 'decoder.weight' on cuda:0\); move the whole module to one device first, or pass device_id"):
        resolve_compute_device(_TwoDevices(), None)
    assert resolve_compute_device(nn.Linear(2, 2), None) == torch.device("cpu")
    if torch.cuda.is_available():
        # Partly on CPU and partly on the device_id device: accepted and moved (as torch FSDP1).
        assert resolve_compute_device(_TwoDevices(), "cuda:0") == torch.device("cuda", 0)
        assert resolve_compute_device(nn.Linear(2, 2), 0) == torch.device("cuda", 0)  # int = CUDA index
    else:
        with pytest.raises(RuntimeError, match=r"device_id=3 names a CUDA device, but CUDA is not available"):
            resolve_compute_device(nn.Linear(2, 2), 3)
        with pytest.raises(RuntimeError, match=r"device_id='cuda:0' names a CUDA device, but CUDA is not available"):
            resolve_compute_device(_TwoDevices(), "cuda:0")
    assert resolve_compute_device(nn.Linear(2, 2), torch.device("cpu")) == torch.device("cpu")
