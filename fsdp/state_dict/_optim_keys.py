"""Optimizer state dicts: which parameter is which (by FQN, by optimizer key, in the model), how
the ranks agree on it, and the exception types of the optimizer-state APIs.

An optimizer keys its own state dict by parameter IDs (positions in its ``param_groups``) or, a
named optimizer, by the names ``model.named_parameters()`` gives (see [Note: Named optimizers]
in ``_optim_state_dict.py``); FSDP's optimizer state dicts key it by the original parameters'
fully qualified names. :class:`ModelView` maps a wrapped model's parameters to FQNs, handles
and positions inside them; the functions here translate between the three kinds of keys. No
collectives, except in :func:`agree`.

[Note: Optimizer state keyed by names across ranks]
An optimizer's own state dict keys parameters by IDs: positions in *that rank's*
``optim.param_groups``. Ranks may build their optimizers from the same parameters in different
orders (``reversed(list(model.parameters()))`` on one rank, parameter groups in another order),
so an ID means nothing to another rank. Everything that crosses ranks is keyed by names: a
FlatParameter by its first parameter's FQN, an original or unmanaged parameter by its FQN.

Before the first collective that moves state, every rank all-gathers (:func:`agree`) what it
holds, described by names (saving: which parameters have state, and each state's kind, dtype
and shape, see ``_optim_save.py``; no tensor data), and then runs the same checks on the same
gathered data, so either every rank goes on, with the
collectives in one order fixed by names, or every rank raises the same exception type naming
the parameters and the ranks. A rank whose own preparation raised still joins that all-gather
(carrying its error), so the others raise too instead of waiting in a collective it never joins.

[Note: Optimizer state dict exception types]
torch FSDP1 is the contract for *which* exception type a user mistake raises, so that code that
catches torch's types keeps working; our messages stay ours (they name the parameter, the rank
and the remedy). Where torch raises ``ValueError``/``RuntimeError``/``TypeError`` we raise the
same. Where torch fails with a lookup error for the same mistake (a ``KeyError`` from a dict of
names, an ``IndexError`` from a list of IDs), an ``AttributeError`` or an ``AssertionError``, we raise a class that is
*both* that type and ``ValueError``: ``except KeyError`` (torch) and ``except ValueError`` (ours
since the first release) both catch it, and its message is printed as written (a plain
``KeyError`` would print its message quoted).
"""

from __future__ import annotations

import copy
import os
import sys
import warnings
from types import FrameType
from typing import Any, Callable, Iterable, Optional, TypeVar, Union, cast

import torch
import torch.distributed as dist
from torch import nn

from fsdp._common import clean_fqn
from fsdp._comm import _collectives as comm
from fsdp.api import OptimStateKeyType
from fsdp.flat_param.flat_param import FlatParamHandle
from fsdp.runtime._state import check_idle, is_fsdp, unit_state
from fsdp.state_dict._values import ShardedForm, parent_mesh

# torch FSDP1's legacy ``optim_input`` argument: the optimizer's param groups (torch types them
# Dict[str, Any]) or its parameters.
OptimInput = Optional[Union[list[dict[str, Any]], Iterable[nn.Parameter]]]

__all__ = [
    "OptimStateKeyError",
    "OptimStateIndexError",
    "OptimStateAssertionError",
    "OptimStateAttributeError",
    "ParamKey",
    "NO_FSDP",
    "ModelView",
    "refuse_rank0_only_tensor_parallel",
    "param_list",
    "optimizer_keys",
    "keyed_by_names",
    "names_to_ids",
    "keys_by_fqn",
    "rekey",
    "agree",
    "split_user_states",
    "add_user_states",
    "user_stacklevel",
    "warn_sharded_tensor_deprecated",
]

# State dict values are Any here: torch types Optimizer.state_dict() as dict[str, Any].

T = TypeVar("T")


# ----------------------------------------------------------------------------- warnings
_FSDP_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def user_stacklevel() -> int:
    """The ``stacklevel`` that attributes a warning to the first caller outside ``fsdp``.

    Counted for a ``warnings.warn`` call made by the caller of this function.
    """
    frame: Optional[FrameType] = sys._getframe(1)  # the function that calls warnings.warn
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_FSDP_DIR + os.sep):
        frame = frame.f_back
        level += 1
    return level


