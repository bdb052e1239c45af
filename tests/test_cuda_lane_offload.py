"""The CUDA lane for fractional offload and the pipelined host step (FSDP_TEST_DEVICE=cuda).

On a GPU an offloaded unit steps with torch's CPU AdamW and a device unit with the GPU's (as
torch FSDP1's offload steps on the CPU), so a mix is compared unit by unit with the placement
each unit has: after one step each unit's parameters equal those of the model that keeps every
unit where this unit is (all offloaded, or none), bit for bit (the gradients are the same GPU
arithmetic; offload only moves the reduced shard). The pipelined host step is the same
arithmetic as the unpipelined one, so it is compared bit for bit over several steps. Every
AdamW runs its single-tensor kernel (``foreach=False``): a mix of host and device tensors
takes it by default, and the references must run the same kernel.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests._harness import RankPool
from tests.conftest import test_device

if test_device() != "cuda" or not torch.cuda.is_available():
    pytest.skip("CUDA lane off: FSDP_TEST_DEVICE=cuda runs it on an NVIDIA GPU", allow_module_level=True)

from tests._models import Block, make_toy  # noqa: E402
from tests.test_cuda_lane import _batch, _dev, _full, _loss, _wrap  # noqa: E402


def _mix(fraction: float) -> nn.Module:
    from fsdp import CPUOffload, FullyShardedDataParallel as FSDP
    from fsdp.wrap import ModuleWrapPolicy

    return FSDP(
        make_toy(),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        device_id=_dev(),
        cpu_offload=CPUOffload(offload_params=True, fraction=fraction),
    )


def _placement(model: nn.Module) -> dict[str, bool]:
    """Per unit (name), whether it offloads; asserts its shard, gradient and optimizer state
    are where that puts them (pinned host memory, or the GPU)."""
    from fsdp import FullyShardedDataParallel as FSDP

    chosen = {}
    for name, unit in model.named_modules():
        if not isinstance(unit, FSDP):
            continue
        offloads = unit._fsdp_state.policy.offload_params
        chosen[name.replace("_fsdp_wrapped_module.", "")] = offloads
        for handle in unit._fsdp_state.handles:
            shard = handle.flat_param
            assert shard.device.type == ("cpu" if offloads else "cuda"), (name, shard.device)
            if offloads:
                assert shard.is_pinned(), name
            if shard.grad is not None:
                assert shard.grad.device == shard.device, name
    return chosen


def lane_fractional_offload() -> int:
    from fsdp.runtime._host_step import PipelinedHostStep

    _, _, x, y = _batch(0)
    mix, piped = _mix(0.5), _mix(0.5)
    every = _wrap("ours", make_toy(), dict(strategy="FULL_SHARD", offload=True))
    none = _wrap("ours", make_toy().to(_dev()), dict(strategy="FULL_SHARD"))
    opts = {id(m): torch.optim.AdamW(m.parameters(), lr=0.01, foreach=False) for m in (mix, every, none)}
    for model in (mix, every, none):
        _loss(model, x, y).backward()
        for param in model.parameters():
            assert param.grad is not None and param.grad.device == param.device
        opts[id(model)].step()
        for param in model.parameters():
            assert opts[id(model)].state[param]["exp_avg"].device == param.device
    chosen = _placement(mix)
    assert any(chosen.values()) and not all(chosen.values()), chosen
    after = {name: _full(m, "ours") for name, m in (("mix", mix), ("every", every), ("none", none))}
    compared = 0
    for param_name, value in after["mix"].items():
        unit = ".".join(param_name.split(".")[:2]) if param_name.startswith("blocks.") else ""
        reference = after["every" if chosen.get(unit, chosen[""]) else "none"][param_name]
        assert torch.equal(value, reference), param_name
        compared += 1
    # The pipelined host step against one optimizer stepped in place, same placement.
    pipeline = PipelinedHostStep(piped, lambda ps: torch.optim.AdamW(ps, lr=0.01, foreach=False))
    plain = _mix(0.5)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=0.01, foreach=False)
    for step in range(3):
        _, _, x, y = _batch(step)
        losses = []
        for model in (plain, piped):
            loss = _loss(model, x, y)
            loss.backward()
            losses.append(loss.detach())
            model.clip_grad_norm_(0.05)  # type: ignore[operator]
        assert torch.equal(losses[0], losses[1]), step
        plain_opt.step()
        plain_opt.zero_grad()
        pipeline.step()
    mine, reference_full = _full(piped, "ours"), _full(plain, "ours")
    for name in reference_full:
        assert torch.equal(mine[name], reference_full[name]), name
    pipeline.close()
    return compared


@pytest.mark.parametrize("pool_name", ["cuda_pool1", "cuda_pool2"])
def test_fractional_offload_on_cuda(pool_name: str, request: pytest.FixtureRequest) -> Any:
    pool: RankPool = request.getfixturevalue(pool_name)
    counts = pool.run(lane_fractional_offload)
    assert counts[0] > 0 and counts == [counts[0]] * pool.world_size
