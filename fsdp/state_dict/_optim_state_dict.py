"""Optimizer state dicts: unflatten (save) and flatten (load) the state of sharded parameters.

[Note: Optimizer state dict formats]
The optimizer holds per-rank state for what it optimizes: with ``use_orig_params=False`` one
entry per FlatParameter (positive-dimension tensors such as Adam's ``exp_avg`` are 1-D and
shard-shaped, ``sharded_numel`` elements, padding at the end of the last ranks' shards); with
``use_orig_params=True`` one entry per original Parameter, whose tensors are this rank's 1-D part
of the shard (possibly empty, or absent on a rank that holds no part of the parameter).

- Saving (``optim_state_dict``): the state is re-keyed by the original parameters' fully
  qualified names (their names in the unwrapped model; a tied parameter once, under its first
  name). Each positive-dimension state of a handle is gathered into a fresh padded unsharded
  tensor and split per parameter in its original shape (views of it: no further copies, see
  [Note: State dict gathers]); scalar states (``step``) and non-tensor states are copied.
  FULL_STATE_DICT returns full tensors (``offload_to_cpu``; ``rank0_only``: the states are
  sent to the saving rank only, point to point, and the others return ``{}``). Otherwise
  each full value is chunked along dim 0 like ``torch.chunk`` over the handle's shard group:
  a ``DTensor`` with ``Shard(0)`` on a 1-D mesh of that group (see [Note: No ShardedTensor]).
  Key and value order follow torch FSDP1.
- Loading (``optim_state_dict_to_load``): the inverse. Sharded values are gathered back to
  full tensors, every name and shape is checked against the model before anything changes,
  then each parameter's state is flattened (missing parameters of a FlatParameter get zeros),
  padded, and this rank's slice taken; the result is keyed by this optimizer's parameter IDs.
- Named optimizers (``NamedOptimizer`` / TorchRec's ``KeyedOptimizer``, see
  [Note: Named optimizers]) key their own state dicts by parameter names instead of IDs.

Every collective runs over a handle's own process group, in the same order on every rank,
an order fixed by parameter names, never by a rank's optimizer IDs (see
[Note: Optimizer state keyed by names across ranks] in ``_optim_agreement.py``). Exception
types follow torch FSDP1 (see [Note: Optimizer state dict exception types] in
``_optim_errors.py``).

[Note: Named optimizers]
A named optimizer's ``state_dict()`` keys ``state`` and each group's ``params`` by names, not
IDs. As in torch FSDP1, a parameter's name is the one ``model.named_parameters()`` gives the
parameter object the optimizer holds: with ``use_orig_params=False`` a FlatParameter's name
(``_fsdp_wrapped_module._flat_param``), with ``use_orig_params=True`` an original parameter's
name with the wrapper prefixes (``_fsdp_wrapped_module.layer._fsdp_wrapped_module.weight``),
and an unmanaged parameter's own name. The optimizer's parameter order (its IDs) is
``optim.param_groups``, as for any optimizer.

- Saving detects such a state dict by its string keys and re-keys it by IDs first (keeping
  each group's parameter order, which decides the order of the saved group's names); the
  result is the usual FQN-keyed state dict, whatever the optimizer.
- Loading with ``is_named_optimizer=True`` keys the result by these names, and each group's
  ``params`` are the sorted names (a named optimizer's ``state_dict()`` sorts them too). torch
  A parameter this rank holds no part of (use_orig_params) gets no loaded state there (its
  gradient is None there, so a plain optimizer has none; see ``_shard_orig_state``); with
  ``is_named_optimizer=True``, as in torch FSDP1, it keeps the optimizer's current state for
  it (``_keep_named_state``).
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from fsdp._common import clean_fqn, p_assert
from fsdp.api import OptimStateKeyType, StateDictType
from fsdp.flat_param.flat_param import FlatParamHandle
from fsdp._comm import _collectives as comm
from fsdp.runtime._state import check_idle, is_fsdp, unit_state
from fsdp.state_dict import _settings
from fsdp.state_dict._gather import NOBODY, PendingGather, gather, start_gather
from fsdp.state_dict._optim_agreement import (
    RankOptimState,
    agree,
    check_save_flat,
    check_save_orig,
    describe_state,
)
from fsdp.state_dict._optim_errors import (
    OptimStateAssertionError,
    OptimStateAttributeError,
    OptimStateIndexError,
    OptimStateKeyError,
    warn_legacy_api,
    warn_optim_input,
)

ParamKey = Union[int, str]
"""A parameter's key in an optimizer's own state dict: its ID, or a named optimizer's name."""

__all__ = [
    "save",
    "to_load",
    "optim_state_dict_api",
    "optim_state_dict_to_load_api",
    "full_optim_state_dict",
    "sharded_optim_state_dict",
    "shard_full_optim_state_dict",
    "flatten_sharded_optim_state_dict",
    "scatter_full_optim_state_dict",
    "rekey_optim_state_dict",
]


# ----------------------------------------------------------------------------- the model's view
_NO_FSDP = (
    "fsdp: the model contains no FullyShardedDataParallel instance; optimizer state dicts of an "
    "unwrapped model need no conversion (use optim.state_dict())."
)


class _ModelView:
    """Which parameter of ``model`` is what: FQNs, handles and positions inside them."""

    def __init__(self, model: nn.Module) -> None:
        units = [m for m in model.modules() if is_fsdp(m)]
        if not units:
            # torch FSDP1's legacy APIs fail with an IndexError (its list of FSDP modules is
            # empty); optim_state_dict / optim_state_dict_to_load see _settings_of.
            raise OptimStateIndexError(_NO_FSDP)
        for unit in units:
            if not unit_state(unit).has_fsdp_parent:
                check_idle(unit, "an optimizer state dict API")
        flags = {unit_state(u).handles[0].use_orig_params for u in units if unit_state(u).handles}
        self.use_orig_params = flags == {True}
        prefix: dict[int, str] = {}
        for name, module in model.named_modules(remove_duplicate=False):
            prefix.setdefault(id(module), name)
        self.handles: list[FlatParamHandle] = []
        self.handle_fqns: list[list[str]] = []
        # fqn -> (handle position, index in the handle)
        self.fqn_to_slot: dict[str, tuple[int, int]] = {}
        # id(param) -> the parameter's FQNs (a FlatParameter: all of its parameters' names)
        self.param_to_fqns: dict[int, list[str]] = {}
        self.flat_to_handle: dict[int, int] = {}
        self.orig_to_slot: dict[int, tuple[int, int]] = {}
        seen: set[int] = set()
        for unit in units:
            for handle in unit_state(unit).handles:
                if id(handle) in seen:
                    continue
                seen.add(id(handle))
                h = len(self.handles)
                fqns = []
                for index, info in enumerate(handle.param_infos):
                    base = prefix.get(id(info.module), "")
                    fqn = clean_fqn(f"{base}.{info.param_name}" if base else info.param_name)
                    fqns.append(fqn)
                    self.fqn_to_slot[fqn] = (h, index)
                self.handles.append(handle)
                self.handle_fqns.append(fqns)
                self.flat_to_handle[id(handle.flat_param)] = h
                self.param_to_fqns[id(handle.flat_param)] = list(fqns)
                for index, param in enumerate(handle.managed_orig_params()):
                    self.orig_to_slot[id(param)] = (h, index)
                    self.param_to_fqns[id(param)] = [fqns[index]]
        # Parameters FSDP does not manage (ignored modules): their own (cleaned) names.
        self.unmanaged: dict[str, nn.Parameter] = {}
        for name, param in model.named_parameters():
            if id(param) not in self.param_to_fqns:
                fqn = clean_fqn(name)
                self.param_to_fqns[id(param)] = [fqn]
                self.unmanaged[fqn] = param
        # fqn -> the parameter object an optimizer holds for it
        self.fqn_to_param: dict[str, nn.Parameter] = dict(self.unmanaged)
        for h, handle in enumerate(self.handles):
            origs = handle.managed_orig_params()
            for index, fqn in enumerate(self.handle_fqns[h]):
                self.fqn_to_param[fqn] = origs[index] if origs else handle.flat_param

    def fqn_shape(self, fqn: str) -> torch.Size:
        if fqn in self.fqn_to_slot:
            h, index = self.fqn_to_slot[fqn]
            return self.handles[h].param_infos[index].shape
        return self.unmanaged[fqn].shape

    def describe_fqns(self) -> str:
        names = list(self.fqn_to_param)
        shown = ", ".join(f"'{n}' {tuple(self.fqn_shape(n))}" for n in names[:8])
        more = f", ... ({len(names)} in all)" if len(names) > 8 else ""
        return shown + more


