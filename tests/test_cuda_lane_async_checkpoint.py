"""The CUDA lane for asynchronous flat-shard saves (FSDP_TEST_DEVICE=cuda).

The shards live on the GPU: ``async_save_sharded`` copies them into pinned host staging buffers
(asynchronous device-to-host copies, waited for before the call returns), and the background
write reads only those. Checked on both lane pools: the optimizer steps on the GPU while the
write is held open, and the checkpoint loads (into a fresh GPU model) the values at save time
bit for bit; every staging buffer is a pinned host tensor, and a second save reuses them.
"""

from __future__ import annotations

import os
import tempfile
import threading
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.conftest import test_device

if test_device() != "cuda" or not torch.cuda.is_available():
    pytest.skip("CUDA lane off: FSDP_TEST_DEVICE=cuda runs it on an NVIDIA GPU", allow_module_level=True)

from tests.test_async_checkpoint import GatedWriter  # noqa: E402
from tests.test_cuda_lane import _batch, _full, _loss, _wrap  # noqa: E402
from tests._models import make_toy  # noqa: E402


def _step(model: Any, optim: torch.optim.Optimizer, step: int) -> None:
    _, _, x, y = _batch(step)
    _loss(model, x, y).backward()
    optim.step()
    optim.zero_grad()


def lane_async_save() -> None:
    from fsdp.checkpoint import _ASYNC, async_save_sharded, load_sharded

    directory = tempfile.mkdtemp(prefix="fsdp_lane_async_") if dist.get_rank() == 0 else ""
    holder = [directory]
    dist.broadcast_object_list(holder)
    directory = holder[0]
    model = _wrap("ours", make_toy(seed=5), {})
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        _step(model, optim, step)
    expected = _full(model, "ours")
    gate = threading.Event()
    path = os.path.join(directory, "ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        future = async_save_sharded(model, optim, checkpoint_id=path, storage_writer=GatedWriter(path, gate))
        for step in range(2, 4):
            _step(model, optim, step)  # GPU work while the write waits
        assert not future.done()
        gate.set()
        future.result(timeout=120)
        buffers = list(_ASYNC.staging._buffers.values())
        assert buffers and all(b.device.type == "cpu" and b.is_pinned() for b in buffers)
        ptrs = sorted(b.data_ptr() for b in buffers)
        async_save_sharded(model, optim, checkpoint_id=os.path.join(directory, "again")).result(timeout=120)
        assert sorted(b.data_ptr() for b in _ASYNC.staging._buffers.values()) == ptrs, "buffers reused"
        target = _wrap("ours", make_toy(seed=9), {})
        target_optim = torch.optim.AdamW(target.parameters(), lr=1e-2)
        _step(target, target_optim, 0)
        load_sharded(target, target_optim, checkpoint_id=path)
    loaded = _full(target, "ours")
    for name, value in expected.items():
        assert torch.equal(loaded[name], value), name


@pytest.mark.parametrize("pool_name", ["cuda_pool1", "cuda_pool2"])
def test_async_save_from_gpu_shards(pool_name: str, request: pytest.FixtureRequest) -> None:
    request.getfixturevalue(pool_name).run(lane_async_save, _timeout=300)
