"""The CUDA lane: fsdp on NVIDIA GPUs against torch FSDP1 on the same GPU and single-process training.

Runs only with ``FSDP_TEST_DEVICE=cuda`` on a machine with a GPU (see README); otherwise the
module is skipped with one line saying why. Two pools (``tests/conftest.py``):

* world size 1 with NCCL, the way every single-GPU user runs;
* world size 2 on the one GPU with gloo and CUDA tensors (NCCL refuses two ranks on one GPU).
  gloo's all-gather, reduce-scatter, all-reduce and broadcast take CUDA tensors (staged through
  host memory); its send/recv do not, so fsdp's point-to-point forms stay CPU-only.

The overlap test runs outside the pools, in a fresh interpreter that plays rank 0 of 8 on torch's
fake process group with slept collectives (``tests/_overlap.py``; its CPU run is in
``tests/test_streams.py``).

Both pools turn on ``torch.use_deterministic_algorithms``: fsdp and torch FSDP1 do the same
arithmetic in the same order, so every comparison with torch is bit for bit (``torch.equal``).
Comparisons with the single-process model use the tolerance the CPU parity tests derive
(``tests/test_parity.py``): the per-rank half batches are summed in another order than the
whole batch, a few ulps per step.
"""

from __future__ import annotations

import copy
import os
import types
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests._harness import RankPool
from tests._models import Block, global_batch, lm_loss, local_rows, make_toy
from tests.conftest import test_device

if test_device() != "cuda":
    pytest.skip("CUDA lane off: FSDP_TEST_DEVICE=cuda runs it on an NVIDIA GPU", allow_module_level=True)
if not torch.cuda.is_available():
    pytest.skip(
        "FSDP_TEST_DEVICE=cuda, but torch.cuda.is_available() is False (no NVIDIA GPU, or a CPU "
        "build of torch): the CUDA lane cannot run here",
        allow_module_level=True,
    )

STEPS = 3
LR = 0.01
# The single-process comparison's tolerance in fp32 (see tests/test_parity.py for the argument).
FP32_RTOL, FP32_ATOL = 2e-5, 2e-6
# bf16/fp16 compute against an fp32 single-process model: every matmul input is rounded to 8
# (bf16) or 11 (fp16) mantissa bits, a relative error of at most 2^-9 per rounding; a loss after a
# dozen roundings stays within 2^-5 relative (a 16x margin over 12 * 2^-9).
LOW_PRECISION_LOSS_RTOL = 2.0**-5


def _dev() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _lib(name: str) -> types.SimpleNamespace:
    """fsdp's or torch FSDP1's public names, under one namespace."""
    if name == "ours":
        import fsdp as m
        import fsdp.sharded_grad_scaler as gs
        import fsdp.wrap as w
    else:
        import torch.distributed.fsdp as m  # type: ignore[no-redef]
        import torch.distributed.fsdp.sharded_grad_scaler as gs  # type: ignore[no-redef]
        import torch.distributed.fsdp.wrap as w  # type: ignore[no-redef]
    return types.SimpleNamespace(
        FSDP=m.FullyShardedDataParallel,
        ShardingStrategy=m.ShardingStrategy,
        MixedPrecision=m.MixedPrecision,
        CPUOffload=m.CPUOffload,
        BackwardPrefetch=m.BackwardPrefetch,
        StateDictType=m.StateDictType,
        FullStateDictConfig=m.FullStateDictConfig,
        ShardedStateDictConfig=m.ShardedStateDictConfig,
        FullOptimStateDictConfig=m.FullOptimStateDictConfig,
        ModuleWrapPolicy=w.ModuleWrapPolicy,
        ShardedGradScaler=gs.ShardedGradScaler,
    )


def _wrap(name: str, model: nn.Module, cfg: dict[str, Any]) -> nn.Module:
    """Wraps ``model`` (one unit per Block) with the library ``name`` and the options in ``cfg``."""
    lib = _lib(name)
    dtype = cfg.get("mp")
    kwargs: dict[str, Any] = dict(
        auto_wrap_policy=lib.ModuleWrapPolicy({Block}),
        sharding_strategy=lib.ShardingStrategy[cfg.get("strategy", "FULL_SHARD")],
        device_id=_dev(),
        use_orig_params=cfg.get("uop", False),
        limit_all_gathers=cfg.get("limit", True),
        forward_prefetch=cfg.get("fwd_prefetch", False),
        backward_prefetch=(
            lib.BackwardPrefetch[cfg["bwd_prefetch"]] if cfg.get("bwd_prefetch") else None
        ),
    )
    if dtype is not None:
        kwargs["mixed_precision"] = lib.MixedPrecision(
            param_dtype=dtype, reduce_dtype=cfg.get("reduce", dtype), buffer_dtype=dtype
        )
    if cfg.get("offload"):
        kwargs["cpu_offload"] = lib.CPUOffload(offload_params=True)
    if "mesh" in cfg:
        from torch.distributed.device_mesh import init_device_mesh

        kwargs["device_mesh"] = init_device_mesh("cuda", cfg["mesh"])
    for key in ("sync_module_states", "param_init_fn"):
        if key in cfg:
            kwargs[key] = cfg[key]
    wrapped = lib.FSDP(model, **kwargs)
    if cfg.get("hook"):
        _register_default_hook(name, wrapped, cfg)
    return wrapped


