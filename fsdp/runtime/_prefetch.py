"""Prefetching: launch the next unit's all-gather while this unit computes.

[Note: Prefetch]
The first iteration records the order in which units gather, in forward and in backward (the
execution-order check, [Note: Execution order check]). From the second iteration on, a unit
may launch the *next* unit's all-gather before it computes, so the gather overlaps its
computation instead of running between the two:

- ``backward_prefetch=BACKWARD_PRE`` (default): in a unit's pre-backward hook, right after its
  own gather, launch the gather of the unit whose backward comes next. Two units are unsharded
  at once during backward.
- ``BACKWARD_POST``: launch it in the post-backward hook, once this unit's gradient is computed
  and its parameters freed (lower peak memory, less overlap).
- ``forward_prefetch=True``: in a unit's pre-forward, launch the next unit's forward gather.

On CUDA every gather runs on the unshard stream ([Note: One gather path] in
``flat_param/_storage.py``), and the compute stream waits on an event only when the prefetched
unit starts (torch FSDP1's design); the prefetched unit's ``unshard()`` waits for it, and
resharding never frees memory a collective is still writing. The unshard stream waits for the
compute stream once per iteration (:func:`order_gathers_after_compute`), not before each gather,
so without any prefetch too a unit's gather runs while the previous unit computes: the CPU is
ahead of the GPU and issues it as soon as the previous unit's forward is queued ([Note: Stream
edges] in ``flat_param/_streams.py``). On CPU a prefetch completes where
it is launched ([Note: On CPU a collective completes where it is launched] in
``flat_param/_policy.py``).

``limit_all_gathers=True`` (CUDA): the CPU thread runs ahead of the GPU, and a buffer that a
(side-stream) gather filled can only be reused once the compute stream is past its last use,
so without a limit a fast CPU would keep allocating fresh buffers for gathers of units far
ahead (with no wait of the unshard stream for the compute stream, nothing else holds it
back). Each reshard of such a buffer records an event on the compute stream; before launching
a gather the CPU waits for the oldest event while two or more are outstanding, so at most two
freed buffers are still pending reuse: when the CPU allocates unit k+2's buffer (no
prefetch), the compute stream is past unit k's last read, so unit k's block is free again and
only unit k+1's may still be read. So the run-ahead costs at most one freed unit's buffer
beyond the gathered units the CPU's own order holds (those the planner replays), whatever the
distance the CPU runs ahead; torch FSDP1's limiter bounds it the same way.
tests/test_cuda_lane.py's overlap test checks the bound on the fake group, and that
``limit_all_gathers=False`` exceeds it. On CPU execution is eager (each free happens when the thread
gets there) and a prefetch is always consumed by the very next unit, so nothing needs limiting.

Prefetching only changes *when* collectives run, never which ones or their order on a rank (all
ranks follow the same recorded order), so results are bit-identical with and without it.

[Note: The first backward unit stays gathered]
With ``BACKWARD_PRE``, the root's pre-backward hook (the first of a backward) prefetches the
unit whose backward comes next, before any backward computation. When that unit is also the
last non-root unit of the forward, freeing it at its post-forward only to gather it again
moments later buys nothing: nothing in between gathers, and the moment the backward starts
already holds it (the prefetch). The same holds, whatever the prefetch setting, when that unit's
own backward is the first (a root with no computation after it). So from the second iteration on (when both orders are known)
that unit keeps its unsharded parameters from its post-forward into its backward, like the
root: one all-gather less per step (FULL_SHARD: 2 x blocks - 1 gathers of the blocks instead of
2 x blocks) and no exposed gather at the start of backward, for one unit's unsharded parameters held
through the loss ([Note: Only a gathered unit stays gathered] says when that is worth it).
torchtitan makes the same choice with FSDP2 (``reshard_after_forward=False`` for the last
block). The unit is released (resharded) wherever the backward that should take it does not
come: at the end of backward if the backward never reached it, at the root's next forward
after a forward with no backward, and by a failed backward's reset. With ``BACKWARD_POST`` or
no backward prefetch, a unit whose backward is not the first is freed at post-forward as before
(keeping it would raise the memory between forward and backward). The memory planner replays the same rule
(``fsdp/plan/_schedule.py``, through :func:`unit_kept_for_backward`).

[Note: Only a gathered unit stays gathered]
Keeping the unit is not free: its unsharded parameters stay alive from its post-forward to the
moment the backward would have gathered them anyway (the root's pre-backward prefetch, or its own
pre-backward). In between run the root's remaining forward, the loss, and the loss's backward,
and for a language model that interval *is* the step's peak: the logits, their fp32 copy and
the log-softmax, each ``batch x seq x vocab``. What the keep saves is one all-gather, so it is
worth a unit of memory at that peak only when the unshard is a collective. A unit that does not
shard (NO_SHARD, or world size 1, where FULL_SHARD runs as NO_SHARD) with low-precision
parameters "unshards" by a local cast of its parameter (or a host-to-device copy with offload):
as cheap to redo as to keep, and no communication to save. Such a unit is freed at its
post-forward as torch FSDP1 does, so the peak holds no extra copy. Measured (CPU, GPT of 4
blocks of width 256, vocab 4096, bf16 parameters, world size 1): the kept last block's bf16 copy
(1.51 MiB) was the only allocation alive at the step's peak (the cross entropy in forward, the
log-softmax backward) that torch FSDP1 did not hold; on the H100 benchmark's 1.1B GPT the same
unit is 100.7 MB (0.094 GiB), which matches the measured gap of 33.16 GiB vs 33.06 GiB (0.09-0.11
GiB after rounding; not yet measured again on a GPU). ``tests/test_memory_ws1.py``.
"""

