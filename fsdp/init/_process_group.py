"""Resolving which process group a unit shards over."""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist


def resolve_process_group(process_group: Any, device_mesh: Any) -> dist.ProcessGroup:
    """Returns the group to shard over, or raises a clear error.

    Raises:
        RuntimeError: If no default process group is initialized.
        NotImplementedError: For hybrid layouts (a tuple of groups, or a device mesh).
        TypeError: If ``process_group`` is not a ProcessGroup.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "fsdp: FullyShardedDataParallel needs an initialized default process group, and "
            "torch.distributed is not initialized. Call "
            "torch.distributed.init_process_group(backend='gloo') (CPU) or backend='nccl' (GPU) "
            "first, typically under `torchrun --nproc_per_node=N train.py`; or try the "
            "self-launching demo: python -m fsdp.examples.train"
        )
    if device_mesh is not None:
        raise NotImplementedError(
            "fsdp: device_mesh is not supported yet (hybrid sharding comes with the "
            "'process groups and HYBRID_SHARD' feature); pass process_group instead."
        )
    if isinstance(process_group, tuple):
        raise NotImplementedError(
            "fsdp: process_group as an (intra, inter) tuple (hybrid sharding) is not supported "
            "yet; pass a single ProcessGroup."
        )
    if process_group is None:
        return dist.group.WORLD  # type: ignore[return-value]
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            f"fsdp: process_group must be a torch.distributed.ProcessGroup or None, got "
            f"{type(process_group).__name__}"
        )
    return process_group


def group_rank_and_size(group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    """Returns ``(rank, world_size)`` of this process in ``group``."""
    return dist.get_rank(group), dist.get_world_size(group)