def _register_default_hook(name: str, wrapped: nn.Module, cfg: dict[str, Any]) -> None:
    """The default communication hook of the unit's reduction (all-reduce for NO_SHARD, which
    world size 1 runs, else reduce-scatter) from fsdp.comm_hooks or torch's default hooks: the
    reduction then runs through the hook path (on the post-backward stream, [Note: One reduction
    path] in fsdp/flat_param/_reduction.py), the same arithmetic as without it."""
    if name == "ours":
        import fsdp.comm_hooks as hooks
    else:
        from torch.distributed.algorithms._comm_hooks import default_hooks as hooks  # type: ignore[no-redef]
    no_shard = cfg.get("strategy") == "NO_SHARD" or dist.get_world_size() == 1
    hook = hooks.allreduce_hook if no_shard else hooks.reduce_scatter_hook
    wrapped.register_comm_hook(hooks.DefaultState(dist.group.WORLD), hook)  # type: ignore[operator]


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(global tokens, global targets, this rank's tokens, this rank's targets) on the GPU."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    tokens, targets = (t.to(_dev()) for t in global_batch(step, ws))
    return tokens, targets, local_rows(tokens, rank, ws), local_rows(targets, rank, ws)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return lm_loss(model(x).float(), y)


def _full(model: nn.Module, name: str) -> dict[str, torch.Tensor]:
    with _lib(name).FSDP.summon_full_params(model, writeback=False):
        return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}


def _offload_checks(model: nn.Module) -> None:
    """CPUOffload(offload_params=True): every sharded flat parameter lives in pinned host memory."""
    from fsdp import FullyShardedDataParallel as FSDP

    for unit in FSDP.fsdp_modules(model):
        for handle in unit._fsdp_state.handles:
            shard = handle.flat_param
            assert shard.device.type == "cpu", f"{unit}: offloaded shard on {shard.device}"
            assert shard.is_pinned(), "offloaded shard is not in pinned memory (slow, synchronous copies)"


# ------------------------------------------------------------------------------ training parity
CONFIGS: list[dict[str, Any]] = [
    dict(strategy="FULL_SHARD"),
    dict(strategy="SHARD_GRAD_OP"),
    dict(strategy="NO_SHARD"),
    dict(strategy="HYBRID_SHARD"),
    dict(strategy="_HYBRID_SHARD_ZERO2"),
    dict(strategy="FULL_SHARD", uop=True),
    dict(strategy="FULL_SHARD", mp=torch.bfloat16, reduce=torch.float32),
    dict(strategy="SHARD_GRAD_OP", mp=torch.bfloat16, uop=True),
    dict(strategy="FULL_SHARD", offload=True),
    dict(strategy="FULL_SHARD", offload=True, mp=torch.bfloat16, reduce=torch.float32),
    dict(strategy="FULL_SHARD", bwd_prefetch="BACKWARD_POST", fwd_prefetch=True),
    dict(strategy="FULL_SHARD", bwd_prefetch="BACKWARD_PRE", limit=False),
    dict(strategy="FULL_SHARD", bwd_prefetch=None, limit=True),
    # The reduction through a registered default hook, on the post-backward stream.
    dict(strategy="FULL_SHARD", hook=True),
    dict(strategy="NO_SHARD", hook=True),
    # Offload with both prefetches: at world size 1 (offload takes the sharded path there) the
    # host-to-device unshard copies run on the unshard stream ahead of compute.
    dict(strategy="FULL_SHARD", offload=True, bwd_prefetch="BACKWARD_PRE", fwd_prefetch=True),
]


def _describe(cfg: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in cfg.items())


def lane_training_parity(configs: list[dict[str, Any]]) -> int:
    """Each config: STEPS AdamW steps through the plain model (global batch), fsdp and torch FSDP1
    (this rank's rows). Losses and full parameters equal torch's bit for bit after every step; the
    plain model's within the fp32 / low-precision tolerance. Returns the configs checked."""
    for cfg in configs:
        what = _describe(cfg)
        if cfg.get("strategy", "").startswith("_HYBRID") or cfg.get("strategy") == "HYBRID_SHARD":
            if dist.get_world_size() == 1:
                continue  # nothing to shard nor replicate
        if "HYBRID" in cfg.get("strategy", ""):
            # One layout for both: a (replicate, shard) mesh that replicates over the two ranks
            # (torch FSDP1 would size a node by torch.cuda.device_count(), fsdp by torchrun's
            # LOCAL_WORLD_SIZE; the lane's two ranks share one GPU).
            cfg = {**cfg, "mesh": (dist.get_world_size(), 1)}
        # torch FSDP1's hybrid strategies over gloo with CUDA tensors (the two-rank pool) end
        # their second step off the single-process model (loss 2.6695 vs 2.6593 on rank 0; H100,
        # torch 2.11) while fsdp matches it within FP32_RTOL; there the plain model is the oracle.
        torch_is_oracle = not ("HYBRID" in cfg.get("strategy", "") and dist.get_backend() == "gloo")
        ref = make_toy().to(_dev())
        # Offloaded models start on the CPU (as users build them); the others on the GPU.
        ours = _wrap("ours", make_toy() if cfg.get("offload") else make_toy().to(_dev()), cfg)
        theirs = _wrap("torch", make_toy() if cfg.get("offload") else make_toy().to(_dev()), cfg)
        if cfg.get("offload"):
            _offload_checks(ours)
        opts = [torch.optim.AdamW(m.parameters(), lr=LR) for m in (ref, ours, theirs)]
        for step in range(STEPS):
            tokens, targets, x, y = _batch(step)
            losses = []
            for i, (model, opt) in enumerate(zip((ref, ours, theirs), opts)):
                loss = _loss(model, tokens, targets) if i == 0 else _loss(model, x, y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.detach().cpu())
            if cfg.get("mp") is None:
                # Rank-local losses: the mean of the ranks' losses is the global batch's.
                mean = losses[1].to(_dev())
                dist.all_reduce(mean)
                torch.testing.assert_close(mean.cpu() / dist.get_world_size(), losses[0], rtol=FP32_RTOL, atol=FP32_ATOL)
            else:
                mean = losses[1].to(_dev())
                dist.all_reduce(mean)
                rel = ((mean.cpu() / dist.get_world_size() - losses[0]).abs() / losses[0].abs()).item()
                assert rel < LOW_PRECISION_LOSS_RTOL, f"{what}: step {step}: loss off the fp32 model by {rel:.3g}"
            # After the single-process check: a mismatch here means fsdp matched the plain model.
            if torch_is_oracle:
                assert torch.equal(losses[1], losses[2]), f"{what}: step {step}: loss {losses[1]} != torch {losses[2]}"
        mine, torch_full = _full(ours, "ours"), _full(theirs, "torch")
        assert list(mine) == list(torch_full), what
        for name in mine:
            if torch_is_oracle:
                assert torch.equal(mine[name], torch_full[name]), f"{what}: {name} differs from torch FSDP1"
            if cfg.get("mp") is None:
                ref_value = dict(ref.named_parameters())[name].detach().cpu()
                torch.testing.assert_close(mine[name], ref_value, rtol=FP32_RTOL, atol=FP32_ATOL, msg=f"{what}: {name}")
        if not cfg.get("offload"):
            for p in ours.parameters():
                assert p.device.type == "cuda", f"{what}: parameter on {p.device}"
        del ours, theirs, ref, opts
        torch.cuda.empty_cache()
    return len(configs)