def _param_list(
    model: nn.Module, optim: Optional[torch.optim.Optimizer], optim_input: Optional[Any]
) -> list[nn.Parameter]:
    """The parameters in optimizer-ID order (``optim_input`` first, as torch FSDP1, else
    ``optim``, else the model's parameters).

    Raises:
        TypeError: ``optim_input`` is neither an iterable of tensors nor of parameter groups.
        ValueError: ``optim_input`` is empty.
    """
    if optim_input is None and optim is not None:
        return [p for group in optim.param_groups for p in group["params"]]
    if optim_input is None:
        return list(model.parameters())
    try:
        items = list(optim_input)
    except TypeError as exc:
        raise TypeError(
            f"fsdp: optim_input must be an iterable of tensors or of parameter groups (dicts), as "
            f"passed to the optimizer; got {type(optim_input).__name__}. Better: pass optim=."
        ) from exc
    if not items:
        raise ValueError("fsdp: optim_input is empty; pass what the optimizer was built from, or optim=.")
    if all(isinstance(item, dict) for item in items):
        for index, item in enumerate(items):
            if "params" not in item:
                raise OptimStateAssertionError(
                    f"fsdp: parameter group {index} of optim_input has no 'params' key."
                )
        return [p for group in items for p in (list(group["params"]) if not isinstance(group["params"], torch.Tensor) else [group["params"]])]
    if not all(isinstance(item, torch.Tensor) for item in items):
        kinds = sorted({type(item).__name__ for item in items})
        raise TypeError(
            f"fsdp: optim_input must hold only tensors or only parameter groups (dicts); got {kinds}."
        )
    return items


def _names_in_model(model: nn.Module) -> dict[int, str]:
    """id(param) -> the name ``model.named_parameters()`` gives it (its first name, uncleaned)."""
    return {id(param): name for name, param in model.named_parameters()}


def _optimizer_keys(model: nn.Module, params: list[nn.Parameter], named: bool) -> list[ParamKey]:
    """The key of each of the optimizer's parameters in its own state dict, in ID order.

    IDs for a ``torch.optim.Optimizer``; names for a named optimizer (see
    [Note: Named optimizers]).
    """
    if not named:
        return list(range(len(params)))
    names = _names_in_model(model)
    keys: list[ParamKey] = []
    for position, param in enumerate(params):
        if id(param) not in names:
            # torch FSDP1 fails with a KeyError looking the parameter up.
            raise OptimStateKeyError(
                f"fsdp: the named optimizer holds a parameter of shape {tuple(param.shape)} (ID "
                f"{position}) that is not a parameter of the model, so it has no name to key its "
                f"state by."
            )
        keys.append(names[id(param)])
    return keys


def _keyed_by_names(osd: dict[str, Any]) -> bool:
    """Whether an optimizer's own state dict comes from a named optimizer (string keys)."""
    keys = list(osd.get("state", {}))
    for group in osd.get("param_groups", []):
        keys.extend(group.get("params", []))
    names = [key for key in keys if isinstance(key, str)]
    if names and len(names) != len(keys):
        others = [key for key in keys if not isinstance(key, str)]
        raise ValueError(
            f"fsdp: the optimizer state dict mixes parameter names ({names[:3]}) and other keys "
            f"({others[:3]}); a state dict is keyed by parameter IDs or, from a named optimizer, "
            f"by parameter names."
        )
    return bool(names)


def _names_to_ids(osd: dict[str, Any], names: list[ParamKey]) -> dict[str, Any]:
    """A named optimizer's state dict re-keyed by parameter IDs (positions in ``names``)."""
    position = {name: key for key, name in enumerate(names)}

    def key_of(name: str, what: str) -> int:
        if name not in position:
            shown = ", ".join(f"'{n}'" for n in names[:8])
            more = f", ... ({len(names)} in all)" if len(names) > 8 else ""
            raise OptimStateKeyError(
                f"fsdp: the named optimizer's state dict has {what} '{name}', which is not the name "
                f"of a parameter the optimizer holds. Its keys must be the names "
                f"model.named_parameters() gives the optimizer's parameters: {shown}{more}."
            )
        return position[name]

    out: dict[str, Any] = {"state": {key_of(name, "state for"): entry for name, entry in osd["state"].items()}}
    if "param_groups" in osd:
        out["param_groups"] = [
            {**group, "params": [key_of(name, "a parameter group listing") for name in group["params"]]}
            for group in osd["param_groups"]
        ]
    return out


def _is_sharded_tensor(value: Any) -> bool:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return isinstance(value, ShardedTensor)


def _is_pos_dim(value: Any) -> bool:
    """A plain (or DTensor) tensor with dimensions. Never asks a ShardedTensor, whose every
    tensor method warns that ShardedTensor is deprecated (see [Note: No ShardedTensor])."""
    return isinstance(value, torch.Tensor) and not _is_sharded_tensor(value) and value.dim() > 0


