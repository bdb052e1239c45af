"""Mixed precision: fsdp against torch FSDP1, bit for bit, for each precision configuration.

Each case trains the same model on the same data through ours and torch's FSDP1 with the same
``MixedPrecision`` and compares, at every step, the loss, every sharded gradient (values and
dtype) and, at the end, the full parameters; configurations without BatchNorm are also checked
against single-process float32 training (to bf16 tolerance). Then: the dtypes that travel in
each collective, buffers in state dicts, summon_full_params, and argument errors.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests._comm_count import count_collectives
from tests._harness import RankPool
from tests._models import DIM, VOCAB, Block, global_batch, local_rows

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

CONFIGS: dict[str, dict[str, Any]] = {
    "full_precision": {},  # MixedPrecision() with nothing set: the control
    "bf16_all": dict(param_dtype=BF16, reduce_dtype=BF16, buffer_dtype=BF16),
    "param_only": dict(param_dtype=BF16),  # reduce_dtype defaults to param_dtype
    "reduce_only": dict(reduce_dtype=BF16),
    "bf16_param_fp32_reduce": dict(param_dtype=BF16, reduce_dtype=FP32),
    "keep_low_precision_grads": dict(param_dtype=BF16, reduce_dtype=BF16, keep_low_precision_grads=True),
    "fp16": dict(param_dtype=FP16, reduce_dtype=FP16, buffer_dtype=FP16),
    "cast_forward_inputs": dict(param_dtype=BF16, cast_forward_inputs=True, cast_root_forward_inputs=False),
}
STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]


class MPNet(nn.Module):
    """Float features -> Linear -> Blocks (-> BatchNorm) -> head, with a constant float buffer."""

    def __init__(self, batchnorm: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.bn = nn.BatchNorm1d(DIM) if batchnorm else None
        self.head = nn.Linear(DIM, VOCAB)
        # Values that bf16 and fp16 cannot hold exactly.
        self.register_buffer("scale", 1 + torch.randn(DIM) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = h * self.scale.to(h.dtype)
        for block in self.blocks:
            h = block(h)
        if self.bn is not None:
            h = self.bn(h.transpose(1, 2)).transpose(1, 2)
        return self.head(h)


def make_net(seed: int = 0, batchnorm: bool = False) -> MPNet:
    torch.manual_seed(seed)
    return MPNet(batchnorm)


def features(step: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float inputs (scaled so bf16 rounding matters) and integer targets for all ranks."""
    tokens, targets = global_batch(step, world_size)
    g = torch.Generator().manual_seed(77 + step)
    x = torch.randn(*tokens.shape, DIM, generator=g) * 3
    return x, targets


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def _lib(lib: str) -> Any:
    if lib == "ours":
        import fsdp as lib_mod
        import fsdp.wrap as wrap_mod
    else:
        import torch.distributed.fsdp as lib_mod  # type: ignore[no-redef]
        import torch.distributed.fsdp.wrap as wrap_mod  # type: ignore[no-redef]
    return lib_mod, wrap_mod


def wrap(
    lib: str, model: nn.Module, strategy: str, config: str, use_orig_params: bool = False, **extra: Any
) -> nn.Module:
    lib_mod, wrap_mod = _lib(lib)
    if lib != "ours":
        extra["device_id"] = torch.device("cpu")
    return lib_mod.FullyShardedDataParallel(
        model,
        auto_wrap_policy=wrap_mod.ModuleWrapPolicy({Block}),
        sharding_strategy=lib_mod.ShardingStrategy[strategy],
        mixed_precision=lib_mod.MixedPrecision(**CONFIGS[config]),
        use_orig_params=use_orig_params,
        **extra,
    )


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    with type(model).summon_full_params(model, writeback=False):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def upcast_grads(model: nn.Module) -> None:
    """keep_low_precision_grads leaves bf16 grads on fp32 params; AdamW needs them fp32."""
    for p in model.parameters():
        if p.grad is not None and p.grad.dtype != p.dtype:
            p.grad = p.grad.to(p.dtype)


def _grads(model: nn.Module, full: bool) -> list[tuple[str, tuple[nn.Parameter, Any]]]:
    """``(name, (param, grad))``: the sharded gradients, or the full ones with use_orig_params
    (torch FSDP1 then pads each parameter for alignment, so the shards are cut elsewhere)."""
    if not full:
        return [(n, (p, p.grad)) for n, p in model.named_parameters()]
    with type(model).summon_full_params(model, writeback=False, with_grads=True):
        return [(n, (p, None if p.grad is None else p.grad.clone())) for n, p in model.named_parameters()]


