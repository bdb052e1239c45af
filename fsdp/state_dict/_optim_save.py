"""Saving optimizer state dicts: the state of each FlatParameter (or each original parameter
with ``use_orig_params``) gathered, split per parameter and keyed by FQNs.

See [Note: Optimizer state dict formats] in ``_optim_state_dict.py``. Every rank first describes
its state by names and the ranks agree on it ([Note: Optimizer state keyed by names across
ranks] in ``_optim_keys.py``); then every rank runs the same gathers in the same order.

What must agree (saving), checked on every rank's gathered :class:`_RankOptimState`:

- ``use_orig_params=False``: every rank has state for the FlatParameters (and unmanaged
  parameters) that rank 0 has state for, as in torch FSDP1, which raises ``RuntimeError``
  naming the ranks and parameters; state a rank has beyond rank 0's is left out, as in torch.
  The saved keys follow rank 0's parameter order. Each FlatParameter's positive-dimension states
  are shaped like its local shard and have the same names and dtypes on every rank.
- ``use_orig_params=True``: a rank that holds part of a parameter has state for it whenever
  some rank has (torch FSDP1 raises ``RuntimeError`` or fails inside its all-gather); a rank
  that holds no part of it may lack it. Each state's numel is the rank's part of the parameter
  and its dtype is the same on every rank.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from fsdp._common import p_assert
from fsdp._comm import _collectives as comm
from fsdp._comm._phase import collective_phase, during
from fsdp.flat_param.flat_param import FlatParamHandle
from fsdp.state_dict._optim_keys import (
    ModelView,
    OptimInput,
    OptimStateKeyError,
    add_user_states,
    agree,
    keyed_by_names,
    names_to_ids,
    optimizer_keys,
    param_list,
    split_user_states,
    refuse_rank0_only_tensor_parallel,
)
from fsdp.state_dict._values import (
    NOBODY,
    PendingGather,
    ValueKind,
    gather,
    ShardedForm,
    start_gather,
    to_2d_dtensor,
    tp_dtensor,
)

__all__ = ["save"]

# State dict values are Any here: torch types Optimizer.state_dict() as dict[str, Any].


@dataclasses.dataclass(frozen=True)
class _SaveOptions:
    """How :func:`save` gives the state back.

    Attributes:
        to_save: This rank returns the state dict (False: ``rank0_only`` on a rank other than
            rank 0 of ``group``, which joins the collectives and returns ``{}``).
        shard: Each full value is chunked over its unit's group (a sharded state dict).
        offload: Values are copied to CPU.
        rank0_only_full: A full state dict gathered to rank 0 of ``group`` only.
        group: The process group the state dict API was called with.
    """

    to_save: bool
    shard: bool
    offload: bool
    rank0_only_full: bool
    group: Optional[dist.ProcessGroup]


@during("optimizer state dict")
def save(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: Optional[dict[str, Any]] = None,
    group: Optional[dist.ProcessGroup] = None,
    *,
    full: bool = True,
    rank0_only: bool = False,
    offload: bool = True,
    optim_input: OptimInput = None,
) -> dict[str, Any]:
    """The optimizer state keyed by parameter FQNs (see [Note: Optimizer state dict formats]).

    ``optim_state_dict`` (default ``optim.state_dict()``) may be keyed by IDs or, from a named
    optimizer, by names (see [Note: Named optimizers]). Ranks may list their parameters in
    different orders (see [Note: Optimizer state keyed by names across ranks]).
    """
    view = ModelView(model)
    if full and rank0_only:
        refuse_rank0_only_tensor_parallel(view, "saving an optimizer state dict")
    osd, params, infos, user_states = _prepare_save(view, model, optim, optim_state_dict, optim_input, group)
    options = _SaveOptions(
        to_save=not rank0_only or dist.get_rank(group) == 0 or not full,
        shard=not full,
        offload=offload,
        rank0_only_full=full and rank0_only,
        group=group,
    )
    if not view.use_orig_params:
        out_state = _save_flat_states(view, osd["state"], params, infos, options)
    else:
        out_state = _save_orig_states(view, osd["state"], params, infos, options)
    add_user_states(out_state, user_states, warn=True)  # [Note: User-defined optimizer state]
    if not options.to_save:
        return {}
    out: dict[str, Any] = {"state": out_state}
    if "param_groups" in osd:
        out["param_groups"] = _saved_groups(osd["param_groups"], view, params)
    return out


def _prepare_save(
    view: ModelView,
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: Optional[dict[str, Any]],
    optim_input: OptimInput,
    group: Optional[dist.ProcessGroup],
) -> tuple[dict[str, Any], list[nn.Parameter], list[_RankOptimState], dict[Any, Any]]:
    """The ID-keyed state dict to save, the parameters in ID order, every rank's
    :class:`_RankOptimState` (the ranks agree before any state moves: a mistake on one rank
    raises on every rank), and the user-defined state entries ([Note: User-defined optimizer
    state])."""
    prepared: dict[str, Any] = {}

    def prepare() -> _RankOptimState:
        osd = optim.state_dict() if optim_state_dict is None else optim_state_dict
        if not isinstance(osd, dict) or "state" not in osd:
            raise OptimStateKeyError(
                "fsdp: optim_state_dict must have the key 'state' (an optimizer state dict, as "
                "optim.state_dict() returns)"
            )
        params = param_list(model, optim, optim_input)
        osd, user = split_user_states(osd, optim)
        if keyed_by_names(osd):
            osd = names_to_ids(osd, optimizer_keys(model, params, named=True))
        prepared.update(osd=osd, params=params, user=user)
        return _local_optim_state(view, params, osd["state"])

    infos = agree(prepare, group, "describe its optimizer state", view.compute_device)
    return prepared["osd"], prepared["params"], infos, prepared["user"]


def _save_flat_states(
    view: ModelView,
    state: dict[Any, Any],
    params: list[nn.Parameter],
    infos: list[_RankOptimState],
    options: _SaveOptions,
) -> dict[str, Any]:
    """use_orig_params=False: the saved state of each parameter, in rank 0's order."""
    position_of = {id(param): position for position, param in enumerate(params)}
    out_state: dict[str, Any] = {}
    flat_fqns = {view.handle_fqns[h][0]: view.handle_fqns[h] for h in range(len(view.handles))}
    sharded_numels = {
        view.handle_fqns[h][0]: handle.shard_layout.sharded_numel for h, handle in enumerate(view.handles)
    }
    # Rank 0's order, every rank: the collectives below run in one order by names.
    for key in _check_save_flat(infos, flat_fqns, sharded_numels):
        param = view.fqn_to_param[key]
        entry = state[position_of[id(param)]]
        h = view.flat_to_handle.get(id(param))
        if h is None:
            if options.to_save:
                out_state[key] = _copy_unmanaged(entry, options.offload)
            continue
        handle = view.handles[h]
        dst = _receiver(handle, options.rank0_only_full, options.group)
        entries = _unflatten_flat_param_state(
            handle, view.forms[h], entry, options.to_save, options.shard, options.offload, dst
        )
        if options.to_save:
            out_state.update(zip(view.handle_fqns[h], entries))
    return out_state


