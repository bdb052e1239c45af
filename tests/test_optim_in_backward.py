"""Optimizers in backward (``torch.distributed.optim._apply_optimizer_in_backward``).

Each parameter gets its own optimizer, stepped during ``backward()``; under FSDP with
``use_orig_params=True`` the wrapper steps them once the sharded gradient is set ([Note:
Optimizers in backward] in ``fsdp/runtime/_hooks.py``). The same scenario runs through fsdp and
torch FSDP1 (bit for bit), and through fsdp and the plain module with the same per-parameter
optimizers in float64 (to ``tests/test_parity.py``'s ``FP64_TOL``, derived there).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import _apply_optimizer_in_backward

from tests._harness import RankPool
from tests._models import Block, global_batch, lm_loss, local_rows, make_toy
from tests.test_orig_params_torch_attrs import _units
from tests.test_parity import FP64_TOL

# One optimizer class per parameter; Adam carries state, so a skipped or doubled step shows.
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
}


def _wrap(lib: str, model: nn.Module, strategy: str, **kwargs: Any) -> nn.Module:
    """``mixed_precision`` is given as the keywords of the library's ``MixedPrecision``."""
    if lib == "ours":
        from fsdp import FullyShardedDataParallel as FSDP, MixedPrecision, ShardingStrategy
        from fsdp.wrap import ModuleWrapPolicy
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # type: ignore[no-redef]
        from torch.distributed.fsdp import MixedPrecision, ShardingStrategy  # type: ignore[no-redef, assignment]
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy  # type: ignore[no-redef]

        kwargs.setdefault("device_id", torch.device("cpu"))
    if "mixed_precision" in kwargs:
        kwargs["mixed_precision"] = MixedPrecision(**kwargs["mixed_precision"])
    return FSDP(
        model, auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=ShardingStrategy[strategy], **kwargs
    )


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    cls = type(model)
    with cls.summon_full_params(model, writeback=False):  # type: ignore[attr-defined]
        return {name: p.detach().clone() for name, p in model.named_parameters()}


def _chosen(name: str, only: str) -> bool:
    """Whether parameter ``name`` gets an optimizer in backward: every one (``""``), or those
    whose name contains ``only`` (``"blocks"``: whole units; ``"weight"``: part of each unit)."""
    return only in name


def _in_backward(model: nn.Module, optim: str, only: str) -> torch.optim.Optimizer:
    """Per-parameter optimizers on the chosen parameters (see :func:`_chosen`); a regular
    optimizer of the same kind over the rest (returned; it may hold no parameter)."""
    cls, kwargs = OPTIMIZERS[optim]
    chosen = [p for name, p in model.named_parameters() if _chosen(name, only)]
    rest = [p for name, p in model.named_parameters() if not _chosen(name, only)]
    _apply_optimizer_in_backward(cls, chosen, kwargs)
    return cls(rest or [torch.zeros(1, requires_grad=True)], **kwargs)