def mp_parity(
    strategy: str,
    config: str,
    batchnorm: bool = False,
    use_orig_params: bool = False,
    steps: int = 3,
    accumulate: bool = False,
) -> None:
    """Ours == torch FSDP1 bit for bit: losses, sharded grads (dtype too), full params."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    ref = make_net(batchnorm=batchnorm)
    ours = wrap("ours", make_net(batchnorm=batchnorm), strategy, config, use_orig_params)
    theirs = wrap("torch", make_net(batchnorm=batchnorm), strategy, config, use_orig_params)
    models = (ref, ours, theirs)
    opts = [torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1) for m in models]
    grad_dtype = FP32
    if CONFIGS[config].get("keep_low_precision_grads"):
        grad_dtype = CONFIGS[config]["param_dtype"]
    for step in range(steps):
        x, y = features(step, ws)
        losses = []
        for i, (model, opt) in enumerate(zip(models, opts)):
            xs, ys = (x, y) if i == 0 else (local_rows(x, rank, ws), local_rows(y, rank, ws))
            micro_batches = [(xs, ys)] * (2 if accumulate else 1)
            for mx, my in micro_batches:  # accumulate: two backwards without zero_grad
                loss = loss_fn(model(mx), my)
                loss.backward()
            losses.append(loss.detach())
        assert torch.equal(losses[1], losses[2]), f"step {step}: loss {losses[1]} != torch FSDP1 {losses[2]}"
        if use_orig_params and grad_dtype != FP32:
            # torch FSDP1 cannot summon bf16 grads of fp32 original parameters (it raises), and
            # its shards are cut elsewhere; the parameters after each step are compared below.
            assert all(p.grad.dtype == grad_dtype for p in ours.parameters() if p.grad is not None)
            mine_grads, torch_grads = [], []
        else:
            mine_grads, torch_grads = _grads(ours, use_orig_params), _grads(theirs, use_orig_params)
        assert [n for n, _ in mine_grads] == [n for n, _ in torch_grads]
        for (name, (param, grad)), (_, (_, theirs_grad)) in zip(mine_grads, torch_grads):
            if theirs_grad is None:
                assert grad is None or not grad.any(), name
                continue
            assert grad is not None, f"step {step}: {name} has no grad"
            assert param.dtype == FP32, f"{name}: sharded parameter in {param.dtype}"
            assert grad.dtype == theirs_grad.dtype == grad_dtype, (name, grad.dtype, theirs_grad.dtype)
            assert torch.equal(grad, theirs_grad), f"step {step}: grad of {name} differs from torch FSDP1"
        for model, opt in zip(models, opts):
            upcast_grads(model)
            opt.step()
            opt.zero_grad()
        if use_orig_params:
            for (name, value), (_, theirs_value) in zip(full_params(ours).items(), full_params(theirs).items()):
                assert torch.equal(value, theirs_value), f"step {step}: {name} differs from torch FSDP1"
    mine_full, torch_full = full_params(ours), full_params(theirs)
    assert list(mine_full) == list(torch_full)
    for name, value in mine_full.items():
        assert value.dtype == FP32, f"summon_full_params gave {name} in {value.dtype}"
        assert torch.equal(value, torch_full[name]), f"{name} differs from torch FSDP1"
    if not batchnorm:  # BatchNorm statistics are per rank under data parallelism
        for name, value in ref.named_parameters():
            torch.testing.assert_close(mine_full[name], value.detach(), rtol=0, atol=0.05, msg=name)


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_parity_with_torch_ws2(pool2: RankPool, strategy: str, config: str) -> None:
    pool2.run(mp_parity, strategy, config)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("dist_pool", [1, 4], indirect=True)
def test_parity_with_torch_ws1_ws4(dist_pool: RankPool, strategy: str) -> None:
    dist_pool.run(mp_parity, strategy, "bf16_all")
    dist_pool.run(mp_parity, strategy, "keep_low_precision_grads")


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("dist_pool", [2, 4], indirect=True)
def test_batchnorm_runs_in_full_precision_like_torch(dist_pool: RankPool, strategy: str) -> None:
    dist_pool.run(mp_parity, strategy, "bf16_all", True)


@pytest.mark.parametrize("config", ["bf16_all", "keep_low_precision_grads"])
def test_use_orig_params_parity(pool2: RankPool, config: str) -> None:
    for strategy in STRATEGIES:
        pool2.run(mp_parity, strategy, config, False, True)


@pytest.mark.parametrize("config", ["full_precision", "bf16_all", "keep_low_precision_grads", "reduce_only"])
def test_gradient_accumulation_parity(pool2: RankPool, config: str) -> None:
    for strategy in STRATEGIES:
        pool2.run(mp_parity, strategy, config, False, False, 2, True)


# ---------------------------------------------------------------------------------------------
# What travels in which dtype
# ---------------------------------------------------------------------------------------------


def _float_dtypes(counts: Any, kind: Optional[str] = None) -> set[torch.dtype]:
    """Floating dtypes that travelled (the first iteration's order check gathers int64s)."""
    kinds = [kind] if kind else list(counts.dtypes)
    return {d for k in kinds for d in counts.dtypes.get(k, ()) if d.is_floating_point}


def collective_dtypes(strategy: str, config: str) -> None:
    """Training gathers in param_dtype and reduces in reduce_dtype; summon and full state dicts
    gather the full-precision shards."""
    from fsdp import FullStateDictConfig, FullyShardedDataParallel as FSDP, StateDictType

    rank, ws = dist.get_rank(), dist.get_world_size()
    cfg = CONFIGS[config]
    param_dtype = cfg.get("param_dtype") or FP32
    reduce_dtype = cfg.get("reduce_dtype") or param_dtype
    model = wrap("ours", make_net(), strategy, config)
    x, y = features(0, ws)
    with count_collectives() as step_counts:
        loss_fn(model(local_rows(x, rank, ws)), local_rows(y, rank, ws)).backward()
    if strategy == "NO_SHARD":
        assert not _float_dtypes(step_counts, "all_gather") and "reduce_scatter" not in step_counts.calls
        assert _float_dtypes(step_counts, "all_reduce") == {reduce_dtype}, step_counts.dtypes
    else:
        assert _float_dtypes(step_counts, "all_gather") == {param_dtype}, step_counts.dtypes
        assert _float_dtypes(step_counts, "reduce_scatter") == {reduce_dtype}, step_counts.dtypes
        assert not _float_dtypes(step_counts, "all_reduce")
    for p in model.parameters():
        assert p.dtype == FP32 and p.grad is not None and p.grad.dtype == FP32
    with count_collectives() as summon_counts:
        values = full_params(model)
    assert all(v.dtype == FP32 for v in values.values())
    assert _float_dtypes(summon_counts) <= {FP32}, summon_counts.dtypes
    with count_collectives() as save_counts:
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig()):
            state = model.state_dict()
    assert _float_dtypes(save_counts) <= {FP32}, save_counts.dtypes
    for name, value in values.items():
        assert state[name].dtype == FP32 and torch.equal(state[name], value), name