@pytest.mark.parametrize("pool_name", ["cuda_pool1", "cuda_pool2"])
def test_training_parity(pool_name: str, request: pytest.FixtureRequest) -> None:
    pool: RankPool = request.getfixturevalue(pool_name)
    assert pool.run(lane_training_parity, CONFIGS, _timeout=600) == [len(CONFIGS)] * pool.world_size


# ------------------------------------------------------------------------------ compress-hook race
#: GPU cycles a hook holds the post-backward stream for (tens of ms at 1-2 GHz): long enough for
#: the host to issue the previous unit's backward on the compute stream meanwhile.
_HOOK_SLEEP_CYCLES = 50_000_000


def _slow_compress_hook(compress: Any) -> Any:
    """A hook that queues ``torch.cuda._sleep`` on the stream it runs on, then ``compress``."""

    def hook(state: Any, grad: torch.Tensor, output: Optional[torch.Tensor] = None) -> None:
        torch.cuda._sleep(_HOOK_SLEEP_CYCLES)
        if output is None:
            compress(state, grad)
        else:
            compress(state, grad, output)

    return hook


def lane_compress_hook_race(hook_lib: str) -> int:
    """fp32 gradients through ``bf16_compress_hook`` behind a sleep on the post-backward stream
    ([Note: The reduction's input outlives its readers] in fsdp/flat_param/_reduction.py): the
    hook replaces ``grad.data`` with its bf16 cast, the last reference to the autograd-computed
    gradient but one; while the cast waits behind the sleep, the compute stream runs the previous
    unit's backward. Parameters equal torch FSDP1's with the same hook, bit for bit, after every
    step. Returns the strategies checked."""
    if hook_lib == "torch":
        from torch.distributed.algorithms._comm_hooks import default_hooks as hooks
    else:
        import fsdp.comm_hooks as hooks  # type: ignore[no-redef]
    strategies = ["FULL_SHARD"] if dist.get_world_size() == 1 else ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]
    for strategy in strategies:
        cfg = dict(strategy=strategy)
        models = {name: _wrap(name, make_toy().to(_dev()), cfg) for name in ("ours", "torch")}
        for model in models.values():
            state = hooks.LowPrecisionState(dist.group.WORLD)
            model.register_comm_hook(state, _slow_compress_hook(hooks.bf16_compress_hook))  # type: ignore[operator]
        opts = {name: torch.optim.AdamW(m.parameters(), lr=LR) for name, m in models.items()}
        for step in range(STEPS):
            _, _, x, y = _batch(step)
            for name, model in models.items():
                _loss(model, x, y).backward()
                opts[name].step()
                opts[name].zero_grad()
            mine, theirs = _full(models["ours"], "ours"), _full(models["torch"], "torch")
            for key in mine:
                assert torch.equal(mine[key], theirs[key]), f"{strategy} step {step}: {key} differs from torch FSDP1"
        del models, opts
        torch.cuda.empty_cache()
    return len(strategies)


@pytest.mark.parametrize("pool_name,hook_lib", [("cuda_pool1", "torch"), ("cuda_pool2", "ours")])
def test_compress_hook_race(pool_name: str, hook_lib: str, request: pytest.FixtureRequest) -> None:
    """torch's hook on the one-rank NCCL pool; fsdp's on the two-rank gloo pool (gloo reduces no
    bf16: fsdp's collectives carry bf16 values in fp32, torch's hook would hand gloo bf16)."""
    pool: RankPool = request.getfixturevalue(pool_name)
    expected = 1 if pool.world_size == 1 else 3
    assert pool.run(lane_compress_hook_race, hook_lib) == [expected] * pool.world_size


