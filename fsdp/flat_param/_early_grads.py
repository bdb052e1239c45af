"""Taking each parameter's gradient from autograd as soon as it is computed.

[Note: Early per-parameter gradients]
The two-rank gloo reduction starts from the unit's per-parameter gradients ([Note:
Per-parameter gradient reduction] in ``flat_param.py``). Autograd holds those gradients in the
input buffer of the views node (:class:`~fsdp.flat_param.flat_param._UnflattenParams`) until
that node runs, which is only at the very end of the unit's backward: autograd's CPU ready
queue runs the ready node with the highest sequence number first, and the views node, made at
pre-forward, is older than all of the unit's compute. So nothing can be done with a gradient
before the unit's backward ends, and in particular the previous unit's reduction (which keeps
that unit's gradients alive until it completes) could only be finished there, on top of all
of this unit's gradients: that was the step's memory peak.

Instead, the runtime ([Note: Gradient hooks on the views' consumers] in
``runtime/_early_grads.py``) registers a post-hook on every autograd node that consumes a
view (the transpose of a ``Linear`` weight, ``NativeLayerNorm``, ...); those nodes are made
when the forward uses the view, so they run as soon as their input gradient is ready. The hook
hands the gradients it sees to :func:`take_param_grad` (kept per parameter in the handle,
summed with ``a + b`` where a parameter gets several, as autograd would) and gives autograd
``None`` in their place; the views node then receives no gradient, passes none to the
FlatParameter, and the post-accumulate hook reduces from the kept gradients as before. The
arithmetic is unchanged, so results stay bit-identical.

The handle only allows this where the reduction takes the pieces (:func:`can_take_early`,
re-checked by every hook, as it depends on ``no_sync`` and comm hooks set at backward time)
and where the views' gradients come in the reduce dtype (:func:`takes_early_grads_at_forward`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fsdp.runtime import _collectives as comm

if TYPE_CHECKING:
    from fsdp.flat_param.flat_param import FlatParamHandle

__all__ = ["can_take_early", "take_param_grad", "takes_early_grads_at_forward"]


def can_take_early(handle: "FlatParamHandle") -> bool:
    """Whether this backward's reduction of ``handle`` starts from per-parameter gradients."""
    return (
        handle.piecewise_reduction_allowed
        and handle.uses_sharding
        and handle.replicate_world_size == 1
        and handle._unsynced_unsharded_grad is None
        and comm.can_reduce_scatter_halves(handle._local_shard, handle.process_group)
    )


def takes_early_grads_at_forward(handle: "FlatParamHandle") -> bool:
    """Whether the views made now may have their gradients taken early: the reduction can
    start from the pieces and the gradients will come in the reduce dtype."""
    return handle.flat_param.dtype == handle.precision.reduce_dtype and can_take_early(handle)


def take_param_grad(handle: "FlatParamHandle", index: int, grad: torch.Tensor) -> None:
    """Keeps parameter ``index``'s gradient for the reduction (added to one kept before)."""
    grads = handle._param_grads
    if grads is None:
        grads = [None] * len(handle.param_infos)
        handle._param_grads = grads
    previous = grads[index]
    grads[index] = grad if previous is None else previous + grad
