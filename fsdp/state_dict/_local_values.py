"""LOCAL_STATE_DICT values: each unit's local flat shard, in torch FSDP1's exact format.

[Note: Local state dict format]
Torch FSDP1 stores one entry per unit, ``<unit prefix>_flat_param``: a 1-D ShardedTensor of the
unit's *unpadded* flat parameter (``unpadded_unsharded_numel`` elements), whose only local shard
is a view of this rank's part of the local flat shard without its padding (offset
``rank * sharded_numel``; a rank that holds only padding has no local shard). With
use_orig_params "unpadded" still counts the alignment padding between parameters and up to a
multiple of the world size (see [Note: Aligned flat parameter layout] in
``flat_param/_sharding.py``), so every rank's part is a whole shard, padding values included.
We give exactly that, with the same layout, so LOCAL checkpoints move between torch FSDP1 and
fsdp (same wrapping and world size), with or without use_orig_params.
The ShardedTensor is built from metadata we compute (every rank's offset and size follow from
the layout), so saving needs no communication, and torch's deprecation warnings about
ShardedTensor are hidden around our own construction: they concern our internals, not the
user's code. Loading checks the ShardedTensor's metadata against this unit's layout (total
size, every shard's offset and size) and refuses another world size or wrapping, naming the
entry, before anything changes.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator, Optional

import torch

from fsdp.flat_param.flat_param import FlatParamHandle

__all__ = ["quiet_sharded_tensor", "local_value", "check_local_value", "load_local_value"]


@contextlib.contextmanager
def quiet_sharded_tensor() -> Iterator[None]:
    """Hides torch's ShardedTensor deprecation warnings raised by our own construction."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*ShardedTensor.*", category=FutureWarning)
        warnings.filterwarnings("ignore", message=".*ShardedTensor.*", category=DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*_get_pg_default_device.*")
        yield


def _layout(unpadded_numel: int, sharded_numel: int, world_size: int) -> list[tuple[int, int]]:
    """``(offset, numel)`` of every rank's unpadded part, in rank order (0-numel parts included)."""
    parts = []
    for rank in range(world_size):
        offset = rank * sharded_numel
        parts.append((offset, max(0, min(sharded_numel, unpadded_numel - offset))))
    return parts


def local_value(handle: FlatParamHandle, offload: bool) -> Any:
    """The unit's LOCAL_STATE_DICT value (see [Note: Local state dict format]); no copy."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    local_shard = handle._local_shard.detach()
    parts = _layout(handle.unpadded_unsharded_numel, handle.sharded_numel, handle.world_size)
    device = local_shard.device
    shards_metadata = [
        ShardMetadata([offset], [numel], f"rank:{rank}/{device}")
        for rank, (offset, numel) in enumerate(parts)
        if numel > 0
    ]
    offset, numel = parts[handle.rank]
    local_shards = []
    if numel > 0:
        local_shards.append(Shard(local_shard[:numel].view(numel), shards_metadata[handle.rank]))
    properties = TensorProperties.create_from_tensor(local_shard[:0])
    metadata = ShardedTensorMetadata(
        shards_metadata, torch.Size([handle.unpadded_unsharded_numel]), properties
    )
    with quiet_sharded_tensor():
        value = ShardedTensor._init_from_local_shards_and_global_metadata(
            local_shards, metadata, process_group=handle.process_group
        )
        if offload and device.type != "cpu":
            value = value.cpu()
    return value


def check_local_value(key: str, unit_name: str, value: Any, handle: FlatParamHandle) -> Optional[str]:
    """Why ``value`` cannot be loaded as the local flat shard ``key`` (None: it can); no communication."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    current = (
        f"this model (its unit '{unit_name}' holds {handle.unpadded_unsharded_numel} elements in "
        f"shards of {handle.sharded_numel} over {handle.world_size} rank(s))"
    )
    remedy = (
        "A local state dict only loads at the same world size and wrapping; use "
        "StateDictType.SHARDED_STATE_DICT to change world size or wrapping."
    )
    if not isinstance(value, ShardedTensor):
        return (
            f"fsdp: the LOCAL_STATE_DICT entry '{key}' must be a ShardedTensor (as state_dict() "
            f"gives under LOCAL_STATE_DICT, here and in torch FSDP1), got {type(value).__name__}."
        )
    metadata = value.metadata()
    saved = sorted((int(m.shard_offsets[0]), int(m.shard_sizes[0])) for m in metadata.shards_metadata)
    expected = [
        part
        for part in _layout(handle.unpadded_unsharded_numel, handle.sharded_numel, handle.world_size)
        if part[1] > 0
    ]
    if tuple(metadata.size) != (handle.unpadded_unsharded_numel,) or saved != expected:
        return (
            f"fsdp: the LOCAL_STATE_DICT entry '{key}' was saved with a different layout "
            f"({int(metadata.size.numel())} elements in {len(saved)} shard(s) of sizes "
            f"{[n for _, n in saved]} at offsets {[o for o, _ in saved]}) than {current}, whose "
            f"shards have sizes {[n for _, n in expected]} at offsets {[o for o, _ in expected]}. "
            f"{remedy}"
        )
    offset, numel = _layout(handle.unpadded_unsharded_numel, handle.sharded_numel, handle.world_size)[handle.rank]
    shards = value.local_shards()
    local_ok = (not shards and numel == 0) or (
        len(shards) == 1
        and int(shards[0].metadata.shard_offsets[0]) == offset
        and shards[0].tensor.numel() == numel
    )
    if not local_ok:
        held = [(int(s.metadata.shard_offsets[0]), s.tensor.numel()) for s in shards]
        return (
            f"fsdp: the LOCAL_STATE_DICT entry '{key}' holds the part(s) {held} (offset, numel) "
            f"on this rank, but this rank (group rank {handle.rank}) holds ({offset}, {numel}) of "
            f"{current}. Load each rank's own local state dict. {remedy}"
        )
    return None


def load_local_value(handle: FlatParamHandle, value: Any) -> None:
    """Copies a checked local value into the handle's local shard (its padding stays as is)."""
    shards = value.local_shards()
    if shards:
        local = shards[0].tensor.reshape(-1)
        handle._local_shard[: local.numel()].copy_(local)