# ------------------------------------------------------------------------------ runtime features
def _scenario_step(name: str, model: nn.Module, opt: Optional[torch.optim.Optimizer], feature: str, step: int) -> Any:
    """One step of ``feature`` on this rank's rows; returns what the step observes (a loss, a
    norm, eval outputs) for the comparison with torch FSDP1."""
    _, _, x, y = _batch(step)
    if feature == "no_sync":  # two micro-batches accumulated unsynchronized, a third synchronized
        with model.no_sync():  # type: ignore[operator]
            _loss(model, x[:2], y[:2]).backward()
            _loss(model, x[2:], y[2:]).backward()
        observed: Any = _loss(model, x, y)
        observed.backward()
    elif feature == "eval":
        model.eval()
        with torch.no_grad():
            observed = model(x).float()
        model.train()
        _loss(model, x, y).backward()
    else:
        observed = _loss(model, x, y)
        observed.backward()
    if feature == "clip":
        observed = model.clip_grad_norm_(0.05)  # type: ignore[operator]
    if opt is not None:
        opt.step()
        opt.zero_grad()
    return observed.detach().cpu() if isinstance(observed, torch.Tensor) else observed


def lane_runtime_features(features: list[str]) -> int:
    """Each feature on CUDA streams (the unshard and post-backward streams; at world size 2 too):
    ``no_sync`` accumulation, ``eval`` under ``no_grad`` between steps, ``clip_grad_norm_``,
    activation checkpointing of every block (non-reentrant and reentrant), optimizers in backward
    (``_apply_optimizer_in_backward``, ``use_orig_params=True``). STEPS steps through fsdp and torch
    FSDP1; what each step observes (loss, norm, eval outputs) and the full parameters after every
    step equal torch FSDP1's bit for bit. Returns the features checked."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )
    from torch.distributed.optim import _apply_optimizer_in_backward

    for feature in features:
        cfg: dict[str, Any] = dict(strategy="FULL_SHARD", uop=feature == "optim_in_backward")
        models: dict[str, nn.Module] = {}
        opts: dict[str, Optional[torch.optim.Optimizer]] = {}
        for name in ("ours", "torch"):
            model = _wrap(name, make_toy().to(_dev()), cfg)
            if feature.startswith("checkpoint"):
                impl = CheckpointImpl.REENTRANT if feature == "checkpoint_reentrant" else CheckpointImpl.NO_REENTRANT
                apply_activation_checkpointing(
                    model,
                    checkpoint_wrapper_fn=lambda m, impl=impl: checkpoint_wrapper(m, checkpoint_impl=impl),
                    check_fn=lambda m: isinstance(m, Block),
                )
            if feature == "optim_in_backward":
                _apply_optimizer_in_backward(torch.optim.Adam, list(model.parameters()), {"lr": LR})
                opts[name] = None
            else:
                opts[name] = torch.optim.AdamW(model.parameters(), lr=LR)
            models[name] = model
        for step in range(STEPS):
            seen = {name: _scenario_step(name, m, opts[name], feature, step) for name, m in models.items()}
            assert torch.equal(torch.as_tensor(seen["ours"]), torch.as_tensor(seen["torch"])), (
                f"{feature} step {step}: {seen['ours']} != torch {seen['torch']}"
            )
            mine, theirs = _full(models["ours"], "ours"), _full(models["torch"], "torch")
            assert list(mine) == list(theirs), feature
            for key in mine:
                assert torch.equal(mine[key], theirs[key]), f"{feature} step {step}: {key} differs from torch FSDP1"
        del models, opts
        torch.cuda.empty_cache()
    return len(features)


RUNTIME_FEATURES = ["no_sync", "eval", "clip", "checkpoint", "checkpoint_reentrant", "optim_in_backward"]


@pytest.mark.parametrize("pool_name", ["cuda_pool1", "cuda_pool2"])
def test_runtime_features(pool_name: str, request: pytest.FixtureRequest) -> None:
    pool: RankPool = request.getfixturevalue(pool_name)
    assert pool.run(lane_runtime_features, RUNTIME_FEATURES, _timeout=600) == [len(RUNTIME_FEATURES)] * pool.world_size


# ------------------------------------------------------------------------------ fp16 + scaler
def lane_fp16_grad_scaler() -> float:
    """fp16 mixed precision with ShardedGradScaler, including a step whose gradients overflow:
    both skip it, halve the scale, and end with the same parameters bit for bit."""
    cfg = dict(strategy="FULL_SHARD", mp=torch.float16)
    models = {name: _wrap(name, make_toy().to(_dev()), cfg) for name in ("ours", "torch")}
    opts = {name: torch.optim.AdamW(m.parameters(), lr=LR) for name, m in models.items()}
    scalers = {name: _lib(name).ShardedGradScaler(init_scale=2.0**12) for name in models}
    for step in range(4):
        _, _, x, y = _batch(step)
        for name, model in models.items():
            loss = _loss(model, x, y)
            if step == 1:
                loss = loss * 1e30  # overflows fp16 gradients: the step is skipped
            scalers[name].scale(loss).backward()
            scalers[name].step(opts[name])
            scalers[name].update()
            opts[name].zero_grad()
        assert scalers["ours"].get_scale() == scalers["torch"].get_scale(), f"step {step}"
    assert scalers["ours"].get_scale() == 2.0**11, scalers["ours"].get_scale()  # halved once
    mine, theirs = _full(models["ours"], "ours"), _full(models["torch"], "torch")
    for name in mine:
        assert torch.equal(mine[name], theirs[name]), name
    return scalers["ours"].get_scale()


@pytest.mark.parametrize("pool_name", ["cuda_pool1", "cuda_pool2"])
def test_fp16_sharded_grad_scaler(pool_name: str, request: pytest.FixtureRequest) -> None:
    pool: RankPool = request.getfixturevalue(pool_name)
    assert pool.run(lane_fp16_grad_scaler) == [2.0**11] * pool.world_size


# ------------------------------------------------------------------------------ initialization
def lane_scaler_with_offload() -> int:
    """fp16 + ``CPUOffload`` + ShardedGradScaler with the GPU busy when ``unscale_`` runs
    ([Note: Host copies of the scale] in fsdp/sharded_grad_scaler.py): the host gradients are
    unscaled by exactly the scale's reciprocal, and an inf planted in a host gradient skips the
    step and halves the scale. A ``torch.cuda._sleep`` queued first keeps the stream busy, so a
    non-blocking copy of the scale to host memory would land after the CPU kernel read it."""
    cfg = dict(strategy="FULL_SHARD", mp=torch.float16, offload=True)
    model = _wrap("ours", make_toy().to(_dev()), cfg)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = _lib("ours").ShardedGradScaler(init_scale=2.0**12)
    for step in range(2):
        _, _, x, y = _batch(step)
        scaler.scale(_loss(model, x, y)).backward()
        params = [p for p in model.parameters() if p.grad is not None]
        assert params and all(p.grad.device.type == "cpu" for p in params), "offloaded grads on the host"
        if step == 1:
            params[0].grad.view(-1)[0] = float("inf")
        scaled = [p.grad.clone() for p in params]
        before = [p.detach().clone() for p in model.parameters()]
        inv_scale = torch.tensor(scaler.get_scale(), dtype=torch.float64).reciprocal().float()
        torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU cycles queued ahead of the scale's copies
        scaler.unscale_(opt)
        for param, grad in zip(params, scaled):
            assert torch.equal(param.grad, grad * inv_scale.to(grad.dtype)), f"step {step}: unscaled wrongly"
        scaler.step(opt)
        scaler.update()
        after = list(model.parameters())
        if step == 1:
            assert all(torch.equal(a, b) for a, b in zip(after, before)), "the inf step was taken"
            assert scaler.get_scale() == 2.0**11, scaler.get_scale()
        else:
            assert any(not torch.equal(a, b) for a, b in zip(after, before)), "the clean step was skipped"
        opt.zero_grad()
    return len(params)


def test_scaler_with_offload_and_busy_gpu(cuda_pool1: RankPool) -> None:
    assert all(n > 0 for n in cuda_pool1.run(lane_scaler_with_offload))


# ------------------------------------------------------------------------------ summon with grads
def lane_summon_with_grads_offload() -> int:
    """``summon_full_params(with_grads=True)`` with ``CPUOffload``: the offloaded sharded gradient
    (host memory) is gathered on the GPU (a pure NCCL group refuses a CPU tensor, and world size 1
    with offload keeps the sharded path), and the full gradients equal those of the same model
    trained without offload bit for bit (the same GPU arithmetic; offload only moves the reduced
    shard). The sharded gradient stays on the host, unchanged, and an in-place edit made inside
    with ``writeback=True`` reaches it. Returns the parameters compared."""
    FSDP = _lib("ours").FSDP
    _, _, x, y = _batch(0)
    compared = 0
    for uop in (False, True):
        models = {
            "offload": _wrap("ours", make_toy(), dict(strategy="FULL_SHARD", offload=True, uop=uop)),
            "gpu": _wrap("ours", make_toy().to(_dev()), dict(strategy="FULL_SHARD", uop=uop)),
        }
        full: dict[str, dict[str, torch.Tensor]] = {}
        for name, model in models.items():
            _loss(model, x, y).backward()
            with FSDP.summon_full_params(model, with_grads=True):
                full[name] = {}
                for n, p in model.named_parameters():
                    assert p.grad is not None, f"uop={uop} {name}: {n} has no gradient"
                    assert p.grad.device == p.device, f"uop={uop} {name}: {n}: grad on {p.grad.device}"
                    full[name][n] = p.grad.detach().cpu().clone()
        assert list(full["offload"]) == list(full["gpu"]), f"uop={uop}"
        for n in full["gpu"]:
            assert torch.equal(full["offload"][n], full["gpu"][n]), f"uop={uop}: {n}: offloaded gradient differs"
        model = models["offload"]
        sharded = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        assert sharded and all(g.device.type == "cpu" for g in sharded.values()), f"uop={uop}: grads not on the host"
        with FSDP.summon_full_params(model, with_grads=True, writeback=True):
            for p in model.parameters():
                p.grad.mul_(2)
        for n, p in model.named_parameters():
            if n in sharded:
                assert p.grad is not None and p.grad.device.type == "cpu", f"uop={uop}: {n}"
                assert torch.equal(p.grad, sharded[n] * 2), f"uop={uop}: {n}: the grad edit did not reach the host shard"
        compared += len(full["gpu"])
    return compared


@pytest.mark.parametrize("pool_name", ["cuda_pool1", "cuda_pool2"])
def test_summon_with_grads_offload(pool_name: str, request: pytest.FixtureRequest) -> None:
    pool: RankPool = request.getfixturevalue(pool_name)
    counts = pool.run(lane_summon_with_grads_offload)
    assert counts[0] > 0 and counts == [counts[0]] * pool.world_size


def _init_on_gpu(module: nn.Module) -> None:
    module.to_empty(device=_dev(), recurse=False)
    for m in [module]:
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()  # type: ignore[operator]


def lane_init() -> int:
    """Meta-device init onto the GPU, with and without ``param_init_fn``: fsdp materializes in
    pre-order ([Note: Meta-device materialization order]), so the parameters equal an eager
    init on the GPU with the same seed; torch FSDP1 materializes unit by unit bottom-up (other
    random draws), so it is only checked to land on the GPU. Then ``sync_module_states`` from
    rank 0: the same full parameters as torch FSDP1's."""
    torch.manual_seed(0)
    with torch.device(_dev()):
        eager = {n: p.detach().cpu() for n, p in make_toy(seed=0).named_parameters()}
    checked = 0
    for param_init_fn in (None, _init_on_gpu):
        for name in ("ours", "torch"):
            torch.manual_seed(0)
            with torch.device("meta"):
                model = make_toy()
            cfg: dict[str, Any] = {} if param_init_fn is None else {"param_init_fn": param_init_fn}
            wrapped = _wrap(name, model, cfg)
            assert all(p.device.type == "cuda" for p in wrapped.parameters()), name
            if name == "ours":
                full = _full(wrapped, name)
                for key, value in eager.items():
                    assert torch.equal(full[key], value), f"meta init param_init_fn={param_init_fn}: {key} != eager init"
        checked += 1
    # sync_module_states: every rank starts from different values; rank 0's win.
    synced = {}
    for name in ("ours", "torch"):
        model = make_toy(seed=dist.get_rank() + 7).to(_dev())
        synced[name] = _full(_wrap(name, model, {"sync_module_states": True}), name)
    rank0 = make_toy(seed=7)
    for key, value in rank0.named_parameters():
        assert torch.equal(synced["ours"][key], value.detach()), f"sync_module_states: {key}"
        assert torch.equal(synced["torch"][key], value.detach()), f"torch sync_module_states: {key}"
    return checked + 1