def _save_orig_states(
    view: ModelView,
    state: dict[Any, Any],
    params: list[nn.Parameter],
    infos: list[_RankOptimState],
    options: _SaveOptions,
) -> dict[str, Any]:
    """use_orig_params=True: the saved state of each parameter, in torch FSDP1's order."""
    _check_save_orig(infos, [fqn for fqns in view.handle_fqns for fqn in fqns])
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
            handle, view.forms[h], view.handle_fqns[h], per_handle[h], options.to_save, options.shard, options.offload,
            _receiver(handle, options.rank0_only_full, options.group),
        )
        for h, handle in enumerate(view.handles)
    ]
    # torch FSDP1's order: unmanaged parameters, then each handle's (sorted) names, handles
    # ordered by their first name in sorted order.
    out_state: dict[str, Any] = {}
    for fqn in sorted(unmanaged):
        if options.to_save:
            out_state[fqn] = _copy_unmanaged(unmanaged[fqn], options.offload)
    nonempty = [r for r in results if r]
    for result in sorted(nonempty, key=lambda r: min(r)):
        out_state.update(result)
    return out_state


def _saved_groups(
    osd_groups: list[dict[str, Any]], view: ModelView, params: list[nn.Parameter]
) -> list[dict[str, Any]]:
    """This rank's own parameter groups, in its own order (as torch FSDP1), listing FQNs."""
    groups = []
    for group_sd in osd_groups:
        new = copy.deepcopy(group_sd)
        names: list[str] = []
        for key in group_sd["params"]:
            names.extend(view.param_to_fqns[id(params[key])])
        new["params"] = names
        groups.append(new)
    return groups


