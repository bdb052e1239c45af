"""Model state dicts: FULL, SHARDED and LOCAL, save and load.

[Note: Model state dict formats]
- FULL_STATE_DICT: the unwrapped model's keys and full tensors (owned copies). Saving gathers
  one unit at a time while ``nn.Module.state_dict`` walks the tree (it calls each nested unit's
  ``state_dict``), so the key order is the unwrapped model's. A sharded unit is gathered
  straight into the tensor whose views are returned ([Note: Full state dict of a sharded
  unit]). ``rank0_only``: the other ranks send their shards to rank 0 (and never hold an
  unsharded unit) and return no entry of an FSDP unit. ``offload_to_cpu``: values on CPU
  (works on CPU too). Loading needs no communication: every rank copies its own slice of each
  full value into its shard.
- SHARDED_STATE_DICT: the same keys; each managed parameter is this rank's ``torch.chunk`` rows
  in torch FSDP1's form: a ShardedTensor over the shard group, or a DTensor on the unit's
  ``device_mesh`` (see [Note: Sharded state dict values] in docs/design.md and [Note: Sharded
  value forms] in ``_values.py``). Buffers and ignored parameters are plain tensors.
- LOCAL_STATE_DICT: torch FSDP1's format exactly ([Note: Local state dict format]): one
  ``<unit>._flat_param`` ShardedTensor per unit, plus what ``nn.Module`` saves besides.
  A NO_SHARD unit gives (and takes) FULL entries instead, with torch's warning.

[Note: State dict hooks]
Key translation lives in hooks on every FSDP instance, as in torch FSDP1, so that any root
works: an FSDP root, a plain module holding FSDP children, activation-checkpoint wrappers
around or inside units. Saving: ``nn.Module.state_dict`` calls each child's ``state_dict``, so
our override gathers the unit around the walk; the unit's state-dict post-hook removes the
``_fsdp_wrapped_module.`` segment from its subtree's keys (and puts LOCAL values in place).
Loading: ``nn.Module.load_state_dict`` runs each module's load pre-hook before its
``_load_from_state_dict``; the unit's pre-hook adds the segment back to its subtree's keys,
checks its managed entries (shapes, sharded layouts) and, if they are all good, copies them
into the shards and removes them, leaving buffers and ignored parameters to ``nn.Module``. Its
post-hook reports missing managed keys under their clean names (not the FlatParameter's) and
cleans every reported key, as torch does.

Every load validates keys and shapes first and changes nothing on error: an FSDP root checks
the whole tree before ``nn.Module`` copies anything; through a plain root each unit checks its
own entries before changing them (the plain module's own entries load as ``nn.Module`` loads
them).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from fsdp._comm._phase import collective_phase, during
from fsdp._common import FLAT_PARAM, FSDP_PREFIX, clean_fqn
from fsdp.api import FullStateDictConfig, ShardingStrategy, StateDictType
from fsdp.flat_param._layout import local_tensor
from fsdp.flat_param._recast import adopt_external_cast
from fsdp.flat_param.flat_param import FlatParamHandle, HandleState
from fsdp.runtime._lazy_init import lazy_init
from fsdp.runtime._mixed_precision import refresh_cast_buffers
from fsdp.runtime._state import (
    HandleTrainingState,
    UnitState,
    check_idle,
    named_fsdp_states,
    transition,
    unit_state,
)
from fsdp.runtime._summon import _summon_unit, deregister_params, register_params
from fsdp.state_dict._values import (
    check_local_value,
    check_sharded_value,
    full_value,
    gather,
    is_dtensor,
    is_sharded_tensor,
    load_local_value,
    local_form,
    local_value,
    refuse_local_with_mesh,
    ShardedForm,
)


# ----------------------------------------------------------------------------- common
# [Note: NO_SHARD state-dict warnings] torch FSDP1 warns at each state-dict hook of a NO_SHARD
# unit, whatever the state-dict type (FULL too): before and after its part of a save, and before
# and after its part of a load; its load hooks give the sentence without the space before "be".
_NO_SHARD_WARNING = "When using ``NO_SHARD`` for ``ShardingStrategy``, full_state_dict will be returned."
_NO_SHARD_LOAD_WARNING = "When using ``NO_SHARD`` for ``ShardingStrategy``, full_state_dict willbe returned."


def _unit_settings(module: nn.Module) -> Any:
    return module._state_dict_settings


def _effective_kind(module: nn.Module, state: UnitState) -> StateDictType:
    """The unit's state-dict type; a NO_SHARD unit gives (and takes) FULL instead of LOCAL or
    SHARDED, as torch FSDP1 does: its values are whole on every rank."""
    kind = _unit_settings(module).state_dict_type
    if state.sharding_strategy is ShardingStrategy.NO_SHARD:
        return StateDictType.FULL_STATE_DICT
    return kind


def _warn_if_no_shard(state: UnitState, message: str) -> None:
    """torch FSDP1's UserWarning at a NO_SHARD unit's state-dict hook ([Note: NO_SHARD
    state-dict warnings])."""
    if state.sharding_strategy is ShardingStrategy.NO_SHARD:
        warnings.warn(message, stacklevel=4)


def _handle_storages(state: UnitState) -> set[int]:
    """The storages the unit's unsharded parameters live in: the FlatParameter's, and that of the
    views registered now (a user's ``summon_full_params(offload_to_cpu=True)`` registers views of
    a host copy), so that every value viewing them is copied out."""
    ptrs = set()
    for handle in state.handles:
        ptrs.add(handle.flat_param.untyped_storage().data_ptr())
        for info in handle.param_infos:
            view = getattr(info.module, info.param_name, None)
            if isinstance(view, torch.Tensor) and view.numel() > 0:
                ptrs.add(local_tensor(view).untyped_storage().data_ptr())
    return ptrs


def _refuse_local_with_mesh(module: nn.Module, what: str) -> None:
    """Torch FSDP1's error for LOCAL_STATE_DICT units built with a ``device_mesh`` (a NO_SHARD
    unit gives FULL instead, as torch's does), before anything changes."""
    refuse_local_with_mesh(
        [
            (name, state)
            for name, sub, state in named_fsdp_states(module)
            if _effective_kind(sub, state) is StateDictType.LOCAL_STATE_DICT
        ],
        what,
    )


