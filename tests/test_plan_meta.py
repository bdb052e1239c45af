"""fsdp.estimate_memory on meta models of common torch modules, whatever their init methods.

Planning needs shapes and dtypes, never values ([Note: Planning needs no values] in
fsdp/plan/_api.py): a model built on the meta device plans even when some module has no
``reset_parameters()`` (``nn.MultiheadAttention``, so every ``nn.TransformerEncoder``), while
the wrapper itself still refuses to materialize such a model, as torch FSDP1 does.

Each model's plan built on the meta device must equal the plan of the same model built on the
CPU (same units, sizes and trace; the CPU build has values, the plan never reads them), and the
TransformerEncoder's prediction is checked against a measured CPU run.
"""

from __future__ import annotations

import gc
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp import CPUOffload, MixedPrecision, ShardingStrategy, estimate_memory
from fsdp.wrap import ModuleWrapPolicy
from tests._harness import RankPool

D_MODEL, HEADS, FF, LAYERS = 256, 4, 1024, 4
BATCH, SEQ = 4, 64


def _encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(D_MODEL, HEADS, FF, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)


class _AttentionBlock(nn.Module):
    """``nn.MultiheadAttention`` (no ``reset_parameters()``) and a projection."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(D_MODEL, HEADS, batch_first=True)
        self.proj = nn.Linear(D_MODEL, D_MODEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.attn(x, x, x, need_weights=False)
        return self.proj(torch.relu(out)) + x


class _NoReset(nn.Module):
    """A parameter and a buffer, and no ``reset_parameters()``."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(D_MODEL))
        self.register_buffer("shift", torch.zeros(D_MODEL))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + self.shift


def _attention_model() -> nn.Module:
    return nn.Sequential(_AttentionBlock(), _AttentionBlock(), nn.Linear(D_MODEL, 8))


def _no_reset_model() -> nn.Module:
    return nn.Sequential(nn.Linear(D_MODEL, D_MODEL), _NoReset(), nn.ReLU(), nn.Linear(D_MODEL, D_MODEL), _NoReset())


# name -> (builder, block class to wrap)
MODELS: dict[str, tuple[Callable[[], nn.Module], type]] = {
    "TransformerEncoder": (_encoder, nn.TransformerEncoderLayer),
    "MultiheadAttention": (_attention_model, _AttentionBlock),
    "no reset_parameters": (_no_reset_model, _NoReset),
}

