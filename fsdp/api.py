"""Public enums and configuration dataclasses, named and shaped as in PyTorch FSDP1.

These are plain data: no behaviour lives here. Each mirrors the torch FSDP1 name, fields and
defaults so that a training script switches to ``fsdp`` by changing its imports only.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto
from typing import Callable, Optional, Sequence, Type

import torch
from torch import nn

__all__ = [
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
]


class ShardingStrategy(Enum):
    """How parameters, gradients and optimizer state are split across ranks.

    - ``FULL_SHARD``: parameters are sharded; the unsharded parameter is freed after forward and
      gathered again for backward (ZeRO-3).
    - ``SHARD_GRAD_OP``: the unsharded parameter is kept from forward to the end of backward
      (ZeRO-2).
    - ``NO_SHARD``: nothing is sharded; gradients are all-reduced (like DDP).
    - ``HYBRID_SHARD`` / ``_HYBRID_SHARD_ZERO2``: FULL_SHARD / SHARD_GRAD_OP inside a group,
      replication across groups.
    """

    FULL_SHARD = auto()
    SHARD_GRAD_OP = auto()
    NO_SHARD = auto()
    HYBRID_SHARD = auto()
    _HYBRID_SHARD_ZERO2 = auto()


class BackwardPrefetch(Enum):
    """When to issue the next unit's all-gather during backward."""

    BACKWARD_PRE = auto()
    BACKWARD_POST = auto()


@dataclass
class MixedPrecision:
    """Mixed-precision settings (same fields and defaults as torch FSDP1)."""

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    buffer_dtype: Optional[torch.dtype] = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True
    _module_classes_to_ignore: Sequence[Type[nn.Module]] = (nn.modules.batchnorm._BatchNorm,)


@dataclass
class CPUOffload:
    """Whether sharded parameters (and their gradients) live on CPU between uses.

    ``CPUOffload(offload_params=True)`` offloads every unit, as torch FSDP1. Two optional fields
    (fsdp's, default None: torch's behaviour) offload only some units; the others keep their
    shard, gradient and optimizer state on the device (see [Note: Fractional offload] in
    ``fsdp/flat_param/_policy.py``):

    - ``fraction``: offload about this fraction (0 to 1) of the parameters: the units the
      backward reaches first (the last in the model's module order), up to the first that
      reaches the fraction.
    - ``offload_module``: offload the units whose wrapped module it returns True for.

    Both are resolved once, when the root is built, over the units that constructor plans;
    ``fsdp.estimate_memory`` resolves the same.
    """

    offload_params: bool = False
    fraction: Optional[float] = None
    offload_module: Optional[Callable[[nn.Module], bool]] = None

    def __post_init__(self) -> None:
        if self.fraction is None and self.offload_module is None:
            return
        if not self.offload_params:
            raise ValueError(
                f"fsdp: CPUOffload(fraction=..., offload_module=...) chooses which units offload "
                f"their parameters, but offload_params is False (got {self!r}). Pass "
                f"CPUOffload(offload_params=True, ...)."
            )
        if self.fraction is not None and self.offload_module is not None:
            raise ValueError(
                "fsdp: CPUOffload takes fraction= or offload_module=, not both: pick the units "
                "by the share of parameters or by a predicate on the unit's module."
            )
        if self.fraction is not None and (
            isinstance(self.fraction, bool) or not isinstance(self.fraction, (int, float)) or not 0.0 <= self.fraction <= 1.0
        ):
            raise ValueError(f"fsdp: CPUOffload fraction must be a number from 0 to 1, got {self.fraction!r}")
        if self.offload_module is not None and not callable(self.offload_module):
            raise TypeError(
                f"fsdp: CPUOffload offload_module must be a callable taking the unit's module and "
                f"returning a bool, got {self.offload_module!r}"
            )

    @property
    def selects_units(self) -> bool:
        """Whether only some units offload (``fraction`` or ``offload_module`` given)."""
        return self.offload_params and (self.fraction is not None or self.offload_module is not None)


class StateDictType(Enum):
    """Which kind of state dict ``state_dict()`` / ``load_state_dict()`` produce and take."""

    FULL_STATE_DICT = auto()
    LOCAL_STATE_DICT = auto()
    SHARDED_STATE_DICT = auto()


@dataclass
class StateDictConfig:
    """Base of the model state-dict configs."""

    offload_to_cpu: bool = False


@dataclass
class FullStateDictConfig(StateDictConfig):
    """Config for ``StateDictType.FULL_STATE_DICT``."""

    rank0_only: bool = False


@dataclass
class LocalStateDictConfig(StateDictConfig):
    """Config for ``StateDictType.LOCAL_STATE_DICT``."""


@dataclass
class ShardedStateDictConfig(StateDictConfig):
    """Config for ``StateDictType.SHARDED_STATE_DICT``."""

    _use_dtensor: bool = False


@dataclass
class OptimStateDictConfig:
    """Base of the optimizer state-dict configs."""

    offload_to_cpu: bool = True


@dataclass
class FullOptimStateDictConfig(OptimStateDictConfig):
    """Config for full optimizer state dicts."""

    rank0_only: bool = False


@dataclass
class LocalOptimStateDictConfig(OptimStateDictConfig):
    """Config for local optimizer state dicts."""

    offload_to_cpu: bool = False


@dataclass
class ShardedOptimStateDictConfig(OptimStateDictConfig):
    """Config for sharded optimizer state dicts."""

    _use_dtensor: bool = False


@dataclass
class StateDictSettings:
    """What ``get_state_dict_type`` / ``set_state_dict_type`` return."""

    state_dict_type: StateDictType
    state_dict_config: StateDictConfig
    optim_state_dict_config: OptimStateDictConfig


class OptimStateKeyType(Enum):
    """How optimizer state is keyed: by parameter name or by integer parameter ID."""

    PARAM_NAME = auto()
    PARAM_ID = auto()
