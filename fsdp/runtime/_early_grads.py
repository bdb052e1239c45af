"""Hooks that take each parameter's gradient from autograd the moment it is computed.

[Note: Gradient hooks on the views' consumers]
For [Note: Early per-parameter gradients] (``flat_param/_early_grads.py``) the runtime needs a
hook that runs as soon as a parameter's gradient exists. A hook on the views (or a node between
the views and the module) does not: autograd's CPU ready queue runs the ready node with the
highest sequence number first, and such a node, made at pre-forward, is older than all of the
unit's compute, so it runs only after the unit's whole backward (measured: every one ran at the
unit's end). The nodes that *use* a view are made when the forward uses it, so they run as soon
as their own input gradient is ready.

So at post-forward the runtime walks the autograd graph from the unit's outputs (only nodes made
after the unit's views node: older ones cannot use the views) and registers a post-hook on each
node with an edge into the views node. When such a node has run, the hook passes the gradients
it produced for the views to the handle and hands autograd ``None`` in their place. Before
taking the unit's first gradient it finishes the reductions in flight ([Note: Overlapped
gradient reduction] in ``_hooks.py``): the previous unit's gradients are released before this
unit's are kept. A use of a view that the outputs do not reach sends its gradient to the views
node as before, which adds it to the kept ones.

Where the reduction does not start from the pieces this backward (``no_sync``, a comm hook, a
``no_sync`` gradient still held) the hook changes nothing. The walk costs one visit per autograd
node of the unit (nested units' nodes included) per forward.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Optional, Sequence

import torch

from fsdp.flat_param._early_grads import can_take_early, keeps_param_grads, take_param_grad
from fsdp.flat_param.flat_param import FlatParamHandle
from fsdp.runtime._state import RootContext, UnitState

__all__ = ["finish_inflight_reductions", "hook_view_consumers"]


def finish_inflight_reductions(ctx: RootContext) -> None:
    """Waits for every gradient reduction still in flight (oldest first)."""
    while ctx.inflight_reductions:
        ctx.inflight_reductions.pop(0).wait_reduction()


def hook_view_consumers(state: UnitState, outputs: Sequence[torch.Tensor]) -> None:
    """Registers the early-gradient post-hooks on the consumers of this forward's views.

    Called at post-forward with the outputs that require grad; a no-op for handles whose views
    were not made for it.
    """
    ctx = state.ctx
    for handle in state.handles:
        views_node, handle.early_grads_views_node = handle.early_grads_views_node, None
        if views_node is None or ctx is None:
            continue
        handle_ref, ctx_ref = weakref.ref(handle), weakref.ref(ctx)
        handle.early_grads_runs += 1
        run = handle.early_grads_runs
        for node in _consumers(views_node, outputs):
            # (edge index, index of the view whose gradient that edge carries)
            edges = [
                (edge, view_index)
                for edge, (next_node, view_index) in enumerate(node.next_functions)
                if next_node is views_node
            ]
            node.register_hook(functools.partial(_take_consumer_grads, handle_ref, ctx_ref, run, edges))


def _consumers(views_node: Any, outputs: Sequence[torch.Tensor]) -> list[Any]:
    """The autograd nodes reachable from ``outputs`` with an edge into ``views_node``."""
    oldest = views_node._sequence_nr()
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    seen: set[Any] = set()
    found: list[Any] = []
    while stack:
        node = stack.pop()
        if node in seen or node is views_node:
            continue
        seen.add(node)
        uses_views = False
        for next_node, _ in node.next_functions:
            if next_node is None:
                continue
            if next_node is views_node:
                uses_views = True
            elif next_node not in seen and next_node._sequence_nr() > oldest:
                stack.append(next_node)
        if uses_views:
            found.append(node)
    return found


def _take_consumer_grads(
    handle_ref: "weakref.ref[FlatParamHandle]",
    ctx_ref: "weakref.ref[RootContext]",
    run: int,
    edges: list[tuple[int, int]],
    grad_inputs: tuple[Optional[torch.Tensor], ...],
    grad_outputs: tuple[Optional[torch.Tensor], ...],
) -> Optional[tuple[Optional[torch.Tensor], ...]]:
    """Node post-hook: keeps the gradients this node computed for the views; None in their place."""
    handle, ctx = handle_ref(), ctx_ref()
    if handle is None or ctx is None or not can_take_early(handle):
        return None
    if all(grad_inputs[edge] is None for edge, _ in edges):
        return None
    if not keeps_param_grads(handle):
        finish_inflight_reductions(ctx)  # release the previous unit's gradients first
    replaced = list(grad_inputs)
    for edge, view_index in edges:
        grad = grad_inputs[edge]
        if grad is not None:
            take_param_grad(handle, view_index, grad, run)
            replaced[edge] = None
    return tuple(replaced)
