"""Model state dicts: saving (FULL, SHARDED, LOCAL); see [Note: Model state dict formats] and
[Note: State dict hooks] in ``_model_state_dict.py``."""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Any, Iterator, Optional

import torch
from torch import nn

from fsdp._common import FLAT_PARAM, FSDP_PREFIX
from fsdp.api import FullStateDictConfig, StateDictType
from fsdp.flat_param.flat_param import FlatParamHandle, HandleState
from fsdp.flat_param._layout import local_tensor
from fsdp.flat_param._recast import adopt_external_cast
from fsdp.runtime._lazy_init import lazy_init
from fsdp.runtime._state import HandleTrainingState, UnitState, check_idle, transition, unit_state
from fsdp.runtime._summon import _summon_unit, deregister_params, register_params
from fsdp.state_dict._values import gather, local_value, to_dtensor
from fsdp.state_dict._model_common import _effective_kind, _flat_key, _handle_storages, _move_prefix, _settings


# ----------------------------------------------------------------------------- saving
@contextlib.contextmanager
def _top_level(module: nn.Module) -> Iterator[bool]:
    """Yields whether this call is the outermost state_dict call of the tree."""
    state = lazy_init(module) if not unit_state(module).has_fsdp_parent else unit_state(module)
    ctx = state.ctx
    outermost = ctx is None or not ctx.state_dict_active
    if outermost:
        check_idle(module, "state_dict()")
        if ctx is not None:
            ctx.state_dict_active = True
            ctx.state_dict_done = set()  # ids of finished values
    try:
        yield outermost
    finally:
        if outermost and ctx is not None:
            ctx.state_dict_active = False
            ctx.state_dict_done = set()


def save_state_dict(
    module: nn.Module, super_state_dict: Any, destination: Any, prefix: str, keep_vars: bool
) -> dict[str, Any]:
    """The state_dict of one FSDP unit's subtree (called recursively by nn.Module).

    Gathers the unit around ``nn.Module``'s walk; the keys are translated by the unit's post-hook
    ([Note: State dict hooks]).
    """
    with _top_level(module):
        if destination is None:
            destination = OrderedDict()
        state: UnitState = unit_state(module)
        start = len(destination)
        kind = _effective_kind(module, state, warn=True)
        if kind is StateDictType.LOCAL_STATE_DICT:
            super_state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
            return destination
        cfg = _settings(module).state_dict_config
        full = kind is StateDictType.FULL_STATE_DICT
        rank0_only = full and isinstance(cfg, FullStateDictConfig) and cfg.rank0_only
        offload = bool(cfg.offload_to_cpu)
        if full and _gathers_directly(state):
            _save_full_gathered(module, state, super_state_dict, destination, prefix, keep_vars, rank0_only, offload)
        else:
            _save_summoned(module, state, super_state_dict, destination, prefix, keep_vars, rank0_only, full, offload)
        if rank0_only and state.rank != 0:  # this unit's subtree returns nothing here
            for key in list(destination.keys())[start:]:
                del destination[key]
        return destination


def save_post_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """State-dict post-hook of every unit: clean keys, LOCAL values (see [Note: State dict hooks])."""
    _move_prefix(state_dict, prefix + FSDP_PREFIX, prefix)
    state = unit_state(module)
    if _effective_kind(module, state, warn=False) is not StateDictType.LOCAL_STATE_DICT:
        return
    offload = bool(_settings(module).state_dict_config.offload_to_cpu)
    for index, handle in enumerate(state.handles):
        # In place of the FlatParameter's own entry (use_orig_params registers none: appended).
        state_dict[prefix + _flat_key(index)] = local_value(handle, offload)


def _save_summoned(
    module: nn.Module,
    state: UnitState,
    super_state_dict: Any,
    destination: "OrderedDict[str, Any]",
    prefix: str,
    keep_vars: bool,
    rank0_only: bool,
    full: bool,
    offload: bool,
) -> None:
    """FULL or SHARDED entries of one unit, read through ``summon_full_params``' views.

    The general path (NO_SHARD, a unit left unsharded by a forward, SHARDED_STATE_DICT): the
    views alias the unsharded flat parameter, so each value is copied out.
    """
    start = len(destination)
    with _summon_unit(module, state, writeback=False, rank0_only=rank0_only, offload_to_cpu=False, with_grads=False):
        ptrs = _handle_storages(state)
        super_state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if not (rank0_only and state.rank != 0):
            _materialize_entries(destination, start, ptrs, state, full, offload)


