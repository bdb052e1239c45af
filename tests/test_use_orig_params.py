"""use_orig_params=True: original parameters, parameter groups, frozen parameters without
gradient memory, writeback of replaced data, torch.compile — against torch FSDP1 and
single-process training.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests._harness import RankPool
from tests._models import Block, global_batch, lm_loss, local_rows, make_toy
from tests.test_parity import _full_params

STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]


def _model(freeze: str) -> nn.Module:
    model = make_toy()
    for name, p in model.named_parameters():
        if (freeze == "bias" and name.endswith("bias")) or (freeze == "fc1" and ".fc1." in name):
            p.requires_grad_(False)
    return model


def _wrap(lib: str, model: nn.Module, strategy: str) -> nn.Module:
    if lib == "ours":
        from fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
        from fsdp.wrap import ModuleWrapPolicy

        return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=ShardingStrategy[strategy], use_orig_params=True)
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP, ShardingStrategy as TS
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TP

    return TorchFSDP(model, auto_wrap_policy=TP({Block}), sharding_strategy=TS[strategy], use_orig_params=True, device_id=torch.device("cpu"))


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    """Three AdamW parameter groups: embedding (own lr), norms (no decay), the rest (decay)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for n, p in named if "embed" in n], "lr": 0.02},
        {"params": [p for n, p in named if "norm" in n], "weight_decay": 0.0},
        {"params": [p for n, p in named if "embed" not in n and "norm" not in n], "weight_decay": 0.1},
    ]


def _step(models: list[nn.Module], opts: list[torch.optim.Optimizer], step: int, set_to_none: bool = True) -> None:
    rank, ws = dist.get_rank(), dist.get_world_size()
    tokens, targets = global_batch(step, ws)
    for i, (model, opt) in enumerate(zip(models, opts)):
        x, y = (tokens, targets) if i == 0 else (local_rows(tokens, rank, ws), local_rows(targets, rank, ws))
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)