def _finish(
    value: torch.Tensor, handle: FlatParamHandle, index: int, form: ShardedForm, shard: bool, offload: bool, fresh: bool
) -> Any:
    """A full per-parameter value (of parameter ``index`` of ``handle``) as it goes into the
    returned state dict.

    ``fresh``: ``value`` views a buffer made for this call (else it views the optimizer's own
    state and is cloned). ``form``: how the unit's SHARDED values are made ([Note: Sharded value
    forms]: a ShardedTensor, or a DTensor for a model built with a ``device_mesh``; only the
    chunk is copied). A tensor-parallel parameter's value is its tp-local full tensor: a tp
    DTensor when full, a 2-D DTensor when sharded, as torch FSDP1 gives them ([Note: 2-D sharded
    values]).
    """
    spec = handle.param_infos[index].dtensor_spec
    if shard and spec is None and form.root is None:
        return form.value(value, offload)
    if not fresh:
        value = value.detach().clone()
    if offload:
        value = value.cpu()
    if shard and form.root is not None:
        return to_2d_dtensor(value, spec, form.root, offload)
    if spec is not None:
        return tp_dtensor(value, spec)  # NO_SHARD, sharded too: dp does not shard it
    return value


def _check_flat_state(handle: FlatParamHandle, name: str, value: torch.Tensor) -> None:
    """Internal: ``value`` is shaped like the FlatParameter's local shard (``_check_save_flat``
    checked every rank's before any collective)."""
    p_assert(
        value.dim() == 1 and value.numel() == handle.shard_layout.sharded_numel,
        f"optimizer state '{name}' of unit '{handle.unit_name}' has shape {tuple(value.shape)}, "
        f"expected ({handle.shard_layout.sharded_numel},)",
    )


def _start_flat_state_gather(handle: FlatParamHandle, sharded_value: torch.Tensor, dst: Optional[int]) -> PendingGather:
    """Starts gathering a shard-shaped state into a fresh padded unsharded tensor (on ``dst`` or all)."""
    sharded_value = sharded_value.detach().to(handle.device)
    with collective_phase(None, handle):
        return start_gather(sharded_value, handle.process_group, handle.rank, handle.world_size, dst)


def _gather_flat_states(
    handle: FlatParamHandle, flat_state: dict[str, Any], kinds: dict[str, ValueKind], dst: Optional[int]
) -> dict[str, tuple[Optional[torch.Tensor], bool]]:
    """Each positive-dimension state of a FlatParameter (``kinds``: each state's kind) in the
    unpadded unsharded layout.

    Returns ``name -> (unpadded unsharded value, fresh)``; the value is None on a rank that does
    not receive (``dst``), ``fresh`` whether it is a tensor made for this call. The gathers of
    all states run at once.
    """
    unpadded_numel = handle.shard_layout.unpadded_unsharded_numel
    pending: dict[str, PendingGather] = {}
    out: dict[str, tuple[Optional[torch.Tensor], bool]] = {}
    for name in sorted(flat_state):
        value = flat_state[name]
        if not kinds[name].has_dims:
            continue
        _check_flat_state(handle, name, value)
        if handle.shard_layout.uses_sharding:
            pending[name] = _start_flat_state_gather(handle, value, dst)
        else:
            out[name] = (value[:unpadded_numel], False)
    for name, pending_gather in pending.items():
        with collective_phase(None, handle):
            padded_unsharded = pending_gather.wait()
        unpadded = None if padded_unsharded is None else padded_unsharded[:unpadded_numel]
        out[name] = (unpadded, True)
    return {name: out[name] for name in sorted(out)}


