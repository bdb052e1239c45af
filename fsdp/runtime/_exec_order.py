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

The error lists each rank's unit by the name *that rank* gives it: the ints only say whether the
ranks agree; on disagreement (which every rank sees at once, from the same gathered ints) the
ranks exchange their own descriptions, so no rank looks up another rank's index in its own list.

[Note: Layout agreement]
Ranks that wrap different models with the same number of units pass the order check (the unit
indices agree) and would then all-gather flat parameters of different sizes: gloo aborts the
process on the size mismatch, NCCL hangs or reads garbage. So before the very first gather, the
ranks agree on the layout: each hashes its units' names, flat sizes and dtypes into one int64 and
the ranks all-gather it (one collective per group, once). On disagreement they exchange the layouts
and every rank raises the same error naming the first unit that differs and what each rank has.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from fsdp._common import describe_group_rank, group_size
from fsdp._comm import _collectives as comm
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
    if not ctx.exec_order:
        check_same_layout(ctx)  # the first gather of the first iteration: [Note: Layout agreement]
    index = ctx.unit_index[id(state)]
    code = index * len(_PHASES) + _PHASES.index(phase)
    for group in _groups(ctx):
        world = group_size(group)
        if world == 1:
            continue
        codes = _all_gather_int(code, group, ctx.root.compute_device)
        if any(c != code for c in codes):
            ctx.raised_in_step = True  # every rank raises here, after the same collectives
            described = comm.all_gather_object(f"{phase} of unit '{state.unit_name}'", group, ctx.root.compute_device)
            ranks = [describe_group_rank(group, r) for r in range(world)]
            listing = "; ".join(f"{rank}: {what}" for rank, what in zip(ranks, described))
            raise RuntimeError(
                f"fsdp: ranks took different paths through the model in the first iteration "
                f"(step {len(ctx.exec_order) + 1} of the execution order): {listing}. Every rank "
                f"must run the same FSDP units in the same order: a data-dependent branch must "
                f"not skip a unit on some ranks only, and every rank must wrap the model the same "
                f"way. (Without this check the ranks would wait in mismatched collectives.)"
            )
    ctx.exec_order.append(code)


def _all_gather_int(value: int, group: dist.ProcessGroup, device: torch.device) -> list[int]:
    everyone = comm.all_gather_tensors(torch.tensor([value], dtype=torch.int64, device=device), group)
    return [int(t.item()) for t in everyone]


def _layout(ctx: RootContext) -> list[str]:
    """One line per unit: its name and, per flat parameter, the unsharded size and dtype."""
    lines = []
    for unit in ctx.states:
        flats = ", ".join(
            f"{handle.flat_param.dtype} x {handle.shard_layout.padded_unsharded_numel}" for handle in unit.handles
        )
        lines.append(f"'{unit.unit_name}' [{flats or 'no parameters'}]")
    return lines


def _digest(lines: list[str]) -> int:
    """A signed int64 hash of ``lines`` (the same on every rank for the same lines)."""
    raw = hashlib.blake2b("\n".join(lines).encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little", signed=True)


def check_same_layout(ctx: RootContext) -> None:
    """Verifies that every rank has the same units with the same flat sizes ([Note: Layout agreement]).

    Raises:
        RuntimeError: On every rank, naming the first unit that differs and each rank's version.
    """
    layout = _layout(ctx)
    for group in _groups(ctx):
        world = group_size(group)
        if world == 1:
            continue
        digest = _digest(layout)
        if all(d == digest for d in _all_gather_int(digest, group, ctx.root.compute_device)):
            continue
        layouts: list[list[str]] = comm.all_gather_object(layout, group, ctx.root.compute_device)  # every rank's _layout
        ranks = [describe_group_rank(group, r) for r in range(world)]
        longest = max(len(lay) for lay in layouts)
        first = next(
            i for i in range(longest)
            if len({lay[i] if i < len(lay) else "<none>" for lay in layouts}) > 1
        )
        listing = "; ".join(
            f"{rank}: {lay[first] if first < len(lay) else '<no such unit>'} ({len(lay)} units)"
            for rank, lay in zip(ranks, layouts)
        )
        raise RuntimeError(
            f"fsdp: ranks wrapped different models: FSDP unit #{first} (pre-order) differs: "
            f"{listing}. Every rank must build the same model and wrap it with the same policy and "
            f"arguments. (Without this check the ranks would all-gather flat parameters of "
            f"different sizes: gloo aborts the process, NCCL hangs.)"
        )


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
