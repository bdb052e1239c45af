"""Optimizer state dicts: the kinds of state values, and sharded (DTensor) values.

[Note: No ShardedTensor]
Sharded optimizer state dicts hold DTensors (Shard(0) on a 1-D mesh of the unit's shard group),
as our sharded model state dicts do, never ShardedTensors: torch deprecates ShardedTensor and
warns (FutureWarning) at every tensor method called on one, its own checkpoint planner's
included, so a state dict holding them fills a user's log with warnings about our internals
(torch FSDP1 gives ShardedTensors unless built with a device_mesh). Values, global shapes and
the chunking along dim 0 are the same as torch FSDP1's; torch.distributed.checkpoint stores
both alike, so checkpoints load across the two. ShardedTensors given to us to load (from torch
FSDP1) are read through their metadata and local shards only, which do not warn.

The chunking and the gather of a ShardedTensor's rows are the model state dict's
(``_sharded_values.py``, [Note: Sharded state dict values]); what is particular to optimizer
state (the value kinds, reading a ShardedTensor's global shape and dtype from its metadata,
checking a loaded ShardedTensor's layout) is here.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fsdp._common import p_assert
from fsdp.flat_param.flat_param import FlatParamHandle
from fsdp.state_dict._sharded_values import gather_chunked_rows, is_dtensor, is_sharded_tensor, shard_rows


def _is_pos_dim(value: Any) -> bool:
    """A plain (or DTensor) tensor with dimensions. Never asks a ShardedTensor, whose every
    tensor method warns that ShardedTensor is deprecated (see [Note: No ShardedTensor])."""
    return isinstance(value, torch.Tensor) and not is_sharded_tensor(value) and value.dim() > 0


def _is_zero_dim(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and not is_sharded_tensor(value) and value.dim() == 0


def _chunk(full: torch.Tensor, handle: FlatParamHandle) -> Any:
    """``full`` chunked along dim 0 over the handle's group like ``torch.chunk``: a DTensor
    holding this rank's chunk (empty on ranks past the last chunk)."""
    return shard_rows(full, handle.process_group, handle.rank, handle.world_size, full.device)


def _is_sharded_value(value: Any) -> bool:
    return is_dtensor(value) or is_sharded_tensor(value)


def _global_shape(value: Any) -> torch.Size:
    if is_sharded_tensor(value):
        return torch.Size(value.metadata().size)
    return value.shape


def _dtype_of(value: Any) -> torch.dtype:
    if is_sharded_tensor(value):
        return value.metadata().tensor_properties.dtype
    return value.dtype


def _gather_sharded(value: Any, where: str) -> torch.Tensor:
    """The full tensor of a DTensor or a dim-0 chunk-sharded ShardedTensor (a collective)."""
    if is_dtensor(value):
        return value.full_tensor()
    p_assert(is_sharded_tensor(value), f"{where}: not a sharded value")
    group = value._process_group
    ws = dist.get_world_size(group)
    metadata = value.metadata()
    size = torch.Size(metadata.size)
    metas = sorted(metadata.shards_metadata, key=lambda m: m.shard_offsets[0])
    expected = [len(c) for c in torch.chunk(torch.empty(size[0]), ws)] if size[0] else []
    if [m.shard_sizes[0] for m in metas] != expected or any(
        any(o != 0 for o in m.shard_offsets[1:]) for m in metas
    ):
        raise ValueError(
            f"fsdp: {where} is a ShardedTensor that is not chunked along dim 0 over its group "
            f"(shards {[(m.shard_offsets, m.shard_sizes) for m in metas]}); only the layout "
            f"FSDP's optim_state_dict produces can be loaded."
        )
    shards = value.local_shards()
    dtype = metadata.tensor_properties.dtype
    device = shards[0].tensor.device if shards else torch.device("cpu")
    if group is not None and dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    return gather_chunked_rows(shards[0].tensor if shards else None, size, dtype, device, group, ws)
