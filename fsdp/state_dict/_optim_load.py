"""Loading optimizer state dicts: an FQN-keyed state dict checked against the model, gathered
back to full values, then flattened (or, with ``use_orig_params``, sliced) to this rank's shard
and keyed as this rank's optimizer keys its own.

See [Note: Optimizer state dict formats] in ``_optim_state_dict.py``. Every name and shape is
checked before anything changes; with ``rank0_only`` or a sharded state dict the ranks first
agree that every rank's inputs are valid ([Note: Optimizer state keyed by names across ranks]
in ``_optim_keys.py``).
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from fsdp._comm import _collectives as comm
from fsdp._comm._phase import during
from fsdp.flat_param.flat_param import FlatParamHandle
from fsdp.state_dict._optim_keys import (
    ModelView,
    OptimStateAttributeError,
    OptimInput,
    OptimStateKeyError,
    ParamKey,
    add_user_states,
    agree,
    keys_by_fqn,
    optimizer_keys,
    param_list,
    refuse_rank0_only_tensor_parallel,
    split_user_states,
    warn_sharded_tensor_deprecated,
)
from fsdp.state_dict._values import ValueKind, tp_local

__all__ = ["to_load"]

# State dict values are Any here: torch types Optimizer.state_dict() as dict[str, Any].


@dataclasses.dataclass
class _HeldKeys:
    """What this rank's optimizer holds, and how its own state dict keys it.

    Attributes:
        params: The optimizer's parameters in ID order.
        keys: Each one's key in the optimizer's own state dict (ID, or a named optimizer's name).
        fqn_to_key: FQN -> the key of the parameter object the optimizer holds under that name.
    """

    params: list[nn.Parameter]
    keys: list[ParamKey]
    fqn_to_key: dict[str, ParamKey]


@during("optimizer state dict")
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
    optim_input: OptimInput = None,
) -> dict[str, Any]:
    """This rank's flattened / sharded optimizer state dict, keyed as ``optim`` keys its own.

    Keys are ``optim``'s parameter IDs, or with ``is_named_optimizer`` its parameter names (see
    [Note: Named optimizers]). Every name and shape is checked before anything changes. With
    ``rank0_only`` (rank 0's state dict is broadcast) or ``sharded`` (the values are gathered),
    the ranks first agree that every rank's inputs are valid, so a mistake on one rank raises on
    every rank instead of leaving the others in a collective (see
    [Note: Optimizer state keyed by names across ranks]).
    """
    view = ModelView(model)
    if rank0_only:
        refuse_rank0_only_tensor_parallel(view, "loading an optimizer state dict")
    if load_directly and optim is None:
        # torch FSDP1 fails with an AttributeError (on None.load_state_dict).
        raise OptimStateAttributeError("fsdp: load_directly=True needs the optimizer to load into; pass optim.")
    if optim_state_dict is not None:
        warn_sharded_tensor_deprecated(optim_state_dict)
    user_states: dict[Any, Any] = {}
    if optim is not None and optim_state_dict is not None:  # [Note: User-defined optimizer state]
        optim_state_dict, user_states = split_user_states(optim_state_dict, optim)
    osd, held = _prepare_load(
        view, model, optim, optim_state_dict, is_named_optimizer, group, rank0_only, sharded, optim_input
    )
    state = _gathered_state(osd, view)
    if not view.use_orig_params:
        out_state = _load_flat_states(view, state, held)
    else:
        out_state = _load_orig_states(view, state, held, optim if is_named_optimizer else None)
    for fqn, entry in state.items():
        if fqn in view.unmanaged and fqn in held.fqn_to_key:
            out_state[held.fqn_to_key[fqn]] = copy.copy(entry)
    add_user_states(out_state, user_states, warn=False)
    out: dict[str, Any] = {"state": out_state}
    if "param_groups" in osd:
        out["param_groups"] = _loaded_groups(
            osd["param_groups"], held.fqn_to_key, None if is_named_optimizer else optim, held.params, held.keys
        )
    if load_directly and optim is not None:  # (None raised above)
        optim.load_state_dict(out)
    return out


def _prepare_load(
    view: ModelView,
    model: nn.Module,
    optim: Optional[torch.optim.Optimizer],
    optim_state_dict: Optional[dict[str, Any]],
    is_named_optimizer: bool,
    group: Optional[dist.ProcessGroup],
    rank0_only: bool,
    sharded: bool,
    optim_input: OptimInput,
) -> tuple[dict[str, Any], _HeldKeys]:
    """The checked FQN-keyed state dict to load (rank 0's, broadcast, with ``rank0_only``) and
    this optimizer's keys. Raises on every rank together where the ranks must agree."""
    prepared: dict[str, Any] = {}
    osd: dict[str, Any] = {}

    def prepare_optimizer() -> None:
        params = param_list(model, optim, optim_input)
        keys = optimizer_keys(model, params, is_named_optimizer)
        prepared.update(params=params, keys=keys, fqn_to_key=keys_by_fqn(view, params, keys))

    if rank0_only:
        agree(prepare_optimizer, group, "match its optimizer to the model", view.compute_device)
        osd = _broadcast_from_rank0(optim_state_dict, view, group)
        _check_groups_held(osd, prepared["fqn_to_key"])
    else:

        def prepare() -> list[tuple[str, str, tuple[int, ...], str]]:
            nonlocal osd
            prepare_optimizer()
            if optim_state_dict is None:
                raise ValueError("fsdp: optim_state_dict must be an optimizer state dict, got None")
            osd = optim_state_dict
            _validate(optim_state_dict, view)
            _check_groups_held(optim_state_dict, prepared["fqn_to_key"])
            return _sharded_layout(optim_state_dict, view)

        if sharded:
            _check_layouts_agree(agree(prepare, group, "load its sharded optimizer state dict", view.compute_device))
        else:
            prepare()
    return osd, _HeldKeys(prepared["params"], prepared["keys"], prepared["fqn_to_key"])


def _gathered_state(osd: dict[str, Any], view: ModelView) -> dict[str, dict[str, Any]]:
    """The state by FQN with sharded values (DTensor / ShardedTensor) gathered back to full
    tensors, and a tensor-parallel parameter's values to its tp-local tensors ([Note:
    Tensor-parallel values to load] in ``_values.py``), in model order, then state names, the
    same on every rank."""
    state: dict[str, dict[str, Any]] = {fqn: dict(entry) for fqn, entry in osd["state"].items()}
    for fqn in view.fqn_to_param:
        entry = state.get(fqn)
        if not isinstance(entry, dict):
            continue
        spec = view.fqn_spec(fqn)
        for name in sorted(entry):
            value = entry[name]
            kind = ValueKind.of(value)
            if spec is not None and (kind.has_dims or kind.sharded):
                h, _ = view.fqn_to_slot[fqn]
                entry[name] = tp_local(value, spec, view.roots[h], view.compute_device)
            elif kind.sharded:
                entry[name] = kind.full_tensor(value, f"state '{name}' of '{fqn}'", view.compute_device)
    return state


def _load_flat_states(view: ModelView, state: dict[str, dict[str, Any]], held: _HeldKeys) -> dict[ParamKey, Any]:
    """use_orig_params=False: each FlatParameter's state (this rank's shard), by optimizer key."""
    param_to_key = {id(param): held.keys[position] for position, param in enumerate(held.params)}
    out_state: dict[ParamKey, Any] = {}
    for h, handle in enumerate(view.handles):
        fqns = view.handle_fqns[h]
        key = param_to_key.get(id(handle.flat_param))
        if key is None or not any(f in state for f in fqns):
            continue
        out_state[key] = _flatten_for_handle(handle, fqns, state)
    return out_state


def _load_orig_states(
    view: ModelView, state: dict[str, dict[str, Any]], held: _HeldKeys, named_optim: Optional[torch.optim.Optimizer]
) -> dict[ParamKey, Any]:
    """use_orig_params=True: this rank's part of each managed parameter's state, by optimizer key.

    ``named_optim``: a named optimizer (``is_named_optimizer``), which keeps its current state for
    a parameter this rank holds no part of (see ``_keep_named_state``); None otherwise.
    """
    key_to_param = {key: param for param, key in zip(held.params, held.keys)}
    out_state: dict[ParamKey, Any] = {}
    for fqn, entry in state.items():
        key = held.fqn_to_key.get(fqn)
        if key is None or fqn not in view.fqn_to_slot:
            continue
        h, index = view.fqn_to_slot[fqn]
        sharded_entry = _shard_orig_state(view.handles[h], index, entry)
        if sharded_entry:
            out_state[key] = sharded_entry
        elif named_optim is not None:
            _keep_named_state(named_optim, key_to_param[key], key, fqn, out_state)
    # In this optimizer's order, as torch FSDP1 gives it, whatever the saved order.
    position = {key: index for index, key in enumerate(held.keys)}
    return {key: out_state[key] for key in sorted(out_state, key=position.__getitem__)}


def _strip_tensors(osd: dict[str, Any]) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The structure of a state dict with its tensors with dimensions replaced by their
    metadata, and those tensors in the order of the structure."""
    tensors: list[torch.Tensor] = []

    def strip(value: Any) -> Any:
        if ValueKind.of(value).has_dims:
            tensors.append(value)
            return ("__fsdp_tensor__", tuple(value.shape), value.dtype)
        return value

    structure = {
        "state": {k: {n: strip(v) for n, v in st.items()} if isinstance(st, dict) else st for k, st in osd.get("state", {}).items()},
        **({"param_groups": copy.deepcopy(osd["param_groups"])} if "param_groups" in osd else {}),
    }
    return structure, tensors


def _broadcast_from_rank0(osd: Optional[dict[str, Any]], view: ModelView, group: Optional[dist.ProcessGroup]) -> dict[str, Any]:
    """rank0_only loading: rank 0's (validated) state dict on every rank."""
    rank = dist.get_rank(group)
    error: Optional[BaseException] = None
    stripped: dict[str, Any] = {}
    loaded: dict[str, Any] = {}  # rank 0: the validated state dict
    tensors: list[torch.Tensor] = []
    if rank == 0:
        try:
            if osd is None:
                # torch FSDP1 fails with a TypeError here.
                raise TypeError(
                    "fsdp: rank 0 must pass the full optimizer state dict (rank0_only / "
                    "scatter_full_optim_state_dict), got None"
                )
            _validate(osd, view)
            loaded = osd
        except (ValueError, TypeError) as exc:
            error = exc
        else:
            stripped, tensors = _strip_tensors(loaded)
    sent: dict[str, Any] = {"error": (type(error), str(error))} if error is not None else stripped
    structure = comm.broadcast_object_from_rank0(sent, group, view.compute_device)
    if error is not None:
        raise error
    if "error" in structure:
        error_type, message = structure["error"]
        raise error_type(message)
    if rank == 0:
        device = _comm_device(view)
        for value in tensors:
            comm.broadcast_from_rank0(value.detach().to(device).contiguous(), group)
        return loaded
    device = _comm_device(view)
    for key, st in structure["state"].items():
        for name, value in list(st.items()):
            if isinstance(value, tuple) and len(value) == 3 and value[0] == "__fsdp_tensor__":
                tensor = torch.empty(value[1], dtype=value[2], device=device)
                comm.broadcast_from_rank0(tensor, group)
                st[name] = tensor
    return structure


def _comm_device(view: ModelView) -> torch.device:
    return view.handles[0].device if view.handles else torch.device("cpu")


def _validate(osd: dict[str, Any], view: ModelView) -> None:
    """Checks names and shapes of a FQN-keyed state dict against the model (raises ValueError)."""
    if not isinstance(osd, dict) or "state" not in osd:
        raise ValueError(
            "fsdp: the optimizer state dict to load must be a dict with the key 'state' (as "
            "returned by FullyShardedDataParallel.optim_state_dict)."
        )
    kinds: dict[str, dict[str, ValueKind]] = {}
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
        kinds[key] = {}
        for name, value in entry.items():
            kind = kinds[key][name] = ValueKind.of(value)
            if kind.has_dims or kind.sharded:
                got = kind.global_shape(value)
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
                value_kinds = [kinds[f][name] for f in present]
                if value_kinds[0].has_dims or value_kinds[0].sharded:
                    dtypes = [kind.dtype(v) for kind, v in zip(value_kinds, values)]
                    if len(set(dtypes)) != 1:
                        raise ValueError(
                            f"All unflattened parameters comprising a single flat parameter "
                            f"must have positive-dimension tensor state with the same dtype "
                            f"(fsdp: optimizer state '{name}' has different dtypes "
                            f"{sorted({str(d) for d in dtypes})} across the "
                            f"parameters {present} of one FlatParameter)."
                        )
                    continue
                scalars = [v.item() if kind is ValueKind.SCALAR else v for kind, v in zip(value_kinds, values)]
                if len(present) != len(fqns) or any(x != scalars[0] for x in scalars):
                    raise ValueError(  # torch's tests match its sentence at the start
                        f"All unflattened parameters comprising a single flat parameter must "
                        f"have scalar state with the same value and dtype (fsdp: the parameters "
                        f"{fqns} share a FlatParameter, so their scalar optimizer state "
                        f"'{name}' must be present for all of them and equal; got "
                        f"{dict(zip(present, scalars))})."
                    )


def _flatten_for_handle(handle: FlatParamHandle, fqns: list[str], state: dict[str, Any]) -> dict[str, Any]:
    """use_orig_params=False: one FlatParameter's state (this rank's shard) from its parameters'."""
    present = [f for f in fqns if f in state]
    names = list(state[present[0]])
    flat_state: dict[str, Any] = {}
    for name in names:
        first = state[present[0]][name]
        kind = ValueKind.of(first)
        if kind.has_dims:
            pieces = []
            for index, fqn in enumerate(fqns):
                info = handle.param_infos[index]
                value = state[fqn][name] if fqn in state else None
                if value is None:
                    pieces.append(torch.zeros(info.numel, dtype=first.dtype, device=handle.device))
                else:
                    pieces.append(value.detach().reshape(-1).to(handle.device))
            flat = torch.cat(pieces)
            if handle.shard_layout.uses_sharding:
                padded = torch.zeros(handle.shard_layout.padded_unsharded_numel, dtype=flat.dtype, device=flat.device)
                padded[: flat.numel()].copy_(flat)
                flat = handle.shard_layout.local_slice(padded).clone()
            flat_state[name] = flat
        elif kind is ValueKind.SCALAR:
            flat_state[name] = first.detach().clone().cpu()
        else:
            flat_state[name] = first
    return flat_state


def _keep_named_state(
    optim: torch.optim.Optimizer, param: nn.Parameter, key: ParamKey, fqn: str, out_state: dict[ParamKey, Any]
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
        # Frames: this one, _load_orig_states, to_load, optim_state_dict_to_load_api, then the
        # wrapper's optim_state_dict_to_load, which the warning names.
        stacklevel=5,
    )


def _shard_orig_state(handle: FlatParamHandle, index: int, entry: dict[str, Any]) -> dict[str, Any]:
    """use_orig_params: this rank's part of one parameter's state.

    A rank that holds no part of the parameter gets no state at all (an empty dict), as in
    torch FSDP1: its gradient there is None, so its optimizer never makes state for it, and
    resuming then matches training straight on exactly.
    """
    piece = handle.shard_layout.shard_slices[index]
    if piece is None:
        return {}
    out: dict[str, Any] = {}
    for name, value in entry.items():
        kind = ValueKind.of(value)
        if kind.has_dims:
            value = value.detach().to(handle.device)
            if handle.shard_layout.uses_sharding:
                start = piece.offset_in_param
                value = value.reshape(-1)[start : start + piece.numel].clone()
            else:
                value = value.clone()
        elif kind is ValueKind.SCALAR:
            value = value.detach().clone()
        out[name] = value
    return out


def _check_groups_held(osd: dict[str, Any], fqn_to_key: dict[str, ParamKey]) -> None:
    for group_sd in osd.get("param_groups", []):
        missing = [f for f in group_sd["params"] if f not in fqn_to_key]
        if missing:
            # torch FSDP1 raises KeyError for this mistake.
            raise OptimStateKeyError(
                f"fsdp: a parameter group of the optimizer state dict lists {missing}, which "
                f"this optimizer does not hold."
            )


def _sharded_layout(osd: dict[str, Any], view: ModelView) -> list[tuple[str, str, tuple[int, ...], str]]:
    """The sharded values of a state dict in the order they are gathered: ``(fqn, state name,
    global shape, dtype)``, parameters in model order, state names sorted."""
    layout = []
    for fqn in view.fqn_to_param:
        entry = osd["state"].get(fqn)
        if not isinstance(entry, dict):
            continue
        for name in sorted(entry):
            value = entry[name]
            kind = ValueKind.of(value)
            if kind.sharded:
                layout.append((fqn, name, tuple(kind.global_shape(value)), str(kind.dtype(value))))
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
