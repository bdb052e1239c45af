"""CPUOffload(offload_params=True): sharded parameters and gradients on CPU, optimizer on CPU.

On a CPU-only machine the compute device is the CPU, so offloading is the ordinary layout; it
must work (torch FSDP1 refuses CPU offload without an accelerator). Results equal
single-process training and fsdp without offload.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests._harness import RankPool
from tests._models import Block, global_batch, lm_loss, local_rows, make_toy
from tests.test_parity import _full_params


def offload(strategy: str, orig: bool) -> None:
    from fsdp import CPUOffload, FullyShardedDataParallel as FSDP, ShardingStrategy
    from fsdp.wrap import ModuleWrapPolicy
    from torch.distributed.fsdp import CPUOffload as TorchOffload
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    rank, ws = dist.get_rank(), dist.get_world_size()
    kwargs = dict(auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=ShardingStrategy[strategy], use_orig_params=orig)
    ref, plain, ours = make_toy(), FSDP(make_toy(), **kwargs), FSDP(make_toy(), cpu_offload=CPUOffload(offload_params=True), **kwargs)
    models = [ref, plain, ours]
    opts = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in models]
    for step in range(3):
        tokens, targets = global_batch(step, ws)
        for i, (model, opt) in enumerate(zip(models, opts)):
            x, y = (tokens, targets) if i == 0 else (local_rows(tokens, rank, ws), local_rows(targets, rank, ws))
            lm_loss(model(x), y).backward()
            model_norm = model.clip_grad_norm_(1.0) if i else torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            assert torch.isfinite(model_norm)
            opt.step()
            opt.zero_grad()
    for unit in FSDP.fsdp_modules(ours):
        for handle in unit._fsdp_state.handles:
            assert handle.flat_param.device.type == "cpu"
    mine, without, ref_full = _full_params(ours, FSDP), _full_params(plain, FSDP), dict(ref.named_parameters())
    for name in mine:
        assert torch.equal(mine[name], without[name]), name
        torch.testing.assert_close(mine[name], ref_full[name].detach(), rtol=5e-5, atol=5e-6, msg=name)
    # torch FSDP1 cannot offload on a CPU-only machine.
    with pytest.raises(Exception):
        theirs = TorchFSDP(make_toy(), cpu_offload=TorchOffload(offload_params=True), device_id=torch.device("cpu"))
        lm_loss(theirs(local_rows(tokens, rank, ws)), local_rows(targets, rank, ws)).backward()


@pytest.mark.parametrize("orig", [False, True])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_cpu_offload_on_cpu(pool2: RankPool, strategy: str, orig: bool) -> None:
    pool2.run(offload, strategy, orig)