def _flat_key(index: int) -> str:
    """A handle's LOCAL key inside its unit: ``_flat_param`` (``_flat_param_1``, ... for more handles)."""
    return FLAT_PARAM + (f"_{index}" if index else "")


def _move_prefix(state_dict: dict[str, Any], old: str, new: str) -> None:
    """Renames every key starting with ``old`` to start with ``new`` instead, keeping their order."""
    for key in [k for k in state_dict if k.startswith(old)]:
        state_dict[new + key[len(old):]] = state_dict.pop(key)


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

    @property
    def spec(self) -> Any:
        """The parameter's DTensor spec if it is tensor-parallel, else None ([Note: DTensor
        parameters])."""
        return self.handle.param_infos[self.index].dtensor_spec


def _unit_managed(state: UnitState) -> "OrderedDict[str, _ManagedParam]":
    """The unit's managed parameters keyed by their clean names inside its wrapped module."""
    result: OrderedDict[str, _ManagedParam] = OrderedDict()
    for handle in state.handles:
        for index, info in enumerate(handle.param_infos):
            key = clean_fqn(info.fqn)
            result[key] = _ManagedParam(key, handle, index, info.shape)
        for shared in handle.shared_param_infos:
            key = clean_fqn(shared.fqn)
            result[key] = _ManagedParam(key, handle, shared.prim_index, handle.param_infos[shared.prim_index].shape)
    return result


def _managed_params(root: nn.Module) -> "OrderedDict[str, _ManagedParam]":
    """Every managed parameter of ``root``'s tree keyed by its clean name from ``root``."""
    result: OrderedDict[str, _ManagedParam] = OrderedDict()
    for name, _, state in named_fsdp_states(root):
        unit_prefix = name + "." if name else ""
        for key, param in _unit_managed(state).items():
            result[unit_prefix + key] = _ManagedParam(unit_prefix + key, param.handle, param.index, param.shape)
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