def run_in_backward(
    strategy: str,
    optim: str,
    only: str = "",
    steps: int = 3,
    bf16: bool = False,
    hybrid: bool = False,
    twice: bool = False,
    clip: bool = False,
) -> int:
    """``bf16``: MixedPrecision(param_dtype=bf16) (compared with torch FSDP1 only);
    ``hybrid``: HYBRID_SHARD over 2 x 2 groups; ``twice``: every chosen parameter gets a second
    optimizer in backward (SGD); ``clip``: ``clip_grad_norm_`` of what backward leaves."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    extra: dict[str, Any] = {}
    if bf16:
        extra["mixed_precision"] = {"param_dtype": torch.bfloat16}
    if hybrid:
        from tests.test_hybrid_shard import _layouts

        extra.update(_layouts()["tuple"])
    # The plain module and a float64 fsdp (not with bf16, whose rounding no tolerance bounds).
    ref = make_toy() if bf16 else make_toy().double()
    ours = _wrap("ours", make_toy(), strategy, use_orig_params=True, **extra)
    theirs = _wrap("torch", make_toy(), strategy, use_orig_params=True, **extra)
    models: tuple[nn.Module, ...] = (ref, ours, theirs)
    if not bf16:
        models += (_wrap("ours", make_toy().double(), strategy, use_orig_params=True, **extra),)
    rest = [_in_backward(m, optim, only) for m in models]
    if twice:
        for model in models:
            _apply_optimizer_in_backward(
                torch.optim.SGD, [p for name, p in model.named_parameters() if _chosen(name, only)], {"lr": 0.05}
            )
    for step in range(steps):
        tokens, targets = global_batch(step, ws)
        losses: list[list[torch.Tensor]] = [[] for _ in models]
        kept = []
        for i, (model, opt) in enumerate(zip(models, rest)):
            x, y = (tokens, targets) if i == 0 else (local_rows(tokens, rank, ws), local_rows(targets, rank, ws))
            loss = lm_loss(model(x), y)
            loss.backward()
            # Stepped and dropped inside backward: no gradient is left on a stepped parameter;
            # the others keep theirs for the regular optimizer (where this rank holds a part).
            kept.append({name: p.grad is not None for name, p in model.named_parameters()})
            if i in (1, 2):  # fsdp and torch FSDP1: which units' flat gradients stay alive
                # (memory is behaviour: a unit whose every parameter stepped keeps none)
                kept[-1].update({f"unit {k} flat grad": u._flat_param.grad is not None for k, u in enumerate(_units(model))})
            assert not any(kept[-1][name] for name in kept[-1] if _chosen(name, only) and "flat grad" not in name), (step, kept[-1])
            if clip:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5) if i == 0 else model.clip_grad_norm_(0.5)  # type: ignore[operator]
                losses[i].append(norm.detach())
                # Clipping rebuilds no gradient of a stepped parameter (torch FSDP1 keeps None).
                assert all(kept[-1][name] == (p.grad is not None) for name, p in model.named_parameters())
            opt.step()
            opt.zero_grad()
            losses[i].append(loss.detach())
        assert all(torch.equal(a, b) for a, b in zip(losses[1], losses[2])), (
            f"step {step}: loss (and norm) {losses[1]} != torch FSDP1 {losses[2]}"
        )
        assert kept[1] == kept[2], f"step {step}: gradients left: {kept[1]} != torch FSDP1 {kept[2]}"
        assert all(kept[0][name] for name in kept[0] if not _chosen(name, only))
        if only == "":  # every parameter stepped in backward: no unit keeps a flat gradient
            assert not any(v for name, v in kept[1].items() if "flat grad" in name), kept[1]
    mine, torch_full, ref_full = _full_params(ours), _full_params(theirs), dict(ref.named_parameters())
    assert list(mine) == list(torch_full)
    initial = dict(make_toy().named_parameters())
    for name in mine:
        assert torch.equal(mine[name], torch_full[name]), f"{name} differs from torch FSDP1"
        assert not torch.equal(mine[name], initial[name]), f"{name} never moved"
    if not bf16:
        mine64 = _full_params(models[3])
        assert list(mine64) == list(mine)
        for name in mine64:
            torch.testing.assert_close(mine64[name], ref_full[name].detach(), **FP64_TOL, msg=name)
    return len(mine)


@pytest.mark.parametrize("optim", ["sgd", "adam"])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
@pytest.mark.parametrize("dist_pool", [1, 2, 4], indirect=True)
def test_matches_torch_fsdp1(dist_pool: RankPool, strategy: str, optim: str) -> None:
    assert dist_pool.run(run_in_backward, strategy, optim) == [20] * dist_pool.world_size


@pytest.mark.parametrize(
    "variant", [{"bf16": True}, {"twice": True}, {"clip": True, "only": "weight"}], ids=["bf16", "twice", "clip"]
)
def test_variants(pool2: RankPool, variant: dict[str, Any]) -> None:
    assert pool2.run(run_in_backward, "FULL_SHARD", "adam", **variant) == [20, 20]


@pytest.mark.parametrize("strategy", ["HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"])
def test_hybrid(pool4: RankPool, strategy: str) -> None:
    assert pool4.run(run_in_backward, strategy, "adam", hybrid=True) == [20] * 4


def stepped_during_backward() -> list[list[int]]:
    """Whether each unit's optimizers have stepped by the time the backward reaches the
    embedding's output (the last gradient), in fsdp and in torch FSDP1: the last block's have
    (a unit steps as its reduction completes), with the same step counts."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    seen: list[list[int]] = []
    for lib in ("ours", "torch"):
        model = _wrap(lib, make_toy(), "FULL_SHARD", use_orig_params=True)
        _in_backward(model, "adam", only="")
        last = [p for name, p in model.named_parameters() if "blocks.2." in name]
        embed = next(m for name, m in model.named_modules() if name.endswith("embed"))
        counts: list[int] = []

        def record(grad: torch.Tensor) -> None:
            states = [opt.state.get(p, {}) for p in last for opt in p._in_backward_optimizers]  # type: ignore[attr-defined]
            counts.append(max(int(state["step"]) if "step" in state else 0 for state in states))

        def on_output(module: nn.Module, args: Any, out: torch.Tensor) -> None:
            out.register_hook(record)

        embed.register_forward_hook(on_output)
        for step in range(2):
            tokens, targets = global_batch(step, ws)
            lm_loss(model(local_rows(tokens, rank, ws)), local_rows(targets, rank, ws)).backward()
        seen.append(counts)
    return seen