def _split(handle: FlatParamHandle, flat: torch.Tensor) -> list[torch.Tensor]:
    """Each parameter's view of an unpadded unsharded flat value (alignment padding skipped)."""
    return handle.shard_layout.unsharded_views(flat)


def _unflatten_flat_param_state(
    handle: FlatParamHandle,
    form: ShardedForm,
    flat_state: dict[str, Any],
    to_save: bool,
    shard: bool,
    offload: bool,
    dst: Optional[int] = None,
) -> list[dict[str, Any]]:
    """Per original parameter, the state of a FlatParameter.

    ``dst``: the group rank that keeps the gathered states (rank0_only), None for every rank;
    ``form``: how the unit's SHARDED values are made.
    """
    kinds = {name: ValueKind.of(value) for name, value in flat_state.items()}
    gathered = _gather_flat_states(handle, flat_state, kinds, dst)
    if not to_save:
        return []
    tensors = {name: _split(handle, value) for name, (value, _) in gathered.items() if value is not None}
    fresh = {name: is_fresh for name, (_, is_fresh) in gathered.items()}
    p_assert(len(tensors) == len(gathered), f"the saving rank missed a gathered state of '{handle.unit_name}'")
    result = []
    for index in range(len(handle.param_infos)):
        entry: dict[str, Any] = {}
        for name, views in tensors.items():
            entry[name] = _finish(views[index], handle, index, form, shard, offload, fresh[name])
        for name in sorted(flat_state):
            value = flat_state[name]
            if kinds[name] is ValueKind.SCALAR:
                entry[name] = value.detach().clone().cpu() if offload else value.detach().clone()
        for name in sorted(flat_state):
            if kinds[name] is ValueKind.OTHER:
                entry[name] = flat_state[name]
        result.append(entry)
    return result


def _gather_orig_param_states(
    handle: FlatParamHandle,
    form: ShardedForm,
    fqns: list[str],
    local: dict[str, dict[str, Any]],
    to_save: bool,
    shard: bool,
    offload: bool,
    dst: Optional[int] = None,
) -> dict[str, dict[str, Any]]:
    """use_orig_params: the full state of each of a handle's parameters that has state on any rank.

    ``dst``: the group rank that keeps the gathered states (rank0_only), None for every rank;
    ``form``: how the unit's SHARDED values are made.
    """
    if not handle.shard_layout.uses_sharding:
        # As torch FSDP1: nothing to gather, plain tensors even for a sharded state dict.
        if not to_save:
            return {}
        out = {}
        for fqn in sorted(f for f in fqns if f in local):
            entry = {}
            spec = handle.param_infos[fqns.index(fqn)].dtensor_spec
            for name, value in local[fqn].items():
                if isinstance(value, torch.Tensor):
                    value = value.detach().clone()
                    if offload:
                        value = value.cpu()
                    if spec is not None and value.dim() > 0:
                        value = tp_dtensor(value, spec)
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
            value_kind = ValueKind.of(value)
            if value_kind.has_dims:
                info[fqn][name] = ("t", value.dtype, value.numel())
            elif value_kind is ValueKind.SCALAR:
                info[fqn][name] = ("s", value.detach().cpu())
            else:
                info[fqn][name] = ("o", value)
    with collective_phase(None, handle):
        gathered = comm.all_gather_object(info, handle.process_group, handle.device)
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
        local_shard = torch.zeros(handle.shard_layout.sharded_numel, dtype=dtype, device=handle.device)
        for index, fqn in enumerate(fqns):
            value = local.get(fqn, {}).get(name)
            offset, numel = handle.shard_layout.sharded_ranges[index]
            if value is None or numel == 0:
                continue
            p_assert(value.numel() == numel, f"state '{name}' of '{fqn}': {value.numel()} != {numel}")
            local_shard[offset : offset + numel].copy_(value.reshape(-1))
        with collective_phase(None, handle):
            padded_unsharded = gather(local_shard, handle.process_group, handle.rank, handle.world_size, dst)
        if padded_unsharded is None or not to_save:
            continue
        views = _split(handle, padded_unsharded[: handle.shard_layout.unpadded_unsharded_numel])
        for index, fqn in enumerate(fqns):
            if fqn in result:
                result[fqn][name] = _finish(views[index], handle, index, form, shard, offload, True)
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


