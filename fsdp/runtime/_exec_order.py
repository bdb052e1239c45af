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
It starts with torch FSDP1's sentence for the same mistake ("Forward order differs across ranks:
rank 0 is all-gathering parameters for [[...]] while rank 1 is ...", naming the first pair of
ranks that differ, each unit by its parameters' names from the root); torch raises it only under
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` and hangs otherwise, we raise it always.

[Note: Forward order after the first iteration]
After the first iteration a rank cannot know, without a collective per unit, whether the others
still gather what it gathers. Like torch FSDP1 under ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (and
only then: a model whose order changes alike on every rank is legal, and the warning would be
noise), each rank compares its own training forwards with the first iteration's, locally, at no
communication cost: the first forward that differs warns (torch's ``UserWarning`` and sentence,
then the unit and the fix), every further difference in that iteration warns too, and later
iterations are not checked again (torch's rule, so a console is not flooded). Units without
parameters gather nothing and are not counted; "training" is the mode of the unit's modules
(``module.train()`` reaches them from the wrapper), as torch checks training forwards only.
Unlike torch, a unit's repeated forwards in one iteration are compared as repeats (torch records
only first uses and would warn from the second iteration on).

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
import warnings

import torch
import torch.distributed as dist

from fsdp._common import describe_group_rank, group_size
from fsdp._comm import _collectives as comm
from fsdp._comm._phase import collective_phase
from fsdp.runtime._prefetch import record_phase_orders
from fsdp.runtime._state import RootContext, UnitState

_PHASES = ("forward", "backward")


def check_execution_order(state: UnitState, phase: str) -> None:
    """Verifies that all ranks gather ``state``'s unit now (first iteration; afterwards, under
    ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, that this rank's forward order is the first one's).

    Raises:
        RuntimeError: On every rank, when ranks are about to gather different units in the
            first iteration.

    Warns:
        UserWarning: A later iteration's forward order differs from the first one's, under
            ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` ([Note: Forward order after the first iteration]).
    """
    ctx = state.ctx
    if ctx is None:
        return
    if ctx.order_checked:
        if (
            not ctx.forward_watch.warned
            and phase == "forward"
            and dist.get_debug_level() == dist.DebugLevel.DETAIL
            and _training_forward(state)
        ):
            _watch_forward(ctx, state)
        return
    with collective_phase("first-iteration execution-order check", state):
        if not ctx.exec_order:
            check_same_layout(ctx)  # the first gather of the first iteration: [Note: Layout agreement]
        index = ctx.unit_index[id(state)]
        code = index * len(_PHASES) + _PHASES.index(phase)
        for group in _groups(ctx):
            if group_size(group) == 1:
                continue
            codes = _all_gather_int(code, group, ctx.root.compute_device)
            if any(c != code for c in codes):
                ctx.raised_in_step = True  # every rank raises here, after the same collectives
                raise RuntimeError(_order_differs(ctx, state, phase, group, codes))
    ctx.exec_order.append(code)
    if phase == "forward" and _training_forward(state):
        ctx.forward_watch.first_iteration.append(index)


def _training_forward(state: UnitState) -> bool:
    """A forward torch FSDP1 would check: the unit has parameters and its modules train."""
    return bool(state.handles) and state.handles[0].param_infos[0].module.training


def _param_names(ctx: RootContext, index: int) -> list[list[str]]:
    """Unit ``index``'s parameter names from the root, one list per handle (torch's format)."""
    unit = ctx.states[index]
    prefix = "" if unit is ctx.root else unit.unit_name + "."
    return [[prefix + info.fqn for info in handle.param_infos] for handle in unit.handles]


def _order_differs(
    ctx: RootContext, state: UnitState, phase: str, group: dist.ProcessGroup, codes: list[int]
) -> str:
    """The first-iteration error: torch FSDP1's sentence for the first pair of ranks that
    differ, then every rank's unit as that rank names it, and the fix."""
    index = ctx.unit_index[id(state)]
    mine = (f"{phase} of unit '{state.unit_name}'", repr(_param_names(ctx, index)))
    described: list[tuple[str, str]] = comm.all_gather_object(mine, group, ctx.root.compute_device)
    world = len(codes)
    r1, r2 = next((a, b) for a in range(world) for b in range(a + 1, world) if codes[a] != codes[b])
    ranks = [describe_group_rank(group, r) for r in range(world)]
    listing = "; ".join(f"{rank}: {what}" for rank, (what, _) in zip(ranks, described))
    return (
        f"{phase.capitalize()} order differs across ranks: rank {r1} is all-gathering parameters "
        f"for {described[r1][1]} while rank {r2} is all-gathering parameters for "
        f"{described[r2][1]}. (fsdp: ranks took different paths through the model in the first "
        f"iteration (step {len(ctx.exec_order) + 1} of the execution order): {listing}. Every "
        f"rank must run the same FSDP units in the same order: a data-dependent branch must not "
        f"skip a unit on some ranks only, and every rank must wrap the model the same way. "
        f"Without this check the ranks would wait in mismatched collectives.)"
    )


def _watch_forward(ctx: RootContext, state: UnitState) -> None:
    """[Note: Forward order after the first iteration]: one training forward of a later iteration
    (under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``; the caller checks)."""
    watch = ctx.forward_watch
    position = watch.position
    watch.position += 1
    first = watch.first_iteration
    index = ctx.unit_index[id(state)]
    if position < len(first) and first[position] == index:
        return
    if position >= len(first):
        expected = "Expected to not all-gather any more parameters in the forward"
        fix = f"the first iteration ran {len(first)} forwards of units with parameters"
    else:
        expected = f"Expected to all-gather for {_param_names(ctx, first[position])}"
        fix = f"the first iteration ran unit '{ctx.states[first[position]].unit_name}' here"
    watch.deviated = True
    warnings.warn(
        f"Forward order differs from that of the first iteration on rank {ctx.root.rank}. "
        f"Collectives are unchecked and may give incorrect results or hang.\n{expected} but "
        f"trying to all-gather parameters for {_param_names(ctx, index)} (fsdp: forward #{position + 1} "
        f"of this iteration is unit '{state.unit_name}'; {fix}. If every rank changes its order "
        f"alike this is harmless, though prefetching follows the first iteration's order; if "
        f"ranks differ, they wait in mismatched collectives: make every rank run the same units "
        f"in the same order.)",
        stacklevel=3,
    )


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
    with collective_phase("lazy-init layout check"):
        _check_same_layout(ctx)


def _check_same_layout(ctx: RootContext) -> None:
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
    """Called at the end of every backward: after the first, the order is known and the
    cross-rank check stops; after any, the next forward starts a new iteration of the local
    check ([Note: Forward order after the first iteration])."""
    watch = ctx.forward_watch
    watch.position = 0
    if watch.deviated:
        watch.warned = True
    if ctx.order_checked:
        return
    ctx.order_checked = True
    record_phase_orders(ctx)