@pytest.mark.parametrize("config", ["bf16_all", "reduce_only", "bf16_param_fp32_reduce", "fp16"])
def test_gradients_travel_in_reduce_dtype(pool2: RankPool, config: str) -> None:
    for strategy in STRATEGIES:
        pool2.run(collective_dtypes, strategy, config)


# ---------------------------------------------------------------------------------------------
# no_sync, and summon_full_params between forward and backward
# ---------------------------------------------------------------------------------------------


def no_sync_parity(strategy: str, config: str) -> None:
    """A no_sync micro-batch, then a synced one: gradients equal torch FSDP1's."""
    import contextlib

    rank, ws = dist.get_rank(), dist.get_world_size()
    ours = wrap("ours", make_net(), strategy, config)
    theirs = wrap("torch", make_net(), strategy, config)
    for model in (ours, theirs):
        for step, ctx in enumerate((model.no_sync(), contextlib.nullcontext())):
            x, y = features(step, ws)
            with ctx:
                loss_fn(model(local_rows(x, rank, ws)), local_rows(y, rank, ws)).backward()
    for (name, p), (_, q) in zip(ours.named_parameters(), theirs.named_parameters()):
        assert p.grad is not None and p.grad.dtype == q.grad.dtype, name
        assert torch.equal(p.grad, q.grad), f"{name}: gradient after no_sync differs from torch FSDP1"


@pytest.mark.parametrize("config", ["bf16_all", "keep_low_precision_grads", "bf16_param_fp32_reduce"])
def test_no_sync_parity(pool2: RankPool, config: str) -> None:
    for strategy in STRATEGIES:
        pool2.run(no_sync_parity, strategy, config)


