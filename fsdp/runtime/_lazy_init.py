"""Root lazy initialization: done once, on the first forward (or first API call) of the root.

The first FSDP instance to run becomes the root unless an FSDP ancestor already claimed it. It
creates the shared :class:`RootContext`, hands it to every unit in its tree, and names units by
their qualified names (for messages).

[Note: Releasing the root context]
Every unit's state points to the shared context (``state.ctx``) and the context lists every
state, so the two form reference cycles: without help, a deleted model's FlatParameters, their
gradients and its process group would stay alive until Python's cyclic collector happens to
run (on the GPU, memory that ``del model`` does not give back; with gloo, worker threads that
outlive ``destroy_process_group`` into interpreter shutdown). The root's wrapper module itself
is not in a cycle, so it dies as soon as the user drops it: a ``weakref.finalize`` on it then
unlinks each unit of its tree from the context (``ctx = None``, ``is_root = None``), which
breaks every cycle and lets reference counting free the rest at once. A unit the user still
holds is left as before lazy initialization, so its next forward makes it a root of its own.
A root dropped between its forward and its backward (``FSDP(model)(x).sum().backward()``) is
not dead yet: the hooks on the forward's outputs hold it until the graph is freed.
Collectives an interrupted backward left in flight on a side stream (CUDA) are waited for
first, so their buffers are not freed under them; on CPU none is in flight ([Note: On CPU a
collective completes where it is launched] in ``flat_param/_policy.py``).
"""

from __future__ import annotations

import warnings
import weakref
from typing import Optional

from torch import nn

from fsdp.flat_param import _streams
from fsdp.runtime._state import RootContext, UnitState, check_idle, named_fsdp_states, unit_state


def lazy_init(module: nn.Module) -> UnitState:
    """Initializes the root's runtime if ``module``'s unit has not been initialized yet.

    Returns:
        The unit's state, with ``is_root`` and ``ctx`` set.
    """
    state: UnitState = unit_state(module)
    if state.is_root is not None:
        return state
    units = [(name, unit) for name, _, unit in named_fsdp_states(module)]
    _check_units(units)  # user errors: before any state changes
    state.is_root = True
    ctx = RootContext(root=state)
    for name, unit in units:
        if unit is not state:
            unit.is_root = False
        unit.ctx = ctx
        unit.unit_name = name or "<root>"
        for handle in unit.handles:
            handle.unit_name = unit.unit_name
        ctx.unit_index[id(unit)] = len(ctx.states)
        ctx.states.append(unit)
    # Every all-gather runs on one side stream, every gradient reduction on another, the hybrid
    # strategies' all-reduce across replicas on a third, shared by the tree (torch FSDP1's
    # unshard, post-backward and all-reduce streams; [Note: Stream edges] in
    # flat_param/_streams.py); none on CPU.
    ctx.unshard_stream = _streams.new_stream(state.compute_device)
    if ctx.unshard_stream is not None:
        ctx.post_backward_stream = _streams.new_stream(state.compute_device)
        ctx.all_reduce_stream = _streams.new_stream(state.compute_device)
    for unit in ctx.states:
        for handle in unit.handles:
            handle.storage.unshard_stream = ctx.unshard_stream
            handle.storage.post_backward_stream = ctx.post_backward_stream
            handle.storage.all_reduce_stream = ctx.all_reduce_stream
    # [Note: Releasing the root context]; nothing to do at interpreter exit.
    weakref.finalize(module, _release_context, ctx).atexit = False
    return state


# Torch FSDP1's names of the settings every unit of one tree must share.
_HOMOGENEOUS = {
    "_use_orig_params": "use_orig_params",
    "limit_all_gathers": "limit_all_gathers",
    "_use_full_prec_in_eval": "full_precision_in_eval",
}


