"""Taking each parameter's gradient from autograd as soon as it is computed.

[Note: Early per-parameter gradients]
The two-rank gloo reduction starts from the unit's per-parameter gradients ([Note:
Per-parameter gradient reduction] in ``_views.py``). Autograd holds those gradients in the
input buffer of the views node (:class:`~fsdp.flat_param._views._UnflattenParams`) until
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

from typing import Any, Optional, Protocol, Sequence

import torch
import torch.distributed as dist

from fsdp._comm import _collectives as comm

__all__ = ["can_take_early", "keeps_param_grads", "settle_open_run", "take_param_grad", "takes_early_grads_at_forward"]


class _KeptGrads(Protocol):
    """What this module reads and writes of a handle's ``grads`` (``_reduction.HandleGrads``)."""

    unsynced_unsharded_grad: Optional[torch.Tensor]
    param_grads: Optional[list[Optional[torch.Tensor]]]
    open_run_grads: Optional[list[Optional[torch.Tensor]]]
    open_run: Optional[int]


class FlatParamHandle(Protocol):
    """What this module reads and writes of a ``flat_param.FlatParamHandle`` (a structural type:
    ``flat_param.py`` imports this module, so importing the class here would be a cycle)."""

    piecewise_reduction_allowed: bool
    replicate_world_size: int
    process_group: Optional[dist.ProcessGroup]
    flat_param: torch.Tensor
    param_infos: Sequence[Any]
    grads: _KeptGrads

    @property
    def uses_sharding(self) -> bool: ...
    @property
    def precision(self) -> Any: ...
    @property
    def _local_shard(self) -> torch.Tensor: ...


def can_take_early(handle: FlatParamHandle) -> bool:
    """Whether this backward's reduction of ``handle`` starts from per-parameter gradients."""
    return (
        handle.piecewise_reduction_allowed
        and handle.uses_sharding
        and handle.replicate_world_size == 1
        and handle.grads.unsynced_unsharded_grad is None
        and comm.can_reduce_scatter_halves(handle._local_shard, handle.process_group)
    )


def takes_early_grads_at_forward(handle: FlatParamHandle) -> bool:
    """Whether the views made now may have their gradients taken early: the reduction can
    start from the pieces and the gradients will come in the reduce dtype."""
    return handle.flat_param.dtype == handle.precision.reduce_dtype and can_take_early(handle)


def take_param_grad(handle: FlatParamHandle, index: int, grad: torch.Tensor, run: int) -> None:
    """Keeps parameter ``index``'s gradient from forward call ``run`` of the unit.

    A unit called several times in one forward has one views node per call. Autograd (and so
    the collecting path, and torch FSDP1) sums a parameter's contributions within each call
    first (in arrival order), then adds the calls' sums to each other; the contributions are kept
    per call here and :func:`settle_open_run` adds a finished call's sum to the unit's total,
    so the sums are the same, bit for bit, whatever the users of a parameter.
    """
    kept = handle.grads
    if kept.open_run != run:
        settle_open_run(handle)
        kept.open_run = run
        kept.open_run_grads = [None] * len(handle.param_infos)
    grads = kept.open_run_grads
    assert grads is not None
    previous = grads[index]
    grads[index] = grad if previous is None else previous + grad


def settle_open_run(handle: FlatParamHandle) -> None:
    """Adds the gradients kept for the current forward call to the unit's kept total."""
    kept = handle.grads
    grads, kept.open_run_grads, kept.open_run = kept.open_run_grads, None, None
    if grads is None:
        return
    total = kept.param_grads
    kept.param_grads = grads if total is None else [
        b if a is None else a if b is None else a + b for a, b in zip(total, grads)
    ]


def keeps_param_grads(handle: FlatParamHandle) -> bool:
    """Whether any gradient of this backward is kept per parameter (settled or not)."""
    return handle.grads.param_grads is not None or handle.grads.open_run_grads is not None