# [Note: Full state dict of a sharded unit]
# FULL_STATE_DICT of a unit whose handles are all sharded (the usual case between steps) does
# not unshard: each handle's local shard is gathered straight into a fresh tensor (see
# [Note: State dict gathers]; with ``rank0_only`` only to group rank 0, the other ranks send
# and hold nothing extra), parameters views of it are registered on the modules for
# ``nn.Module.state_dict`` to walk (the same names, in the same order, as summon_full_params
# registers), and the values it returns are those views: owned, already full, no copies.
def _gathers_directly(state: UnitState) -> bool:
    """Whether every handle of ``state`` is sharded right now.

    First adopts original Parameters the user replaced (use_orig_params), as
    summon_full_params does, which may reshard a stale unsharded copy.
    """
    if not state.handles or state.training_state is not HandleTrainingState.IDLE:
        return False
    for handle in state.handles:
        adopt_external_cast(handle)  # [Note: Casting after wrapping]
        handle.writeback_orig_params()
    return all(handle.uses_sharding and handle.state is HandleState.SHARDED for handle in state.handles)


def _gather_unsharded(handle: FlatParamHandle, rank0_only: bool, offload: bool) -> Optional[torch.Tensor]:
    """A fresh padded unsharded copy of the handle's parameter; None on ranks that keep nothing."""
    shard = handle._local_shard
    if shard.device != handle.device:  # CPU offload of parameters: communicate on the device
        shard = shard.to(handle.device)
    padded_unsharded = gather(shard, handle.process_group, handle.rank, handle.world_size, 0 if rank0_only else None)
    if padded_unsharded is not None and offload and padded_unsharded.device.type != "cpu":
        padded_unsharded = padded_unsharded.cpu()
    return padded_unsharded


@contextlib.contextmanager
def _full_views_registered(handle: FlatParamHandle, padded_unsharded: torch.Tensor) -> Iterator[None]:
    """Parameters viewing ``padded_unsharded`` under the handle's original names, for the walk.

    Registered like summon_full_params registers them (so keys come in the same order); on exit
    the FlatParameter (or, with use_orig_params, the original Parameters in their own slots)
    is back and the names hold what they hold while sharded.
    """
    wrapped = handle.wrapped_module
    flat_registered = wrapped._parameters.pop(FLAT_PARAM, None) is not None
    requires_grad = handle.flat_param.requires_grad
    views = handle.shard_layout.orig_tensors(handle.unsharded_views(padded_unsharded))  # [Note: DTensor parameters]
    params = [nn.Parameter(view, requires_grad=requires_grad) for view in views]
    try:
        register_params(handle, params)
        yield
    finally:
        if not handle.use_orig_params:
            deregister_params(handle)
        if flat_registered:
            wrapped.register_parameter(FLAT_PARAM, handle.flat_param)
        handle.use_sharded_views()


def _save_full_gathered(
    module: nn.Module,
    state: UnitState,
    super_state_dict: Any,
    destination: "OrderedDict[str, Any]",
    prefix: str,
    keep_vars: bool,
    rank0_only: bool,
    offload: bool,
) -> None:
    """FULL_STATE_DICT entries of one sharded unit (see [Note: Full state dict of a sharded unit])."""
    start = len(destination)
    transition(state, HandleTrainingState.SUMMON_FULL_PARAMS)  # nested units and hooks see the unit busy
    try:
        gathered = [_gather_unsharded(handle, rank0_only, offload) for handle in state.handles]
        padded = [p for p in gathered if p is not None]
        if len(padded) < len(gathered):  # rank0_only, not rank 0: nothing kept here
            super_state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
            return
        with contextlib.ExitStack() as stack:
            for handle, padded_unsharded in zip(state.handles, padded):
                stack.enter_context(_full_views_registered(handle, padded_unsharded))
            super_state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        owned = frozenset(p.untyped_storage().data_ptr() for p in padded if p.numel() > 0)
        _materialize_entries(destination, start, set(), state, True, offload, owned)
    finally:
        state.training_state = HandleTrainingState.IDLE


def _materialize_entries(
    destination: "OrderedDict[str, Any]",
    start: int,
    ptrs: set[int],
    state: UnitState,
    full: bool,
    offload: bool,
    owned_ptrs: frozenset[int] = frozenset(),
) -> None:
    """Turns entries that view this unit's flat storage into owned tensors (or DTensors).

    Entries whose storage is in ``owned_ptrs`` were made for this call (see
    [Note: State dict gathers]) and are kept as they are.
    """
    done: set[int] = state.ctx.state_dict_done if state.ctx is not None else set()
    for key in list(destination.keys())[start:]:
        value = destination[key]
        if not isinstance(value, torch.Tensor) or id(value) in done:
            continue  # not a tensor, or already finished by a nested unit
        storage_ptr = local_tensor(value).untyped_storage().data_ptr()
        if storage_ptr in owned_ptrs:
            if isinstance(value, nn.Parameter):  # keep_vars: the view Parameter itself
                value = value.detach()
                destination[key] = value
            done.add(id(value))
            continue
        aliases = value.numel() == 0 or storage_ptr in ptrs
        if full:
            if aliases:
                value = value.detach().to("cpu" if offload else value.device, copy=True)
            elif offload and value.device.type != "cpu":  # as torch: moved, never copied on CPU
                value = value.detach().to("cpu")
        elif aliases:
            value = to_dtensor(value.detach(), state, offload)
        destination[key] = value
        done.add(id(value))
