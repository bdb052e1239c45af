"""Object collectives and optimizer-state values on the unit's compute device, not the current one.

A rank function shared by the CPU test (``tests/test_object_collectives_device.py``, gloo) and
the CUDA lane (``tests/test_cuda_lane.py``, NCCL at world size 1): the model is wrapped with an
explicit ``device_id`` and, where the machine has a second GPU, the current CUDA device is set
to another one (the README's user never calls ``torch.cuda.set_device``). It trains, then saves
and loads full, rank-0-only and sharded optimizer state dicts; every object collective fsdp runs
must stage on ``device_id`` ([Note: Object collectives' device] in ``fsdp/_comm/_collectives.py``),
every tensor handed to a collective on a CUDA device must be on it, and fsdp's own code must
not ask for ``torch.cuda.current_device()`` (patched to raise when fsdp calls it directly).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import ShardedOptimStateDictConfig as TorchShardedOptimConfig
from torch.distributed.fsdp import StateDictType as TorchStateDictType
from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchModuleWrapPolicy

import fsdp._comm._collectives as collectives
from fsdp import FullyShardedDataParallel as FSDP
from fsdp.api import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictType,
)
from fsdp.wrap import ModuleWrapPolicy
from tests._models import Block, global_batch, lm_loss, local_rows, make_toy

_FSDP_DIR = os.path.dirname(sys.modules["fsdp"].__file__ or "")
_COLLECTIVES = ("all_gather", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "gather")


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


@contextlib.contextmanager
def _watched(device: torch.device, staged: list[torch.device], seen: list[torch.device]) -> Iterator[None]:
    """Records the device of every object collective (``staged``) and of every CUDA tensor handed
    to a collective (``seen``); ``torch.cuda.current_device()`` called from fsdp's code raises."""
    saved: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, new: Any) -> None:
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, new)

    real_object_device = collectives._object_device

    def object_device(dev: torch.device) -> Any:
        staged.append(dev)
        return real_object_device(dev)

    patch(collectives, "_object_device", object_device)
    for name in _COLLECTIVES:
        for owner in (dist, c10d):
            real = getattr(owner, name)

            def recording(*args: Any, _real: Callable[..., Any] = real, **kwargs: Any) -> Any:
                for t in _tensors(list(args) + list(kwargs.values())):
                    if t.is_cuda:
                        seen.append(t.device)
                return _real(*args, **kwargs)

            patch(owner, name, recording)
    if torch.cuda.is_available():
        real_current = torch.cuda.current_device

        def current_device() -> int:
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(_FSDP_DIR):
                raise RuntimeError(f"fsdp asked for torch.cuda.current_device() ({caller}); use the unit's device {device}")
            return real_current()

        patch(torch.cuda, "current_device", current_device)
    try:
        yield
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


def _optimizer_state(opt: torch.optim.Optimizer) -> list[dict[str, torch.Tensor]]:
    return [{k: torch.as_tensor(v).cpu().clone() for k, v in opt.state[p].items()} for group in opt.param_groups for p in group["params"]]


def _one_shard(value: Any) -> Any:
    """A tensor with dims as a ShardedTensor whose one shard (world size 1) is all of it."""
    if isinstance(value, ShardedTensor) or not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

    return init_from_local_shards([Shard.from_tensor_and_offsets(value, [0] * value.dim(), 0)], *value.shape)


def _assert_same_state(got: list[dict[str, torch.Tensor]], expected: list[dict[str, torch.Tensor]], what: str) -> None:
    assert len(got) == len(expected), what
    for mine, theirs in zip(got, expected):
        assert sorted(mine) == sorted(theirs), what
        for key in mine:
            assert torch.equal(mine[key], theirs[key]), f"{what}: '{key}' differs"


def check_object_collectives_on(device_name: str) -> int:
    """Runs the scenario (module docstring) on ``device_name`` ("cpu" or "cuda:0"). Every
    optimizer state dict round trip (full, rank0_only, sharded) loads back into a fresh optimizer
    the original optimizer's state exactly, and torch FSDP1's sharded optimizer state dict (its
    ShardedTensors, trained the same way) loads the same state. Returns the number of object collectives run."""
    device = torch.device(device_name)
    rank, ws = dist.get_rank(), dist.get_world_size()
    staged: list[torch.device] = []
    seen: list[torch.device] = []
    if device.type == "cuda" and torch.cuda.device_count() > 1:
        torch.cuda.set_device(torch.cuda.device_count() - 1)  # not device_id
    try:
        with _watched(device, staged, seen):
            for uop in (False, True):
                model = FSDP(make_toy(), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=device, use_orig_params=uop)
                theirs = TorchFSDP(
                    make_toy(), auto_wrap_policy=TorchModuleWrapPolicy({Block}), device_id=device, use_orig_params=uop
                )
                opt = torch.optim.AdamW(model.parameters(), lr=0.01)
                their_opt = torch.optim.AdamW(theirs.parameters(), lr=0.01)
                for step in range(2):
                    tokens, targets = global_batch(step, ws)
                    x, y = (local_rows(t, rank, ws).to(device) for t in (tokens, targets))
                    for m, o in ((model, opt), (theirs, their_opt)):
                        lm_loss(m(x), y).backward()
                        o.step()
                        o.zero_grad()
                expected = _optimizer_state(opt)
                # torch FSDP1's sharded optimizer state dict holds ShardedTensors: loading it
                # gathers them (fsdp/state_dict/_values.py) on the compute device.
                with TorchFSDP.state_dict_type(
                    theirs, TorchStateDictType.SHARDED_STATE_DICT, optim_state_dict_config=TorchShardedOptimConfig()
                ):
                    their_osd = TorchFSDP.optim_state_dict(theirs, their_opt)
                if ws == 1:  # NO_SHARD: plain tensors; the same values as one-shard ShardedTensors
                    their_osd["state"] = {k: {n: _one_shard(v) for n, v in st.items()} for k, st in their_osd["state"].items()}
                assert any(isinstance(v, ShardedTensor) for st in their_osd["state"].values() for v in st.values())
                with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(), ShardedOptimStateDictConfig()):
                    from_torch = torch.optim.AdamW(model.parameters(), lr=0.01)
                    from_torch.load_state_dict(FSDP.optim_state_dict_to_load(model, from_torch, their_osd))
                _assert_same_state(_optimizer_state(from_torch), expected, f"use_orig_params={uop}: torch FSDP1's sharded state")
                configs = [
                    (StateDictType.FULL_STATE_DICT, FullStateDictConfig(), FullOptimStateDictConfig(rank0_only=False)),
                    (StateDictType.FULL_STATE_DICT, FullStateDictConfig(), FullOptimStateDictConfig(rank0_only=True)),
                    (StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(), ShardedOptimStateDictConfig()),
                ]
                for sd_type, sd_config, osd_config in configs:
                    what = f"use_orig_params={uop} {sd_type.name} {osd_config}"
                    with FSDP.state_dict_type(model, sd_type, sd_config, osd_config):
                        osd = FSDP.optim_state_dict(model, opt)
                        fresh = torch.optim.AdamW(model.parameters(), lr=0.01)
                        fresh.load_state_dict(FSDP.optim_state_dict_to_load(model, fresh, osd))
                    _assert_same_state(_optimizer_state(fresh), expected, what)
    finally:
        if device.type == "cuda":
            torch.cuda.set_device(device)
    assert staged, "no object collective ran"
    assert all(d == device for d in staged), f"object collectives staged on {sorted(set(map(str, staged)))}, not {device}"
    assert all(d == device for d in seen), f"collective tensors on {sorted(set(map(str, seen)))}, not {device}"
    return len(staged)