@pytest.mark.parametrize("pool_name", ["cuda_pool1", "cuda_pool2"])
def test_init_meta_and_sync(pool_name: str, request: pytest.FixtureRequest) -> None:
    pool: RankPool = request.getfixturevalue(pool_name)
    assert pool.run(lane_init) == [3] * pool.world_size


# ------------------------------------------------------------------------------ state dicts
def _train_pair(models: dict[str, nn.Module], opts: dict[str, torch.optim.Optimizer], steps: range) -> None:
    for step in steps:
        _, _, x, y = _batch(step)
        for name, model in models.items():
            _loss(model, x, y).backward()
            opts[name].step()
            opts[name].zero_grad()


def _to_local(value: Any) -> Any:
    if hasattr(value, "to_local"):
        return value.to_local()
    if hasattr(value, "local_tensor"):
        return value.local_tensor()
    return value


def _assert_still_equal(models: dict[str, nn.Module], opts: dict[str, torch.optim.Optimizer], after: str) -> None:
    """Taking a state dict changes neither model nor optimizer: fsdp's and torch's still agree."""
    mine, theirs = _full(models["ours"], "ours"), _full(models["torch"], "torch")
    for key in mine:
        assert torch.equal(mine[key], theirs[key]), f"after {after}: parameter {key} differs from torch's"
    for (p_ours, s_ours), (p_torch, s_torch) in zip(opts["ours"].state.items(), opts["torch"].state.items()):
        for field, value in s_ours.items():
            other = s_torch[field]
            assert value.device == other.device, f"after {after}: optimizer {field} on {value.device}, torch's on {other.device}"
            assert torch.equal(value, other), f"after {after}: optimizer {field} differs from torch's"


