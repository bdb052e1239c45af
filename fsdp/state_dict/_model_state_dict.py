"""Model state dicts: FULL, SHARDED and LOCAL, save and load.

[Note: Model state dict formats]
- FULL_STATE_DICT: the unwrapped model's keys and full tensors (owned copies). Saving gathers
  one unit at a time while ``nn.Module.state_dict`` walks the tree (it calls each nested unit's
  ``state_dict``), so the key order is the unwrapped model's. A sharded unit is gathered
  straight into the tensor whose views are returned ([Note: Full state dict of a sharded
  unit]). ``rank0_only``: the other ranks send their shards to rank 0 (and never hold an
  unsharded unit) and return ``{}``. ``offload_to_cpu``: values on CPU (works on CPU too).
  Loading needs no communication: every rank copies its own slice of each full value into its
  shard.
- SHARDED_STATE_DICT: the same keys; each managed parameter is a DTensor over a 1-D mesh of the
  shard group, ``Shard(0)`` of the original shape (chunked like ``torch.chunk``), which is what
  torch FSDP1 produces, so ``torch.distributed.checkpoint`` moves checkpoints between world
  sizes and between torch FSDP1 and fsdp. Buffers and ignored parameters are plain tensors.
- LOCAL_STATE_DICT: each handle's local flat shard under the wrapper's own key
  (``..._fsdp_wrapped_module._flat_param``) plus a small layout tensor; loading checks the
  layout and points to SHARDED_STATE_DICT for another world size or wrapping.

Every load validates keys and shapes first and changes nothing on error.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from fsdp._common import FLAT_PARAM, FSDP_WRAPPED_MODULE, clean_fqn
from fsdp.api import FullStateDictConfig, StateDictType
from fsdp.flat_param._sharding import param_slices_in_shard
from fsdp.flat_param.flat_param import FlatParamHandle, HandleState
from fsdp.runtime._lazy_init import check_idle, is_fsdp, lazy_init, named_fsdp_states, unit_state
from fsdp.runtime._state import TrainingState, UnitState, transition
from fsdp.runtime._summon import _summon_unit, deregister_params, register_params
from fsdp.state_dict._gather import gather

_MESHES: dict[tuple[int, str], Any] = {}
LAYOUT_SUFFIX = "._fsdp_local_layout"


def _mesh_for(group: dist.ProcessGroup, device: torch.device) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    key = (id(group), device.type)
    if key not in _MESHES:
        _MESHES[key] = DeviceMesh.from_group(group, device.type)
    return _MESHES[key]


def _settings(module: nn.Module) -> Any:
    return module._state_dict_settings  # type: ignore[attr-defined]


def _handle_storages(state: UnitState) -> set[int]:
    ptrs = set()
    for handle in state.handles:
        ptrs.add(handle.flat_param.untyped_storage().data_ptr())
    return ptrs


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
    """The state_dict of one FSDP unit's subtree (called recursively by nn.Module)."""
    settings = _settings(module)
    kind = settings.state_dict_type
    with _top_level(module) as outermost:
        if destination is None:
            destination = OrderedDict()
        state: UnitState = unit_state(module)
        if kind is StateDictType.LOCAL_STATE_DICT:
            _save_local(module, state, super_state_dict, destination, prefix, keep_vars)
        else:
            cfg = settings.state_dict_config
            full = kind is StateDictType.FULL_STATE_DICT
            rank0_only = full and isinstance(cfg, FullStateDictConfig) and cfg.rank0_only
            offload = bool(cfg.offload_to_cpu)
            if full and _gathers_directly(state):
                _save_full_gathered(module, state, super_state_dict, destination, prefix, keep_vars, rank0_only, offload)
            else:
                _save_summoned(module, state, super_state_dict, destination, prefix, keep_vars, rank0_only, full, offload)
        if outermost:
            if kind is not StateDictType.LOCAL_STATE_DICT:
                cfg = settings.state_dict_config
                if isinstance(cfg, FullStateDictConfig) and cfg.rank0_only and state.rank != 0:
                    destination.clear()
                    return destination
                cleaned = OrderedDict((clean_fqn(k), v) for k, v in destination.items())
                destination.clear()
                destination.update(cleaned)
        return destination


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
    if not state.handles or state.training_state is not TrainingState.IDLE:
        return False
    for handle in state.handles:
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
    params = [nn.Parameter(view, requires_grad=requires_grad) for view in handle.unsharded_views(padded_unsharded)]
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
    transition(state, TrainingState.SUMMON_FULL_PARAMS)  # nested units and hooks see the unit busy
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
        state.training_state = TrainingState.IDLE


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
        storage_ptr = value.untyped_storage().data_ptr()
        if storage_ptr in owned_ptrs:
            if isinstance(value, nn.Parameter):  # keep_vars: the view Parameter itself
                value = value.detach()
                destination[key] = value
            done.add(id(value))
            continue
        aliases = value.numel() == 0 or storage_ptr in ptrs
        if full:
            if aliases or offload:
                value = value.detach().to("cpu" if offload else value.device, copy=True)
        elif aliases:
            value = _to_dtensor(value.detach(), state, offload)
        destination[key] = value
        done.add(id(value))