CONFIGS: dict[str, tuple[int, dict[str, Any]]] = {
    "ws1": (1, {}),
    "ws2 FULL_SHARD": (2, {}),
    "ws4 SHARD_GRAD_OP bf16": (
        4,
        {"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP, "mixed_precision": MixedPrecision(param_dtype=torch.bfloat16)},
    ),
    "ws4 FULL_SHARD offload cuda": (4, {"cpu_offload": CPUOffload(offload_params=True), "device_id": torch.device("cuda")}),
    "ws2 use_orig_params": (2, {"use_orig_params": True}),
}


def _build(name: str, device: str) -> nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        return MODELS[name][0]()


def _inputs() -> torch.Tensor:
    return torch.zeros(BATCH, SEQ, D_MODEL, device="meta")


def _plan(model: nn.Module, world_size: int, config: dict[str, Any], wrap: type) -> Any:
    kwargs = {"device_id": torch.device("cpu"), "auto_wrap_policy": ModuleWrapPolicy({wrap}), **config}
    return estimate_memory(model, _inputs(), world_size=world_size, **kwargs)


@pytest.mark.parametrize("model_name", list(MODELS))
def test_meta_model_plans_as_its_cpu_build(model_name: str) -> None:
    wrap = MODELS[model_name][1]
    meta, cpu = _build(model_name, "meta"), _build(model_name, "cpu")
    for config_name, (world_size, config) in CONFIGS.items():
        planned_meta = _plan(meta, world_size, config, wrap)
        planned_cpu = _plan(cpu, world_size, config, wrap)
        assert planned_meta == planned_cpu, config_name
        assert len(planned_meta.units) == 1 + sum(isinstance(m, wrap) for m in meta.modules())
    # Planning left the meta model on meta, with no values made up.
    assert all(t.is_meta for t in [*meta.parameters(), *meta.buffers()])


def test_user_param_init_fn_is_not_called_by_planning() -> None:
    calls: list[nn.Module] = []
    meta = _build("no reset_parameters", "meta")
    with_fn = estimate_memory(meta, _inputs(), world_size=2, device_id=torch.device("cpu"), param_init_fn=calls.append)
    without = estimate_memory(meta, _inputs(), world_size=2, device_id=torch.device("cpu"))
    assert calls == [] and with_fn == without


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def _train_encoder_and_check_meta_contract() -> int:
    """Rank function: the wrapper (and torch FSDP1) still refuse a meta TransformerEncoder;
    then a CPU TransformerEncoder is trained under FULL_SHARD and its step's peak RSS returned."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    from fsdp import FullyShardedDataParallel as FSDP
    from fsdp.plan._measure import peak_rss_bytes, reset_peak_rss, rss_bytes, set_mmap_threshold

    policy = ModuleWrapPolicy({nn.TransformerEncoderLayer})
    with torch.device("meta"):
        meta = _encoder()
    with pytest.raises(ValueError, match=r"'layers\.0\.self_attn' \(MultiheadAttention\) has parameters or buffers on the meta device but no reset_parameters\(\)"):
        FSDP(meta, auto_wrap_policy=policy, device_id=torch.device("cpu"))
    with pytest.warns(UserWarning, match="Unable to call `reset_parameters\\(\\)` for module on meta device"):
        with pytest.raises(AttributeError, match="reset_parameters"):
            TorchFSDP(meta, auto_wrap_policy=policy, device_id=torch.device("cpu"))
    del meta

    assert set_mmap_threshold(65536)
    peak = 0
    for measured in (False, True):  # a warm-up run first: [Note: One-time kernel state]
        gc.collect()
        dist.barrier()
        base = rss_bytes()
        model = FSDP(_build("TransformerEncoder", "cpu"), auto_wrap_policy=policy, device_id=torch.device("cpu"))
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randn(BATCH, SEQ, D_MODEL)
        for step in range(2):
            if step == 1:
                gc.collect()
                dist.barrier()
                reset_peak_rss()
            _loss(model(x)).backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
        peak = peak_rss_bytes() - base
        del model, optim, x
        gc.collect()
    return peak


def test_meta_transformer_prediction_vs_measured(pool2: RankPool) -> None:
    """The meta TransformerEncoder's prediction against the busiest rank's measured peak; the
    tolerance is the planner's 10% target (test_plan_measure.py's module docstring says why)."""
    measured = max(pool2.run(_train_encoder_and_check_meta_contract))
    predicted = estimate_memory(
        _build("TransformerEncoder", "meta"),
        _inputs(),
        world_size=2,
        loss_fn=_loss,
        device_id=torch.device("cpu"),
        auto_wrap_policy=ModuleWrapPolicy({nn.TransformerEncoderLayer}),
    ).peak_bytes
    error = (predicted - measured) / measured
    print(f"predicted {predicted / 2**20:.2f} MiB, measured {measured / 2**20:.2f} MiB, {error:+.1%}")
    assert abs(error) <= 0.10, (predicted, measured)


class _ReadsValues(nn.Module):
    """A forward that branches on a tensor's value: no fake tensor can run it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D_MODEL, D_MODEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y * 2 if y.sum() > 0 else y


def test_forward_that_reads_values_is_a_clear_error() -> None:
    with torch.device("meta"):
        model = _ReadsValues()
    with pytest.raises(ValueError, match=r"the model's forward or loss needs tensor values \(aten\._local_scalar_dense"):
        estimate_memory(model, _inputs(), world_size=2)