from __future__ import annotations

from typing import Collection, Optional, Sequence

from fsdp._comm._phase import collective_phase
from fsdp.api import BackwardPrefetch
from fsdp.flat_param import _streams
from fsdp.runtime._state import RootContext, UnitState

__all__ = [
    "MAX_INFLIGHT_UNSHARDS",
    "order_gathers_after_compute",
    "prefetch_after",
    "record_free_event",
    "record_phase_orders",
    "unit_kept_for_backward",
    "unshard_unit",
]

# limit_all_gathers: freed side-stream buffers that may await reuse at once (CUDA).
MAX_INFLIGHT_UNSHARDS = 2

_FORWARD, _BACKWARD = 0, 1


def record_phase_orders(ctx: RootContext) -> None:
    """Splits the first iteration's recorded order into the forward and backward unit orders."""
    ctx.forward_order = _first_occurrences(ctx, _FORWARD)
    ctx.backward_order = _first_occurrences(ctx, _BACKWARD)
    index = {id(unit): position for position, unit in enumerate(ctx.states)}
    kept = unit_kept_for_backward(
        [index[id(unit)] for unit in ctx.forward_order],
        [index[id(unit)] for unit in ctx.backward_order],
        index[id(ctx.root)],
        ctx.root.backward_prefetch,
        {position for position, unit in enumerate(ctx.states) if _gathers(unit)},
    )
    unit = None if kept is None else ctx.states[kept]
    ctx.unit_kept_for_backward = unit if unit is not None and unit.frees_after_forward() else None


def unit_kept_for_backward(
    forward_order: Sequence[int],
    backward_order: Sequence[int],
    root: int,
    backward_prefetch: Optional[BackwardPrefetch],
    gathering: Collection[int],
) -> Optional[int]:
    """The unit that keeps its parameters from its post-forward into its backward, if any.

    [Note: The first backward unit stays gathered]: the last non-root unit of the forward, when
    its backward is the first of the backward, or the second after the root's with
    ``BACKWARD_PRE`` (the root's pre-backward hook prefetches it), and when its unshard is an
    all-gather ([Note: Only a gathered unit stays gathered]). Units are given by index (the
    runtime's and the planner's recorded orders alike); ``gathering`` holds the units whose
    unshard all-gathers (some handle shards).
    """
    non_root_forward = [unit for unit in forward_order if unit != root]
    if not non_root_forward or not backward_order:
        return None
    candidate = non_root_forward[-1]
    if candidate not in gathering:
        return None  # [Note: Only a gathered unit stays gathered]
    if backward_order[0] == candidate:
        return candidate
    if (
        backward_prefetch is BackwardPrefetch.BACKWARD_PRE
        and len(backward_order) >= 2
        and backward_order[0] == root
        and backward_order[1] == candidate
    ):
        return candidate
    return None


