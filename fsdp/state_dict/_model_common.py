"""Helpers the model state-dict save and load paths share (see [Note: Model state dict formats]
in ``_model_state_dict.py``)."""

from __future__ import annotations

import warnings
from typing import Any

from torch import nn

from fsdp._common import FLAT_PARAM
from fsdp.api import ShardingStrategy, StateDictType
from fsdp.runtime._state import UnitState

_NO_SHARD_WARNING = "When using ``NO_SHARD`` for ``ShardingStrategy``, full_state_dict will be returned."


def _settings(module: nn.Module) -> Any:
    return module._state_dict_settings  # type: ignore[attr-defined]


def _effective_kind(module: nn.Module, state: UnitState, warn: bool) -> StateDictType:
    """The unit's state-dict type; a NO_SHARD unit gives (and takes) FULL instead of LOCAL or
    SHARDED, as torch FSDP1 does, with its warning: its values are whole on every rank."""
    kind = _settings(module).state_dict_type
    if kind is not StateDictType.FULL_STATE_DICT and state.sharding_strategy is ShardingStrategy.NO_SHARD:
        if warn:
            warnings.warn(_NO_SHARD_WARNING, stacklevel=3)
        return StateDictType.FULL_STATE_DICT
    return kind


def _handle_storages(state: UnitState) -> set[int]:
    ptrs = set()
    for handle in state.handles:
        ptrs.add(handle.flat_param.untyped_storage().data_ptr())
    return ptrs


def _flat_key(index: int) -> str:
    """A handle's LOCAL key inside its unit: ``_flat_param`` (``_flat_param_1``, ... for more handles)."""
    return FLAT_PARAM + (f"_{index}" if index else "")


def _move_prefix(state_dict: dict[str, Any], old: str, new: str) -> None:
    """Renames every key starting with ``old`` to start with ``new`` instead, keeping their order."""
    for key in [k for k in state_dict if k.startswith(old)]:
        state_dict[new + key[len(old):]] = state_dict.pop(key)