def warn_sharded_tensor_deprecated(osd: dict[str, Any]) -> None:
    """torch's FutureWarning about ShardedTensor, once, when a state dict to load holds
    ShardedTensor values (torch FSDP1's sharded form), attributed to the caller's line.

    torch FSDP1 warns there: it reads those values through ShardedTensor's deprecated tensor
    methods. fsdp reads them through their metadata and local shards ([Note: No ShardedTensor] in
    ``_values.py``), which do not warn, so it says it itself: the values are deprecated all the
    same, and code that turns FutureWarnings into errors meets it where it meets torch's.
    """
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    state = osd.get("state", {}) if isinstance(osd, dict) else {}
    entries = [entry for entry in state.values() if isinstance(entry, dict)]
    if any(isinstance(value, ShardedTensor) for entry in entries for value in entry.values()):
        warnings.warn(
            "Please use DTensor instead and we are deprecating ShardedTensor.",  # torch's text
            FutureWarning,
            stacklevel=user_stacklevel(),
        )


# ----------------------------------------------------------------------------- user-defined state
# [Note: User-defined optimizer state]
# An optimizer may keep state under a key that is no parameter (a step counter of a custom
# optimizer, state TorchRec manages). torch FSDP1 copies such an entry as it is into the state
# dict it saves, with its UserWarning, and into the one it loads. fsdp does the same for a key
# the optimizer itself holds state under that is no parameter (``optim.state["counter"]``), so a
# state dict of another model, or keyed by the wrong names, is still refused, naming the keys.
_USER_STATE_WARNING = (
    "Found a optim state, {key}, that FSDP cannot process. FSDP will directly copy everything to "
    "the returned state_dict. In most cases, this is a user-defined state that is not associated "
    "with any particular parameter. Another possible case is this state is managed by TorchRec. "
    "Otherwise, there may  be a mismatched assumption of optim_state_dict of this mode."
)


def split_user_states(osd: dict[str, Any], optim: Any) -> tuple[dict[str, Any], dict[Any, Any]]:
    """``osd`` without its user-defined state entries, and those entries: the keys ``optim``
    holds state under that are no parameter ([Note: User-defined optimizer state]). ``osd``
    itself is not changed."""
    state = osd.get("state") if isinstance(osd, dict) else None
    held = {key for key in getattr(optim, "state", {}) if not isinstance(key, torch.Tensor)}
    if not isinstance(state, dict) or not held:
        return osd, {}
    user = {key: value for key, value in state.items() if key in held}
    if not user:
        return osd, {}
    return {**osd, "state": {key: value for key, value in state.items() if key not in user}}, user


def add_user_states(out_state: dict[Any, Any], user: dict[Any, Any], warn: bool) -> None:
    """Copies user-defined state entries into a returned state dict (``warn``: with torch
    FSDP1's UserWarning, as its saves give it)."""
    for key, value in user.items():
        if warn:
            warnings.warn(_USER_STATE_WARNING.format(key=key), stacklevel=4)
        out_state[key] = copy.copy(value)


# ----------------------------------------------------------------------------- exception types
class OptimStateKeyError(ValueError, KeyError):
    """A name that is not where it must be; torch FSDP1 raises ``KeyError`` for the same mistake."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class OptimStateIndexError(ValueError, IndexError):
    """An ID or index out of range; torch FSDP1 raises ``IndexError`` for the same mistake."""


class OptimStateAssertionError(ValueError, AssertionError):
    """An argument torch FSDP1 rejects with an ``AssertionError``."""


class OptimStateAttributeError(ValueError, AttributeError):
    """A key of the wrong kind; torch FSDP1 fails with an ``AttributeError`` on it."""


# ----------------------------------------------------------------------------- keys
ParamKey = Union[int, str]
"""A parameter's key in an optimizer's own state dict: its ID, or a named optimizer's name."""

NO_FSDP = (
    "fsdp: the model contains no FullyShardedDataParallel instance; optimizer state dicts of an "
    "unwrapped model need no conversion (use optim.state_dict())."
)


