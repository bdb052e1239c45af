"""Casting a wrapped model: ``model.half()``, ``.to(torch.float64)``, ``.bfloat16()``, ``.float()``.

torch FSDP1 honours such a cast made before its lazy initialization (the first forward): it
re-reads the FlatParameter's dtype then. Cast before the first forward, fsdp must do exactly
what torch FSDP1 does, bit for bit: the same losses at every step, the same full state dict
(values and dtypes), the same parameter and buffer dtypes, with and without use_orig_params,
for FULL_SHARD, SHARD_GRAD_OP and NO_SHARD, with and without ``MixedPrecision``.

Cast after training has started, torch FSDP1 breaks (the next forward or backward fails, or
with MixedPrecision the cast is silently undone at the next reshard). fsdp honours the cast
there too. The oracle is torch FSDP1 doing what it does support: a fresh wrapper of the same
weights (taken from torch FSDP1's own fp32 training), cast before its first forward. fsdp's
optimizer, created before the cast, keeps stepping the same Parameter objects. A cast around the
wrapper (``model.module.half()``: the root unit's parameters change behind its handle) is
adopted the same way; torch FSDP1 undoes it with use_orig_params, so its oracle casts through
the wrapper.

Casts that cannot be honoured raise before anything changes: inside summon_full_params or
forward, to a non-floating-point dtype or another device, of only part of a unit (use_orig_params);
a backward through a forward taken before the cast raises instead of reading freed memory. (torch FSDP1 accepts all of these and
fails later, or silently.)
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision
from torch.distributed.fsdp import ShardingStrategy as TorchShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchModuleWrapPolicy

from fsdp import FullyShardedDataParallel as FSDP
from fsdp import MixedPrecision, ShardingStrategy
from fsdp.wrap import ModuleWrapPolicy
from tests._harness import RankPool
from tests._net import CPU, D_OUT, LR, Block, Net, local_batch

SEED = 4321
DATA_SEED = 700

CASTS: dict[str, Callable[[nn.Module], Any]] = {
    "half": lambda m: m.half(),
    "to_float64": lambda m: m.to(torch.float64),
    "bfloat16": lambda m: m.bfloat16(),
    "double": lambda m: m.double(),
    # Around the wrapper: nn.Module._apply on the wrapped module (the root unit's parameters
    # change behind its handle; the nested units see their own wrapper's _apply).
    "module_half": lambda m: m.module.half(),
}
# What torch FSDP1 is told for the same cast: the wrapped module's cast around the wrapper works
# there without use_orig_params only (with it, the cast is undone at lazy init), so the oracle
# casts through the wrapper.
REF_CAST = {"module_half": "half"}
CAST_DTYPE = {"module_half": torch.float16, "half": torch.float16, "to_float64": torch.float64, "bfloat16": torch.bfloat16, "double": torch.float64}


class CastNet(Net):
    """:class:`tests._net.Net` (root unit plus two Block units) with a float buffer in use."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, D_OUT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


def _plain(state: Optional[dict[str, torch.Tensor]] = None) -> CastNet:
    torch.manual_seed(SEED)
    model = CastNet()
    if state is not None:
        model.load_state_dict(state)
    return model


def _ours(strategy: str, uop: bool, mp: bool = False, state: Optional[dict[str, torch.Tensor]] = None) -> FSDP:
    return FSDP(
        _plain(state),
        sharding_strategy=ShardingStrategy[strategy],
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        use_orig_params=uop,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16) if mp else None,
    )


def _theirs(strategy: str, uop: bool, mp: bool = False, state: Optional[dict[str, torch.Tensor]] = None) -> TorchFSDP:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # world size 1 -> NO_SHARD warning
        return TorchFSDP(
            _plain(state),
            sharding_strategy=TorchShardingStrategy[strategy],
            auto_wrap_policy=TorchModuleWrapPolicy({Block}),
            use_orig_params=uop,
            mixed_precision=TorchMixedPrecision(param_dtype=torch.bfloat16) if mp else None,
            device_id=CPU,
        )