def lane_state_dicts(directory: str, uop: bool) -> int:
    """Full (offload_to_cpu, rank0_only), sharded (offload_to_cpu) and local model state dicts,
    full optimizer state dicts and a DCP round trip: equal to torch FSDP1's, and loadable."""
    import torch.distributed.checkpoint as dcp

    rank = dist.get_rank()
    cfg = dict(strategy="FULL_SHARD", uop=uop)
    models = {name: _wrap(name, make_toy().to(_dev()), cfg) for name in ("ours", "torch")}
    opts = {name: torch.optim.AdamW(m.parameters(), lr=LR) for name, m in models.items()}
    _train_pair(models, opts, range(2))
    checked = 0
    # FULL_STATE_DICT, offloaded to the CPU on rank 0 only.
    full: dict[str, dict[str, torch.Tensor]] = {}
    for name, model in models.items():
        lib = _lib(name)
        with lib.FSDP.state_dict_type(
            model, lib.StateDictType.FULL_STATE_DICT, lib.FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        ):
            full[name] = model.state_dict()
    assert list(full["ours"]) == list(full["torch"])
    for key, value in full["ours"].items():
        if rank == 0:
            # fsdp offloads for every strategy; torch FSDP1 ignores offload_to_cpu for NO_SHARD
            # (world size 1 here) and returns GPU tensors, so its values are moved to compare.
            assert value.device.type == "cpu", f"full state dict {key} on {value.device}"
            assert torch.equal(value, full["torch"][key].cpu()), f"full state dict {key}"
    if rank != 0:
        assert full["ours"] == {} and full["torch"] == {}, "rank0_only: other ranks get empty dicts"
    _assert_still_equal(models, opts, "the full state dict")
    checked += 1
    # SHARDED_STATE_DICT offloaded: the same local shards as torch's.
    sharded: dict[str, dict[str, Any]] = {}
    for name, model in models.items():
        lib = _lib(name)
        with lib.FSDP.state_dict_type(
            model, lib.StateDictType.SHARDED_STATE_DICT, lib.ShardedStateDictConfig(offload_to_cpu=True)
        ):
            sharded[name] = model.state_dict()
    assert list(sharded["ours"]) == list(sharded["torch"])
    for key in sharded["ours"]:
        mine, theirs = _to_local(sharded["ours"][key]), _to_local(sharded["torch"][key])
        assert mine.device.type == "cpu", f"sharded {key} on {mine.device}"
        assert torch.equal(mine, theirs.cpu()), f"sharded state dict {key}"
    _assert_still_equal(models, opts, "the sharded state dict")
    checked += 1
    # LOCAL_STATE_DICT: the flat shard, as torch keeps it.
    local: dict[str, dict[str, Any]] = {}
    for name, model in models.items():
        lib = _lib(name)
        with lib.FSDP.state_dict_type(model, lib.StateDictType.LOCAL_STATE_DICT):
            local[name] = model.state_dict()
    assert list(local["ours"]) == list(local["torch"])
    for key in local["ours"]:
        assert torch.equal(_to_local(local["ours"][key]).cpu(), _to_local(local["torch"][key]).cpu()), f"local {key}"
    _assert_still_equal(models, opts, "the local state dict")
    checked += 1
    # Full optimizer state dicts, then load ours into a fresh fsdp model and keep training.
    osd = {}
    for name, model in models.items():
        lib = _lib(name)
        with lib.FSDP.state_dict_type(
            model,
            lib.StateDictType.FULL_STATE_DICT,
            lib.FullStateDictConfig(offload_to_cpu=True, rank0_only=False),
            lib.FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=False),
        ):
            osd[name] = lib.FSDP.optim_state_dict(model, opts[name])
    assert osd["ours"]["param_groups"] == osd["torch"]["param_groups"]
    assert list(osd["ours"]["state"]) == list(osd["torch"]["state"])
    for key, state in osd["ours"]["state"].items():
        for field, value in state.items():
            assert torch.equal(torch.as_tensor(value).cpu(), torch.as_tensor(osd["torch"]["state"][key][field]).cpu()), (key, field)
    _assert_still_equal(models, opts, "the optimizer state dict")
    checked += 1
    # DCP: fsdp's sharded model state dict saved, loaded into a fresh fsdp model and a fresh
    # torch FSDP1 model; both then train on like the originals.
    lib = _lib("ours")
    with lib.FSDP.state_dict_type(models["ours"], lib.StateDictType.SHARDED_STATE_DICT):
        dcp.save(models["ours"].state_dict(), checkpoint_id=directory)
    fresh = {name: _wrap(name, make_toy(seed=5).to(_dev()), cfg) for name in ("ours", "torch")}
    for name, model in fresh.items():
        flib = _lib(name)
        with flib.FSDP.state_dict_type(model, flib.StateDictType.SHARDED_STATE_DICT):
            template = model.state_dict()
            dcp.load(template, checkpoint_id=directory)
            model.load_state_dict(template)
        with flib.FSDP.state_dict_type(
            model, flib.StateDictType.FULL_STATE_DICT, flib.FullStateDictConfig(offload_to_cpu=True, rank0_only=False)
        ):
            # A copy for torch: at world size 1 torch FSDP1's optim_state_dict returns the
            # optimizer's own state tensors (views, and the step tensors themselves), so loading
            # it into a second optimizer would make the two share state, and stepping one would
            # move the other (found here: torch's original diverged after fresh_torch's step).
            # fsdp's never aliases (tests/test_optim_state_dict.py::test_saved_state_is_not_aliased).
            source = osd[name] if name == "ours" else copy.deepcopy(osd[name])
            optim_input = flib.FSDP.optim_state_dict_to_load(model, torch.optim.AdamW(model.parameters(), lr=LR), source)
        fresh_opt = torch.optim.AdamW(model.parameters(), lr=LR)
        fresh_opt.load_state_dict(optim_input)
        opts[f"fresh_{name}"] = fresh_opt
    _train_pair(models, opts, range(2, 3))
    _assert_still_equal(models, opts, "one more step of the originals")
    restored = {f"fresh_{name}": m for name, m in fresh.items()}
    everything = {**models, **restored}
    _train_pair(restored, opts, range(2, 3))  # the originals took step 2 above
    _train_pair(everything, opts, range(3, 4))
    after = {name: _full(m, "ours" if "ours" in name else "torch") for name, m in everything.items()}
    for key in after["ours"]:
        for other in ("torch", "fresh_ours", "fresh_torch"):
            assert torch.equal(after["ours"][key], after[other][key]), f"after resume ({other}): {key}"
    checked += 1
    # summon_full_params with writeback: a change made in full view reaches the shards.
    ours = models["ours"]
    with _lib("ours").FSDP.summon_full_params(ours, writeback=True):
        first = next(ours.parameters())
        with torch.no_grad():
            first.add_(1.0)
    with _lib("ours").FSDP.summon_full_params(ours, writeback=False, offload_to_cpu=True, rank0_only=False):
        moved = next(ours.parameters())
        assert moved.device.type == "cpu", "summon_full_params(offload_to_cpu=True) gives CPU tensors"
        expected = after["ours"][next(iter(after["ours"]))] + 1.0
        assert torch.equal(moved.detach().float(), expected), "writeback lost"
    checked += 1
    return checked


