"""Ranks agree, by parameter names, on the optimizer state before any collective moves it.

[Note: Optimizer state keyed by names across ranks]
An optimizer's own state dict keys parameters by IDs: positions in *that rank's*
``optim.param_groups``. Ranks may build their optimizers from the same parameters in different
orders (``reversed(list(model.parameters()))`` on one rank, parameter groups in another order),
so an ID means nothing to another rank. Everything that crosses ranks is keyed by names: a
FlatParameter by its first parameter's FQN, an original or unmanaged parameter by its FQN.

Before the first collective that moves state, every rank all-gathers a :class:`RankOptimState`
(which parameters have state, and each state's kind, dtype and shape, by names; no tensor data),
and then runs the same checks on the same gathered data, so either every rank goes on, with the
collectives in one order fixed by names, or every rank raises the same exception type naming
the parameters and the ranks. A rank whose own preparation raised still joins that all-gather
(carrying its error), so the others raise too instead of waiting in a collective it never joins.

What must agree (saving):

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

import dataclasses
import math
from typing import Any, Callable, Optional, TypeVar

import torch
import torch.distributed as dist

from fsdp._comm import _collectives as comm

__all__ = ["RankOptimState", "describe_state", "agree", "check_save_flat", "check_save_orig"]

T = TypeVar("T")

StateMeta = tuple
"""One state's description: ``("t", dtype, shape)`` (positive-dimension tensor),
``("s", value, dtype)`` (zero-dimension tensor) or ``("o", value)`` (anything else)."""


@dataclasses.dataclass
class RankOptimState:
    """One rank's optimizer state, described by parameter names (what ranks exchange).

    Attributes:
        keys: The names of the parameters with state, in this rank's optimizer-ID order.
        states: Name -> state name -> :data:`StateMeta`.
        local_numels: use_orig_params: each managed parameter's numel on this rank (its part of
            the local shard; 0 where the rank holds none of it).
    """

    keys: list[str]
    states: dict[str, dict[str, StateMeta]]
    local_numels: dict[str, int] = dataclasses.field(default_factory=dict)


def describe_state(entry: dict[str, Any]) -> dict[str, StateMeta]:
    """The :data:`StateMeta` of each state of one parameter."""
    out: dict[str, StateMeta] = {}
    for name in sorted(entry):
        value = entry[name]
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            out[name] = ("t", value.dtype, tuple(value.shape))
        elif isinstance(value, torch.Tensor):
            out[name] = ("s", value.item(), value.dtype)  # a number pickles far faster than a tensor
        else:
            out[name] = ("o", value)
    return out


def _rebuild(error_type: type, message: str) -> BaseException:
    try:
        return error_type(message)
    except Exception:  # a type whose constructor wants other arguments
        return RuntimeError(message)


def agree(local: Callable[[], T], group: Optional[dist.ProcessGroup], what: str) -> list[T]:
    """Runs ``local`` here and all-gathers its result over ``group``.

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
        (result, None if error is None else (type(error), str(error))), group
    )
    if error is not None:
        raise error
    for rank, (_, failure) in enumerate(gathered):
        if failure is not None:
            error_type, message = failure
            raise _rebuild(error_type, f"fsdp: rank {rank} could not {what}, so no rank goes on: {message}")
    return [value for value, _ in gathered]


def _shown(names: list[str]) -> str:
    return "[" + ", ".join(f"'{n}'" for n in names) + "]"


def check_save_flat(
    infos: list[RankOptimState],
    flat_fqns: dict[str, list[str]],
    flat_sharded_numel: dict[str, int],
) -> list[str]:
    """use_orig_params=False: the checks of [Note: Optimizer state keyed by names across ranks].

    Args:
        infos: Every rank's :class:`RankOptimState`.
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
                    f"states {_describe(tensors)} on rank {rank} but {_describe(tensor_states[0])} "
                    f"on rank 0; every rank's optimizer must keep the same states."
                )
    return list(reference)


def _describe(tensors: dict[str, Any]) -> str:
    return "{" + ", ".join(f"'{n}': {str(d).replace('torch.', '')}" for n, d in sorted(tensors.items())) + "}"


def check_save_orig(infos: list[RankOptimState], managed_fqns: list[str]) -> None:
    """use_orig_params=True: the checks of [Note: Optimizer state keyed by names across ranks].

    Args:
        infos: Every rank's :class:`RankOptimState`.
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
