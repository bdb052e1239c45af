"""register_comm_hook: torch's default hooks and fsdp.comm_hooks, against torch FSDP1."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests._comm_count import count_collectives
from tests._harness import RankPool
from tests._models import train_against_reference, global_batch, lm_loss, local_rows, make_toy
from tests.test_parity import _full_params, _wrap


def _hook(lib: str, name: str) -> tuple[Any, Any]:
    if lib == "torch":
        import torch.distributed.algorithms._comm_hooks.default_hooks as h
    else:
        import fsdp.comm_hooks as h  # type: ignore[no-redef]
    group = dist.group.WORLD
    if name in ("fp16", "bf16"):
        return h.LowPrecisionState(group), getattr(h, f"{name}_compress_hook")
    return h.DefaultState(group), getattr(h, f"{name}_hook")


def _train(models: list[Any], steps: int = 3) -> None:
    """models[0] is the single-process reference (global batch); the others see local rows."""
    train_against_reference(models, steps, lr=0.01)


def hook_parity(strategy: str, name: str, hook_lib: str) -> None:
    from fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    ref = make_toy()
    ours, theirs = _wrap("ours", make_toy(), strategy, "module"), _wrap("torch", make_toy(), strategy, "module")
    ours.register_comm_hook(*_hook(hook_lib, name))
    # torch's compression hooks call record_stream on the CPU "stream" and fail on CPU, under
    # torch FSDP1 too: there torch FSDP1 runs fsdp's hook (same calling convention).
    theirs.register_comm_hook(*_hook("ours" if name == "fp16" else "torch", name))
    _train([ref, ours, theirs])
    mine, torch_full, ref_full = _full_params(ours, FSDP), _full_params(theirs, TorchFSDP), dict(ref.named_parameters())
    for key in mine:
        assert torch.equal(mine[key], torch_full[key]), key
        tol = dict(rtol=2e-2, atol=2e-3) if name == "fp16" else dict(rtol=5e-5, atol=5e-6)
        torch.testing.assert_close(mine[key], ref_full[key].detach(), msg=key, **tol)


@pytest.mark.parametrize("hook_lib", ["torch", "ours"])
@pytest.mark.parametrize(
    "strategy,name",
    [("NO_SHARD", "allreduce"), ("FULL_SHARD", "reduce_scatter"), ("SHARD_GRAD_OP", "reduce_scatter")],
)
def test_hooks_match_torch(pool2: RankPool, strategy: str, name: str, hook_lib: str) -> None:
    pool2.run(hook_parity, strategy, name, hook_lib)


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_fp16_hook_matches_torch(pool2: RankPool, strategy: str) -> None:
    pool2.run(hook_parity, strategy, "fp16", "ours")


def reduced_grads_match_arithmetic(strategy: str, name: str) -> None:
    """The compression hooks' reduced gradients equal the arithmetic, element for element.

    A recording hook passes each unit's unsharded gradient through fsdp's hook; every rank's
    recorded gradient is gathered and the expected result computed here in the hook's dtype:
    cast, divide by the pre-divide factor, sum over ranks (two ranks: one addition, the same
    whatever the order), divide by the post-divide factor, cast back, this rank's chunk.
    """
    from fsdp import FullyShardedDataParallel as FSDP
    from fsdp.flat_param._sharding import gradient_divide_factors

    rank, ws = dist.get_rank(), dist.get_world_size()
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[name]
    state, hook = _hook("ours", name)
    recorded: list[tuple[Any, torch.Tensor]] = []
    current: list[Any] = []

    def recording_hook(hook_state: Any, grad: torch.Tensor, output: Any = None) -> None:
        recorded.append((current[-1], grad.detach().clone()))
        hook(hook_state, grad, output)

    model = _wrap("ours", make_toy(), strategy, "module")
    model.register_comm_hook(state, recording_hook)
    handles = [unit._fsdp_state.handle for unit in FSDP.fsdp_modules(model)]
    for handle in handles:
        # A tensor hook runs in the FlatParameter's accumulation node, just before the
        # post-accumulate hook that reduces (and calls the comm hook): it names the handle.
        handle.flat_param.register_hook(lambda g, handle=handle: current.append(handle) or g)
    tokens, targets = global_batch(0, ws)
    lm_loss(model(local_rows(tokens, rank, ws)), local_rows(targets, rank, ws)).backward()
    pre, post = gradient_divide_factors(ws)
    assert sorted(id(hd) for hd, _ in recorded) == sorted(id(hd) for hd in handles)
    assert state.gradient_predivide_factor == pre and state.gradient_postdivide_factor == post
    for handle, grad in recorded:
        everyone = [torch.empty_like(grad) for _ in range(ws)]
        dist.all_gather(everyone, grad)
        total = everyone[0].to(dtype) / pre
        for other in everyone[1:]:
            total = total + other.to(dtype) / pre
        expected = (total / post).to(torch.float32)
        if handle.shard_layout.uses_sharding:
            expected = expected.chunk(ws)[rank]
        assert torch.equal(handle.flat_param.grad, expected), handle.unit_name


@pytest.mark.parametrize("name", ["fp16", "bf16"])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_compression_hook_reduces_exactly(pool2: RankPool, strategy: str, name: str) -> None:
    pool2.run(reduced_grads_match_arithmetic, strategy, name)


# torch's compression hooks end with ``record_stream(backend.current_stream())``, which a CPU
# tensor rejects with this message (torch/distributed/algorithms/_comm_hooks/default_hooks.py).
TORCH_HOOK_ON_CPU = "^unknown parameter type$"


def torch_fp16_hook_fails_on_cpu() -> None:
    model = _wrap("ours", make_toy(), "FULL_SHARD", "module")
    model.register_comm_hook(*_hook("torch", "fp16"))
    rank, ws = dist.get_rank(), dist.get_world_size()
    tokens, targets = global_batch(0, ws)
    with pytest.raises(RuntimeError, match=TORCH_HOOK_ON_CPU):
        lm_loss(model(local_rows(tokens, rank, ws)), local_rows(targets, rank, ws)).backward()


def test_torch_fp16_hook_fails_on_cpu(pool2: RankPool) -> None:
    pool2.run(torch_fp16_hook_fails_on_cpu)


def bf16_on_gloo(strategy: str) -> None:
    """torch's bf16 hook fails on CPU (its record_stream); fsdp's works and trains like the reference."""
    from fsdp import FullyShardedDataParallel as FSDP

    theirs = _wrap("torch", make_toy(), strategy, "module")
    theirs.register_comm_hook(*_hook("torch", "bf16"))
    rank, ws = dist.get_rank(), dist.get_world_size()
    tokens, targets = global_batch(0, ws)
    with pytest.raises(RuntimeError, match=TORCH_HOOK_ON_CPU):
        lm_loss(theirs(local_rows(tokens, rank, ws)), local_rows(targets, rank, ws)).backward()
    ref, ours = make_toy(), _wrap("ours", make_toy(), strategy, "module")
    ours.register_comm_hook(*_hook("ours", "bf16"))
    _train([ref, ours])
    mine = _full_params(ours, FSDP)
    for key, value in ref.named_parameters():
        torch.testing.assert_close(mine[key], value.detach(), rtol=5e-2, atol=5e-3, msg=key)
    # Gradients are rounded to bf16 before they travel: they equal their bf16 rounding.
    model = _wrap("ours", make_toy(), strategy, "module")
    model.register_comm_hook(*_hook("ours", "bf16"))
    lm_loss(model(local_rows(tokens, rank, ws)), local_rows(targets, rank, ws)).backward()
    for unit in FSDP.fsdp_modules(model):
        grad = unit._fsdp_state.handle.flat_param.grad
        assert grad.dtype == torch.float32
        assert torch.equal(grad, grad.to(torch.bfloat16).float())


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_bf16_hook_on_gloo(pool2: RankPool, strategy: str) -> None:
    pool2.run(bf16_on_gloo, strategy)


def fp16_travels_in_fp16() -> None:
    rank, ws = dist.get_rank(), dist.get_world_size()
    model = _wrap("ours", make_toy(), "FULL_SHARD", "module")
    model.register_comm_hook(*_hook("ours", "fp16"))
    tokens, targets = global_batch(0, ws)
    with count_collectives() as counts:
        lm_loss(model(local_rows(tokens, rank, ws)), local_rows(targets, rank, ws)).backward()
    assert counts.calls["reduce_scatter"] == 4
    assert counts.dtypes["reduce_scatter"] == {torch.float16}


def test_fp16_hook_communicates_fp16(pool2: RankPool) -> None:
    pool2.run(fp16_travels_in_fp16)


def hook_errors() -> None:
    import fsdp.comm_hooks as h
    from fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy

    model = _wrap("ours", make_toy(), "FULL_SHARD", "module")
    state = h.DefaultState(dist.group.WORLD)
    with pytest.raises(RuntimeError, match=r"^register_comm_hook can only be called on a root instance\.\n"):  # + a note
        model.module.blocks[0].register_comm_hook(state, h.reduce_scatter_hook)
    with pytest.raises(ValueError, match="The communication hook must be callable but got reduce_scatter"):  # torch's type
        model.register_comm_hook(state, "reduce_scatter")
    model.register_comm_hook(state, h.reduce_scatter_hook)
    with pytest.raises(RuntimeError, match="^A communication hook is already registered\n"):  # + a note
        model.register_comm_hook(state, h.reduce_scatter_hook)
    intra, _ = dist.new_subgroups_by_enumeration([[0], [1]])
    hybrid = FSDP(make_toy(), sharding_strategy=ShardingStrategy.HYBRID_SHARD, process_group=(dist.group.WORLD, intra))
    with pytest.raises(RuntimeError, match=r"Communication hook is not supported for hybrid strategies: ShardingStrategy.HYBRID_SHARD \(unit"):
        hybrid.register_comm_hook(state, h.reduce_scatter_hook)


def test_hook_errors(pool2: RankPool) -> None:
    pool2.run(hook_errors)