def _is_zero_dim(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and not _is_sharded_tensor(value) and value.dim() == 0


# ----------------------------------------------------------------------------- sharded values
# [Note: No ShardedTensor]
# Sharded optimizer state dicts hold DTensors (Shard(0) on a 1-D mesh of the unit's shard group),
# as our sharded model state dicts do, never ShardedTensors: torch deprecates ShardedTensor and
# warns (FutureWarning) at every tensor method called on one, its own checkpoint planner's
# included, so a state dict holding them fills a user's log with warnings about our internals
# (torch FSDP1 gives ShardedTensors unless built with a device_mesh). Values, global shapes and
# the chunking along dim 0 are the same as torch FSDP1's; torch.distributed.checkpoint stores
# both alike, so checkpoints load across the two. ShardedTensors given to us to load (from torch
# FSDP1) are read through their metadata and local shards only, which do not warn.
_MESHES: dict[tuple[int, str], Any] = {}


def _mesh(group: dist.ProcessGroup, device_type: str) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    key = (id(group), device_type)
    if key not in _MESHES:
        _MESHES[key] = DeviceMesh.from_group(group, device_type)
    return _MESHES[key]


def _chunk(full: torch.Tensor, handle: FlatParamHandle) -> Any:
    """``full`` chunked along dim 0 over the handle's group like ``torch.chunk``: a DTensor
    holding this rank's chunk (empty on ranks past the last chunk)."""
    from torch.distributed.tensor import DTensor, Shard

    chunks = torch.chunk(full, handle.world_size, dim=0)
    if handle.rank < len(chunks):
        local = chunks[handle.rank].detach().clone()
    else:
        local = full.new_empty((0, *full.shape[1:]))
    return DTensor.from_local(
        local, _mesh(handle.process_group, full.device.type), [Shard(0)], run_check=False,
        shape=full.shape, stride=full.stride(),
    )


def _is_sharded_value(value: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor) or _is_sharded_tensor(value)


def _global_shape(value: Any) -> torch.Size:
    if _is_sharded_tensor(value):
        return torch.Size(value.metadata().size)
    return value.shape


def _dtype_of(value: Any) -> torch.dtype:
    if _is_sharded_tensor(value):
        return value.metadata().tensor_properties.dtype
    return value.dtype


def _gather_sharded(value: Any, where: str) -> torch.Tensor:
    """The full tensor of a DTensor or a dim-0 chunk-sharded ShardedTensor (a collective)."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.full_tensor()
    p_assert(_is_sharded_tensor(value), f"{where}: not a sharded value")
    group = value._process_group
    ws = dist.get_world_size(group)
    metadata = value.metadata()
    size = torch.Size(metadata.size)
    metas = sorted(metadata.shards_metadata, key=lambda m: m.shard_offsets[0])
    rows = math.ceil(size[0] / ws) if size[0] else 0
    expected = [len(c) for c in torch.chunk(torch.empty(size[0]), ws)] if size[0] else []
    if [m.shard_sizes[0] for m in metas] != expected or any(
        any(o != 0 for o in m.shard_offsets[1:]) for m in metas
    ):
        raise ValueError(
            f"fsdp: {where} is a ShardedTensor that is not chunked along dim 0 over its group "
            f"(shards {[(m.shard_offsets, m.shard_sizes) for m in metas]}); only the layout "
            f"FSDP's optim_state_dict produces can be loaded."
        )
    inner = int(math.prod(size[1:]))
    shards = value.local_shards()
    dtype = metadata.tensor_properties.dtype
    device = shards[0].tensor.device if shards else torch.device("cpu")
    if group is not None and dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    local = torch.zeros(rows * inner, dtype=dtype, device=device)
    if shards:
        t = shards[0].tensor.reshape(-1)
        local[: t.numel()].copy_(t)
    out = torch.empty(rows * inner * ws, dtype=dtype, device=device)
    comm.all_gather_flat(out, local, group)
    return out[: size[0] * inner].view(size)


# ----------------------------------------------------------------------------- saving
def _finish(value: torch.Tensor, handle: FlatParamHandle, shard: bool, offload: bool, fresh: bool) -> Any:
    """A full per-parameter value as it goes into the returned state dict.

    ``fresh``: ``value`` views a buffer made for this call (else it views the optimizer's own
    state and is cloned).
    """
    if not fresh:
        value = value.detach().clone()
    if offload:
        value = value.cpu()
    if shard:
        return _chunk(value, handle)
    return value


def _check_flat_state(handle: FlatParamHandle, name: str, value: torch.Tensor) -> None:
    """Internal: ``value`` is shaped like the FlatParameter's local shard (``check_save_flat``
    checked every rank's before any collective)."""
    p_assert(
        value.dim() == 1 and value.numel() == handle.sharded_numel,
        f"optimizer state '{name}' of unit '{handle.unit_name}' has shape {tuple(value.shape)}, "
        f"expected ({handle.sharded_numel},)",
    )


def _start_flat_state_gather(handle: FlatParamHandle, sharded_value: torch.Tensor, dst: Optional[int]) -> PendingGather:
    """Starts gathering a shard-shaped state into a fresh padded unsharded tensor (on ``dst`` or all)."""
    sharded_value = sharded_value.detach().to(handle.device)
    return start_gather(sharded_value, handle.process_group, handle.rank, handle.world_size, dst)


def _gather_flat_states(
    handle: FlatParamHandle, flat_state: dict[str, Any], dst: Optional[int]
) -> dict[str, tuple[Optional[torch.Tensor], bool]]:
    """Each positive-dimension state of a FlatParameter in the unpadded unsharded layout.

    Returns ``name -> (unpadded unsharded value, fresh)``; the value is None on a rank that does
    not receive (``dst``), ``fresh`` whether it is a tensor made for this call. The gathers of
    all states run at once.
    """
    pending: dict[str, PendingGather] = {}
    out: dict[str, tuple[Optional[torch.Tensor], bool]] = {}
    for name in sorted(flat_state):
        value = flat_state[name]
        if not _is_pos_dim(value):
            continue
        _check_flat_state(handle, name, value)
        if handle.uses_sharding:
            pending[name] = _start_flat_state_gather(handle, value, dst)
        else:
            out[name] = (value[: handle.unpadded_unsharded_numel], False)
    for name, pending_gather in pending.items():
        padded_unsharded = pending_gather.wait()
        unpadded = None if padded_unsharded is None else padded_unsharded[: handle.unpadded_unsharded_numel]
        out[name] = (unpadded, True)
    return {name: out[name] for name in sorted(out)}


def _split(handle: FlatParamHandle, flat: torch.Tensor) -> list[torch.Tensor]:
    """Each parameter's view of an unpadded unsharded flat value (alignment padding skipped)."""
    return handle.unsharded_views(flat)


def _unflatten_flat_param_state(
    handle: FlatParamHandle,
    flat_state: dict[str, Any],
    to_save: bool,
    shard: bool,
    offload: bool,
    dst: Optional[int] = None,
) -> list[dict[str, Any]]:
    """Per original parameter, the state of a FlatParameter.

    ``dst``: the group rank that keeps the gathered states (rank0_only), None for every rank.
    """
    gathered = _gather_flat_states(handle, flat_state, dst)
    if not to_save:
        return []
    tensors = {name: _split(handle, value) for name, (value, _) in gathered.items() if value is not None}
    fresh = {name: is_fresh for name, (_, is_fresh) in gathered.items()}
    p_assert(len(tensors) == len(gathered), f"the saving rank missed a gathered state of '{handle.unit_name}'")
    result = []
    for index in range(len(handle.param_infos)):
        entry: dict[str, Any] = {}
        for name, views in tensors.items():
            entry[name] = _finish(views[index], handle, shard, offload, fresh[name])
        for name in sorted(flat_state):
            value = flat_state[name]
            if _is_zero_dim(value):
                entry[name] = value.detach().clone().cpu() if offload else value.detach().clone()
        for name in sorted(flat_state):
            value = flat_state[name]
            if not isinstance(value, torch.Tensor):
                entry[name] = value
        result.append(entry)
    return result


def _gather_orig_param_states(
    handle: FlatParamHandle,
    fqns: list[str],
    local: dict[str, dict[str, Any]],
    to_save: bool,
    shard: bool,
    offload: bool,
    dst: Optional[int] = None,
) -> dict[str, dict[str, Any]]:
    """use_orig_params: the full state of each of a handle's parameters that has state on any rank.

    ``dst``: the group rank that keeps the gathered states (rank0_only), None for every rank.
    """
    if not handle.uses_sharding:
        # As torch FSDP1: nothing to gather, plain tensors even for a sharded state dict.
        if not to_save:
            return {}
        out = {}
        for fqn in sorted(f for f in fqns if f in local):
            entry = {}
            for name, value in local[fqn].items():
                if isinstance(value, torch.Tensor):
                    value = value.detach().clone()
                    if offload:
                        value = value.cpu()
                entry[name] = value
            out[fqn] = entry
        return out
    # What each rank holds: tensor (dtype, numel), scalar value, non-tensor value.
    info: dict[str, dict[str, tuple]] = {}
    for fqn in fqns:
        if fqn not in local:
            continue
        info[fqn] = {}
        for name, value in local[fqn].items():
            if _is_pos_dim(value):
                info[fqn][name] = ("t", value.dtype, value.numel())
            elif _is_zero_dim(value):
                info[fqn][name] = ("s", value.detach().cpu())
            else:
                info[fqn][name] = ("o", value)
    gathered = comm.all_gather_object(info, handle.process_group)
    with_state = [fqn for fqn in fqns if any(fqn in g for g in gathered)]
    tensor_names = sorted({n for g in gathered for st in g.values() for n, v in st.items() if v[0] == "t"})
    result: dict[str, dict[str, Any]] = {fqn: {} for fqn in sorted(with_state)}
    for fqn in result:
        per_rank = [g[fqn] for g in gathered if fqn in g]
        nonempty = [st for st in per_rank if any(v[0] == "t" and v[2] > 0 for v in st.values())]
        source = nonempty or per_rank
        for kind in ("o", "s"):
            for st in source:
                for name, v in sorted(st.items()):
                    if v[0] == kind and name not in result[fqn]:
                        result[fqn][name] = v[1]
    for name in tensor_names:
        dtype = next(v[1] for g in gathered for st in g.values() for n, v in st.items() if n == name and v[0] == "t")
        local_shard = torch.zeros(handle.sharded_numel, dtype=dtype, device=handle.device)
        for index, fqn in enumerate(fqns):
            value = local.get(fqn, {}).get(name)
            offset, numel = handle._orig_sharded_ranges[index]
            if value is None or numel == 0:
                continue
            p_assert(value.numel() == numel, f"state '{name}' of '{fqn}': {value.numel()} != {numel}")
            local_shard[offset : offset + numel].copy_(value.reshape(-1))
        padded_unsharded = gather(local_shard, handle.process_group, handle.rank, handle.world_size, dst)
        if padded_unsharded is None or not to_save:
            continue
        views = _split(handle, padded_unsharded[: handle.unpadded_unsharded_numel])
        for index, fqn in enumerate(fqns):
            if fqn in result:
                result[fqn][name] = _finish(views[index], handle, shard, offload, True)
    return result if to_save else {}


def _receiver(handle: FlatParamHandle, rank0_only_full: bool, group: Optional[dist.ProcessGroup]) -> Optional[int]:
    """Which rank of the handle's group keeps its gathered state.

    None: every rank (all-gather). With a rank0_only full state dict: the group rank of the rank
    that returns the state dict (rank 0 of ``group``), or ``NOBODY`` when that rank is not in
    the handle's group (hybrid sharding: another replica's group), so nothing is gathered.
    """
    if not rank0_only_full:
        return None
    saver = dist.get_global_rank(group, 0) if group is not None else 0
    ranks = dist.get_process_group_ranks(handle.process_group)
    return ranks.index(saver) if saver in ranks else NOBODY


def _local_optim_state(
    view: _ModelView, params: list[nn.Parameter], state: dict[Any, Any]
) -> RankOptimState:
    """This rank's :class:`RankOptimState` (see [Note: Optimizer state keyed by names across ranks])."""
    keys: list[str] = []
    states: dict[str, dict[str, Any]] = {}
    for position, param in enumerate(params):
        if position not in state:
            continue
        fqns = view.param_to_fqns.get(id(param))
        if fqns is None:
            raise OptimStateKeyError(
                f"fsdp: the optimizer holds a parameter of shape {tuple(param.shape)} (ID {position}) "
                f"that is not a parameter of the model."
            )
        keys.append(fqns[0])
        states[fqns[0]] = describe_state(state[position])
    local_numels: dict[str, int] = {}
    if view.use_orig_params:
        for h, handle in enumerate(view.handles):
            for index, fqn in enumerate(view.handle_fqns[h]):
                local_numels[fqn] = handle._orig_sharded_ranges[index][1]
    return RankOptimState(keys, states, local_numels)


def save(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: Optional[dict[str, Any]] = None,
    group: Optional[dist.ProcessGroup] = None,
    *,
    full: bool = True,
    rank0_only: bool = False,
    offload: bool = True,
    optim_input: Optional[Any] = None,
) -> dict[str, Any]:
    """The optimizer state keyed by parameter FQNs (see [Note: Optimizer state dict formats]).

    ``optim_state_dict`` (default ``optim.state_dict()``) may be keyed by IDs or, from a named
    optimizer, by names (see [Note: Named optimizers]). Ranks may list their parameters in
    different orders (see [Note: Optimizer state keyed by names across ranks]).
    """
    view = _ModelView(model)
    prepared: dict[str, Any] = {}

    def prepare() -> RankOptimState:
        osd = optim.state_dict() if optim_state_dict is None else optim_state_dict
        if not isinstance(osd, dict) or "state" not in osd:
            raise OptimStateKeyError(
                "fsdp: optim_state_dict must have the key 'state' (an optimizer state dict, as "
                "optim.state_dict() returns)"
            )
        params = _param_list(model, optim, optim_input)
        if _keyed_by_names(osd):
            osd = _names_to_ids(osd, _optimizer_keys(model, params, named=True))
        prepared.update(osd=osd, params=params)
        return _local_optim_state(view, params, osd["state"])

    infos = agree(prepare, group, "describe its optimizer state")
    osd, params = prepared["osd"], prepared["params"]
    state = osd["state"]
    position_of = {id(param): position for position, param in enumerate(params)}
    to_save = not rank0_only or dist.get_rank(group) == 0 or not full
    shard = not full
    out_state: dict[str, Any] = {}
    if not view.use_orig_params:
        flat_fqns = {view.handle_fqns[h][0]: view.handle_fqns[h] for h in range(len(view.handles))}
        sharded_numels = {view.handle_fqns[h][0]: handle.sharded_numel for h, handle in enumerate(view.handles)}
        # Rank 0's order, every rank: the collectives below run in one order by names.
        for key in check_save_flat(infos, flat_fqns, sharded_numels):
            param = view.fqn_to_param[key]
            entry = state[position_of[id(param)]]
            h = view.flat_to_handle.get(id(param))
            if h is None:
                if to_save:
                    out_state[key] = _copy_unmanaged(entry, offload)
                continue
            handle = view.handles[h]
            dst = _receiver(handle, full and rank0_only, group)
            entries = _unflatten_flat_param_state(handle, entry, to_save, shard, offload, dst)
            if to_save:
                out_state.update(zip(view.handle_fqns[h], entries))
    else:
        check_save_orig(infos, [fqn for fqns in view.handle_fqns for fqn in fqns])
        per_handle: list[dict[str, dict[str, Any]]] = [{} for _ in view.handles]
        unmanaged: dict[str, Any] = {}
        for key, param in enumerate(params):
            if key not in state:
                continue
            if id(param) in view.orig_to_slot:
                h, index = view.orig_to_slot[id(param)]
                per_handle[h][view.handle_fqns[h][index]] = state[key]
            else:
                unmanaged[view.param_to_fqns[id(param)][0]] = state[key]
        # Handles in model order on every rank (the collectives' order).
        results = [
            _gather_orig_param_states(
                handle, view.handle_fqns[h], per_handle[h], to_save, shard, offload,
                _receiver(handle, full and rank0_only, group),
            )
            for h, handle in enumerate(view.handles)
        ]
        # torch FSDP1's order: unmanaged parameters, then each handle's (sorted) names, handles
        # ordered by their first name in sorted order.
        for fqn in sorted(unmanaged):
            if to_save:
                out_state[fqn] = _copy_unmanaged(unmanaged[fqn], offload)
        nonempty = [r for r in results if r]
        for result in sorted(nonempty, key=lambda r: min(r)):
            out_state.update(result)
    if not to_save:
        return {}
    out: dict[str, Any] = {"state": out_state}
    if "param_groups" in osd:
        # This rank's own groups, in its own order (as torch FSDP1).
        groups = []
        for group_sd in osd["param_groups"]:
            new = copy.deepcopy(group_sd)
            names: list[str] = []
            for key in group_sd["params"]:
                names.extend(view.param_to_fqns[id(params[key])])
            new["params"] = names
            groups.append(new)
        out["param_groups"] = groups
    return out


def _copy_unmanaged(entry: dict[str, Any], offload: bool) -> dict[str, Any]:
    entry = copy.copy(entry)
    if offload:
        for name in sorted(entry):
            if isinstance(entry[name], torch.Tensor):
                entry[name] = entry[name].cpu()
    return entry


# ----------------------------------------------------------------------------- loading
def _strip_tensors(osd: dict[str, Any]) -> dict[str, Any]:
    """The structure of a state dict with positive-dimension tensors replaced by their metadata."""

    def strip(value: Any) -> Any:
        if _is_pos_dim(value):
            return ("__fsdp_tensor__", tuple(value.shape), value.dtype)
        return value

    return {
        "state": {k: {n: strip(v) for n, v in st.items()} if isinstance(st, dict) else st for k, st in osd.get("state", {}).items()},
        **({"param_groups": copy.deepcopy(osd["param_groups"])} if "param_groups" in osd else {}),
    }


def _broadcast_from_rank0(osd: Optional[dict[str, Any]], view: _ModelView, group: Optional[dist.ProcessGroup]) -> dict[str, Any]:
    """rank0_only loading: rank 0's (validated) state dict on every rank."""
    rank = dist.get_rank(group)
    error: Optional[BaseException] = None
    if rank == 0:
        try:
            if osd is None:
                # torch FSDP1 fails with a TypeError here.
                raise TypeError(
                    "fsdp: rank 0 must pass the full optimizer state dict (rank0_only / "
                    "scatter_full_optim_state_dict), got None"
                )
            _validate(osd, view)
        except (ValueError, TypeError) as exc:
            error = exc
    structure = comm.broadcast_object_from_rank0(
        {"error": (type(error), str(error))} if error is not None else (_strip_tensors(osd) if rank == 0 else None),  # type: ignore[arg-type]
        group,
    )
    if error is not None:
        raise error
    if "error" in structure:
        error_type, message = structure["error"]
        raise error_type(message)
    if rank == 0:
        device = _comm_device(view)
        for key, st in osd["state"].items():  # type: ignore[index]
            for name, value in st.items():
                if _is_pos_dim(value):
                    comm.broadcast_from_rank0(value.detach().to(device).contiguous(), group)
        return osd  # type: ignore[return-value]
    device = _comm_device(view)
    for key, st in structure["state"].items():
        for name, value in list(st.items()):
            if isinstance(value, tuple) and len(value) == 3 and value[0] == "__fsdp_tensor__":
                tensor = torch.empty(value[1], dtype=value[2], device=device)
                comm.broadcast_from_rank0(tensor, group)
                st[name] = tensor
    return structure


def _comm_device(view: _ModelView) -> torch.device:
    return view.handles[0].device if view.handles else torch.device("cpu")


def _validate(osd: dict[str, Any], view: _ModelView) -> None:
    """Checks names and shapes of a FQN-keyed state dict against the model (raises ValueError)."""
    if not isinstance(osd, dict) or "state" not in osd:
        raise ValueError(
            "fsdp: the optimizer state dict to load must be a dict with the key 'state' (as "
            "returned by FullyShardedDataParallel.optim_state_dict)."
        )
    for key, entry in osd["state"].items():
        if not isinstance(key, str):
            # torch FSDP1 fails with an AttributeError on the ID.
            raise OptimStateAttributeError(
                f"fsdp: optimizer state key {key!r} is not a parameter name. optim_state_dict_to_load "
                f"takes state keyed by fully qualified parameter names (from "
                f"FullyShardedDataParallel.optim_state_dict); rekey a plain optimizer state dict with "
                f"FullyShardedDataParallel.rekey_optim_state_dict(osd, OptimStateKeyType.PARAM_NAME, model)."
            )
        if key not in view.fqn_to_param:
            raise ValueError(
                f"fsdp: the optimizer state dict has state for '{key}', which is not a parameter of "
                f"this model. Was it saved from another model? The model's parameters are: "
                f"{view.describe_fqns()}."
            )
        shape = view.fqn_shape(key)
        for name, value in entry.items():
            if _is_pos_dim(value) or _is_sharded_value(value):
                got = _global_shape(value)
                if got != shape:
                    raise ValueError(
                        f"fsdp: optimizer state '{name}' of parameter '{key}' has shape "
                        f"{tuple(got)}, but the parameter has shape {tuple(shape)}. Was it saved "
                        f"from another model?"
                    )
    for group in osd.get("param_groups", []):
        for fqn in group.get("params", []):
            if fqn not in view.fqn_to_param:
                # torch FSDP1 fails with a KeyError here.
                raise OptimStateKeyError(
                    f"fsdp: a parameter group of the optimizer state dict lists '{fqn}', which is not "
                    f"a parameter of this model. The model's parameters are: {view.describe_fqns()}."
                )
    # The parameters of one FlatParameter must agree on their state names, scalars and types.
    if not view.use_orig_params:
        for h, fqns in enumerate(view.handle_fqns):
            present = [f for f in fqns if f in osd["state"]]
            if not present:
                continue
            names = {f: set(osd["state"][f]) for f in present}
            first = names[present[0]]
            for f in present[1:]:
                if names[f] != first:
                    raise ValueError(
                        f"fsdp: parameters '{present[0]}' and '{f}' share a FlatParameter but have "
                        f"different optimizer state names: {sorted(first)} vs {sorted(names[f])}."
                    )
            for name in first:
                values = [osd["state"][f][name] for f in present]
                if _is_pos_dim(values[0]) or _is_sharded_value(values[0]):
                    if len({_dtype_of(v) for v in values}) != 1:
                        raise ValueError(
                            f"fsdp: optimizer state '{name}' has different dtypes "
                            f"{sorted({str(_dtype_of(v)) for v in values})} across the parameters "
                            f"{present} of one FlatParameter."
                        )
                    continue
                scalars = [v.item() if _is_zero_dim(v) else v for v in values]
                if len(present) != len(fqns) or any(x != scalars[0] for x in scalars):
                    raise ValueError(
                        f"fsdp: the parameters {fqns} share a FlatParameter, so their scalar "
                        f"optimizer state '{name}' must be present for all of them and equal; got "
                        f"{dict(zip(present, scalars))}."
                    )


def _flatten_for_handle(handle: FlatParamHandle, fqns: list[str], state: dict[str, Any]) -> dict[str, Any]:
    """use_orig_params=False: one FlatParameter's state (this rank's shard) from its parameters'."""
    present = [f for f in fqns if f in state]
    names = list(state[present[0]])
    flat_state: dict[str, Any] = {}
    for name in names:
        first = state[present[0]][name]
        if _is_pos_dim(first):
            pieces = []
            for index, fqn in enumerate(fqns):
                info = handle.param_infos[index]
                value = state[fqn][name] if fqn in state else None
                if value is None:
                    pieces.append(torch.zeros(info.numel, dtype=first.dtype, device=handle.device))
                else:
                    pieces.append(value.detach().reshape(-1).to(handle.device))
            flat = torch.cat(pieces)
            if handle.uses_sharding:
                padded = torch.zeros(handle.padded_unsharded_numel, dtype=flat.dtype, device=flat.device)
                padded[: flat.numel()].copy_(flat)
                flat = handle.local_slice(padded).clone()
            flat_state[name] = flat
        elif _is_zero_dim(first):
            flat_state[name] = first.detach().clone().cpu()
        else:
            flat_state[name] = first
    return flat_state


def _keep_named_state(
    optim: Any, param: nn.Parameter, key: ParamKey, fqn: str, out_state: dict[ParamKey, Any]
) -> None:
    """A named optimizer's state for a parameter this rank holds none of, as torch FSDP1 gives it.

    torch FSDP1 keeps what the optimizer holds for it now (a named optimizer's ``init_state``
    makes state for every parameter), and warns when it holds nothing.
    """
    current = optim.state.get(param, None)
    if current is not None:
        out_state[key] = copy.deepcopy(current)
        return
    rank = dist.get_rank() if dist.is_initialized() else 0
    warnings.warn(
        f"optim_state[_OptimStateKey(unflat_param_names=({fqn!r},), is_fsdp_managed=True)] is not "
        f"on rank{rank}.",
        stacklevel=4,
    )


def _shard_orig_state(handle: FlatParamHandle, index: int, entry: dict[str, Any]) -> dict[str, Any]:
    """use_orig_params: this rank's part of one parameter's state.

    A rank that holds no part of the parameter gets no state at all (an empty dict), as in
    torch FSDP1: its gradient there is None, so its optimizer never makes state for it, and
    resuming then matches training straight on exactly.
    """
    piece = handle.shard_slices[index]
    if piece is None:
        return {}
    out: dict[str, Any] = {}
    for name, value in entry.items():
        if _is_pos_dim(value):
            value = value.detach().to(handle.device)
            if handle.uses_sharding:
                start = piece.offset_in_param
                value = value.reshape(-1)[start : start + piece.numel].clone()
            else:
                value = value.clone()
        elif _is_zero_dim(value):
            value = value.detach().clone()
        out[name] = value
    return out


def _fqn_to_key(view: _ModelView, params: list[nn.Parameter], keys: list[ParamKey]) -> dict[str, ParamKey]:
    """FQN -> this optimizer's key for the parameter object it holds under that name."""
    param_to_key = {id(param): keys[position] for position, param in enumerate(params)}
    return {fqn: param_to_key[id(param)] for fqn, param in view.fqn_to_param.items() if id(param) in param_to_key}


def _check_groups_held(osd: dict[str, Any], fqn_to_key: dict[str, ParamKey]) -> None:
    for group_sd in osd.get("param_groups", []):
        missing = [f for f in group_sd["params"] if f not in fqn_to_key]
        if missing:
            # torch FSDP1 raises KeyError for this mistake.
            raise OptimStateKeyError(
                f"fsdp: a parameter group of the optimizer state dict lists {missing}, which "
                f"this optimizer does not hold."
            )


def _sharded_layout(osd: dict[str, Any], view: _ModelView) -> list[tuple[str, str, tuple[int, ...], str]]:
    """The sharded values of a state dict in the order they are gathered: ``(fqn, state name,
    global shape, dtype)``, parameters in model order, state names sorted."""
    layout = []
    for fqn in view.fqn_to_param:
        entry = osd["state"].get(fqn)
        if not isinstance(entry, dict):
            continue
        for name in sorted(entry):
            value = entry[name]
            if _is_sharded_value(value):
                layout.append((fqn, name, tuple(_global_shape(value)), str(_dtype_of(value))))
    return layout


def _check_layouts_agree(layouts: list[list[tuple[str, str, tuple[int, ...], str]]]) -> None:
    for rank, layout in enumerate(layouts):
        if layout == layouts[0]:
            continue
        ours, theirs = set(layout), set(layouts[0])
        only_here = sorted(ours - theirs)[:3]
        only_rank0 = sorted(theirs - ours)[:3]
        raise ValueError(
            f"fsdp: the sharded optimizer state dicts passed on the ranks do not match: rank {rank} "
            f"has sharded values {only_here} that rank 0's lacks and lacks {only_rank0} (entries "
            f"are (parameter, state, global shape, dtype)). Every rank must pass its part of the "
            f"same sharded state dict."
        )


def _loaded_groups(
    osd_groups: list[dict[str, Any]],
    fqn_to_key: dict[str, ParamKey],
    optim: Optional[torch.optim.Optimizer],
    params: list[nn.Parameter],
    keys: list[ParamKey],
) -> list[dict[str, Any]]:
    """The saved parameter groups keyed by this optimizer's keys, in this optimizer's group order.

    ``optim.load_state_dict`` pairs saved groups with its own by position. When this rank's
    optimizer lists the same groups in another order than the saving rank's (each of its groups
    holds exactly the parameters of one saved group), the groups are put in this optimizer's
    order, so each gets its own hyperparameters back; torch FSDP1 keeps the saved order, which
    then fails or swaps hyperparameters between groups. Otherwise the saved order is kept.
    """
    groups = []
    for group_sd in osd_groups:
        new_group = copy.deepcopy(group_sd)
        new_group["params"] = sorted({fqn_to_key[f] for f in group_sd["params"]})
        groups.append(new_group)
    if optim is None or not hasattr(optim, "param_groups"):
        return groups
    key_of = {id(param): keys[position] for position, param in enumerate(params)}
    own = [sorted(key_of[id(p)] for p in g["params"] if id(p) in key_of) for g in optim.param_groups]
    saved = [g["params"] for g in groups]
    if len(own) != len(saved) or own == saved:
        return groups
    order = []
    for own_keys in own:
        matches = [i for i, saved_keys in enumerate(saved) if saved_keys == own_keys]
        if len(matches) != 1:
            return groups
        order.append(matches[0])
    if sorted(order) != list(range(len(groups))):
        return groups
    return [groups[i] for i in order]


def to_load(
    model: nn.Module,
    optim: Optional[torch.optim.Optimizer],
    optim_state_dict: Optional[dict[str, Any]],
    is_named_optimizer: bool = False,
    load_directly: bool = False,
    group: Optional[dist.ProcessGroup] = None,
    *,
    rank0_only: bool = False,
    sharded: bool = False,
    optim_input: Optional[Any] = None,
) -> dict[str, Any]:
    """This rank's flattened / sharded optimizer state dict, keyed as ``optim`` keys its own.

    Keys are ``optim``'s parameter IDs, or with ``is_named_optimizer`` its parameter names (see
    [Note: Named optimizers]). Every name and shape is checked before anything changes. With
    ``rank0_only`` (rank 0's state dict is broadcast) or ``sharded`` (the values are gathered),
    the ranks first agree that every rank's inputs are valid, so a mistake on one rank raises on
    every rank instead of leaving the others in a collective (see
    [Note: Optimizer state keyed by names across ranks]).
    """
    view = _ModelView(model)
    if load_directly and optim is None:
        # torch FSDP1 fails with an AttributeError (on None.load_state_dict).
        raise OptimStateAttributeError("fsdp: load_directly=True needs the optimizer to load into; pass optim.")
    prepared: dict[str, Any] = {}

    def prepare_optimizer() -> None:
        params = _param_list(model, optim, optim_input)
        keys = _optimizer_keys(model, params, is_named_optimizer)
        prepared.update(params=params, keys=keys, fqn_to_key=_fqn_to_key(view, params, keys))

    if rank0_only:
        agree(prepare_optimizer, group, "match its optimizer to the model")
        osd = _broadcast_from_rank0(optim_state_dict, view, group)
        _check_groups_held(osd, prepared["fqn_to_key"])
    else:

        def prepare() -> list[tuple[str, str, tuple[int, ...], str]]:
            prepare_optimizer()
            if optim_state_dict is None:
                raise ValueError("fsdp: optim_state_dict must be an optimizer state dict, got None")
            _validate(optim_state_dict, view)
            _check_groups_held(optim_state_dict, prepared["fqn_to_key"])
            return _sharded_layout(optim_state_dict, view)

        if sharded:
            _check_layouts_agree(agree(prepare, group, "load its sharded optimizer state dict"))
        else:
            prepare()
        osd = optim_state_dict  # type: ignore[assignment]
    params, keys, fqn_to_key = prepared["params"], prepared["keys"], prepared["fqn_to_key"]
    param_to_key = {id(param): keys[position] for position, param in enumerate(params)}
    # Gather sharded values (DTensor / ShardedTensor) back to full tensors, in the order of
    # _sharded_layout (model order, then state names), the same on every rank.
    state: dict[str, dict[str, Any]] = {fqn: dict(entry) for fqn, entry in osd["state"].items()}
    for fqn, name, _, _ in _sharded_layout(osd, view):
        state[fqn][name] = _gather_sharded(state[fqn][name], f"state '{name}' of '{fqn}'")

    out_state: dict[ParamKey, Any] = {}
    if not view.use_orig_params:
        for h, handle in enumerate(view.handles):
            fqns = view.handle_fqns[h]
            key = param_to_key.get(id(handle.flat_param))
            if key is None or not any(f in state for f in fqns):
                continue
            out_state[key] = _flatten_for_handle(handle, fqns, state)
    else:
        key_to_param = {key: param for param, key in zip(params, keys)}
        for fqn, entry in state.items():
            key = fqn_to_key.get(fqn)
            if key is None or fqn not in view.fqn_to_slot:
                continue
            h, index = view.fqn_to_slot[fqn]
            sharded_entry = _shard_orig_state(view.handles[h], index, entry)
            if sharded_entry:
                out_state[key] = sharded_entry
            elif is_named_optimizer and optim is not None:
                _keep_named_state(optim, key_to_param[key], key, fqn, out_state)
    for fqn, entry in state.items():
        if fqn in view.unmanaged and fqn in fqn_to_key:
            out_state[fqn_to_key[fqn]] = copy.copy(entry)
    out: dict[str, Any] = {"state": out_state}
    if "param_groups" in osd:
        out["param_groups"] = _loaded_groups(
            osd["param_groups"], fqn_to_key, None if is_named_optimizer else optim, params, keys
        )
    if load_directly:
        optim.load_state_dict(out)  # type: ignore[union-attr]
    return out


# ----------------------------------------------------------------------------- public entry points
def _settings_of(model: nn.Module) -> Any:
    units = [m for m in model.modules() if is_fsdp(m)]
    if not units:
        # torch FSDP1 fails with an AttributeError (its settings are None).
        raise OptimStateAttributeError(_NO_FSDP)
    return _settings.get_state_dict_type(units)  # what FSDP.get_state_dict_type(model) returns


def optim_state_dict_api(
    model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: Optional[dict[str, Any]], group: Optional[dist.ProcessGroup]
) -> dict[str, Any]:
    """``FullyShardedDataParallel.optim_state_dict``: the format follows ``state_dict_type``."""
    settings = _settings_of(model)
    full = settings.state_dict_type is StateDictType.FULL_STATE_DICT
    config = settings.optim_state_dict_config
    return save(
        model, optim, optim_state_dict, group,
        full=full,
        rank0_only=bool(getattr(config, "rank0_only", False)) if full else False,
        offload=bool(getattr(config, "offload_to_cpu", True)),
    )


def optim_state_dict_to_load_api(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: dict[str, Any],
    is_named_optimizer: bool,
    load_directly: bool,
    group: Optional[dist.ProcessGroup],
) -> dict[str, Any]:
    """``FullyShardedDataParallel.optim_state_dict_to_load``."""
    settings = _settings_of(model)
    full = settings.state_dict_type is StateDictType.FULL_STATE_DICT
    rank0_only = full and bool(getattr(settings.optim_state_dict_config, "rank0_only", False))
    return to_load(
        model, optim, optim_state_dict, is_named_optimizer, load_directly, group,
        rank0_only=rank0_only, sharded=not full,
    )


def full_optim_state_dict(
    model: nn.Module, optim: torch.optim.Optimizer, optim_input: Optional[Any], rank0_only: bool, group: Optional[dist.ProcessGroup]
) -> dict[str, Any]:
    """Legacy ``full_optim_state_dict``: full state keyed by FQNs, offloaded to CPU."""
    warn_legacy_api("full_optim_state_dict", "optim_state_dict")
    warn_optim_input(optim_input)
    return save(
        model, optim, optim.state_dict(), group, full=True, rank0_only=rank0_only, offload=True,
        optim_input=optim_input,
    )


def sharded_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, group: Optional[dist.ProcessGroup]) -> dict[str, Any]:
    """Legacy ``sharded_optim_state_dict``: per-parameter states chunked across ranks."""
    warn_legacy_api("sharded_optim_state_dict", "optim_state_dict")
    return save(
        model, optim, optim.state_dict(), group, full=False, offload=True
    )