@pytest.mark.parametrize("uop", [False, True])
@pytest.mark.parametrize("pool_name", ["cuda_pool1", "cuda_pool2"])
def test_state_dicts(pool_name: str, uop: bool, request: pytest.FixtureRequest, tmp_path: Any) -> None:
    pool: RankPool = request.getfixturevalue(pool_name)
    directory = os.path.join(str(tmp_path), "dcp")
    assert pool.run(lane_state_dicts, directory, uop, _timeout=600) == [6] * pool.world_size


def lane_device_placement() -> Optional[str]:
    """fsdp keeps compute on the GPU: after a step, the sharded flat parameters, the gradients
    and the optimizer state are CUDA tensors; nothing unexpected stays on the CPU."""
    model = _wrap("ours", make_toy().to(_dev()), {})
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    _, _, x, y = _batch(0)
    _loss(model, x, y).backward()
    opt.step()
    for p in model.parameters():
        assert p.device.type == "cuda" and p.grad is not None and p.grad.device.type == "cuda"
    for state in opt.state.values():
        for value in state.values():
            if torch.is_tensor(value) and value.dim() > 0:
                assert value.device.type == "cuda"
    return str(next(model.parameters()).device)


def test_device_placement(cuda_pool1: RankPool) -> None:
    assert cuda_pool1.run(lane_device_placement) == ["cuda:0"]


