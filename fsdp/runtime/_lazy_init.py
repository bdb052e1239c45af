"""Root lazy initialization: done once, on the first forward (or first API call) of the root.

The first FSDP instance to run becomes the root unless an FSDP ancestor already claimed it. It
creates the shared :class:`RootContext`, hands it to every unit in its tree, and names units by
their qualified names (for messages).
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from fsdp._common import clean_fqn
from fsdp.runtime._state import HandleTrainingState, RootContext, UnitState


def is_fsdp(module: nn.Module) -> bool:
    """Whether ``module`` is an FSDP wrapper (without importing the wrapper class)."""
    return getattr(type(module), "_is_fsdp_wrapper", False)


def unit_state(module: nn.Module) -> UnitState:
    """The runtime state of an FSDP wrapper (typed access to ``unit_state(module)``)."""
    state = module.__dict__.get("_fsdp_state")
    if not isinstance(state, UnitState):
        raise TypeError(f"fsdp: {type(module).__name__} is not a FullyShardedDataParallel instance")
    return state


def named_fsdp_states(module: nn.Module) -> Iterator[tuple[str, nn.Module, UnitState]]:
    """Yields ``(qualified name, wrapper, state)`` for every FSDP unit in ``module``, pre-order."""
    for name, sub in module.named_modules():
        if is_fsdp(sub):
            yield clean_fqn(name), sub, unit_state(sub)


def lazy_init(module: nn.Module) -> UnitState:
    """Initializes the root's runtime if ``module``'s unit has not been initialized yet.

    Returns:
        The unit's state, with ``is_root`` and ``ctx`` set.
    """
    state: UnitState = unit_state(module)
    if state.is_root is not None:
        return state
    state.is_root = True
    ctx = RootContext(root=state)
    for name, _, unit in named_fsdp_states(module):
        if unit is not state:
            unit.is_root = False
        unit.ctx = ctx
        unit.unit_name = name or "<root>"
        for handle in unit.handles:
            handle.unit_name = unit.unit_name
        ctx.unit_index[id(unit)] = len(ctx.states)
        ctx.states.append(unit)
    if state.compute_device.type == "cuda":
        # Prefetched all-gathers run on one side stream ([Note: Prefetch]).
        unshard_stream = torch.cuda.Stream(device=state.compute_device)
        for unit in ctx.states:
            for handle in unit.handles:
                handle.unshard_stream = unshard_stream
    return state


def reset_lazy_init(module: nn.Module) -> None:
    """Undoes :func:`lazy_init` for ``module``'s tree (so it can be wrapped further)."""
    for _, _, unit in named_fsdp_states(module):
        unit.is_root = None
        unit.ctx = None


def check_idle(
    module: nn.Module, what: str, allow_summon: bool = False, error: type[Exception] = RuntimeError
) -> None:
    """Raises if any unit in ``module``'s root tree is in forward or backward (or summon).

    Args:
        module: An FSDP instance.
        what: The API being called, for the message.
        allow_summon: Accept units inside ``summon_full_params`` (it may nest).
        error: The exception type (torch FSDP1's for the same call: ``ValueError`` for
            ``apply``, ``no_sync`` and ``clip_grad_norm_``, an ``AssertionError`` for
            ``summon_full_params``).
    """
    state: UnitState = unit_state(module)
    states = state.ctx.states if state.ctx is not None else [s for _, _, s in named_fsdp_states(module)]
    allowed = {HandleTrainingState.IDLE}
    if allow_summon:
        allowed.add(HandleTrainingState.SUMMON_FULL_PARAMS)
    busy = [s for s in states if s.training_state not in allowed]
    if busy:
        desc = ", ".join(f"'{s.unit_name}' ({s.training_state.name})" for s in busy)
        raise error(
            f"fsdp: {what} cannot be called while FSDP units are in forward, backward or "
            f"summon_full_params: {desc}. Call it between training steps, outside the model's "
            f"forward and backward."
        )
