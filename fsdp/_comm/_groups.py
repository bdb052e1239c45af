"""The groups a unit communicates over, and the broadcast from their rank 0.

[Note: Hybrid sharding layout] (in ``fsdp/init/_process_group.py``, which resolves the groups
from the constructor's arguments) describes what the two groups are.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fsdp._comm import _collectives as comm
from fsdp._common import group_size

# torch FSDP1's ``process_group`` argument: one group, or (intra-node, inter-node) for hybrid
# strategies.
ProcessGroupType = Optional[Union[dist.ProcessGroup, tuple[dist.ProcessGroup, dist.ProcessGroup]]]

class ShardingGroups(NamedTuple):
    """The groups one unit communicates over.

    Attributes:
        shard: Parameters are sharded (all-gathered, reduce-scattered) over this group.
        replicate: Hybrid strategies only: sharded gradients are all-reduced over this group.
    """

    shard: dist.ProcessGroup
    replicate: Optional[dist.ProcessGroup]


def broadcast_from_group_rank0(tensor: torch.Tensor, groups: ShardingGroups) -> None:
    """Overwrites ``tensor`` with the value of group-rank 0 of the shard (then replicate) group.

    A DTensor (a tensor-parallel parameter or buffer) is overwritten through its local tensor:
    FSDP's groups are the data-parallel dimension, so each rank receives the piece of the
    rank at position 0 of its own tp coordinate, which holds the same piece. (c10d's broadcast
    has no DTensor rule: the DTensor itself raises ``NotImplementedError``.)
    """
    if isinstance(tensor, DTensor):
        tensor = tensor._local_tensor
    for group in (groups.shard, groups.replicate):
        if group is not None and group_size(group) > 1:
            comm.broadcast_from_rank0(tensor, group)