def _to_dtensor(full_value: torch.Tensor, state: UnitState, offload: bool) -> Any:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = _mesh_for(state.process_group, state.compute_device)
    if full_value.dim() == 0:
        return DTensor.from_local(full_value.clone(), mesh, [Replicate()], run_check=False)
    chunks = torch.chunk(full_value, state.world_size, dim=0)
    if state.rank < len(chunks):
        local = chunks[state.rank].clone()
    else:
        local = full_value.new_empty((0, *full_value.shape[1:]))
    if offload:
        local = local.cpu()
    return DTensor.from_local(
        local, mesh, [Shard(0)], run_check=False, shape=full_value.shape, stride=full_value.stride()
    )


def _local_key(wrapped_prefix: str, index: int) -> str:
    return f"{wrapped_prefix}{FSDP_WRAPPED_MODULE}.{FLAT_PARAM}" + (f"_{index}" if index else "")


def _save_local(
    module: nn.Module,
    state: UnitState,
    super_state_dict: Any,
    destination: "OrderedDict[str, Any]",
    prefix: str,
    keep_vars: bool,
) -> None:
    start = len(destination)
    super_state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
    offload = bool(_settings(module).state_dict_config.offload_to_cpu)
    own = {id(p) for h in state.handles for p in [h.flat_param] + h.managed_orig_params()}
    own_ptrs = _handle_storages(state)
    for key in list(destination.keys())[start:]:
        value = destination[key]
        # Original parameters (use_orig_params) are stored through their flat shard instead.
        if isinstance(value, torch.Tensor) and key.startswith(prefix + FSDP_WRAPPED_MODULE) and (
            id(value) in own or (value.numel() and value.untyped_storage().data_ptr() in own_ptrs)
        ):
            del destination[key]
    for index, handle in enumerate(state.handles):
        key = _local_key(prefix, index)
        shard = handle._local_shard.detach().clone()
        destination[key] = shard.cpu() if offload else shard
        destination[key + LAYOUT_SUFFIX] = _layout(handle)


def _layout(handle: FlatParamHandle) -> torch.Tensor:
    return torch.tensor(
        [handle.world_size, handle.rank, handle.unpadded_unsharded_numel, handle.sharded_numel],
        dtype=torch.long,
    )


# ----------------------------------------------------------------------------- metadata
def _module_prefixes(root: nn.Module) -> dict[int, str]:
    prefixes: dict[int, str] = {}
    for name, mod in root.named_modules(remove_duplicate=False):
        prefixes.setdefault(id(mod), name + "." if name else "")
    return prefixes


class _ManagedParam:
    """One original parameter a handle manages, as the state dict names it."""

    def __init__(self, key: str, handle: FlatParamHandle, index: int, shape: torch.Size) -> None:
        self.key = key
        self.handle = handle
        self.index = index
        self.shape = shape