# ------------------------------------------------------------------------------ device_id only
@pytest.mark.parametrize("pool_name", ["cuda_pool1", "cuda_pool2"])
def test_object_collectives_on_device_id(pool_name: str, request: pytest.FixtureRequest) -> None:
    """NCCL at world size 1 (and gloo with CUDA tensors at 2), ``device_id=cuda:0`` passed explicitly: object collectives (the
    optimizer state-dict APIs' agreement and rank-0 broadcast) and the sharded optimizer values
    stage on ``device_id``; fsdp never asks for ``torch.cuda.current_device()`` (patched to raise
    for fsdp's callers). With a second GPU the current device is moved off ``device_id`` first,
    so a tensor staged on the current device fails the check (tests/_object_device.py)."""
    from tests._object_device import check_object_collectives_on

    pool: RankPool = request.getfixturevalue(pool_name)
    counts = pool.run(check_object_collectives_on, "cuda:0")
    assert counts[0] > 0 and counts == [counts[0]] * pool.world_size


# ------------------------------------------------------------------------------ overlap (fake group)
def test_overlap_on_the_fake_group() -> None:
    """fsdp as rank 0 of 8 on torch's fake process group, every block's collectives and compute
    slept for known times on their streams (tests/_overlap.py; issue 30, part 2), in a fresh
    interpreter: the CUDA events on the compute stream show each overlap the stream schedule
    promises ([Note: Stream edges] in fsdp/flat_param/_streams.py), and the memory shows the
    run-ahead bounded. K blocks, compute C and collective T per block (C = T = 20 ms, K = 6):
    serialized, a phase takes K (C + T) = 240 ms; overlapped about (K + 1) max(C, T) = 140 ms.
    The bar, 0.75 K (C + T) = 180 ms, leaves 40 ms for the host's hooks and launches (tens of
    us per unit); each phase is also at least its slept compute, K C (the sleeps ran)."""
    from tests import _overlap as o

    doc = o.run_in_subprocess("cuda")
    runs = {(r["scenario"], r["limit_all_gathers"]): r for r in doc["results"]}
    k, c, t = o.BLOCKS, o.COMPUTE_S, o.COMM_S
    serialized = k * (c + t)
    # (a) Forward, FULL_SHARD, no forward prefetch: block k+1's all-gather runs during block k's
    # forward (the unshard stream waits for the compute stream once per iteration, not per gather).
    forward = runs[("forward", True)]["forward_s"]
    assert k * c * 0.95 < forward < 0.75 * serialized, f"forward {forward:.3f} s; serialized {serialized:.3f} s"
    # (b) Backward, SHARD_GRAD_OP: block k's reduce-scatter runs during block k-1's backward.
    backward = runs[("backward", True)]["backward_s"]
    assert k * c * 0.95 < backward < 0.75 * serialized, f"backward {backward:.3f} s; serialized {serialized:.3f} s"
    # (c) Hybrid (2 nodes of 4), short compute: block k's all-reduce across nodes (on the
    # all-reduce stream) runs during block k-1's reduce-scatter (on the post-backward stream).
    hybrid = runs[("hybrid", True)]["backward_s"]
    both = k * 2 * t
    assert k * t * 0.95 < hybrid < 0.75 * both, f"hybrid backward {hybrid:.3f} s; serialized {both:.3f} s"
    # (d) Memory of the forward's run-ahead (FULL_SHARD, no prefetch). U: one block's gathered
    # buffer (16 MiB, a segment of its own). Allocated: the host frees block k before it gathers
    # block k+1, so one gathered block at a time, whatever the GPU's lag (limiter or not), plus
    # activations (under 1 MiB) and the root's few bytes. Reserved: with limit_all_gathers, when
    # the host allocates block k+2 the compute stream is past block k, so only block k+1's freed
    # buffer may still be pending: two blocks' segments, plus the small pools' 2 MiB segments
    # (compute and unshard streams); without it the host runs all K gathers ahead: K segments.
    mib = 2**20
    unit = runs[("forward", True)]["unit_bytes"]
    for limit in (True, False):
        run = runs[("forward", limit)]
        allocated = run["forward_max_allocated"] - run["allocated_at_start"]
        assert allocated <= unit + 2 * mib, f"limit={limit}: forward allocated {allocated / mib:.1f} MiB, one block is {unit / mib:.0f}"
    limited, unlimited = (runs[("forward", limit)] for limit in (True, False))
    reserved = limited["forward_max_reserved"] - limited["reserved_at_start"]
    assert reserved <= 2 * unit + 8 * mib, f"forward reserved {reserved / mib:.1f} MiB with limit_all_gathers"
    ahead = unlimited["forward_max_reserved"] - unlimited["reserved_at_start"]
    assert ahead >= (k - 1) * unit, f"without the limiter the run-ahead should show: {ahead / mib:.1f} MiB"
