"""Cross-rank execution-order check: errors where a diverging rank would otherwise hang.

[Note: Execution order check]
FSDP's collectives pair up across ranks only if every rank gathers the same units in the same
order. A data-dependent branch that skips a unit on one rank, or a different wrapping, makes
ranks wait in different collectives forever. During the first iteration (forward and
backward), before each unit gathers, the ranks all-gather which unit they are about to gather
(one int64 per unit and phase, over the root's groups). If they disagree, every rank raises the
same error naming each rank's unit, at the same point, so nothing hangs and the group stays
usable. Afterwards the check is off (it would cost one tiny collective per unit); the order it
recorded (``RootContext.exec_order``) is what prefetching follows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fsdp.runtime._prefetch import record_phase_orders
from fsdp.runtime._state import RootContext, UnitState

_PHASES = ("forward", "backward")


def check_execution_order(state: UnitState, phase: str) -> None:
    """Verifies, during the first iteration, that all ranks gather ``state``'s unit now.

    Raises:
        RuntimeError: On every rank, when ranks are about to gather different units.
    """
    ctx = state.ctx
    if ctx is None or ctx.order_checked:
        return
    index = ctx.unit_index[id(state)]
    code = index * len(_PHASES) + _PHASES.index(phase)
    for group in _groups(ctx):
        world = dist.get_world_size(group)
        if world == 1:
            continue
        mine = torch.tensor([code], dtype=torch.int64, device=ctx.root.compute_device)
        everyone = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(everyone, mine, group=group)
        codes = [int(t.item()) for t in everyone]
        if any(c != code for c in codes):
            ranks = [dist.get_global_rank(group, r) for r in range(world)]
            listing = "; ".join(
                f"rank {rank}: {_PHASES[c % len(_PHASES)]} of unit '{ctx.states[c // len(_PHASES)].unit_name}'"
                for rank, c in zip(ranks, codes)
            )
            raise RuntimeError(
                f"fsdp: ranks took different paths through the model in the first iteration "
                f"(step {len(ctx.exec_order) + 1} of the execution order): {listing}. Every rank "
                f"must run the same FSDP units in the same order: a data-dependent branch must "
                f"not skip a unit on some ranks only, and every rank must wrap the model the same "
                f"way. (Without this check the ranks would wait in mismatched collectives.)"
            )
    ctx.exec_order.append(code)


def _groups(ctx: RootContext) -> list[dist.ProcessGroup]:
    groups = [ctx.root.process_group]
    if ctx.root.replicate_group is not None:
        groups.append(ctx.root.replicate_group)
    return groups


def finish_first_iteration(ctx: RootContext) -> None:
    """Called at the end of the first backward: the order is known; stop checking."""
    if ctx.order_checked:
        return
    ctx.order_checked = True
    record_phase_orders(ctx)
