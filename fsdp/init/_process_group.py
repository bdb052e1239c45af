"""Resolving which process groups a unit shards over and replicates across.

[Note: Hybrid sharding layout]
HYBRID_SHARD and _HYBRID_SHARD_ZERO2 shard inside a *shard group* (typically one node) and
replicate across a *replicate group* (the ranks with the same position in every shard group).
The layout comes from, in order: an ``(intra, inter)`` process-group tuple; a 2-D DeviceMesh
(dim 0 replicates, dim 1 shards, as torch FSDP1 reads it); or torchrun's ``LOCAL_WORLD_SIZE``
(one shard group per node). Without any of these, torch FSDP1 on CPU silently trains
unsynchronized replicas; fsdp raises instead.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

from fsdp._comm._groups import ShardingGroups
from fsdp._common import group_backend, group_size
from fsdp.api import ShardingStrategy
from fsdp.flat_param._policy import HYBRID_STRATEGIES

# Hybrid groups derived from LOCAL_WORLD_SIZE, built once per (world size, local size).
_DERIVED_HYBRID_GROUPS: dict[tuple[int, int], "ShardingGroups"] = {}


def _check_initialized() -> dist.ProcessGroup:
    """The default process group, or the error that torch.distributed is not initialized."""
    world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    if world is None:
        raise RuntimeError(
            "fsdp: FullyShardedDataParallel needs an initialized default process group, and "
            "torch.distributed is not initialized. Call "
            "torch.distributed.init_process_group(backend='gloo') (CPU) or backend='nccl' (GPU) "
            "first, typically under `torchrun --nproc_per_node=N train.py`; or try the "
            "self-launching demo in a clone of the repository: python -m examples.train"
        )
    return world


def _check_group(group: Any, what: str) -> dist.ProcessGroup:
    """``group`` if it can serve as a process group, else a TypeError.

    As in torch FSDP1, any object with the group interface is accepted, not only a
    ``torch.distributed.ProcessGroup``: construction asks a group only for ``rank()`` and
    ``size()``, and stand-in group objects (torch's own tests build FSDP over one) shard as the
    size they report. Collectives need a real group, and fail there as torch's do.
    """
    if isinstance(group, dist.ProcessGroup):
        return group
    if not (callable(getattr(group, "rank", None)) and callable(getattr(group, "size", None))):
        raise TypeError(
            f"fsdp: {what} must be a torch.distributed.ProcessGroup (or an object with its rank() "
            f"and size() methods), got {type(group).__name__}; create one with "
            "torch.distributed.new_group(ranks)"
        )
    return group


def resolve_process_groups(
    process_group: Any, device_mesh: Any, strategy: ShardingStrategy
) -> ShardingGroups:
    """Returns the shard (and, for hybrid strategies, replicate) group, or raises a clear error.

    Only a layout that needs the default group (no group, no mesh) requires it to be
    initialized; explicit groups work without it, as in torch FSDP1 ([Note: Only the unit's
    group]).

    Raises:
        RuntimeError: No group or mesh given and no default process group is initialized.
        ValueError: A layout that does not fit the strategy or the world (both process_group
            and device_mesh; a tuple or 2-D mesh without a hybrid strategy; a hybrid strategy
            without a layout; groups whose sizes do not multiply to the world size).
        TypeError: Objects of the wrong type.
    """
    hybrid = strategy in HYBRID_STRATEGIES
    if process_group is not None and device_mesh is not None:
        raise ValueError(
            "fsdp: Cannot pass both process_group and device_mesh at the same time. Please "
            "just pass only one of them."
        )
    if process_group is None and device_mesh is None:
        _check_initialized()
    if device_mesh is not None:
        return _groups_from_mesh(device_mesh, hybrid, strategy)
    if isinstance(process_group, tuple):
        if not hybrid:
            raise ValueError(
                f"fsdp: process_group as an (intra, inter) tuple needs sharding_strategy="
                f"HYBRID_SHARD or _HYBRID_SHARD_ZERO2, got {strategy}. Pass one ProcessGroup "
                f"for {strategy.name}."
            )
        if len(process_group) != 2:
            raise ValueError(
                f"fsdp: process_group tuple must be (intra_node_group, inter_node_group), got "
                f"{len(process_group)} elements"
            )
        shard = _check_group(process_group[0], "process_group[0] (the intra-node group)")
        replicate = _check_group(process_group[1], "process_group[1] (the inter-node group)")
        _check_hybrid_sizes(shard, replicate, "process_group")
        return ShardingGroups(shard, replicate)
    if hybrid:
        if process_group is not None:
            raise ValueError(
                "fsdp: Expected process_group to be passed in as either None or "
                f"Tuple[dist.ProcessGroup, dist.ProcessGroup] but got {type(process_group)}: "
                f"{strategy.name} needs two groups: pass process_group=(intra_node_group, "
                f"inter_node_group) or a 2-D device_mesh, not a single ProcessGroup."
            )
        return _derived_hybrid_groups(strategy)
    if process_group is None:
        return ShardingGroups(_check_initialized(), None)
    return ShardingGroups(_check_group(process_group, "process_group"), None)


def _groups_from_mesh(device_mesh: Any, hybrid: bool, strategy: ShardingStrategy) -> ShardingGroups:
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"fsdp: device_mesh must be a DeviceMesh, got {type(device_mesh).__name__}")
    if hybrid:
        if device_mesh.ndim != 2:
            raise ValueError(
                f"fsdp: {strategy.name} needs a 2-D device_mesh (dim 0 replicates, dim 1 shards), "
                f"got a {device_mesh.ndim}-D mesh of shape {tuple(device_mesh.shape)}."
            )
        return ShardingGroups(device_mesh.get_group(mesh_dim=1), device_mesh.get_group(mesh_dim=0))
    if device_mesh.ndim != 1:
        raise ValueError(
            f"fsdp: {strategy.name} needs a 1-D device_mesh, got a {device_mesh.ndim}-D mesh of "
            f"shape {tuple(device_mesh.shape)}; use HYBRID_SHARD for 2-D meshes."
        )
    return ShardingGroups(device_mesh.get_group(), None)


def _check_hybrid_sizes(shard: dist.ProcessGroup, replicate: dist.ProcessGroup, what: str) -> None:
    if not dist.is_initialized():
        return  # nothing to compare with: the two groups are the whole world
    world = dist.get_world_size()
    intra, inter = group_size(shard), group_size(replicate)
    if intra * inter != world:
        raise ValueError(
            f"fsdp: {what}: the intra-node group has {intra} ranks and the inter-node group "
            f"{inter}, but {intra} x {inter} != world size {world}. Every rank must be in one "
            f"shard group and one replicate group that cover the world."
        )


def _derived_hybrid_groups(strategy: ShardingStrategy) -> ShardingGroups:
    world = dist.get_world_size()
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local is None:
        raise ValueError(
            f"fsdp: Wrapping with {strategy} requires explicit specification of process group "
            f"or device_mesh. Without them fsdp derives the node size from LOCAL_WORLD_SIZE, "
            f"which is not set (torchrun sets it). Pass device_mesh=init_device_mesh("
            f"device_type, (num_nodes, ranks_per_node)) or process_group=(intra_node_group, "
            f"inter_node_group)."
        )
    local_size = int(local)
    if local_size <= 0 or world % local_size != 0:
        raise ValueError(
            f"fsdp: LOCAL_WORLD_SIZE={local_size} does not divide the world size {world}; pass "
            f"an explicit device_mesh or (intra, inter) process_group."
        )
    key = (world, local_size)
    if key not in _DERIVED_HYBRID_GROUPS:
        from torch.distributed.device_mesh import init_device_mesh

        device_type = "cuda" if group_backend(None) == "nccl" else "cpu"
        mesh = init_device_mesh(device_type, (world // local_size, local_size))
        _DERIVED_HYBRID_GROUPS[key] = ShardingGroups(mesh.get_group(1), mesh.get_group(0))
    return _DERIVED_HYBRID_GROUPS[key]