def summon_between_forward_and_backward(strategy: str) -> None:
    """summon_full_params (full precision) on a root still holding its bf16 copy from forward:
    the backward after it still sees the bf16 parameters, and matches torch without a summon."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    ours = wrap("ours", make_net(), strategy, "bf16_all")
    theirs = wrap("torch", make_net(), strategy, "bf16_all")
    x, y = features(0, ws)
    before = full_params(ours)
    loss_ours = loss_fn(ours(local_rows(x, rank, ws)), local_rows(y, rank, ws))
    inside = full_params(ours)
    for name, value in inside.items():
        assert value.dtype == FP32 and torch.equal(value, before[name]), name
    loss_ours.backward()
    loss_fn(theirs(local_rows(x, rank, ws)), local_rows(y, rank, ws)).backward()
    for (name, p), (_, q) in zip(ours.named_parameters(), theirs.named_parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_summon_between_forward_and_backward(pool2: RankPool) -> None:
    for strategy in STRATEGIES:
        pool2.run(summon_between_forward_and_backward, strategy)


# ---------------------------------------------------------------------------------------------
# Buffers
# ---------------------------------------------------------------------------------------------


def buffers_in_state_dicts(strategy: str) -> None:
    """buffer_dtype casts buffers for compute; state dicts give back their full-precision values
    (torch FSDP1 gives the bf16-rounded ones), also after a load."""
    from fsdp import FullyShardedDataParallel as FSDP, ShardedStateDictConfig, StateDictType

    original = make_net().scale.clone()
    ours = wrap("ours", make_net(), strategy, "bf16_all")
    theirs = wrap("torch", make_net(), strategy, "bf16_all")
    x, y = features(0, dist.get_world_size())
    rank, ws = dist.get_rank(), dist.get_world_size()
    for model in (ours, theirs):
        loss_fn(model(local_rows(x, rank, ws)), local_rows(y, rank, ws)).backward()
    assert ours.module.scale.dtype == BF16
    assert torch.equal(ours.module.scale, theirs.module.scale)  # both cast for compute
    ours_sd, theirs_sd = ours.state_dict(), theirs.state_dict()
    assert list(ours_sd) == list(theirs_sd)
    assert ours_sd["scale"].dtype == theirs_sd["scale"].dtype == FP32
    assert torch.equal(ours_sd["scale"], original), "the full-precision buffer value is lost"
    assert torch.equal(theirs_sd["scale"], original.to(BF16).float())
    assert not torch.equal(original, original.to(BF16).float())  # the test means something
    # Loading a new value: the module holds its bf16 cast, state dicts the loaded value.
    new_value = original * 1.001 + 0.0001
    ours_sd["scale"] = new_value
    ours.load_state_dict(ours_sd)
    assert ours.module.scale.dtype == BF16 and torch.equal(ours.module.scale, new_value.to(BF16))
    assert torch.equal(ours.state_dict()["scale"], new_value)
    with FSDP.state_dict_type(ours, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig()):
        sharded = ours.state_dict()
    assert sharded["scale"].dtype == FP32 and torch.equal(sharded["scale"], new_value)
    # A buffer changed in place since (as forward may do) is saved upcast.
    with torch.no_grad():
        ours.module.scale.add_(1)
    assert torch.equal(ours.state_dict()["scale"], (new_value.to(BF16) + 1).float())


def test_buffers_keep_full_precision_values_in_state_dicts(pool2: RankPool) -> None:
    for strategy in STRATEGIES:
        pool2.run(buffers_in_state_dicts, strategy)


# ---------------------------------------------------------------------------------------------
# ShardedGradScaler
# ---------------------------------------------------------------------------------------------


def scaler_parity(strategy: str) -> None:
    """fp16 training with ShardedGradScaler == torch FSDP1 with its ShardedGradScaler, including a
    step where only rank 1 overflows: every rank skips it and backs off."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchScaler

    from fsdp.sharded_grad_scaler import ShardedGradScaler

    rank, ws = dist.get_rank(), dist.get_world_size()
    ours = wrap("ours", make_net(), strategy, "fp16")
    theirs = wrap("torch", make_net(), strategy, "fp16")
    pairs = [
        (ours, ShardedGradScaler("cpu", init_scale=2.0**10, growth_interval=2)),
        (theirs, TorchScaler("cpu", init_scale=2.0**10, growth_interval=2)),
    ]
    opts = [torch.optim.AdamW(m.parameters(), lr=0.01) for m, _ in pairs]
    for step in range(4):
        x, y = features(step, ws)
        for (model, scaler), opt in zip(pairs, opts):
            scaler.scale(loss_fn(model(local_rows(x, rank, ws)), local_rows(y, rank, ws))).backward()
            if step == 1 and rank == ws - 1:
                next(p for p in model.parameters() if p.grad is not None and p.grad.numel()).grad[0] = float("inf")
            before = [p.detach().clone() for p in model.parameters()]
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            if step == 1:  # every rank skipped the step
                assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
        assert pairs[0][1].get_scale() == pairs[1][1].get_scale(), (step, pairs[0][1].get_scale(), pairs[1][1].get_scale())
        for (name, p), (_, q) in zip(ours.named_parameters(), theirs.named_parameters()):
            assert torch.equal(p, q), f"step {step}: {name} differs from torch FSDP1"
    scales = [torch.zeros(()) for _ in range(ws)]
    dist.all_gather(scales, torch.tensor(pairs[0][1].get_scale()))
    assert len(set(s.item() for s in scales)) == 1