def _copy_unmanaged(entry: dict[str, Any], offload: bool) -> dict[str, Any]:
    entry = copy.copy(entry)
    if offload:
        for name in sorted(entry):
            if isinstance(entry[name], torch.Tensor):
                entry[name] = entry[name].cpu()
    return entry


# ----------------------------------------------------------------------------- agreement
_StateMeta = tuple
"""One state's description: ``("t", dtype, shape)`` (positive-dimension tensor),
``("s", value, dtype)`` (zero-dimension tensor) or ``("o", value)`` (anything else)."""


@dataclasses.dataclass
class _RankOptimState:
    """One rank's optimizer state, described by parameter names (what ranks exchange).

    Attributes:
        keys: The names of the parameters with state, in this rank's optimizer-ID order.
        states: Name -> state name -> :data:`_StateMeta`.
        local_numels: use_orig_params: each managed parameter's numel on this rank (its part of
            the local shard; 0 where the rank holds none of it).
    """

    keys: list[str]
    states: dict[str, dict[str, _StateMeta]]
    local_numels: dict[str, int] = dataclasses.field(default_factory=dict)


def _describe_state(entry: dict[str, Any]) -> dict[str, _StateMeta]:
    """The :data:`_StateMeta` of each state of one parameter."""
    out: dict[str, _StateMeta] = {}
    for name in sorted(entry):
        value = entry[name]
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            out[name] = ("t", value.dtype, tuple(value.shape))
        elif isinstance(value, torch.Tensor):
            out[name] = ("s", value.item(), value.dtype)  # a number pickles far faster than a tensor
        else:
            out[name] = ("o", value)
    return out


def _local_optim_state(
    view: ModelView, params: list[nn.Parameter], state: dict[Any, Any]
) -> _RankOptimState:
    """This rank's :class:`_RankOptimState` (see [Note: Optimizer state keyed by names across ranks])."""
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
        states[fqns[0]] = _describe_state(state[position])
    local_numels: dict[str, int] = {}
    if view.use_orig_params:
        for h, handle in enumerate(view.handles):
            for index, fqn in enumerate(view.handle_fqns[h]):
                local_numels[fqn] = handle.shard_layout.sharded_ranges[index][1]
    return _RankOptimState(keys, states, local_numels)


def _shown(names: list[str]) -> str:
    return "[" + ", ".join(f"'{n}'" for n in names) + "]"