class ModelView:
    """Which parameter of ``model`` is what: FQNs, handles and positions inside them."""

    def __init__(self, model: nn.Module) -> None:
        units = [m for m in model.modules() if is_fsdp(m)]
        if not units:
            # torch FSDP1's legacy APIs fail with an IndexError (its list of FSDP modules is
            # empty); optim_state_dict / optim_state_dict_to_load see _settings_of.
            raise OptimStateIndexError(NO_FSDP)
        for unit in units:
            if not unit_state(unit).has_fsdp_parent:
                check_idle(unit, "an optimizer state dict API")
        flags = {unit_state(u).handles[0].use_orig_params for u in units if unit_state(u).handles}
        self.use_orig_params = flags == {True}
        # Where object collectives stage ([Note: Object collectives' device] in fsdp/_comm/).
        self.compute_device: torch.device = unit_state(units[0]).compute_device
        prefix: dict[int, str] = {}
        for name, module in model.named_modules(remove_duplicate=False):
            prefix.setdefault(id(module), name)
        self.handles: list[FlatParamHandle] = []
        self.handle_fqns: list[list[str]] = []
        # Each handle's unit's parent mesh ([Note: 2-D sharded values]), None if none.
        self.roots: list[Any] = []
        # How each handle's unit makes SHARDED values ([Note: Sharded value forms]), once per call.
        self.forms: list[ShardedForm] = []
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
                self.roots.append(parent_mesh(unit_state(unit)))
                self.forms.append(ShardedForm(unit_state(unit)))
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
        """The parameter's shape as the user sees it (a tensor-parallel one's global shape)."""
        spec = self.fqn_spec(fqn)
        if spec is not None:
            return spec.shape
        if fqn in self.fqn_to_slot:
            h, index = self.fqn_to_slot[fqn]
            return self.handles[h].param_infos[index].shape
        return self.unmanaged[fqn].shape

    def fqn_spec(self, fqn: str) -> Optional[Any]:
        """A tensor-parallel parameter's DTensor spec ([Note: DTensor parameters]), else None."""
        if fqn not in self.fqn_to_slot:
            return None
        h, index = self.fqn_to_slot[fqn]
        return self.handles[h].param_infos[index].dtensor_spec

    def describe_fqns(self) -> str:
        names = list(self.fqn_to_param)
        shown = ", ".join(f"'{n}' {tuple(self.fqn_shape(n))}" for n in names[:8])
        more = f", ... ({len(names)} in all)" if len(names) > 8 else ""
        return shown + more


def refuse_rank0_only_tensor_parallel(view: ModelView, api: str) -> None:
    """Raises before anything moves if ``rank0_only`` meets tensor-parallel (DTensor) parameters.

    One rank cannot return (or hand out) the state of every tp piece: each tp rank holds its own.
    Torch FSDP1 hangs there (its ranks leave the dp groups' gathers unmatched).

    Raises:
        NotImplementedError: Naming the first DTensor parameter and what works instead.
    """
    for h, handle in enumerate(view.handles):
        for index, info in enumerate(handle.param_infos):
            if info.dtensor_spec is not None:
                raise NotImplementedError(
                    f"fsdp: {api} with rank0_only=True does not support tensor-parallel (DTensor) "
                    f"parameters: parameter '{view.handle_fqns[h][index]}' of FSDP unit "
                    f"'{handle.unit_name}' is a DTensor (placements "
                    f"{list(info.dtensor_spec.placements)}), and one rank cannot hold every tp "
                    f"rank's piece (torch FSDP1 hangs here). Use rank0_only=False "
                    f"(FullOptimStateDictConfig(rank0_only=False); with torch.distributed."
                    f"checkpoint.state_dict, full_state_dict=True without cpu_offload or broadcast_from_rank0) or a "
                    f"SHARDED_STATE_DICT."
                )