# ----------------------------------------------------------------------------- saving
@contextlib.contextmanager
def _top_level(module: nn.Module) -> Iterator[bool]:
    """Yields whether this call is the outermost state_dict call of the tree."""
    state = lazy_init(module) if not unit_state(module).has_fsdp_parent else unit_state(module)
    ctx = state.ctx
    outermost = ctx is None or not ctx.state_dict_active
    if outermost:
        # Inside the user's summon_full_params the units stay summoned and their values are read
        # from the views as they are ([Note: State dict inside summon_full_params]).
        check_idle(module, "state_dict()", allow_summon=True)
        _refuse_local_with_mesh(module, "state_dict() was called")
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
    state: UnitState = unit_state(module)
    with _top_level(module), collective_phase("state_dict", state):
        if destination is None:
            destination = OrderedDict()
        start = len(destination)
        _warn_if_no_shard(state, _NO_SHARD_WARNING)
        kind = _effective_kind(module, state)
        if kind is StateDictType.LOCAL_STATE_DICT:
            super_state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
            return destination
        cfg = _unit_settings(module).state_dict_config
        full = kind is StateDictType.FULL_STATE_DICT
        rank0_only = full and isinstance(cfg, FullStateDictConfig) and cfg.rank0_only
        offload = bool(cfg.offload_to_cpu)
        walk = functools.partial(super_state_dict, destination=destination, prefix=prefix, keep_vars=keep_vars)
        if full and _gathers_directly(state):
            _save_full_gathered(state, walk, destination, rank0_only, offload)
        else:
            _save_summoned(module, state, walk, destination, rank0_only, full, offload)
        if rank0_only and state.rank != 0:  # this unit's subtree returns nothing here
            for key in list(destination.keys())[start:]:
                del destination[key]
        return destination


def save_post_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """State-dict post-hook of every unit: clean keys, LOCAL values (see [Note: State dict hooks])."""
    _move_prefix(state_dict, prefix + FSDP_PREFIX, prefix)
    state = unit_state(module)
    _warn_if_no_shard(state, _NO_SHARD_WARNING)
    if _effective_kind(module, state) is not StateDictType.LOCAL_STATE_DICT:
        return
    offload = bool(_unit_settings(module).state_dict_config.offload_to_cpu)
    for index, handle in enumerate(state.handles):
        # In place of the FlatParameter's own entry (use_orig_params registers none: appended).
        state_dict[prefix + _flat_key(index)] = local_value(handle, offload)


# [Note: State dict inside summon_full_params]
# ``model.state_dict()`` inside the user's ``summon_full_params(model)`` returns what it returns
# outside, as torch FSDP1 does: the units are already unsharded, so nothing is gathered again;
# each value is read from the registered full views and copied out (FULL: owned full tensors;
# SHARDED: this rank's chunk in torch FSDP1's form), with the unwrapped model's names. The summon
# stays as the user opened it. With ``recurse=False`` only the summoned units read their views;
# the others gather as usual.
def _save_summoned(
    module: nn.Module,
    state: UnitState,
    walk: Callable[[], Any],
    destination: "OrderedDict[str, Any]",
    rank0_only: bool,
    full: bool,
    offload: bool,
) -> None:
    """FULL or SHARDED entries of one unit, read through ``summon_full_params``' views.

    The general path (NO_SHARD, a unit left unsharded by a forward, SHARDED_STATE_DICT): the
    views alias the unsharded flat parameter, so each value is copied out. ``walk``:
    ``nn.Module.state_dict`` of the unit's subtree into ``destination``.
    """
    start = len(destination)
    with _summon_unit(module, state, writeback=False, rank0_only=rank0_only, offload_to_cpu=False, with_grads=False):
        ptrs = _handle_storages(state)
        walk()
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
    return all(handle.shard_layout.uses_sharding and handle.state is HandleState.SHARDED for handle in state.handles)