def _train(model: nn.Module, opt: torch.optim.Optimizer, dtype: torch.dtype, steps: int, seed: int) -> list[float]:
    """``steps`` SGD steps on this rank's batches (different on every rank), in ``dtype``."""
    losses = []
    for step in range(steps):
        x, y = local_batch(seed + 10 * step)
        out = model(x.to(dtype))  # with mixed precision, not ``dtype``: torch 2.11's mse_loss
        loss = nn.functional.mse_loss(out, y.to(out.dtype))  # backward rejects mixed dtypes
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_same_state(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], what: str) -> None:
    """Same keys, dtypes and values, bit for bit."""
    assert list(ours) == list(theirs), what
    for key, value in theirs.items():
        assert ours[key].dtype == value.dtype, f"{what}: {key}: {ours[key].dtype} vs torch {value.dtype}"
        assert torch.equal(ours[key], value), f"{what}: {key} differs from torch FSDP1"


def _dtypes(tensors: Any) -> list[torch.dtype]:
    return [t.dtype for t in tensors]


def _summoned(model: nn.Module, cls: Any) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    with cls.summon_full_params(model):
        return [(n.replace("_fsdp_wrapped_module.", ""), p.dtype, tuple(p.shape)) for n, p in model.named_parameters()]


def _check_cast_before_first_forward(strategy: str, uop: bool, cast: str, mp: bool) -> None:
    """The cast torch FSDP1 supports: same dtypes, losses and state dicts, bit for bit."""
    what = f"{strategy} use_orig_params={uop} {cast} mp={mp}"
    ours, theirs = _ours(strategy, uop, mp), _theirs(strategy, uop, mp)
    CASTS[cast](ours)
    CASTS[REF_CAST.get(cast, cast)](theirs)
    dtype = CAST_DTYPE[cast]
    assert _dtypes(ours.parameters()) == _dtypes(theirs.parameters()) and all(
        d == dtype for d in _dtypes(ours.parameters())
    ), what
    assert _dtypes(ours.buffers()) == _dtypes(theirs.buffers()) == [dtype], what
    assert _summoned(ours, FSDP) == _summoned(theirs, TorchFSDP), what
    # Optimizers created after the cast, as torch FSDP1's users do.
    ours_losses = _train(ours, torch.optim.SGD(ours.parameters(), lr=LR), dtype, 2, DATA_SEED)
    theirs_losses = _train(theirs, torch.optim.SGD(theirs.parameters(), lr=LR), dtype, 2, DATA_SEED)
    assert ours_losses == theirs_losses, what
    assert _dtypes(p.grad for p in ours.parameters() if p.grad is not None) == _dtypes(
        p.grad for p in theirs.parameters() if p.grad is not None
    ), what
    _assert_same_state(_full_state(ours), _full_state(theirs), what)


def _check_cast_after_training(strategy: str, uop: bool, cast: str, mp: bool, back: bool = False) -> None:
    """Cast after fp32 steps (torch FSDP1 breaks): fsdp matches torch FSDP1 re-wrapped and cast."""
    what = f"{strategy} use_orig_params={uop} {cast} mp={mp} (after training)"
    ours, theirs = _ours(strategy, uop, mp), _theirs(strategy, uop, mp)
    opt = torch.optim.SGD(ours.parameters(), lr=LR)
    fp32_losses = _train(ours, opt, torch.float32, 1, DATA_SEED)
    assert fp32_losses == _train(theirs, torch.optim.SGD(theirs.parameters(), lr=LR), torch.float32, 1, DATA_SEED), what
    # The oracle: torch FSDP1 wrapping the weights its own training reached, cast before its
    # first forward (the cast it supports).
    reference = _theirs(strategy, uop, mp, state=_full_state(theirs))
    CASTS[cast](ours)
    CASTS[REF_CAST.get(cast, cast)](reference)
    dtype = CAST_DTYPE[cast]
    assert _dtypes(ours.parameters()) == _dtypes(reference.parameters()), what
    _assert_same_state(_full_state(ours), _full_state(reference), what + ", right after the cast")
    ours_losses = _train(ours, opt, dtype, 2, DATA_SEED + 1)  # the optimizer from before the cast
    ref_losses = _train(reference, torch.optim.SGD(reference.parameters(), lr=LR), dtype, 2, DATA_SEED + 1)
    assert ours_losses == ref_losses, what
    _assert_same_state(_full_state(ours), _full_state(reference), what)
    if not back:
        return
    # And back to float32: the same as casting torch FSDP1's result back before a new wrapper.
    ours.float()
    back = _theirs(strategy, uop, mp, state={k: v.float() for k, v in _full_state(reference).items()})
    _assert_same_state(_full_state(ours), _full_state(back), what + ", cast back with float()")
    assert _train(ours, opt, torch.float32, 1, DATA_SEED + 2) == _train(
        back, torch.optim.SGD(back.parameters(), lr=LR), torch.float32, 1, DATA_SEED + 2
    ), what