def _gathers(unit: UnitState) -> bool:
    """Whether the unit's unshard is an all-gather (some handle shards)."""
    return any(handle.shard_layout.uses_sharding for handle in unit.handles)


def _first_occurrences(ctx: RootContext, phase: int) -> list[UnitState]:
    seen: set[int] = set()
    order: list[UnitState] = []
    for code in ctx.exec_order:
        index, code_phase = divmod(code, 2)
        if code_phase == phase and index not in seen:
            seen.add(index)
            order.append(ctx.states[index])
    return order


def _next_unit(ctx: RootContext, state: UnitState, order: list[UnitState]) -> Optional[UnitState]:
    for position, unit in enumerate(order):
        if unit is state:
            return order[position + 1] if position + 1 < len(order) else None
    return None


def prefetch_after(state: UnitState, moment: str) -> None:
    """Launches the gather of the unit that follows ``state``, if its settings ask for it now.

    Args:
        state: The unit that is about to compute (``"forward"``, ``"backward_pre"``) or has just
            finished its backward (``"backward_post"``).
        moment: Which hook calls.
    """
    ctx = state.ctx
    if ctx is None or not ctx.order_checked:
        return  # the order is known from the second iteration on
    if moment == "forward":
        if not state.forward_prefetch:
            return
        order = ctx.forward_order
    else:
        wanted = BackwardPrefetch.BACKWARD_PRE if moment == "backward_pre" else BackwardPrefetch.BACKWARD_POST
        if state.backward_prefetch is not wanted:
            return
        order = ctx.backward_order
    target = _next_unit(ctx, state, order)
    if target is None or (moment != "forward" and target.ran_pre_backward):
        return  # (a unit whose backward already ran is done, whatever the recorded order says)
    with collective_phase("forward prefetch" if moment == "forward" else "backward prefetch"):
        for handle in target.handles:
            if handle.is_unsharded or not handle.has_unsharded_buffer:
                continue
            _limit_all_gathers(state)
            handle.unshard(full_precision=target.forward_in_full_precision, async_op=True, stream_ordered=True)
            ctx.prefetches_issued += 1


def unshard_unit(state: UnitState) -> None:
    """Unshards the unit's handles for its forward or backward computation (waiting for a
    prefetch of them), after the ``limit_all_gathers`` wait where one gathers.

    Precondition: the iteration's :func:`order_gathers_after_compute` ran (the root's
    pre-forward, the first hook of a backward). Postcondition: every handle is unsharded in
    the precision the forward computes in.
    """
    for handle in state.handles:
        if not handle.is_unsharded and handle.has_unsharded_buffer:
            _limit_all_gathers(state)
        handle.unshard(full_precision=state.forward_in_full_precision, stream_ordered=True)


def order_gathers_after_compute(ctx: RootContext) -> None:
    """The unshard stream waits for the compute stream's work so far: once per forward of the
    root and once per backward, before their first gather ([Note: Stream edges] in
    ``flat_param/_streams.py``, edge 1). The local shards every gather of the iteration reads
    were last written before (the optimizer step, a state-dict load, any user code between
    iterations); fsdp's own writes inside the iteration order the stream themselves. A no-op
    without streams (CPU)."""
    if ctx.unshard_stream is not None:
        ctx.unshard_stream.wait_stream(_streams.current_stream(ctx.root.compute_device))


def _limit_all_gathers(state: UnitState) -> None:
    """CUDA, ``limit_all_gathers``: before a gather allocates, waits for the oldest freed buffer
    while two or more are pending reuse (every gather runs on the unshard stream, so every one
    is limited, as in torch FSDP1). On CPU no free events are recorded: a no-op."""
    ctx = state.ctx
    if ctx is None or not state.limit_all_gathers:
        return
    while len(ctx.free_events) >= MAX_INFLIGHT_UNSHARDS:
        ctx.free_events.pop(0).synchronize()  # the oldest first


def record_free_event(state: UnitState) -> None:
    """CUDA: marks where the compute stream is done with a unit's gathered buffers."""
    ctx = state.ctx
    if ctx is None or ctx.unshard_stream is None or not state.limit_all_gathers:
        return
    ctx.free_events.append(_streams.record_event(_streams.current_stream(state.compute_device)))
    # Events on one stream complete in order: waiting for a newer one covers the older ones.
    del ctx.free_events[:-MAX_INFLIGHT_UNSHARDS]