def shard_full_optim_state_dict(
    full_osd: dict[str, Any], model: nn.Module, optim_input: Optional[Any], optim: Optional[torch.optim.Optimizer]
) -> dict[str, Any]:
    """Legacy ``shard_full_optim_state_dict``: every rank passes the full state dict."""
    warn_legacy_api("shard_full_optim_state_dict", "optim_state_dict_to_load")
    warn_optim_input(optim_input)
    return to_load(model, optim, full_osd, optim_input=optim_input)


def flatten_sharded_optim_state_dict(
    sharded_osd: dict[str, Any], model: nn.Module, optim: torch.optim.Optimizer
) -> dict[str, Any]:
    """Legacy ``flatten_sharded_optim_state_dict``."""
    warn_legacy_api("flatten_sharded_optim_state_dict", "optim_state_dict_to_load")
    return to_load(model, optim, sharded_osd, sharded=True)


def scatter_full_optim_state_dict(
    full_osd: Optional[dict[str, Any]],
    model: nn.Module,
    optim_input: Optional[Any],
    optim: Optional[torch.optim.Optimizer],
    group: Optional[dist.ProcessGroup],
) -> dict[str, Any]:
    """Legacy ``scatter_full_optim_state_dict``: only rank 0 needs the full state dict."""
    warn_legacy_api("scatter_full_optim_state_dict", "optim_state_dict_to_load")
    warn_optim_input(optim_input)
    return to_load(model, optim, full_osd, group=group, rank0_only=True, optim_input=optim_input)