def _gather_unsharded(handle: FlatParamHandle, rank0_only: bool, offload: bool) -> Optional[torch.Tensor]:
    """A fresh padded unsharded copy of the handle's parameter; None on ranks that keep nothing."""
    shard = handle._local_shard
    if shard.device != handle.device:  # CPU offload of parameters: communicate on the device
        shard = shard.to(handle.device)
    with collective_phase(None, handle):
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
    layout = handle.shard_layout
    views = layout.orig_tensors(layout.unsharded_views(padded_unsharded))  # [Note: DTensor parameters]
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
    state: UnitState,
    walk: Callable[[], Any],
    destination: "OrderedDict[str, Any]",
    rank0_only: bool,
    offload: bool,
) -> None:
    """FULL_STATE_DICT entries of one sharded unit (see [Note: Full state dict of a sharded unit]).

    ``walk``: ``nn.Module.state_dict`` of the unit's subtree into ``destination``.
    """
    start = len(destination)
    transition(state, HandleTrainingState.SUMMON_FULL_PARAMS)  # nested units and hooks see the unit busy
    try:
        gathered = [_gather_unsharded(handle, rank0_only, offload) for handle in state.handles]
        padded = [p for p in gathered if p is not None]
        if len(padded) < len(gathered):  # rank0_only, not rank 0: nothing kept here
            walk()
            return
        with contextlib.ExitStack() as stack:
            for handle, padded_unsharded in zip(state.handles, padded):
                stack.enter_context(_full_views_registered(handle, padded_unsharded))
            walk()
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
    form = None if full else ShardedForm(state)  # once per unit ([Note: Sharded value forms])
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
        elif aliases and form is not None:
            value = form.value(value.detach(), offload)
        destination[key] = value
        done.add(id(value))


