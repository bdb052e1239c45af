"""``sync_module_states``: make every rank start from rank 0's parameters and buffers.

Parameters are broadcast as each unit's flat tensor, before sharding (one collective per unit,
no extra memory; see FlatParamHandle). Buffers are broadcast here. For hybrid layouts the
broadcast goes over the shard group, then the replicate group, so every replica receives the
values of the rank at mesh position (0, 0). Unlike torch FSDP1 this works on CPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from fsdp.init._process_group import ShardingGroups
from fsdp._comm import _collectives as comm


def broadcast_from_group_rank0(tensor: torch.Tensor, groups: ShardingGroups) -> None:
    """Overwrites ``tensor`` with the value of group-rank 0 of the shard (then replicate) group."""
    for group in (groups.shard, groups.replicate):
        if group is not None and dist.get_world_size(group) > 1:
            comm.broadcast_from_rank0(tensor, group)


def sync_buffers(modules: list[nn.Module], groups: ShardingGroups) -> None:
    """Broadcasts the own buffers of ``modules`` from rank 0 (in place)."""
    with torch.no_grad():
        for module in modules:
            for buf in module._buffers.values():
                if buf is not None:
                    broadcast_from_group_rank0(buf, groups)