def _managed_params(root: nn.Module) -> "OrderedDict[str, _ManagedParam]":
    prefixes = _module_prefixes(root)
    result: OrderedDict[str, _ManagedParam] = OrderedDict()
    for _, _, state in named_fsdp_states(root):
        for handle in state.handles:
            for index, info in enumerate(handle.param_infos):
                key = clean_fqn(prefixes[id(info.module)] + info.param_name)
                result[key] = _ManagedParam(key, handle, index, info.shape)
            for shared in handle.shared_param_infos:
                key = clean_fqn(prefixes[id(shared.module)] + shared.param_name)
                prim = handle.param_infos[shared.prim_index]
                result[key] = _ManagedParam(key, handle, shared.prim_index, prim.shape)
    return result


def _other_entries(root: nn.Module) -> "OrderedDict[str, torch.Tensor]":
    """Buffers, ignored parameters and extra state: what nn.Module saves besides managed params."""
    managed_ids: set[int] = set()
    for _, _, state in named_fsdp_states(root):
        for handle in state.handles:
            managed_ids.add(id(handle.flat_param))
            managed_ids.update(id(p) for p in handle.managed_orig_params())
    entries: OrderedDict[str, torch.Tensor] = OrderedDict()
    for mod_name, mod in root.named_modules():
        prefix = mod_name + "." if mod_name else ""
        for name, param in mod._parameters.items():
            if param is not None and id(param) not in managed_ids:
                entries[clean_fqn(prefix + name)] = param
        for name, buf in mod._buffers.items():
            if buf is not None and name not in mod._non_persistent_buffers_set:
                entries[clean_fqn(prefix + name)] = buf
    return entries