# ----------------------------------------------------------------------------- loading
def _format_incompatible(module: nn.Module, missing: list[str], unexpected: list[str]) -> str:
    parts = []
    if unexpected:
        parts.append("Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in unexpected) + ". ")
    if missing:
        parts.append("Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in missing) + ". ")
    return f"Error(s) in loading state_dict for {type(module).__name__}:\n\t" + "\n\t".join(parts)


def _size_mismatch(key: str, value: Any, shape: torch.Size) -> Optional[str]:
    # A ShardedTensor's shape from its metadata: its tensor methods warn (deprecated).
    value_shape = tuple(value.metadata().size) if is_sharded_tensor(value) else tuple(value.shape)
    if value_shape == tuple(shape):
        return None
    return (
        f"size mismatch for {key}: copying a param with shape {value_shape} from "
        f"checkpoint, the shape in current model is {tuple(shape)}."
    )


class _LoadError(Exception):
    """A layout error of one entry: raised as ``error_type(message)`` before anything changes."""

    def __init__(self, error_type: type, message: str) -> None:
        super().__init__(message)
        self.error_type = error_type


def _is_tensor_like(value: Any) -> bool:
    """Whether ``nn.Module`` would copy ``value``: a tensor, or a tensor-like with
    ``__torch_function__`` (Lightning's lazily loaded checkpoint tensors, which are no
    ``torch.Tensor``), read through torch functions ([Note: Tensor-like values])."""
    return torch.overrides.is_tensor_like(value)


# [Note: Tensor-like values]
# nn.Module's load copies any tensor-like value (``torch.overrides.is_tensor_like``: a tensor or an
# object with ``__torch_function__``), and so does torch FSDP1's load. Lightning's FULL checkpoint
# resume hands such objects (its lazily loaded tensors: not ``torch.Tensor`` instances; shape and
# dtype as attributes, the values read when a torch function is applied). Managed entries are
# checked and loaded here, not by nn.Module, so the same test decides, and the values are only
# ever used through torch functions (``torch.flatten`` in _load_managed). Anything else gets
# nn.Module's error message.
def _check_managed(key: str, param: _ManagedParam, value: Any, state: UnitState) -> Optional[str]:
    """FULL/SHARDED: a size-mismatch message for ``value`` (None if fine); raises on bad layouts."""
    if not _is_tensor_like(value):
        return (
            f'While copying the parameter named "{key}", expected torch.Tensor or Tensor-like '
            f"object from checkpoint but received {type(value)}"
        )
    mismatch = _size_mismatch(key, value, param.shape)
    if mismatch is not None:
        return mismatch
    layout_error = check_sharded_value(key, value, param.shape, state)
    if layout_error is not None:
        raise _LoadError(RuntimeError, layout_error)
    return None


def _local_form_checked(key: str, param: _ManagedParam, value: Any, state: UnitState) -> tuple[Any, Optional[str]]:
    """``value`` as the unit holds it (``local_form``: collective for a 2-D DTensor), or itself
    with a size-mismatch message when it is a plain value of a tensor-parallel parameter whose
    shape is not the parameter's global shape (the unwrapped model's, which nn.Module names)."""
    if param.spec is not None and _is_tensor_like(value) and not (is_dtensor(value) or is_sharded_tensor(value)):
        mismatch = _size_mismatch(key, value, param.spec.shape)  # [Note: Tensor-parallel values to load]
        if mismatch is not None:
            return value, mismatch
    return local_form(value, state, param.spec), None


def _check_local(key: str, index: int, value: Any, state: UnitState) -> None:
    error = check_local_value(key, state.unit_name, value, state.handles[index])
    if error is not None:
        raise _LoadError(ValueError, error)


def _needs_collectives(values: list[Any]) -> bool:
    return any(is_dtensor(v) or is_sharded_tensor(v) for v in values)


def _agree(ok: bool, group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether every rank of ``group`` is ok (one tiny all-reduce), so that no rank enters a
    gather its peers left by raising."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _raise_unless_agreed(error: Optional[_LoadError], state: UnitState, what: str) -> None:
    if not _agree(error is None, state.process_group, state.compute_device):
        if error is not None:
            raise error.error_type(str(error))
        raise RuntimeError(
            f"fsdp: load_state_dict() failed on another rank while checking {what}; nothing was "
            f"loaded here. See that rank's error."
        )


def _load_managed(param: _ManagedParam, full: torch.Tensor) -> None:
    """Copies this rank's part of a full value into the handle's local shard."""
    handle = param.handle
    # ``torch.flatten`` rather than ``full.reshape``: a tensor-like with ``__torch_function__``
    # (Lightning's lazily loaded checkpoint tensors) is accepted, as torch's ``copy_`` accepts it.
    flat_value = torch.flatten(full).detach().to(handle._local_shard.device, handle._local_shard.dtype)
    # The handle's own slices: they skip any alignment padding (use_orig_params).
    piece = handle.shard_layout.shard_slices[param.index]
    if piece is not None:
        handle._local_shard[piece.offset_in_shard : piece.offset_in_shard + piece.numel].copy_(
            flat_value[piece.offset_in_param : piece.offset_in_param + piece.numel]
        )


@dataclass
class _PendingLoad:
    """What a unit's load pre-hook leaves for its post-hook (the missing keys to report).

    Attributes:
        own_keys: Clean keys nn.Module may report missing for tensors this unit manages (the
            FlatParameter's, the original parameters').
        absent_keys: Keys of this unit's managed entries the state dict lacks.
        cast_buffer_values: The entries under the unit (keys relative to it) when it has
            mixed-precision buffers, whose kept full-precision values the post-hook refreshes
            from them ([Note: Full-precision buffers in state dicts]).
        prefix: The unit's prefix in this load.
        missing_start: How many missing keys were reported before the unit's subtree.
    """

    own_keys: set[str] = field(default_factory=set)
    absent_keys: list[str] = field(default_factory=list)
    cast_buffer_values: dict[str, Any] = field(default_factory=dict)
    prefix: str = ""
    missing_start: int = 0


_PENDING: dict[int, _PendingLoad] = {}
#: Set while an FSDP root's load_state_dict has checked the whole tree (hooks need not agree again).
_ROOT_CHECKED: list[bool] = [False]


def load_pre_hook(
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """Load pre-hook of every unit (see [Note: State dict hooks])."""
    state = unit_state(module)
    _warn_if_no_shard(state, _NO_SHARD_LOAD_WARNING)
    if not state.has_fsdp_parent:
        lazy_init(module)
        check_idle(module, "load_state_dict()")
        _refuse_local_with_mesh(module, "load_state_dict() was called")
    _move_prefix(state_dict, prefix, prefix + FSDP_PREFIX)
    inner = prefix + FSDP_PREFIX
    pending = _PendingLoad(prefix=prefix, missing_start=len(missing_keys))
    _PENDING[id(module)] = pending
    if state.cast_buffers:
        pending.cast_buffer_values = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
    with torch.no_grad(), collective_phase(None, state):
        if _effective_kind(module, state) is StateDictType.LOCAL_STATE_DICT:
            _load_local_entries(state, state_dict, prefix, inner, pending)
        else:
            _load_full_or_sharded_entries(state, state_dict, prefix, inner, pending, error_msgs)


def _load_full_or_sharded_entries(
    state: UnitState,
    state_dict: dict[str, Any],
    prefix: str,
    inner: str,
    pending: _PendingLoad,
    error_msgs: list[str],
) -> None:
    managed = _unit_managed(state)
    pending.own_keys = {clean_fqn(prefix + key) for key in managed}
    pending.own_keys.update(clean_fqn(prefix + _flat_key(i)) for i in range(len(state.handles)))
    present = [(inner + key, param) for key, param in managed.items() if inner + key in state_dict]
    pending.absent_keys = [clean_fqn(prefix + key) for key, param in managed.items() if inner + key not in state_dict]
    values = [state_dict.pop(key) for key, _ in present]
    mismatches: list[Optional[str]] = [None] * len(present)
    if not _ROOT_CHECKED[0]:  # a root that is no FSDP unit: the values as _check_tree makes them
        for i, (key, param) in enumerate(present):
            values[i], mismatches[i] = _local_form_checked(clean_fqn(key), param, values[i], state)
    error: Optional[_LoadError] = None
    try:
        for i, ((key, param), value) in enumerate(zip(present, values)):
            if mismatches[i] is None:
                mismatches[i] = _check_managed(clean_fqn(key), param, value, state)
    except _LoadError as exc:
        error = exc
    if _needs_collectives(values) and not _ROOT_CHECKED[0]:
        _raise_unless_agreed(error, state, f"unit '{state.unit_name}'")
    if error is not None:
        raise error.error_type(str(error))
    if any(mismatches):  # nn.Module raises them at the end; this unit stays as it was
        error_msgs.extend(m for m in mismatches if m is not None)
        return
    for (_, param), value in zip(present, values):  # all tensor-like: checked above
        _load_managed(param, full_value(value, param.shape, state))


def _load_local_entries(
    state: UnitState, state_dict: dict[str, Any], prefix: str, inner: str, pending: _PendingLoad
) -> None:
    keys = [inner + _flat_key(i) for i in range(len(state.handles))]
    pending.own_keys = {clean_fqn(prefix + _flat_key(i)) for i in range(len(state.handles))}
    pending.absent_keys = [clean_fqn(prefix + _flat_key(i)) for i, key in enumerate(keys) if key not in state_dict]
    present = [(index, key) for index, key in enumerate(keys) if key in state_dict]
    for index, key in present:
        _check_local(clean_fqn(key), index, state_dict[key], state)
    for index, key in present:
        load_local_value(state.handles[index], state_dict.pop(key))


def _in_module_order(module: nn.Module, prefix: str, keys: list[str]) -> list[str]:
    """``keys`` (clean, under ``module`` at ``prefix``) in the order nn.Module reports them.

    That is the unwrapped model's order, which torch FSDP1 reports (it registers the original
    parameters for a load): modules in pre-order, each one's parameters before its buffers.
    Keys of one module and kind keep their relative order.
    """
    module_index: dict[str, tuple[int, nn.Module]] = {}
    root_name = prefix[:-1] if prefix else ""
    for name, sub in module.named_modules(remove_duplicate=False, prefix=root_name):
        module_index.setdefault(clean_fqn(name), (len(module_index), sub))

    def order(item: tuple[int, str]) -> tuple[int, int, int]:
        position, key = item
        path, _, local = key.rpartition(".")
        index, owner = module_index.get(path, (len(module_index), None))
        is_buffer = owner is not None and local in owner._buffers
        return index, int(is_buffer), position

    return [key for _, key in sorted(enumerate(keys), key=order)]


def load_post_hook(module: nn.Module, incompatible_keys: Any) -> None:
    """Load post-hook of every unit: the missing keys under the names the state dict uses."""
    _warn_if_no_shard(unit_state(module), _NO_SHARD_LOAD_WARNING)
    pending = _PENDING.pop(id(module), None)
    missing, unexpected = incompatible_keys.missing_keys, incompatible_keys.unexpected_keys
    if pending is not None:
        if pending.cast_buffer_values:  # loaded: those values are the new full-precision ones
            refresh_cast_buffers(module, [unit_state(module)], pending.cast_buffer_values)
        start = pending.missing_start
        inside = [clean_fqn(k) for k in missing[start:] if clean_fqn(k) not in pending.own_keys]
        if len(missing) > start or pending.absent_keys:
            missing[start:] = _in_module_order(module, pending.prefix, inside + pending.absent_keys)
    missing[:] = [clean_fqn(k) for k in missing]
    unexpected[:] = [clean_fqn(k) for k in unexpected]


def register_state_dict_hooks(module: nn.Module) -> None:
    """Registers the save post-hook and the load pre/post-hooks on an FSDP instance."""
    module._register_state_dict_hook(save_post_hook)
    module._register_load_state_dict_pre_hook(load_pre_hook, with_module=True)
    module.register_load_state_dict_post_hook(load_post_hook)


def _check_tree(module: nn.Module, state_dict: dict[str, Any], strict: bool) -> None:
    """Checks every key, shape and layout of a load into an FSDP root, before anything changes.

    Raises:
        RuntimeError: Missing or unexpected keys (``strict``), size mismatches, SHARDED values
            of another layout (the same messages nn.Module and the hooks give).
        ValueError: LOCAL values of another layout.
    """
    kinds = {id(state): _effective_kind(sub, state) for _, sub, state in named_fsdp_states(module)}
    managed: "OrderedDict[str, tuple[_ManagedParam, UnitState]]" = OrderedDict()
    local: "OrderedDict[str, tuple[int, UnitState]]" = OrderedDict()
    orig_views: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    for name, _, state in named_fsdp_states(module):
        unit_prefix = name + "." if name else ""
        if kinds[id(state)] is StateDictType.LOCAL_STATE_DICT:
            for index, handle in enumerate(state.handles):
                local[unit_prefix + _flat_key(index)] = (index, state)
                # use_orig_params: nn.Module also saves (and loads) the sharded views.
                for info in handle.param_infos if handle.use_orig_params else []:
                    orig_views[unit_prefix + clean_fqn(info.fqn)] = getattr(info.module, info.param_name)
                for shared in handle.shared_param_infos if handle.use_orig_params else []:
                    orig_views[unit_prefix + clean_fqn(shared.fqn)] = getattr(shared.module, shared.param_name)
        else:
            for key, param in _unit_managed(state).items():
                managed[unit_prefix + key] = (param, state)
    others = _other_entries(module)
    others.update(orig_views)
    expected = list(managed) + list(local) + [k for k in others if k not in managed]
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in managed and k not in local and k not in others]
    if strict and (missing or unexpected):
        raise RuntimeError(_format_incompatible(module, missing, unexpected))
    mismatches: list[str] = []
    plain_tp_mismatches: set[str] = set()
    for key, (param, state) in managed.items():  # [Note: 2-D sharded values]
        if key in state_dict:
            state_dict[key], mismatch = _local_form_checked(key, param, state_dict[key], state)
            if mismatch is not None:
                mismatches.append(mismatch)
                plain_tp_mismatches.add(key)
    error: Optional[_LoadError] = None
    try:
        for key, value in state_dict.items():
            if key in plain_tp_mismatches:
                continue
            if key in managed:
                param, state = managed[key]
                mismatch = _check_managed(key, param, value, state)
            elif key in local:
                _check_local(key, local[key][0], value, local[key][1])
                mismatch = None
            elif key in others and _is_tensor_like(value) and not is_sharded_tensor(value):
                mismatch = _size_mismatch(key, value, others[key].shape)
            else:
                mismatch = None
            if mismatch is not None:
                mismatches.append(mismatch)
    except _LoadError as exc:
        error = exc
    if _needs_collectives([state_dict[k] for k in managed if k in state_dict]):
        _raise_unless_agreed(error, unit_state(module), "the state dict")
    if error is not None:
        raise error.error_type(str(error))
    if mismatches:
        raise RuntimeError(
            f"Error(s) in loading state_dict for {type(module).__name__}:\n\t" + "\n\t".join(mismatches)
        )


@during("load_state_dict")
def load_state_dict(module: nn.Module, super_load_state_dict: Any, state_dict: dict[str, Any], strict: bool, assign: bool) -> Any:
    """Loads a FULL, SHARDED or LOCAL state dict into an FSDP root: checks, then nn.Module + hooks."""
    if unit_state(module).has_fsdp_parent:
        raise RuntimeError(
            "fsdp: load_state_dict() must be called on the root FSDP instance (the outermost "
            "FullyShardedDataParallel), not on a nested unit."
        )
    lazy_init(module)
    check_idle(module, "load_state_dict()")
    _refuse_local_with_mesh(module, "load_state_dict() was called")
    _check_tree(module, state_dict, strict)
    _ROOT_CHECKED[0] = True
    try:
        return super_load_state_dict(state_dict, strict=strict, assign=assign)
    finally:
        _ROOT_CHECKED[0] = False
        _PENDING.clear()