def test_steps_during_backward(pool2: RankPool) -> None:
    for ours, theirs in pool2.run(stepped_during_backward):
        assert ours == theirs == [1, 2]


@pytest.mark.parametrize("only", ["blocks", "weight"])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_some_parameters_in_backward(pool2: RankPool, strategy: str, only: str) -> None:
    """Some parameters step in backward (whole units, or the weights inside every unit), the
    rest with a regular optimizer after it."""
    assert pool2.run(run_in_backward, strategy, "adam", only=only) == [20, 20]


def in_backward_with_no_sync() -> None:
    """Inside ``no_sync`` nothing steps; the synchronized backward steps once, on the sum."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    ours = _wrap("ours", make_toy(), "FULL_SHARD", use_orig_params=True)
    theirs = _wrap("torch", make_toy(), "FULL_SHARD", use_orig_params=True)
    for model in (ours, theirs):
        _in_backward(model, "adam", only="")
    for step in range(2):
        micro = [global_batch(2 * step + k, ws) for k in range(2)]
        for model in (ours, theirs):
            before = _full_params(model)
            tokens, targets = micro[0]
            with model.no_sync():  # type: ignore[operator]
                lm_loss(model(local_rows(tokens, rank, ws)), local_rows(targets, rank, ws)).backward()
            assert all(torch.equal(before[n], v) for n, v in _full_params(model).items()), "stepped inside no_sync"
            tokens, targets = micro[1]
            lm_loss(model(local_rows(tokens, rank, ws)), local_rows(targets, rank, ws)).backward()
            assert all(p.grad is None for p in model.parameters())
    mine, torch_full = _full_params(ours), _full_params(theirs)
    for name in mine:
        assert torch.equal(mine[name], torch_full[name]), f"{name} differs from torch FSDP1"


def test_no_sync(pool2: RankPool) -> None:
    pool2.run(in_backward_with_no_sync)


def in_backward_with_offload() -> None:
    """CPU offload (its logic runs without a GPU, [Note: CPU offload]) steps the host shards
    to the values training without offload gives; torch FSDP1 refuses offload without a GPU."""
    from fsdp import CPUOffload

    rank, ws = dist.get_rank(), dist.get_world_size()
    plain = _wrap("ours", make_toy(), "FULL_SHARD", use_orig_params=True)
    offloaded = _wrap("ours", make_toy(), "FULL_SHARD", use_orig_params=True, cpu_offload=CPUOffload(offload_params=True))
    for model in (plain, offloaded):
        _in_backward(model, "adam", only="")
    for step in range(3):
        tokens, targets = global_batch(step, ws)
        for model in (plain, offloaded):
            lm_loss(model(local_rows(tokens, rank, ws)), local_rows(targets, rank, ws)).backward()
    from fsdp import FullyShardedDataParallel as FSDP

    assert all(h.storage.offload_params for unit in FSDP.fsdp_modules(offloaded) for h in unit._fsdp_state.handles)
    mine, reference = _full_params(offloaded), _full_params(plain)
    initial = dict(make_toy().named_parameters())
    for name in mine:
        assert torch.equal(mine[name], reference[name]), f"{name}: offload differs"
        assert not torch.equal(mine[name], initial[name]), f"{name} never moved"


def test_cpu_offload(pool2: RankPool) -> None:
    pool2.run(in_backward_with_offload)


def flat_parameter_refused() -> list[str]:
    """``use_orig_params=False`` gives the optimizer the FlatParameters: both libraries refuse
    at the first forward, before any collective."""
    messages = []
    for lib in ("ours", "torch"):
        model = _wrap(lib, make_toy(), "FULL_SHARD")
        _apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), {"lr": 0.1})
        tokens, _ = global_batch(0, dist.get_world_size())
        with pytest.raises(RuntimeError, match="FSDP optimizer in backward only supported with use_orig_params=True") as err:
            model(local_rows(tokens, dist.get_rank(), dist.get_world_size()))
        messages.append(str(err.value))
    return messages


def test_flat_parameters_refused(pool2: RankPool) -> None:
    for ours, _ in pool2.run(flat_parameter_refused):
        assert "use_orig_params=True" in ours and "wrap with use_orig_params=True" in ours