def test_sharded_grad_scaler_parity(pool2: RankPool) -> None:
    for strategy in STRATEGIES:
        pool2.run(scaler_parity, strategy)


def scaler_without_local_grads() -> None:
    """A rank whose optimizer holds no gradient still takes part in the overflow decision."""
    from fsdp.sharded_grad_scaler import ShardedGradScaler

    rank = dist.get_rank()
    param = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([param], lr=0.1)
    scaler = ShardedGradScaler("cpu", init_scale=8.0)
    scaler.scale(torch.ones(()))  # the loss every rank scales
    if rank == 0:
        param.grad = torch.tensor([1.0, float("nan"), 1.0])
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 4.0  # rank 0's overflow reached rank 1, which has no grads
    assert torch.equal(param.detach(), torch.ones(3))


def test_sharded_grad_scaler_rank_without_grads(pool2: RankPool) -> None:
    pool2.run(scaler_without_local_grads)


# ---------------------------------------------------------------------------------------------
# FSDP_USE_FULL_PREC_IN_EVAL
# ---------------------------------------------------------------------------------------------


def full_precision_in_eval(strategy: str) -> None:
    """With FSDP_USE_FULL_PREC_IN_EVAL=1, eval() runs in full precision (fp32 outputs, fp32
    buffers meanwhile); train() goes back to bf16, equal to torch FSDP1."""
    import os

    rank, ws = dist.get_rank(), dist.get_world_size()
    os.environ["FSDP_USE_FULL_PREC_IN_EVAL"] = "1"
    try:
        ours = wrap("ours", make_net(), strategy, "bf16_all")
        theirs = wrap("torch", make_net(), strategy, "bf16_all")
    finally:
        del os.environ["FSDP_USE_FULL_PREC_IN_EVAL"]
    x, y = features(0, ws)
    xs, ys = local_rows(x, rank, ws), local_rows(y, rank, ws)
    for step in range(2):
        for model in (ours, theirs):
            model.eval()
        with torch.no_grad():
            out_ours, out_theirs = ours(xs), theirs(xs)
        assert out_ours.dtype == out_theirs.dtype == FP32
        if step == 0:
            # Full precision means the model's own numbers: ours equals the unwrapped fp32
            # model exactly; torch FSDP1 uses the buffer's bf16 rounding, upcast.
            with torch.no_grad():
                assert torch.equal(out_ours, make_net().eval()(xs))
        torch.testing.assert_close(out_ours, out_theirs, rtol=0, atol=2e-2)
        assert ours.module.scale.dtype == FP32
        for model in (ours, theirs):
            model.train()
        losses = [loss_fn(model(xs), ys) for model in (ours, theirs)]
        assert torch.equal(losses[0], losses[1])
        for loss in losses:
            loss.backward()
        assert ours.module.scale.dtype == BF16
        for (name, p), (_, q) in zip(ours.named_parameters(), theirs.named_parameters()):
            assert torch.equal(p.grad, q.grad), f"step {step}: {name}"
            p.grad = None
            q.grad = None
    # A full-precision eval forward did not disturb the buffer's full-precision value.
    assert torch.equal(ours.state_dict()["scale"], make_net().scale)


def test_full_precision_in_eval(pool2: RankPool) -> None:
    for strategy in STRATEGIES:
        pool2.run(full_precision_in_eval, strategy)



# ---------------------------------------------------------------------------------------------
# With hybrid sharding and with activation checkpointing
# ---------------------------------------------------------------------------------------------


