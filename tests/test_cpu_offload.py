"""CPUOffload(offload_params=True): sharded parameters and gradients in host buffers.

The offload path runs on a CPU-only machine too ([Note: CPU offload] in
``fsdp/flat_param/_storage.py``): the local shard and each reduced gradient are host tensors of
their own, unshard copies the shard to the compute device, and the reduced gradient is copied
into a new host buffer, exactly as on an accelerator (only pinning needs one). So these tests
check that logic against plain training and fsdp without offload. torch FSDP1 refuses CPU
offload without an accelerator.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist

from tests._harness import RankPool
from tests._models import Block, global_batch, lm_loss, local_rows, make_toy
from tests.test_parity import _full_params


@contextlib.contextmanager
def _reduction_outputs() -> Iterator[list[torch.Tensor]]:
    """The tensors fsdp's gradient reductions wrote into, kept alive (so no address is reused)."""
    from fsdp._comm import _collectives as comm

    seen: list[torch.Tensor] = []
    names = ["reduce_scatter_flat", "all_reduce_sum"]
    originals = {name: getattr(comm, name) for name in names}

    def spy(name: str) -> Any:
        def recording(output: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            seen.append(output)  # the output (in-place: the tensor) is the first argument
            return originals[name](output, *args, **kwargs)

        return recording

    for name in names:
        setattr(comm, name, spy(name))
    try:
        yield seen
    finally:
        for name, original in originals.items():
            setattr(comm, name, original)


def _check_host_buffers(model: Any, reduced: list[torch.Tensor]) -> None:
    """Every sharded gradient is a host buffer of its own, not a reduction's output."""
    from fsdp import FullyShardedDataParallel as FSDP

    written = {t.untyped_storage().data_ptr() for t in reduced}
    for unit in FSDP.fsdp_modules(model):
        for handle in unit._fsdp_state.handles:
            grad = handle.flat_param.grad
            assert grad is not None and grad.device.type == "cpu", unit
            assert grad.untyped_storage().data_ptr() not in written, (
                f"{type(unit.module).__name__}: the reduced gradient was not copied to a host buffer"
            )


def offload(strategy: str, orig: bool) -> None:
    from fsdp import CPUOffload, FullyShardedDataParallel as FSDP, ShardingStrategy
    from fsdp.wrap import ModuleWrapPolicy

    rank, ws = dist.get_rank(), dist.get_world_size()
    kwargs = dict(auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=ShardingStrategy[strategy], use_orig_params=orig)
    ref, plain, ours = make_toy(), FSDP(make_toy(), **kwargs), FSDP(make_toy(), cpu_offload=CPUOffload(offload_params=True), **kwargs)
    models = [ref, plain, ours]
    opts = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in models]
    for step in range(3):
        tokens, targets = global_batch(step, ws)
        for i, (model, opt) in enumerate(zip(models, opts)):
            x, y = (tokens, targets) if i == 0 else (local_rows(tokens, rank, ws), local_rows(targets, rank, ws))
            with _reduction_outputs() as reduced:
                lm_loss(model(x), y).backward()
            if model is ours:
                _check_host_buffers(ours, reduced)
            model_norm = model.clip_grad_norm_(1.0) if i else torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            assert torch.isfinite(model_norm)
            opt.step()
            opt.zero_grad()
    for unit in FSDP.fsdp_modules(ours):
        for handle in unit._fsdp_state.handles:
            assert handle.flat_param.device.type == "cpu"
            assert handle.storage.offload_params
    mine, without, ref_full = _full_params(ours, FSDP), _full_params(plain, FSDP), dict(ref.named_parameters())
    for name in mine:
        assert torch.equal(mine[name], without[name]), name
        torch.testing.assert_close(mine[name], ref_full[name].detach(), rtol=5e-5, atol=5e-6, msg=name)


@pytest.mark.parametrize("orig", [False, True])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_cpu_offload_on_cpu(pool2: RankPool, strategy: str, orig: bool) -> None:
    pool2.run(offload, strategy, orig)


def test_cpu_offload_on_one_rank(pool1: RankPool) -> None:
    """One rank: offload takes the sharded path ([Note: CPU offload on one rank])."""
    pool1.run(offload, "FULL_SHARD", False)


def grad_accumulation_with_offload() -> None:
    """Two backwards without zero_grad: the second reduced gradient adds to the first's host buffer."""
    from fsdp import CPUOffload, FullyShardedDataParallel as FSDP
    from fsdp.wrap import ModuleWrapPolicy

    rank, ws = dist.get_rank(), dist.get_world_size()
    kwargs: dict[str, Any] = dict(auto_wrap_policy=ModuleWrapPolicy({Block}))
    plain, ours = FSDP(make_toy(), **kwargs), FSDP(make_toy(), cpu_offload=CPUOffload(offload_params=True), **kwargs)
    for step in range(2):
        tokens, targets = global_batch(step, ws)
        for model in (plain, ours):
            lm_loss(model(local_rows(tokens, rank, ws)), local_rows(targets, rank, ws)).backward()
    for a, b in zip(FSDP.fsdp_modules(plain), FSDP.fsdp_modules(ours)):
        assert torch.equal(a._fsdp_state.handle.flat_param.grad, b._fsdp_state.handle.flat_param.grad)


def test_cpu_offload_grad_accumulation(pool2: RankPool) -> None:
    pool2.run(grad_accumulation_with_offload)


def torch_refuses_offload_on_cpu() -> None:
    from torch.distributed.fsdp import CPUOffload as TorchOffload
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    rank, ws = dist.get_rank(), dist.get_world_size()
    tokens, targets = global_batch(0, ws)
    theirs = TorchFSDP(make_toy(), cpu_offload=TorchOffload(offload_params=True), device_id=torch.device("cpu"))
    with pytest.raises(RuntimeError, match=TORCH_OFFLOAD_ON_CPU):
        lm_loss(theirs(local_rows(tokens, rank, ws)), local_rows(targets, rank, ws)).backward()


# torch FSDP1 pins the offloaded shard at lazy init, which needs an accelerator.
TORCH_OFFLOAD_ON_CPU = "Cannot access accelerator device when none is available"


def test_torch_refuses_offload_on_cpu(pool2: RankPool) -> None:
    pool2.run(torch_refuses_offload_on_cpu)
