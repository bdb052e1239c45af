"""Small helpers shared across the package: the internal-invariant error tier and tensor tree maps.

Two error tiers (see docs/design.md, [Note: Error tiers]):

- *Internal invariants* use :func:`p_assert`. It prints the message before raising, because an
  exception raised inside an autograd hook can lose its message on the way out of the engine.
  A failing ``p_assert`` is a bug in ``fsdp``, never the user's fault.
- *User mistakes* raise ``ValueError`` / ``TypeError`` / ``RuntimeError`` /
  ``NotImplementedError`` with the offending module, parameter or argument and the remedy.
"""

from __future__ import annotations

import functools
import sys
import traceback
from typing import Any, Callable, NoReturn, Optional

import torch
import torch.distributed as dist

FSDP_WRAPPED_MODULE = "_fsdp_wrapped_module"
FSDP_PREFIX = FSDP_WRAPPED_MODULE + "."
FLAT_PARAM = "_flat_param"
# torch's checkpoint_wrapper nests the module under this name; like FSDP's own wrapper name it
# is not part of the model's parameter names (torch strips both too).
CHECKPOINT_WRAPPED_MODULE = "_checkpoint_wrapped_module"
_WRAPPER_SEGMENTS = frozenset({FSDP_WRAPPED_MODULE, CHECKPOINT_WRAPPED_MODULE})


class FSDPInternalError(AssertionError):
    """Raised when an internal invariant of ``fsdp`` does not hold (a bug in fsdp)."""


class FSDPStateAssertionError(RuntimeError, AssertionError):
    """A user call FSDP cannot serve in the current state, where torch FSDP1 raises AssertionError.

    Torch FSDP1 reports a few user mistakes (``summon_full_params`` inside forward or backward,
    ``register_comm_hook`` on a nested unit, twice, or with a hybrid strategy) as
    ``AssertionError``. This type is both an ``AssertionError`` (code written against torch
    keeps catching it) and a ``RuntimeError`` (not mistaken for :class:`FSDPInternalError`, the
    internal-invariant tier).
    """


def p_assert(cond: Any, msg: str) -> None:
    """Checks an internal invariant; prints the message and stack before raising.

    Args:
        cond: Condition that must hold.
        msg: What was expected, with the actual values.

    Raises:
        FSDPInternalError: If ``cond`` is false.
    """
    if not cond:
        _fail(msg)


def _fail(msg: str) -> NoReturn:
    full = f"fsdp internal error (please report): {msg}"
    print(full, file=sys.stderr)
    traceback.print_stack(file=sys.stderr)
    raise FSDPInternalError(full)


def apply_to_tensors(fn: Callable[[torch.Tensor], Any], container: Any) -> Any:
    """Applies ``fn`` to every tensor in a nested structure and rebuilds the structure.

    Handles tensors, lists, tuples (including namedtuples), dicts (keeping their type) and
    leaves anything else unchanged.
    """
    if isinstance(container, torch.Tensor):
        return fn(container)
    if isinstance(container, dict):
        return type(container)((k, apply_to_tensors(fn, v)) for k, v in container.items())
    if isinstance(container, tuple) and hasattr(container, "_fields"):  # namedtuple
        return type(container)(*(apply_to_tensors(fn, v) for v in container))
    if isinstance(container, (list, tuple)):
        return type(container)(apply_to_tensors(fn, v) for v in container)
    return container


def eager_only(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Marks an FSDP runtime step to run eagerly (graph break) under ``torch.compile``.

    ``torch.compiler.disable`` would import all of dynamo when fsdp is imported, which costs
    start-up time and has aborted processes at interpreter exit. The marker is applied lazily:
    only once dynamo is loaded, which ``torch.compile`` does before it traces any of our code.
    """
    disabled: list[Callable[..., Any]] = []

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if "torch._dynamo" not in sys.modules:
            return fn(*args, **kwargs)
        if not disabled:
            disabled.append(torch.compiler.disable(fn))
        return disabled[0](*args, **kwargs)

    return wrapper


def strip_fsdp_segments(name: str) -> str:
    """Removes only FSDP's wrapper segments (what torch FSDP1's ``named_parameters`` strips)."""
    if FSDP_WRAPPED_MODULE not in name:
        return name
    return ".".join(part for part in name.split(".") if part != FSDP_WRAPPED_MODULE)


def clean_fqn(name: str) -> str:
    """Removes wrapper segments (FSDP's, activation checkpointing's) from a qualified name.

    ``"blocks.0._fsdp_wrapped_module.fc1.weight"`` becomes ``"blocks.0.fc1.weight"`` and
    ``"embed._fsdp_wrapped_module"`` becomes ``"embed"``.
    """
    if FSDP_WRAPPED_MODULE not in name and CHECKPOINT_WRAPPED_MODULE not in name:
        return name
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_SEGMENTS)


# [Note: Only the unit's group]
# As in torch FSDP1, a unit talks only to the process group it was given: construction,
# training and state dicts work with ``process_group=pg`` even when the default group was never
# initialized (a ProcessGroup built directly from a store). ``dist.get_rank(group)``,
# ``dist.get_backend(group)`` and ``dist.get_global_rank`` need the default group or c10d's
# registry, so fsdp asks the group object itself and addresses peers by group rank.


def group_rank(group: Optional["dist.ProcessGroup"]) -> int:
    """This process's rank in ``group`` (None: the default group), without needing the default group."""
    return group.rank() if group is not None else dist.get_rank()


def group_size(group: Optional["dist.ProcessGroup"]) -> int:
    """The number of ranks in ``group`` (None: the default group)."""
    return group.size() if group is not None else dist.get_world_size()


def group_backend(group: Optional["dist.ProcessGroup"]) -> str:
    """The backend name of ``group`` (``"gloo"``, ``"nccl"``, ...; None: the default group).

    What ``dist.get_backend`` says for groups c10d registered; for a group built directly from
    a store (unknown to c10d), the group's own backend name.
    """
    if group is None:
        return str(dist.get_backend())
    try:
        return str(dist.get_backend(group))
    except (ValueError, RuntimeError, KeyError):
        name = getattr(group, "name", None)  # a stand-in group object may have no name()
        return str(name()) if callable(name) else type(group).__name__


def describe_group_rank(group: Optional["dist.ProcessGroup"], rank_in_group: int) -> str:
    """``"rank N"`` with the global rank when c10d knows the group, else ``"group rank N"`` (messages)."""
    if group is None:
        return f"rank {rank_in_group}"
    try:
        return f"rank {dist.get_global_rank(group, rank_in_group)}"
    except (ValueError, RuntimeError, KeyError):
        return f"group rank {rank_in_group}"
