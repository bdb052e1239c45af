"""``sync_module_states``: make every rank start from rank 0's parameters and buffers.

Parameters are broadcast as each unit's flat tensor, before sharding (one collective per unit,
no extra memory; see FlatParamHandle). Buffers are broadcast here. For hybrid layouts the
broadcast goes over the shard group, then the replicate group, so every replica receives the
values of the rank at mesh position (0, 0). Unlike torch FSDP1 this works on CPU.
Tensor-parallel (DTensor) parameters and buffers are broadcast through their local tensors
(``broadcast_from_group_rank0``): FSDP's groups span the data-parallel dimension, so every rank
receives the piece its tp coordinate holds at dp position 0.
"""

from __future__ import annotations

import torch
from torch import nn

from fsdp._comm._groups import ShardingGroups, broadcast_from_group_rank0
from fsdp._comm._phase import during


@during("sync_module_states at construction")
def sync_buffers(modules: list[nn.Module], groups: ShardingGroups) -> None:
    """Broadcasts the own buffers of ``modules`` from rank 0 (in place)."""
    with torch.no_grad():
        for module in modules:
            for buf in module._buffers.values():
                if buf is not None:
                    broadcast_from_group_rank0(buf, groups)
