"""``state_dict_type`` bookkeeping: which kind of state dict each unit produces and takes."""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterator, Optional, Sequence, cast

from torch import nn

from fsdp.api import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from fsdp.runtime._state import fsdp_modules, unit_state
from fsdp.state_dict._values import refuse_local_with_mesh

_CONFIG_TYPES: dict[StateDictType, tuple[type, type]] = {
    StateDictType.FULL_STATE_DICT: (FullStateDictConfig, FullOptimStateDictConfig),
    StateDictType.SHARDED_STATE_DICT: (ShardedStateDictConfig, ShardedOptimStateDictConfig),
    StateDictType.LOCAL_STATE_DICT: (LocalStateDictConfig, LocalOptimStateDictConfig),
}


# Torch FSDP1's deprecation of its state-dict setters (FSDP.set_state_dict_type and the
# FSDP.state_dict_type context, which sets twice: on entry and on exit), word for word.
_SETTER_DEPRECATION = (
    "FSDP.state_dict_type() and FSDP.set_state_dict_type() are being "
    "deprecated. Please use APIs, get_state_dict() and set_state_dict(), "
    "which can support different parallelisms, FSDP1, FSDP2, DDP. "
    "API doc: https://pytorch.org/docs/stable/distributed.checkpoint.html"
    "#torch.distributed.checkpoint.state_dict.get_state_dict ."
    "Tutorial: https://pytorch.org/tutorials/recipes/distributed_checkpoint_recipe.html ."
)


def warn_setter_deprecated(stacklevel: int) -> None:
    """Torch FSDP1's ``FutureWarning`` for each setting of the state-dict type.

    ``stacklevel`` counts from the caller of this function (1: that caller's line).
    ``torch.distributed.checkpoint.state_dict`` silences it, as it does torch's.
    """
    warnings.warn(_SETTER_DEPRECATION, FutureWarning, stacklevel=stacklevel + 1)


def default_settings() -> StateDictSettings:
    """The settings a new unit starts with (FULL_STATE_DICT, default configs), as in torch."""
    return StateDictSettings(
        StateDictType.FULL_STATE_DICT, FullStateDictConfig(), FullOptimStateDictConfig()
    )


def _check_config(kind: str, config: object, expected: type, state_dict_type: StateDictType) -> None:
    if type(config) is not expected:
        raise RuntimeError(  # torch FSDP1's type for this mistake
            f"fsdp: Expected {kind} of type {expected} but got {type(config)}: {kind} must be "
            f"a {expected.__name__} for {state_dict_type}, got {type(config).__name__}. Pass "
            f"{expected.__name__}(...) or None for the default."
        )


def set_state_dict_type(
    modules: Sequence[nn.Module],
    state_dict_type: StateDictType,
    state_dict_config: Optional[StateDictConfig],
    optim_state_dict_config: Optional[OptimStateDictConfig],
) -> StateDictSettings:
    """Sets the settings on every unit in ``modules``; returns the previous (common) settings."""
    if not isinstance(state_dict_type, StateDictType):
        raise TypeError(f"fsdp: state_dict_type must be a StateDictType, got {state_dict_type!r}")
    config_type, optim_config_type = _CONFIG_TYPES[state_dict_type]
    if state_dict_config is None:
        state_dict_config = config_type()
    if optim_state_dict_config is None:
        optim_state_dict_config = optim_config_type()
    _check_config("state_dict_config", state_dict_config, config_type, state_dict_type)
    _check_config(
        "optim_state_dict_config", optim_state_dict_config, optim_config_type, state_dict_type
    )
    previous = get_state_dict_type(modules)
    new = StateDictSettings(state_dict_type, state_dict_config, optim_state_dict_config)
    for module in modules:
        # nn.Module.__setattr__ is typed to take tensors and modules; a unit keeps its settings here.
        module._state_dict_settings = new  # type: ignore[assignment]
    return previous


def get_state_dict_type(modules: Sequence[nn.Module]) -> StateDictSettings:
    """Returns the settings shared by every unit in ``modules``."""
    if not modules:
        raise ValueError("fsdp: the module contains no FullyShardedDataParallel instance")
    # nn.Module.__getattr__ is typed Union[Tensor, Module]; a unit keeps its settings here.
    settings = [cast(StateDictSettings, m._state_dict_settings) for m in modules]
    first = settings[0]
    for other in settings[1:]:
        if other != first:
            raise ValueError(
                f"fsdp: FSDP units disagree on their state_dict settings ({first} vs {other}); "
                f"set them once on the root with FullyShardedDataParallel.set_state_dict_type."
            )
    return first


def get_state_dict_type_checked(named_modules: Sequence[tuple[str, nn.Module]]) -> StateDictSettings:
    """``FullyShardedDataParallel.get_state_dict_type``: :func:`get_state_dict_type` of the
    units (``(name, unit)`` pairs), and torch FSDP1's RuntimeError for LOCAL_STATE_DICT on a
    unit built with a ``device_mesh``, which torch's raises there already.

    Raises:
        RuntimeError: LOCAL_STATE_DICT is set and a unit was built with a ``device_mesh``.
    """
    settings = get_state_dict_type([module for _, module in named_modules])
    if settings.state_dict_type is StateDictType.LOCAL_STATE_DICT:
        refuse_local_with_mesh(
            [(name, unit_state(module)) for name, module in named_modules],
            "FullyShardedDataParallel.get_state_dict_type() was called",
        )
    return settings


@contextlib.contextmanager
def state_dict_type_context(
    module: nn.Module,
    state_dict_type: StateDictType,
    state_dict_config: Optional[StateDictConfig],
    optim_state_dict_config: Optional[OptimStateDictConfig],
) -> Iterator[None]:
    """``FullyShardedDataParallel.state_dict_type``: the settings of ``module``'s units inside.

    On exit the previous settings are set again on the units ``module`` contains then. Each
    of the two settings warns that the setters are deprecated, as torch FSDP1's do.
    """
    warn_setter_deprecated(stacklevel=1)
    previous = set_state_dict_type(
        fsdp_modules(module), state_dict_type, state_dict_config, optim_state_dict_config
    )
    try:
        yield
    finally:
        warn_setter_deprecated(stacklevel=1)
        set_state_dict_type(
            fsdp_modules(module),
            previous.state_dict_type,
            previous.state_dict_config,
            previous.optim_state_dict_config,
        )