# ----------------------------------------------------------------------------- loading
def _format_incompatible(module: nn.Module, missing: list[str], unexpected: list[str]) -> str:
    parts = []
    if unexpected:
        parts.append("Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in unexpected) + ". ")
    if missing:
        parts.append("Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in missing) + ". ")
    return f"Error(s) in loading state_dict for {type(module).__name__}:\n\t" + "\n\t".join(parts)


def _shape_of(value: Any) -> torch.Size:
    return value.shape


def load_state_dict(module: nn.Module, state_dict: dict[str, Any], strict: bool, assign: bool) -> Any:
    """Loads a FULL, SHARDED or LOCAL state dict into ``module`` (the root)."""
    if unit_state(module).has_fsdp_parent:
        raise RuntimeError(
            "fsdp: load_state_dict() must be called on the root FSDP instance (the outermost "
            "FullyShardedDataParallel), not on a nested unit."
        )
    lazy_init(module)
    check_idle(module, "load_state_dict()")
    kind = _settings(module).state_dict_type
    if kind is StateDictType.LOCAL_STATE_DICT:
        return _load_local(module, state_dict, strict)
    managed = _managed_params(module)
    others = _other_entries(module)
    expected = list(managed) + [k for k in others if k not in managed]
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in managed and k not in others]
    if strict and (missing or unexpected):
        raise RuntimeError(_format_incompatible(module, missing, unexpected))
    errors = []
    for key, value in state_dict.items():
        target = managed[key].shape if key in managed else (others[key].shape if key in others else None)
        if target is not None and isinstance(value, torch.Tensor) and _shape_of(value) != target:
            errors.append(
                f"size mismatch for {key}: copying a param with shape {tuple(_shape_of(value))} from "
                f"checkpoint, the shape in current model is {tuple(target)}."
            )
    if errors:
        raise RuntimeError(
            f"Error(s) in loading state_dict for {type(module).__name__}:\n\t" + "\n\t".join(errors)
        )
    with torch.no_grad():
        for key in [k for k in managed if k in state_dict]:  # same order on every rank
            _load_managed(managed[key], state_dict[key])
        for key, target_tensor in others.items():
            if key in state_dict and key not in managed:
                value = state_dict[key]
                value = value.full_tensor() if _is_dtensor(value) else value
                target_tensor.copy_(value)
    return _IncompatibleKeys(missing, unexpected)


def _is_dtensor(value: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def _load_managed(param: _ManagedParam, value: Any) -> None:
    """Copies this rank's part of a full (or DTensor) value into the handle's local shard."""
    handle = param.handle
    if _is_dtensor(value):
        value = value.full_tensor()
    # ``torch.flatten`` rather than ``value.reshape``: a tensor-like with ``__torch_function__``
    # (Lightning's lazily loaded checkpoint tensors) is accepted, as torch's ``copy_`` accepts it.
    flat_value = torch.flatten(value).detach().to(handle._local_shard.device, handle._local_shard.dtype)
    numels = [info.numel for info in handle.param_infos]
    if not handle.uses_sharding:
        offset = sum(numels[: param.index])
        handle._local_shard[offset : offset + numels[param.index]].copy_(flat_value)
        return
    for piece in param_slices_in_shard(numels, handle.rank, handle.world_size):
        if piece.param_index == param.index:
            handle._local_shard[piece.offset_in_shard : piece.offset_in_shard + piece.numel].copy_(
                flat_value[piece.offset_in_param : piece.offset_in_param + piece.numel]
            )


def _load_local(module: nn.Module, state_dict: dict[str, Any], strict: bool) -> Any:
    handles: OrderedDict[str, FlatParamHandle] = OrderedDict()
    for mod_name, sub in module.named_modules():
        if is_fsdp(sub):
            prefix = mod_name + "." if mod_name else ""
            for index, handle in enumerate(unit_state(sub).handles):
                handles[_local_key(prefix, index)] = handle
    others: OrderedDict[str, torch.Tensor] = OrderedDict()
    managed_ids = {id(h.flat_param) for h in handles.values()}
    managed_ids.update(id(p) for h in handles.values() for p in h.managed_orig_params())
    for mod_name, mod in module.named_modules():
        prefix = mod_name + "." if mod_name else ""
        for name, param in mod._parameters.items():
            if param is not None and id(param) not in managed_ids:
                others[prefix + name] = param
        for name, buf in mod._buffers.items():
            if buf is not None and name not in mod._non_persistent_buffers_set:
                others[prefix + name] = buf
    expected = list(handles) + [k + LAYOUT_SUFFIX for k in handles] + list(others)
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    if strict and (missing or unexpected):
        raise RuntimeError(_format_incompatible(module, missing, unexpected))
    for key, handle in handles.items():
        layout = state_dict.get(key + LAYOUT_SUFFIX)
        if layout is None and key not in state_dict:
            continue
        mine = _layout(handle)
        if layout is None or not torch.equal(layout.to(torch.long).cpu(), mine):
            saved = "unknown" if layout is None else f"world size {int(layout[0])}, {int(layout[2])} elements"
            raise ValueError(
                f"fsdp: the LOCAL_STATE_DICT entry '{key}' was saved with a different layout "
                f"({saved}) than this model's ({handle.world_size} ranks, "
                f"{handle.unpadded_unsharded_numel} elements): a local state dict only loads at "
                f"the same world size and wrapping. Use StateDictType.SHARDED_STATE_DICT to "
                f"change world size or wrapping."
            )
        if tuple(state_dict[key].shape) != tuple(handle._local_shard.shape):
            raise ValueError(
                f"fsdp: size mismatch for {key}: the checkpoint holds a local shard of shape "
                f"{tuple(state_dict[key].shape)}, this rank's shard has shape "
                f"{tuple(handle._local_shard.shape)}. Use SHARDED_STATE_DICT to change layouts."
            )
    with torch.no_grad():
        for key, handle in handles.items():
            if key in state_dict:
                handle._local_shard.copy_(state_dict[key])
        for key, target in others.items():
            if key in state_dict:
                target.copy_(state_dict[key])
    return _IncompatibleKeys(missing, unexpected)