def _check_save_flat(
    infos: list[_RankOptimState],
    flat_fqns: dict[str, list[str]],
    flat_sharded_numel: dict[str, int],
) -> list[str]:
    """use_orig_params=False: the checks of [Note: Optimizer state keyed by names across ranks].

    Args:
        infos: Every rank's :class:`_RankOptimState`.
        flat_fqns: A FlatParameter's key -> the FQNs of its parameters.
        flat_sharded_numel: A FlatParameter's key -> its local shard's numel.

    Returns:
        The keys to save, in rank 0's order.

    Raises:
        RuntimeError: A rank lacks state rank 0 has (torch FSDP1's type).
        ValueError: A FlatParameter's state is misshaped, or its names or dtypes differ
            between ranks.
    """
    reference = infos[0].keys
    missing: list[str] = []
    for rank, info in enumerate(infos):
        have = set(info.keys)
        lacking = [key for key in reference if key not in have]
        if lacking:
            shown = ", ".join(
                f"the FlatParameter of {_shown(flat_fqns[key])}" if key in flat_fqns else f"'{key}'"
                for key in lacking
            )
            missing.append(f"rank {rank} has none for {shown}")
    if missing:
        raise RuntimeError(
            "fsdp: FSDP currently requires each rank to have at least the optimizer states "
            "needed by rank 0's optimizer but some ranks are missing some of those states: "
            f"every rank's optimizer must have state for the parameters rank 0's has (the "
            f"order may differ between ranks), but {'; '.join(missing)}. Build every rank's "
            f"optimizer from the same parameters and step it on every rank before saving."
        )
    for key in reference:
        if key not in flat_fqns:
            continue
        numel = flat_sharded_numel[key]
        tensor_states: list[dict[str, tuple]] = []
        for rank, info in enumerate(infos):
            tensors = {}
            for name, meta in info.states[key].items():
                if meta[0] != "t":
                    continue
                if len(meta[2]) != 1 or meta[2][0] != numel:
                    raise ValueError(
                        f"fsdp: optimizer state '{name}' of the FlatParameter of "
                        f"{_shown(flat_fqns[key])} has shape {meta[2]} on rank {rank}; expected "
                        f"({numel},), the parameter's sharded shape. Was this optimizer state "
                        f"dict made by another model?"
                    )
                tensors[name] = meta[1]
            tensor_states.append(tensors)
        for rank, tensors in enumerate(tensor_states):
            if tensors != tensor_states[0]:
                raise ValueError(
                    f"fsdp: the FlatParameter of {_shown(flat_fqns[key])} has tensor optimizer "
                    f"states {_describe_tensors(tensors)} on rank {rank} but {_describe_tensors(tensor_states[0])} "
                    f"on rank 0; every rank's optimizer must keep the same states."
                )
    return list(reference)


def _describe_tensors(tensors: dict[str, Any]) -> str:
    return "{" + ", ".join(f"'{n}': {str(d).replace('torch.', '')}" for n, d in sorted(tensors.items())) + "}"


def _check_save_orig(infos: list[_RankOptimState], managed_fqns: list[str]) -> None:
    """use_orig_params=True: the checks of [Note: Optimizer state keyed by names across ranks].

    Args:
        infos: Every rank's :class:`_RankOptimState`.
        managed_fqns: The FQNs of the parameters FSDP manages, in model order.

    Raises:
        RuntimeError: A rank that holds part of a parameter lacks state another rank has.
        ValueError: A state's numel is not the rank's part, or its dtype differs between ranks.
    """
    missing: dict[int, list[str]] = {}
    for fqn in managed_fqns:
        holders = [rank for rank, info in enumerate(infos) if fqn in info.states]
        if not holders:
            continue
        for rank, info in enumerate(infos):
            if fqn not in info.states and info.local_numels.get(fqn, 0) > 0:
                missing.setdefault(rank, []).append(fqn)
    if missing:
        lines = "; ".join(f"rank {rank} has none for {_shown(fqns)}" for rank, fqns in missing.items())
        raise RuntimeError(
            f"fsdp: every rank's optimizer must have state for the parameters whose shards it "
            f"holds wherever another rank's optimizer has state for them (the order may differ "
            f"between ranks), but {lines}. Build every rank's optimizer from the same parameters "
            f"and step it on every rank before saving."
        )
    for fqn in managed_fqns:
        dtypes: dict[str, tuple[int, Any]] = {}
        for rank, info in enumerate(infos):
            for name, meta in info.states.get(fqn, {}).items():
                if meta[0] != "t":
                    continue
                numel = math.prod(meta[2])
                expected = info.local_numels.get(fqn, 0)
                if numel != expected:
                    raise ValueError(
                        f"fsdp: optimizer state '{name}' of parameter '{fqn}' has {numel} elements "
                        f"on rank {rank}; its part of the shard has {expected}. Was this optimizer "
                        f"state dict made by another model?"
                    )
                if name in dtypes and dtypes[name][1] != meta[1]:
                    first_rank, first_dtype = dtypes[name]
                    raise ValueError(
                        f"fsdp: optimizer state '{name}' of parameter '{fqn}' is {meta[1]} on rank "
                        f"{rank} but {first_dtype} on rank {first_rank}; every rank's optimizer "
                        f"must keep the same states."
                    )
                dtypes.setdefault(name, (rank, meta[1]))