def _check_grads_cast_along(strategy: str, uop: bool) -> None:
    """Gradients held across the cast are cast with the parameters, as ``nn.Module.double()`` does."""
    what = f"{strategy} use_orig_params={uop} (gradients)"
    ours = _ours(strategy, uop)
    x, y = local_batch(DATA_SEED)
    nn.functional.mse_loss(ours(x), y).backward()
    before = [(p.detach().clone(), p.grad.clone() if p.grad is not None else None) for p in ours.parameters()]
    opt = torch.optim.SGD(ours.parameters(), lr=LR)
    ours.double()
    for (param, grad), now in zip(before, ours.parameters()):
        assert now.dtype == torch.float64 and torch.equal(now, param.double()), what
        if grad is None:
            assert now.grad is None, what
            continue
        assert now.grad is not None and now.grad.dtype == torch.float64, what
        assert torch.equal(now.grad, grad.double()), what
    opt.step()  # SGD: p + (-lr) * g, in float64 now
    for (param, grad), now in zip(before, ours.parameters()):
        expected = param.double() if grad is None else torch.add(param.double(), grad.double(), alpha=-LR)
        assert torch.equal(now.detach(), expected), what


def _check_rejected_casts(strategy: str, uop: bool) -> None:
    """Casts that cannot be honoured raise before changing anything; training goes on."""
    what = f"{strategy} use_orig_params={uop} (errors)"
    ours = _ours(strategy, uop)
    x, y = local_batch(DATA_SEED)
    nn.functional.mse_loss(ours(x), y).backward()  # lazily initialized
    ours.zero_grad()
    state = _full_state(ours)

    def unchanged() -> None:
        assert all(p.dtype == torch.float32 and p.device == CPU for p in ours.parameters()), what
        _assert_same_state(_full_state(ours), state, what + ": changed by a rejected cast")

    with FSDP.summon_full_params(ours):
        with pytest.raises(RuntimeError, match=r"cast of the parameters cannot be called while FSDP units are in forward, backward or "
            r"summon_full_params: '<root>' \(SUMMON_FULL_PARAMS\)"):
            ours.double()
        ours.float()  # nothing to change: accepted, as by torch FSDP1
    unchanged()

    def cast_in_forward(module: nn.Module, args: Any) -> None:
        ours.half()

    hook = ours.module.out.register_forward_pre_hook(cast_in_forward)
    with pytest.raises(RuntimeError, match=r"cast of the parameters cannot be called .* '<root>' \(FORWARD\)"):
        ours(x)
    hook.remove()
    unchanged()

    with pytest.raises(TypeError, match="FSDP unit '<root>' keeps its parameters in one floating-point"):
        ours.type(torch.IntTensor)  # type: ignore[arg-type]
    unchanged()
    with pytest.raises(RuntimeError, match="computes on cpu; moving it to meta"):
        ours.to("meta")
    unchanged()

    if uop:
        # Part of a unit cast on its own (around the wrapper): one FlatParameter has one dtype.
        saved = [p.detach().clone() for p in ours.module.inp.parameters()]
        ours.module.inp.half()
        with pytest.raises(RuntimeError, match=r"the parameters of FSDP unit '<root>' no longer share one dtype: 'inp.weight' \(torch.float16\)"):
            ours(x)
        for param, value in zip(ours.module.inp.parameters(), saved):
            param.data = value  # (inp.float() would keep the values rounded to float16)
        unchanged()

    # A cast between forward and backward: that backward would use the parameters of before.
    loss = nn.functional.mse_loss(ours(x), y)
    ours.double()
    with pytest.raises(RuntimeError, match="FSDP unit '<root>' was cast to torch.float64 .* between its forward"):
        loss.backward()
    del loss
    # The next forward starts clean (warning about the interrupted backward), in float64, and
    # trains exactly as torch FSDP1 wrapping the same weights cast before its first forward.
    reference = _theirs(strategy, uop, state={k: v.float() for k, v in _full_state(ours).items()})
    reference.double()
    with pytest.warns(UserWarning, match="previous backward did not finish"):
        ours_losses = _train(ours, torch.optim.SGD(ours.parameters(), lr=LR), torch.float64, 2, DATA_SEED)
    assert ours_losses == _train(reference, torch.optim.SGD(reference.parameters(), lr=LR), torch.float64, 2, DATA_SEED), what
    _assert_same_state(_full_state(ours), _full_state(reference), what)
    if not uop:
        # The same around the wrapper: the root unit's FlatParameter cast behind its handle.
        loss = nn.functional.mse_loss(ours(x.double()), y.double())
        ours.module.half()
        with pytest.raises(RuntimeError, match="FSDP unit '<root>' was cast to torch.float16 .* between its forward"):
            loss.backward()