def rekey_optim_state_dict(
    osd: dict[str, Any],
    key_type: Any,
    model: nn.Module,
    optim_input: Optional[Any],
    optim: Optional[torch.optim.Optimizer],
) -> dict[str, Any]:
    """Re-keys ``osd`` by parameter names (PARAM_NAME) or by optimizer parameter IDs (PARAM_ID).

    Local: no collectives, each rank re-keys by its own optimizer's IDs.
    """
    warn_optim_input(optim_input)
    name = getattr(key_type, "name", None)
    if name not in (OptimStateKeyType.PARAM_NAME.name, OptimStateKeyType.PARAM_ID.name):
        # torch FSDP1 rejects it with an AssertionError.
        raise OptimStateAssertionError(
            f"fsdp: optim_state_key_type must be OptimStateKeyType.PARAM_NAME or PARAM_ID, got {key_type!r}"
        )
    keys = list(osd.get("state", {}))
    by_name = [type(k) is str for k in keys]
    by_id = [type(k) is int for k in keys]
    if (any(by_name) and not all(by_name)) or (any(by_id) and not all(by_id)):
        raise ValueError(f"fsdp: invalid parameter keys (mixed names and IDs): {keys}")
    if (name == "PARAM_NAME" and all(by_name)) or (name == "PARAM_ID" and all(by_id)):
        return osd
    params = _param_list(model, optim, optim_input)
    fqn_of = _param_names(model)
    if name == "PARAM_NAME":
        id_to_name = []
        for p in params:
            if id(p) not in fqn_of:
                raise OptimStateKeyError(
                    f"fsdp: the optimizer holds a parameter of shape {tuple(p.shape)} that is not "
                    f"a parameter of the model."
                )
            id_to_name.append(fqn_of[id(p)])

        def rekey(k: Any) -> Any:
            if not isinstance(k, int) or not 0 <= k < len(id_to_name):
                raise OptimStateIndexError(
                    f"fsdp: parameter ID {k!r} is out of range: the optimizer has {len(id_to_name)} parameters."
                )
            return id_to_name[k]
    else:
        name_to_id = {fqn_of[id(p)]: k for k, p in enumerate(params) if id(p) in fqn_of}

        def rekey(k: Any) -> Any:
            if k not in name_to_id:
                raise OptimStateKeyError(
                    f"fsdp: parameter name '{k}' is not a parameter the optimizer holds; known names: "
                    f"{sorted(name_to_id)[:8]}."
                )
            return name_to_id[k]

    new: dict[str, Any] = {"state": {rekey(k): v for k, v in osd["state"].items()}}
    new["param_groups"] = copy.deepcopy(osd["param_groups"])
    for group in new["param_groups"]:
        group["params"] = sorted(rekey(k) for k in group["params"])
    return new


def _param_names(model: nn.Module) -> dict[int, str]:
    """id(param) -> its (first, cleaned) name, for wrapped and unwrapped models alike."""
    names: dict[int, str] = {}
    if any(is_fsdp(m) for m in model.modules()):
        view = _ModelView(model)
        for pid, fqns in view.param_to_fqns.items():
            names[pid] = fqns[0]
        return names
    for name, param in model.named_parameters():
        names.setdefault(id(param), name)
    return names