def _checkpoint_blocks(model: nn.Module, around_units: bool) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    if around_units:  # around each nested unit (as apply_activation_checkpointing on FSDP units)
        fsdp_cls = type(model)
        check = lambda m: isinstance(m, fsdp_cls) and m is not model  # noqa: E731
    else:  # inside each unit, around its Block
        check = lambda m: isinstance(m, Block)  # noqa: E731
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper, check_fn=check)


def mp_composed(kind: str, strategy: str) -> None:
    """bf16 mixed precision composed with hybrid sharding or activation checkpointing: losses
    and gradients equal torch FSDP1's at every step, full parameters at the end."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    extra: dict[str, Any] = {}
    if kind == "hybrid":
        from torch.distributed.device_mesh import init_device_mesh

        extra["device_mesh"] = init_device_mesh("cpu", (2, ws // 2))
    models = [wrap(lib, make_net(), strategy, "bf16_all", **dict(extra)) for lib in ("ours", "torch")]
    if kind.startswith("checkpoint"):
        for model in models:
            _checkpoint_blocks(model, around_units=kind == "checkpoint_units")
    opts = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in models]
    for step in range(3):
        x, y = features(step, ws)
        losses = [loss_fn(m(local_rows(x, rank, ws)), local_rows(y, rank, ws)) for m in models]
        assert torch.equal(losses[0], losses[1]), f"step {step}: loss differs from torch FSDP1"
        for loss in losses:
            loss.backward()
        for (name, p), (_, q) in zip(*(m.named_parameters() for m in models)):
            assert p.grad is not None and p.grad.dtype == FP32, name
            assert torch.equal(p.grad, q.grad), f"step {step}: grad of {name} differs from torch FSDP1"
        for opt in opts:
            opt.step()
            opt.zero_grad()
    mine, theirs = full_params(models[0]), full_params(models[1])
    for name, value in mine.items():
        assert torch.equal(value, theirs[name]), name


@pytest.mark.parametrize("strategy", ["HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"])
def test_with_hybrid_sharding(pool4: RankPool, strategy: str) -> None:
    pool4.run(mp_composed, "hybrid", strategy)


@pytest.mark.parametrize("kind", ["checkpoint_blocks", "checkpoint_units"])
def test_with_activation_checkpointing(pool2: RankPool, kind: str) -> None:
    for strategy in STRATEGIES:
        pool2.run(mp_composed, kind, strategy)


def _no_shard_frees_low_precision_after_forward() -> list[tuple[bool, bool]]:
    """(fsdp keeps the unit's bf16 copy after forward, torch FSDP1 keeps its mp shard) per unit."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import MixedPrecision as TorchMP
    from torch.distributed.fsdp import ShardingStrategy as TorchSS
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy

    from fsdp import FullyShardedDataParallel as FSDP, MixedPrecision, ShardingStrategy
    from fsdp.wrap import ModuleWrapPolicy
    from tests._models import Block, make_toy

    ours = FSDP(
        make_toy(), auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=ShardingStrategy.NO_SHARD,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16),
    )
    theirs = TorchFSDP(
        make_toy(), auto_wrap_policy=TorchPolicy({Block}), sharding_strategy=TorchSS.NO_SHARD,
        mixed_precision=TorchMP(param_dtype=torch.bfloat16), device_id=torch.device("cpu"),
    )
    tokens = torch.zeros(2, 3, dtype=torch.long)
    out_ours, out_theirs = ours(tokens), theirs(tokens)  # outputs require grad: a backward may follow
    kept = []
    for mine, torchs in zip(FSDP.fsdp_modules(ours), TorchFSDP.fsdp_modules(theirs)):
        torch_mp_shard = torchs._handle.flat_param._mp_shard
        kept.append((mine._fsdp_state.handles[0].is_unsharded, torch_mp_shard.untyped_storage().size() > 0))
    out_ours.sum().backward()
    out_theirs.sum().backward()
    return kept


def test_no_shard_frees_low_precision_copy_after_forward(pool2: Any) -> None:
    """Found by the GPU benchmark (1B GPT, one GPU, NO_SHARD, bf16): fsdp kept every unit's bf16
    copy from forward to backward, one low-precision model (2 GiB) above torch FSDP1's peak.
    torch frees NO_SHARD's low-precision copy at every reshard, the root's too; so does fsdp."""
    for per_unit in pool2.run(_no_shard_frees_low_precision_after_forward):
        assert per_unit == [(False, False)] * 4, per_unit