# (strategy, use_orig_params, cast, mixed precision) per world size. Every strategy, both
# use_orig_params modes and every cast are covered; NO_SHARD with MixedPrecision(param_dtype=bf16)
# cast to bfloat16 is the case where the unit stops needing a low-precision copy at all.
BEFORE_2 = [
    ("FULL_SHARD", False, "half", False),
    ("FULL_SHARD", True, "bfloat16", False),
    ("FULL_SHARD", False, "to_float64", True),
    ("SHARD_GRAD_OP", True, "half", False),
    ("SHARD_GRAD_OP", False, "to_float64", False),
    ("NO_SHARD", False, "half", False),
    ("NO_SHARD", True, "to_float64", True),
    ("NO_SHARD", False, "bfloat16", True),
    ("SHARD_GRAD_OP", True, "module_half", False),
]
AFTER_2 = [
    ("FULL_SHARD", False, "half", False, True),
    ("FULL_SHARD", True, "double", True),
    ("SHARD_GRAD_OP", True, "half", False),
    ("SHARD_GRAD_OP", False, "bfloat16", True),
    ("NO_SHARD", False, "double", False),
    ("NO_SHARD", True, "bfloat16", True),
    ("FULL_SHARD", False, "module_half", True),
    ("NO_SHARD", True, "module_half", False),
]
# World size 1 runs NO_SHARD whatever the strategy asked (in both implementations).
BEFORE_1 = [("FULL_SHARD", False, "half", False), ("FULL_SHARD", True, "to_float64", True)]
AFTER_1 = [("FULL_SHARD", False, "double", False, True), ("FULL_SHARD", True, "half", True)]
# Four ranks: shards with padding on the last ranks. Without use_orig_params only: with it torch
# FSDP1 pads every original parameter for alignment, so gloo's reduce-scatter sums some elements
# of four ranks in another order than for fsdp's layout (with two ranks, a + b == b + a exactly).
BEFORE_4 = [("FULL_SHARD", False, "half", False)]
AFTER_4 = [("FULL_SHARD", False, "double", True), ("SHARD_GRAD_OP", False, "half", False)]


def _check_all(
    before: list[tuple[str, bool, str, bool]],
    after: list[tuple[Any, ...]],
    edge_cases: list[tuple[str, bool]],
) -> bool:
    for case in before:
        _check_cast_before_first_forward(*case)
    for case in after:
        _check_cast_after_training(*case)
    for strategy, uop in edge_cases:
        _check_grads_cast_along(strategy, uop)
        _check_rejected_casts(strategy, uop)
    dist.barrier()
    return True


def test_module_cast_world_size_2(pool2: RankPool) -> None:
    edge = [("FULL_SHARD", True), ("SHARD_GRAD_OP", False), ("NO_SHARD", False)]
    assert pool2.run(_check_all, BEFORE_2, AFTER_2, edge) == [True, True]


def test_module_cast_world_size_1(pool1: RankPool) -> None:
    assert pool1.run(_check_all, BEFORE_1, AFTER_1, [("FULL_SHARD", True)]) == [True]


def test_module_cast_world_size_4(pool4: RankPool) -> None:
    assert pool4.run(_check_all, BEFORE_4, AFTER_4, []) == [True] * 4