def _check_units(units: list[tuple[str, UnitState]]) -> None:
    """Raises, as torch FSDP1 does at lazy initialization, for a tree its runtime cannot serve.

    Raises:
        RuntimeError: An optimizer in backward (``_apply_optimizer_in_backward``) was given a
            FlatParameter (it needs ``use_orig_params=True``).
        ValueError: Units disagree on ``use_orig_params``, ``limit_all_gathers`` or
            ``FSDP_USE_FULL_PREC_IN_EVAL``.
    """
    for name, unit in units:
        for handle in unit.handles:
            if hasattr(handle.flat_param, "_in_backward_optimizers"):
                raise RuntimeError(
                    f"fsdp: FSDP optimizer in backward only supported with use_orig_params=True! "
                    f"Unit '{name or '<root>'}' has use_orig_params=False, so the optimizer was "
                    f"given its FlatParameter; wrap with use_orig_params=True."
                )
    for torch_name, field in _HOMOGENEOUS.items():
        values = {getattr(unit, field) for _, unit in units}
        if len(values) != 1:
            by_value = {
                value: [name or "<root>" for name, unit in units if getattr(unit, field) == value]
                for value in values
            }
            raise ValueError(
                f"fsdp: Expects one homogeneous value for {torch_name} but got {values}: the "
                f"FSDP units of one tree must share it ({by_value}); pass the same value to "
                f"every FullyShardedDataParallel of the model."
            )


def _release_context(ctx: RootContext) -> None:
    """Unlinks the units of a deleted root's tree from ``ctx`` (see the note above).

    Collectives a failed backward left in flight (a prefetched all-gather, a reduction: on CUDA
    only, on a side stream) are completed first: the compute stream waits on their events, so
    no buffer they use is freed under them. These are event waits, not collectives: no phase
    to name ([Note: Collective phase]).
    """
    for unit in ctx.states:
        if unit.ctx is not ctx:  # re-initialized under another root since
            continue
        for handle in unit.handles:
            try:
                handle.storage.wait_unshard()
                handle.grads.wait()
            except Exception as err:  # a finalizer cannot raise: say so, free the rest
                warnings.warn(
                    f"fsdp: finishing a collective of the dropped model's unit '{unit.unit_name}' "
                    f"failed (the peer is gone or stuck?): {err}",
                    stacklevel=1,
                )
        unit.ctx = None
        unit.is_root = None
    ctx.states.clear()


def reset_lazy_init(module: nn.Module) -> None:
    """Undoes :func:`lazy_init` for ``module``'s tree (so it can be wrapped further)."""
    for _, _, unit in named_fsdp_states(module):
        unit.is_root = None
        unit.ctx = None


def require_root(
    module: nn.Module,
    what: str,
    error: type[Exception] = RuntimeError,
    torch_message: str = "",
    anchored: bool = False,
    idle_error: Optional[type[Exception]] = None,
) -> UnitState:
    """Lazily initializes ``module``'s tree and returns its state, if it is the root.

    Args:
        module: An FSDP instance.
        what: The API being called, for the message.
        error: The exception type (torch FSDP1's for the same call).
        torch_message: Torch FSDP1's message for the same call, which ours starts with.
        anchored: The message is exactly ``torch_message`` (torch's tests match it whole);
            ours goes into a note.
        idle_error: Also require every unit of the tree to be idle (not in forward, backward
            or ``summon_full_params``), raising this type (torch FSDP1's for the call).

    Raises:
        RuntimeError (or ``error``): ``module`` is a nested unit, not the root.
        ``idle_error``: A unit of the tree is busy.
    """
    state: UnitState = unit_state(module)
    if not state.has_fsdp_parent:
        state = lazy_init(module)
    if state.has_fsdp_parent or not state.is_root:
        where = f"{what} was called on the nested unit '{state.unit_name}'"
        fix = "Call it on the outermost FSDP module."
        if anchored:
            exc = error(torch_message)
            exc.add_note(f"fsdp: {where}. {fix}")
            raise exc
        if torch_message:
            sep = " " if torch_message.endswith(".") else ": "
            raise error(f"fsdp: {torch_message}{sep}{where}. {fix}")
        raise error(
            f"fsdp: {what} must be called on the root FSDP instance, but it was called on the "
            f"nested unit '{state.unit_name}'. {fix}"
        )
    if idle_error is not None:
        check_idle(module, what, error=idle_error)
    return state