def param_list(
    model: nn.Module, optim: Optional[torch.optim.Optimizer], optim_input: OptimInput
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
        items: list[Any] = list(optim_input)  # Any: the user's items, their kinds checked below
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
        return [p for group in items for p in _group_params(group["params"])]
    if not all(isinstance(item, torch.Tensor) for item in items):
        kinds = sorted({type(item).__name__ for item in items})
        raise TypeError(
            f"fsdp: optim_input must hold only tensors or only parameter groups (dicts); got {kinds}."
        )
    return items


def _group_params(params: Any) -> list[Any]:
    """A parameter group's ``params`` as a list (a group may hold one tensor, not a list)."""
    return [params] if isinstance(params, torch.Tensor) else list(params)


def _names_in_model(model: nn.Module) -> dict[int, str]:
    """id(param) -> the name ``model.named_parameters()`` gives it (its first name, uncleaned)."""
    return {id(param): name for name, param in model.named_parameters()}


def optimizer_keys(model: nn.Module, params: list[nn.Parameter], named: bool) -> list[ParamKey]:
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


def keyed_by_names(osd: dict[str, Any]) -> bool:
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


def names_to_ids(osd: dict[str, Any], names: list[ParamKey]) -> dict[str, Any]:
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


def keys_by_fqn(view: ModelView, params: list[nn.Parameter], keys: list[ParamKey]) -> dict[str, ParamKey]:
    """FQN -> this optimizer's key for the parameter object it holds under that name."""
    param_to_key = {id(param): keys[position] for position, param in enumerate(params)}
    return {fqn: param_to_key[id(param)] for fqn, param in view.fqn_to_param.items() if id(param) in param_to_key}


def rekey(
    osd: dict[str, Any],
    key_type: Any,
    model: nn.Module,
    optim_input: OptimInput,
    optim: Optional[torch.optim.Optimizer],
) -> dict[str, Any]:
    """Re-keys ``osd`` by parameter names (PARAM_NAME) or by optimizer parameter IDs (PARAM_ID).

    Local: no collectives, each rank re-keys by its own optimizer's IDs. The body of
    ``FullyShardedDataParallel.rekey_optim_state_dict`` (which warns about ``optim_input`` first).
    """
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
    params = param_list(model, optim, optim_input)
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

        def new_key(k: Any) -> Any:
            if not isinstance(k, int) or not 0 <= k < len(id_to_name):
                raise OptimStateIndexError(
                    f"fsdp: parameter ID {k!r} is out of range: the optimizer has {len(id_to_name)} parameters."
                )
            return id_to_name[k]
    else:
        name_to_id = {fqn_of[id(p)]: k for k, p in enumerate(params) if id(p) in fqn_of}

        def new_key(k: Any) -> Any:
            if k not in name_to_id:
                raise OptimStateKeyError(
                    f"fsdp: parameter name '{k}' is not a parameter the optimizer holds; known names: "
                    f"{sorted(name_to_id)[:8]}."
                )
            return name_to_id[k]

    new: dict[str, Any] = {"state": {new_key(k): v for k, v in osd["state"].items()}}
    new["param_groups"] = copy.deepcopy(osd["param_groups"])
    for group in new["param_groups"]:
        group["params"] = sorted(new_key(k) for k in group["params"])
    return new


def _param_names(model: nn.Module) -> dict[int, str]:
    """id(param) -> its (first, cleaned) name, for wrapped and unwrapped models alike."""
    names: dict[int, str] = {}
    if any(is_fsdp(m) for m in model.modules()):
        view = ModelView(model)
        for pid, fqns in view.param_to_fqns.items():
            names[pid] = fqns[0]
        return names
    for name, param in model.named_parameters():
        names.setdefault(id(param), name)
    return names


# ----------------------------------------------------------------------------- agreement
def _rebuild(error_type: type, message: str) -> BaseException:
    try:
        return error_type(message)
    except Exception:  # a type whose constructor wants other arguments
        return RuntimeError(message)


def agree(local: Callable[[], T], group: Optional[dist.ProcessGroup], what: str, device: torch.device) -> list[T]:
    """Runs ``local`` here and all-gathers its result over ``group`` (staged on ``device``).

    Returns:
        Every rank's result, in rank order.

    Raises:
        The exception ``local`` raised on this rank; or, where it raised on another rank, the
        same type naming that rank (so no rank goes on to a collective the others skip).
    """
    result: Optional[T] = None
    error: Optional[BaseException] = None
    try:
        result = local()
    except (ValueError, TypeError, KeyError, IndexError, RuntimeError, AssertionError) as exc:
        error = exc
    gathered = comm.all_gather_object(
        (result, None if error is None else (type(error), str(error))), group, device
    )
    if error is not None:
        raise error
    for rank, (_, failure) in enumerate(gathered):
        if failure is not None:
            error_type, message = failure
            raise _rebuild(error_type, f"fsdp: rank {rank} could not {what}, so no rank goes on: {message}")
    return [cast(T, value) for value, _ in gathered]  # no rank failed: every value was computed