def parity(strategy: str) -> None:
    from fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    ws = dist.get_world_size()
    ref, ours, theirs = _model("bias"), _wrap("ours", _model("bias"), strategy), _wrap("torch", _model("bias"), strategy)
    # Original names, as torch shows them (prefixes outside summon_full_params).
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    # The same Parameter objects the plain module had: optimizer groups built on them work.
    models = [ref, ours, theirs]
    opts = [torch.optim.AdamW(_groups(m), lr=0.01) for m in models]
    for step in range(4):
        _step(models, opts, step, set_to_none=step % 2 == 0)
    mine, torch_full, ref_full = _full_params(ours, FSDP), _full_params(theirs, TorchFSDP), dict(ref.named_parameters())
    assert list(mine) == list(torch_full) == list(ref_full)
    for name in mine:
        if ws <= 2:  # one addition per element: bit-exact whatever the shard layout
            assert torch.equal(mine[name], torch_full[name]), name
        else:  # torch pads each parameter for alignment: another layout, another summation order
            torch.testing.assert_close(mine[name], torch_full[name], rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(mine[name], ref_full[name].detach(), rtol=5e-5, atol=5e-6, msg=name)
        if name.endswith("bias"):  # frozen: never moved
            assert torch.equal(mine[name], dict(_model("bias").named_parameters())[name])


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("dist_pool", [1, 2, 4], indirect=True)
def test_parity_param_groups_frozen(dist_pool: RankPool, strategy: str) -> None:
    dist_pool.run(parity, strategy)


def _flat_grad_bytes(model: nn.Module, flat_cls: type) -> int:
    total = 0
    for module in model.modules():
        for attr in ("_fsdp_state",):
            state = getattr(module, attr, None)
            if state is not None:
                for handle in state.handles:
                    if handle.flat_param.grad is not None:
                        total += handle.flat_param.grad.numel() * handle.flat_param.grad.element_size()
        handle = getattr(module, "_handle", None)  # torch FSDP1 (ours has it too: counted above)
        if getattr(module, "_fsdp_state", None) is None and handle is not None and getattr(handle, "flat_param", None) is not None and handle.flat_param.grad is not None:
            total += handle.flat_param.grad.numel() * handle.flat_param.grad.element_size()
    return total


def frozen_memory() -> tuple[int, int, int]:
    from fsdp import FullyShardedDataParallel as FSDP
    from fsdp.flat_param._sharding import sharded_numel

    ours, theirs = _wrap("ours", _model("fc1"), "FULL_SHARD"), _wrap("torch", _model("fc1"), "FULL_SHARD")
    _step([make_toy(), ours, theirs], [torch.optim.SGD(m.parameters(), lr=0.0) for m in (make_toy(), ours, theirs)], 0, set_to_none=False)
    ours_bytes = _flat_grad_bytes(ours, object)
    theirs_bytes = _flat_grad_bytes(theirs, object)
    ws = dist.get_world_size()
    trainable = 0
    for unit in FSDP.fsdp_modules(ours):
        for handle in unit._fsdp_state.handles:
            if handle.flat_param.requires_grad:
                trainable += sharded_numel(handle.shard_layout.unpadded_unsharded_numel, ws) * 4
            else:
                assert handle.flat_param.grad is None  # the frozen handle has no gradient at all
    return ours_bytes, theirs_bytes, trainable


def test_frozen_params_cost_no_gradient_memory(pool2: RankPool) -> None:
    ours, theirs, trainable = pool2.run(frozen_memory)[0]
    assert ours == trainable  # gradients exist for the trainable parameters only
    frozen_fc1 = 3 * (7 * 11 + 11) * 4 // 2  # each rank's share of the frozen fc1 layers
    assert theirs >= ours + frozen_fc1  # torch FSDP1 keeps a gradient for frozen parameters too
    print(f"sharded gradient bytes per rank: fsdp {ours}, torch FSDP1 {theirs}")


def writeback(strategy: str) -> None:
    from fsdp import FullyShardedDataParallel as FSDP

    rank, ws = dist.get_rank(), dist.get_world_size()
    ref, ours = make_toy(), _wrap("ours", make_toy(), strategy)
    models = [ref, ours]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    _step(models, opts, 0)
    inner = ours.module
    # 1. Replace .data in the sharded shape the parameter has between steps.
    p_ours = inner.blocks[0].module.fc1.weight
    p_ours.data = p_ours.data * 0.5
    ref.blocks[0].fc1.weight.data = ref.blocks[0].fc1.weight.data * 0.5
    # 2. Replace a Parameter on its module with one in the original (full) shape.
    new_head = torch.linspace(-1, 1, 13 * 7).reshape(13, 7)
    inner.head.weight = nn.Parameter(new_head.clone())
    ref.head.weight = nn.Parameter(new_head.clone())
    tokens, _ = global_batch(1, ws)
    out_ours = ours(local_rows(tokens, rank, ws))
    out_ref = ref(tokens)
    torch.testing.assert_close(out_ours, local_rows(out_ref, rank, ws), rtol=1e-5, atol=1e-6)
    mine = _full_params(ours, FSDP)
    for name, value in ref.named_parameters():
        torch.testing.assert_close(mine[name], value.detach(), rtol=1e-6, atol=1e-7, msg=name)
    # 3. A shape change is a clear error, raised before the forward changes anything.
    inner.blocks[1].module.fc2.bias.data = torch.zeros(3, 3)
    with pytest.raises(RuntimeError, match=r"Cannot writeback when the parameter shape changes: parameter 'fc2.bias' of FSDP unit 'blocks.1' was given shape \(3, 3\); it must keep its shape \(7,\)"):
        ours(local_rows(tokens, rank, ws))
    assert all(u.training_state.name == "IDLE" for u in FSDP.fsdp_modules(ours))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_writeback_of_replaced_data(pool2: RankPool, strategy: str) -> None:
    pool2.run(writeback, strategy)


def summon_orig(strategy: str) -> None:
    from fsdp import FullyShardedDataParallel as FSDP

    ref, ours = _model("bias"), _wrap("ours", _model("bias"), strategy)
    models = [ref, ours]
    opts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1) for m in models]
    _step(models, opts, 0)
    rank, ws = dist.get_rank(), dist.get_world_size()
    tokens, targets = global_batch(1, ws)
    lm_loss(ref(tokens), targets).backward()
    lm_loss(ours(local_rows(tokens, rank, ws)), local_rows(targets, rank, ws)).backward()
    originals = {n: p for n, p in ours.named_parameters()}
    with FSDP.summon_full_params(ours, with_grads=True):
        got = dict(ours.named_parameters())
        for name, value in ref.named_parameters():
            assert got[name] is originals["_fsdp_wrapped_module." + name.replace("blocks.0.", "blocks.0._fsdp_wrapped_module.").replace("blocks.1.", "blocks.1._fsdp_wrapped_module.").replace("blocks.2.", "blocks.2._fsdp_wrapped_module.")]
            torch.testing.assert_close(got[name].detach(), value.detach(), rtol=1e-6, atol=1e-7, msg=name)
            if value.grad is None:
                assert got[name].grad is None, name
            else:
                torch.testing.assert_close(got[name].grad, value.grad, rtol=1e-5, atol=1e-6, msg=name)
    # Back to sharded views: training continues and still matches.
    for opt in opts:
        opt.step()
        opt.zero_grad()
    _step(models, opts, 2)
    mine = _full_params(ours, FSDP)
    for name, value in ref.named_parameters():
        torch.testing.assert_close(mine[name], value.detach(), rtol=5e-5, atol=5e-6, msg=name)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_summon_with_orig_params(pool2: RankPool, strategy: str) -> None:
    pool2.run(summon_orig, strategy)
