"""fsdp: fully sharded data parallel for PyTorch, in the FlatParameter / wrapper-module design.

The public names are those of PyTorch's FSDP1 package, so a script switches by
changing its imports only::

    from fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
    from fsdp.wrap import ModuleWrapPolicy
"""

from fsdp.api import (
    BackwardPrefetch,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    OptimStateDictConfig,
    OptimStateKeyType,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from fsdp.flat_param.flat_param import FlatParameter
from fsdp.fully_sharded_data_parallel import FullyShardedDataParallel
# Beyond torch's names (so outside __all__, which lists exactly torch.distributed.fsdp's):
# the redirect for stacks that import torch's FSDP1 (docs/stacks.md) and the memory planner
# (docs/memory.md), imported when first used (see __getattr__).
from fsdp.torch_alias import redirect_torch_fsdp  # noqa: F401

__version__ = "0.1.0"

__all__ = [
    "FullyShardedDataParallel",
    "ShardingStrategy",
    "BackwardPrefetch",
    "MixedPrecision",
    "CPUOffload",
    "StateDictType",
    "StateDictConfig",
    "FullStateDictConfig",
    "ShardedStateDictConfig",
    "LocalStateDictConfig",
    "OptimStateDictConfig",
    "FullOptimStateDictConfig",
    "ShardedOptimStateDictConfig",
    "LocalOptimStateDictConfig",
    "StateDictSettings",
    "OptimStateKeyType",
    "FlatParameter",
]


def __getattr__(name: str) -> object:
    """The memory planner's names, imported on first use (``fsdp.estimate_memory``)."""
    if name in ("estimate_memory", "MemoryEstimate"):
        import fsdp.plan

        return getattr(fsdp.plan, name)
    raise AttributeError(f"module 'fsdp' has no attribute {name!r}")
