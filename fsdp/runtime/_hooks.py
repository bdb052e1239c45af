"""Forward and backward hooks: when each unit unshards, reshards and reduces its gradient.

See docs/hook_order.md, [Note: Hook order], for the sequence in one training step.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from typing import Any, Iterator, Optional, TypeVar, cast

import torch
from torch import nn
from torch.autograd import Variable
from torch.autograd.graph import Node

from fsdp._common import apply_to_tensors, compile_boundary, eager_only, p_assert
from fsdp._comm._errors import check_interrupted_backward_agreed
from fsdp._comm._phase import collective_phase
from fsdp.flat_param.flat_param import FlatParameter, FlatParamHandle
from fsdp.flat_param._recast import adopt_external_cast, check_not_recast_since_forward
from fsdp.runtime._exec_order import check_execution_order, finish_first_iteration
from fsdp.runtime._lazy_init import lazy_init, require_root
from fsdp.runtime._mixed_precision import cast_forward_inputs, set_buffers_full_precision
from fsdp.runtime._prefetch import order_gathers_after_compute, prefetch_after, record_free_event, unshard_unit
from fsdp.runtime._state import HandleTrainingState, RootContext, UnitState, transition


_T = TypeVar("_T")


@compile_boundary  # [Note: torch.compile]: only the wrapped module's forward is compiled
def unit_forward(wrapper: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> Any:
    """Runs one unit's forward: lazy init (root), unshard, the wrapped module, post-forward.

    Under ``torch.compile`` Dynamo does not trace this function (a traced caller breaks its
    graph at the call) and its two FSDP steps run eagerly; the wrapped module's own forward in
    between is compiled.
    """
    # Any: the wrapped module's output (torch types nn.Module.__call__ as returning Any).
    state, args, kwargs, recompute = _unit_pre_forward(wrapper, args, kwargs)
    # nn.Module.__getattr__ is typed Union[Tensor, Module]; the wrapper holds its module there.
    module = cast(nn.Module, wrapper._fsdp_wrapped_module)
    if recompute:
        return module(*args, **kwargs)
    try:
        output = module(*args, **kwargs)
    except BaseException:
        state.training_state = HandleTrainingState.IDLE
        raise
    # The root's wrapper rides on the outputs' hooks: a model dropped between its forward and
    # its backward lives until that backward ([Note: Releasing the root context]).
    return _post_forward(state, output, wrapper if state.is_root else None)


@eager_only
def _unit_pre_forward(
    wrapper: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]
) -> tuple[UnitState, tuple[object, ...], dict[str, object], bool]:
    """Everything a unit's forward does before the wrapped module runs.

    Returns:
        The unit's state, the (moved, cast) inputs, and whether this forward recomputes the
        unit inside backward (then there is no post-forward).
    """
    state = lazy_init(wrapper)
    state.forward_in_full_precision = state.full_precision_in_eval and not wrapper.training
    assert state.ctx is not None
    if state.is_root:
        _recover_if_backward_interrupted(state)
        _release_kept_unit(state)
        args, kwargs = _root_pre_forward(state, args, kwargs)
    elif state.ctx.root.training_state is not HandleTrainingState.FORWARD and not _in_backward(state):
        order_gathers_after_compute(state.ctx)  # a nested unit run on its own: its own iteration
    args, kwargs = cast_forward_inputs(state, args, kwargs)
    if not state.is_root and _in_backward(state):
        # Activation checkpointing re-runs this unit's forward inside backward (see
        # [Note: Activation checkpointing] in docs/hook_order.md).
        _unshard_for_recompute(state)
        return state, args, kwargs, True
    _pre_forward(state)
    return state, args, kwargs, False


def _in_backward(state: UnitState) -> bool:
    """Whether a backward of this unit's tree is running (the unit is being recomputed)."""
    return state.ctx is not None and state.ctx.final_callback_queued


def _unshard_for_recompute(state: UnitState) -> None:
    """Gathers the unit for a recomputed forward; its post-backward hook frees it afterwards."""
    with collective_phase("backward unshard for a recomputed forward", state):
        unshard_unit(state)
    for handle in state.handles:
        handle.use_unsharded_views()


def _recover_if_backward_interrupted(state: UnitState) -> None:
    """Resets units that a failed backward left mid-flight (an exception escaped it).

    The end-of-backward callback never ran, so units may still be gathered, in a backward
    state, holding half-reduced gradients. Warn, drop what that backward produced (gradients
    from before it are kept) and start clean, instead of failing every later step; but only
    where every rank stopped at the same point ([Note: A backward that raised on some ranks]).

    Raises:
        RuntimeError: The other ranks did not stop where this one did (nothing is reset).
    """
    ctx = state.ctx
    assert ctx is not None
    in_step, ctx.raised_in_step = ctx.raised_in_step, False
    stuck = [s for s in ctx.states if s.training_state in (HandleTrainingState.BACKWARD_PRE, HandleTrainingState.BACKWARD_POST) or s.ran_pre_backward]
    if not stuck and not ctx.final_callback_queued:
        return
    # Safe only where every rank stopped at the same point ([Note: A backward that raised on
    # some ranks] in fsdp/_comm/_errors.py); raises before any collective otherwise.
    progress = ", ".join(f"'{s.unit_name}' ({s.training_state.name}{', pre-backward ran' if s.ran_pre_backward else ''})" for s in stuck)
    groups = [g for g in (ctx.root.process_group, ctx.root.replicate_group) if g is not None]
    if not in_step:
        check_interrupted_backward_agreed(groups, f"FSDP units {progress or 'none'}")
    warnings.warn(
        "fsdp: the previous backward did not finish (an exception was raised inside it?); "
        f"resetting FSDP units {[s.unit_name for s in stuck]} and discarding the gradients "
        "that backward produced.",
        stacklevel=4,
    )
    ctx.inflight_reductions.clear()
    for unit in ctx.states:  # (reductions in flight complete by event waits: no collective)
        for handle in unit.handles:
            handle.abandon_backward()
        unit.ran_pre_backward = False
        unit.training_state = HandleTrainingState.IDLE
    ctx.final_callback_queued = False


def _release_kept_unit(root: UnitState) -> None:
    """Reshards the unit an earlier forward kept for a backward that never came.

    [Note: The first backward unit stays gathered] in ``_prefetch.py``: a forward whose outputs
    required grad but were never backpropagated (a second forward before the backward, an
    evaluation under grad) leaves that unit gathered; the next forward of the root frees it, so
    that forward gathers the current parameters.
    """
    ctx = root.ctx
    if ctx is None or ctx.kept_unit_pending is None or ctx.final_callback_queued:
        return
    kept, ctx.kept_unit_pending = ctx.kept_unit_pending, None
    if kept.ran_pre_backward:
        return
    for handle in kept.handles:
        if handle.is_unsharded:
            handle.reshard()
    record_free_event(kept)


def _keeps_for_backward(state: UnitState) -> bool:
    """Whether this post-forward keeps the unit gathered for the backward that follows."""
    ctx = state.ctx
    return (
        ctx is not None
        and ctx.unit_kept_for_backward is state
        and ctx.root.training_state is HandleTrainingState.FORWARD  # inside the root's forward
    )


def _root_pre_forward(
    state: UnitState, args: tuple[object, ...], kwargs: dict[str, object]
) -> tuple[tuple[object, ...], dict[str, object]]:
    """Moves forward inputs to the compute device (a no-op when they are already there)."""
    ctx = state.ctx
    assert ctx is not None
    order_gathers_after_compute(ctx)  # once per iteration ([Note: Stream edges], edge 1)
    if ctx.buffers_in_full_precision != state.forward_in_full_precision:
        set_buffers_full_precision(ctx.states, state.forward_in_full_precision)
        ctx.buffers_in_full_precision = state.forward_in_full_precision
    device = state.compute_device

    def to_device(t: torch.Tensor) -> torch.Tensor:
        return t if t.device == device else t.to(device, non_blocking=True)

    return apply_to_tensors(to_device, args), apply_to_tensors(to_device, kwargs)


def _pre_forward(state: UnitState) -> None:
    """Postcondition: the unit's parameters are unsharded and its names are views into them."""
    for handle in state.handles:
        adopt_external_cast(handle)  # [Note: Casting after wrapping]; may raise a user error
        handle.writeback_orig_params()  # may raise a user error: before any state change
        # use_orig_params: after zero_grad(set_to_none=True) on the original parameters, drop
        # the sharded flat gradient now (as torch FSDP1 does in its pre-forward), not at the
        # next backward: it would otherwise stay alive through the whole forward.
        handle.grads.sync_from_orig()
    with collective_phase("forward unshard", state):
        check_execution_order(state, "forward")  # first iteration: raises instead of hanging
        transition(state, HandleTrainingState.FORWARD)
        unshard_unit(state)
        for handle in state.handles:
            handle.use_unsharded_views()
        _register_reduction_input_release(state)
        prefetch_after(state, "forward")


def _register_reduction_input_release(state: UnitState) -> None:
    """In backward, the assembly of this unit's unsharded gradient first gives back the memory
    of the reduction inputs in flight.

    [Note: Overlapped gradient reduction] keeps the previous unit's reduction running while
    this unit's backward computes, and its input alive until the post-backward stream has read
    it. A pre-hook on the node that concatenates the parameter views' gradients into the
    FlatParameter's (split's backward) runs once they are all complete, just before that
    concatenation: the unit's compute has overlapped the reduction by then, and releasing the
    input there rather than at the unit's post-backward frees it before this unit's own
    unsharded gradient is allocated, the step's memory peak. One hook per handle, not one per
    parameter view: it runs once, where the last view's gradient is in (tests/test_streams.py
    checks each input is released before the next reduction is issued). Without a
    post-backward stream (CPU) every reduction completes where it is launched, nothing is ever
    in flight, and no hook is registered.
    """
    if not torch.is_grad_enabled() or state.ctx is None or state.ctx.post_backward_stream is None:
        return
    hook = functools.partial(_release_reduction_inputs_hook, weakref.ref(state.ctx))
    for handle in state.handles:
        views = [view for view in handle.views.module_tensors() if view.grad_fn is not None]
        if views:
            _gradient_assembly_node(views[0], handle.flat_param).register_prehook(hook)


def _gradient_assembly_node(view: torch.Tensor, flat_param: torch.Tensor) -> Node:
    """The autograd node that writes ``flat_param``'s gradient from its views' (split's
    backward), found down the first inputs of ``view``'s graph (a view, then for a DTensor
    parameter its ``from_local``)."""
    node = view.grad_fn
    # (An AccumulateGrad node's ``variable`` is its leaf: here the FlatParameter.)
    while node is not None and not any(getattr(n, "variable", None) is flat_param for n, _ in node.next_functions):
        node = node.next_functions[0][0] if node.next_functions else None
    p_assert(node is not None, f"no autograd path from a parameter view ({view.grad_fn}) to its FlatParameter")
    assert node is not None  # for type checkers
    return node


def _release_reduction_inputs_hook(ctx_ref: "weakref.ref[RootContext]", grad_outputs: tuple[torch.Tensor, ...]) -> None:
    ctx = ctx_ref()
    if ctx is not None:
        release_reduction_inputs(ctx)


def release_reduction_inputs(ctx: RootContext) -> None:
    """Gives back the memory of every reduction input in flight (the compute stream waits
    for the post-backward stream's last read of each, ``GradReduction.release_input``); the
    reductions themselves stay in flight until the end of backward. A unit whose parameters
    have optimizers in backward completes here instead: they step on its reduced gradient
    ([Note: Optimizers in backward]).

    Where it runs: the pre-hook of the next unit's gradient assembly, and the post-backward
    hook before it launches a reduction, so at most one reduction input is alive at a time
    ([Note: Overlapped gradient reduction]).
    """
    for handle in list(ctx.inflight_reductions):
        if _optimizers_in_backward(handle):
            finish_inflight_reductions(ctx, only=handle)
        else:
            handle.grads.release_input()


def finish_inflight_reductions(ctx: RootContext, only: Optional[FlatParamHandle] = None) -> None:
    """Completes the gradient reductions in flight, oldest first (``only``: that handle's).

    The one place reductions are completed ([Note: Overlapped gradient reduction]): the end of
    backward; a unit with optimizers in backward where its input is released; a handle about
    to reduce again in the same backward. The collectives ran in ``reduce``; completing one
    is the compute stream's wait on its event, so no collective runs here.
    """
    for handle in list(ctx.inflight_reductions):
        if only is not None and handle is not only:
            continue
        ctx.inflight_reductions.remove(handle)
        handle.grads.wait()
        _step_optimizers_in_backward(handle)


@eager_only  # FSDP bookkeeping runs eagerly; the module's own forward compiles
def _post_forward(state: UnitState, output: _T, owner: Optional[nn.Module] = None) -> _T:
    """Reshards per strategy and registers the pre-backward hooks on the outputs.

    ``owner`` (the root's wrapper) is bound into those hooks, so the autograd graph keeps it.

    The root keeps its parameters unsharded after forward when a backward is expected (it
    would gather them again at once), and so does the unit whose backward comes first ([Note:
    The first backward unit stays gathered] in ``_prefetch.py``); every unit reshards when no
    backward can follow (grad disabled, or no output requires grad), so eval and ``no_grad``
    leave nothing behind.
    """
    grad_outputs: list[torch.Tensor] = []
    if torch.is_grad_enabled():

        def collect(t: torch.Tensor) -> torch.Tensor:
            if t.requires_grad:
                grad_outputs.append(t)
            return t

        apply_to_tensors(collect, output)
    expects_backward = bool(grad_outputs)
    if expects_backward and state.frees_after_forward() and _keeps_for_backward(state):
        assert state.ctx is not None
        state.ctx.kept_unit_pending = state  # [Note: The first backward unit stays gathered]
    elif not expects_backward or state.frees_after_forward():
        for handle in state.handles:
            handle.reshard()
        record_free_event(state)
    if expects_backward:
        _register_orig_params_after_forward(state)
    hook = functools.partial(_pre_backward_hook, state, owner=owner)
    for t in grad_outputs:
        t.register_hook(hook)
    transition(state, HandleTrainingState.IDLE)
    return output


def _register_orig_params_after_forward(state: UnitState) -> None:
    """A unit kept gathered after forward shows its original Parameters (use_orig_params), or
    else its FlatParameter's local shard ([Note: A kept unit shows its local shard]).

    [Note: Original parameters between forward and backward]
    Code that runs between a forward and its backward (logging, clipping or scaling gradients
    during accumulation, ``named_parameters()``) sees what torch FSDP1 shows, which depends on
    the strategy, not on whether the unsharded memory is kept: FULL_SHARD and HYBRID_SHARD
    show the original Parameters in their sharded 1-D form, and NO_SHARD in their original
    shapes, each with the ``.grad`` it had before the forward (the sharded gradient's view,
    or inside ``no_sync`` the accumulated unsharded gradient's); SHARD_GRAD_OP and
    _HYBRID_SHARD_ZERO2 keep the unsharded views (plain tensors, no ``.grad``), as torch FSDP1
    does. A unit freed after forward already shows them (its reshard registers them); this
    registers them back on a unit that keeps its unsharded memory for the backward (the root,
    the first backward unit, NO_SHARD): the memory stays, only the names change. The forward
    never touched the Parameter objects' ``.data`` or ``.grad``, so nothing is re-derived;
    the pre-backward hook points the names at views again for the backward's recomputations.
    tests/test_orig_params_grads.py compares ``.grad`` and shapes at each point with torch's.
    """
    for handle in state.handles:
        if not handle.use_orig_params:
            handle.show_local_shard()  # [Note: A kept unit shows its local shard]
        elif handle.is_unsharded and not state.policy.keeps_unsharded_for_backward:
            handle.views.use_sharded()


def _queue_final_callback(ctx: RootContext) -> None:
    """At the first FSDP hook of a backward: queues the end-of-backward callback, and orders
    the backward's gathers after the compute stream's work so far (once per backward,
    [Note: Stream edges] in flat_param/_streams.py, edge 1)."""
    if not ctx.final_callback_queued:
        ctx.final_callback_queued = True
        Variable._execution_engine.queue_callback(functools.partial(_final_callback, ctx))
        order_gathers_after_compute(ctx)


def _pre_backward_hook(state: UnitState, grad: torch.Tensor, owner: Optional[nn.Module] = None) -> torch.Tensor:
    """Runs when a gradient w.r.t. one of the unit's outputs is ready: unshard for backward.

    ``owner`` is unused: bound into the hook, it keeps the root's wrapper alive as long as
    the graph can still run this backward (see ``_post_forward``).

    Postcondition: the unit's FlatParameter holds the padded unsharded tensor, so the views
    autograd saved in forward see valid data again.
    """
    p_assert(state.ctx is not None, f"unit '{state.unit_name}': backward before lazy init")
    assert state.ctx is not None
    _queue_final_callback(state.ctx)
    if state.ran_pre_backward:
        return grad
    for handle in state.handles:
        check_not_recast_since_forward(handle)  # user error: before any state change
        handle.views.check_not_replaced_since_forward(handle.is_unsharded)  # user error: before any state change
    state.ran_pre_backward = True
    if state.ctx.kept_unit_pending is state:
        state.ctx.kept_unit_pending = None  # kept from its forward for this backward
    with collective_phase("backward unshard", state):
        check_execution_order(state, "backward")
        transition(state, HandleTrainingState.BACKWARD_PRE)
        unshard_unit(state)
        for handle in state.handles:
            # Names become views again (not placeholders): a checkpointed submodule of this unit
            # re-runs its forward during backward and reads them; forward's own views where it
            # took them ([Note: Backward reads forward's views] in flat_param/_views.py).
            if not handle.views.use_recorded_views():
                handle.use_unsharded_views()
        prefetch_after(state, "backward_pre")
    return grad


def _pre_accumulate_hook(handle_ref: "weakref.ref[FlatParamHandle]", grad: torch.Tensor) -> torch.Tensor:
    """Runs just before autograd accumulates into the FlatParameter: stash the old gradient."""
    handle = handle_ref()
    if handle is not None:
        handle.grads.stash()
    return grad


def _post_backward_hook(
    state_ref: "weakref.ref[UnitState]",
    handle_ref: "weakref.ref[FlatParamHandle]",
    flat_param: FlatParameter,
) -> None:
    """Runs once a handle's unsharded gradient is accumulated: reshard, prefetch, reduce.

    [Note: Reshard before reducing]
    The unit's unsharded parameters are freed, and a ``BACKWARD_POST`` prefetch launched, before
    its gradient reduction is, in torch FSDP1's order: nothing reads the parameters once
    autograd has accumulated the gradient, and the reduction allocates (the reduced output;
    gloo a full-size copy of its input), so freeing first keeps one unit's unsharded parameters
    out of the reduction's peak; and the next unit's all-gather, which its compute waits for, is
    issued ahead of this unit's reduce-scatter, which nothing waits for until later (NCCL runs a
    group's collectives in issue order). On CUDA a sharded unit's buffer was allocated on the
    unshard stream, so the freed block serves that stream's next gather.
    """
    state, handle = state_ref(), handle_ref()
    if state is None or handle is None:
        return  # the model is being destroyed
    assert state.ctx is not None
    _queue_final_callback(state.ctx)
    p_assert(
        handle.is_unsharded,
        f"unit '{state.unit_name}': gradient arrived while the parameters are sharded "
        f"(the pre-backward hook did not run)",
    )
    transition(state, HandleTrainingState.BACKWARD_POST)
    ctx = state.ctx
    with collective_phase("backward reduce", handle):
        # At most one reduction input alive: release those in flight (a unit without the gradient
        # assembly hook comes here first), and complete this handle's own if it reduces again.
        release_reduction_inputs(ctx)
        finish_inflight_reductions(ctx, only=handle)
        if state.reshards_after_backward():
            _reshard_after_backward(state, handle)
        prefetch_after(state, "backward_post")
        handle.grads.reduce(
            state.sync_gradients,
            state.comm_hook,
            state.comm_hook_state,
            full_precision=state.forward_in_full_precision,
        )
        if handle.grads.inflight is not None:
            ctx.inflight_reductions.append(handle)
        elif state.sync_gradients:
            _step_optimizers_in_backward(handle)  # the reduction completed here


def _reshard_after_backward(state: UnitState, handle: FlatParamHandle) -> None:
    # A frozen handle of the same unit was needed for this unit's backward only; it is done
    # now too (its gradient-less parameters fire no hook of their own).
    for unit_handle in state.handles:
        if unit_handle is handle or not unit_handle.flat_param.requires_grad:
            unit_handle.reshard()
    record_free_event(state)


def register_flat_param_hooks(state: UnitState) -> None:
    """Registers the gradient hooks on the unit's trainable FlatParameters (once).

    The hooks live in the FlatParameter's C++ autograd metadata, where Python's garbage
    collector cannot see them: they hold only weak references to the handle and the state, so
    ``del model`` frees the parameters (a strong reference would form an uncollectable cycle).
    """
    for handle in state.handles:
        if not handle.flat_param.requires_grad:
            continue
        handle.flat_param.register_hook(functools.partial(_pre_accumulate_hook, weakref.ref(handle)))
        handle.flat_param.register_post_accumulate_grad_hook(
            functools.partial(_post_backward_hook, weakref.ref(state), weakref.ref(handle))
        )


def _final_callback(ctx: RootContext) -> None:
    """End of backward: reshard what is still unsharded, set sharded grads, reset states.

    Units whose gradient never arrived (unused outputs, frozen parameters) are resharded here,
    and keep ``.grad`` as it was. No collective runs here: completing the reductions in flight
    and a prefetched gather are the compute stream's waits on their events.
    """
    finish_inflight_reductions(ctx)
    for state in ctx.states:
        for handle in state.handles:
            handle.views.drop_recorded_views()
            if handle.is_unsharded and state.reshards_after_backward():
                handle.reshard()
            elif handle.use_orig_params:
                # Kept unsharded (no_sync, SHARD_GRAD_OP's root, ...): the names hold this
                # backward's views; register the original Parameters back, as torch FSDP1 does,
                # so the optimizer and named_parameters() see them between steps.
                handle.views.use_sharded()
                if handle.grads.holds_unsynced:
                    handle.grads.use_sharded_grad_views()  # no_sync: the accumulated unsharded views
            else:
                handle.show_local_shard()  # kept unsharded: [Note: A kept unit shows its local shard]
            if handle.grads.stepped_in_backward:
                handle.grads.stepped_in_backward = False  # finalized and consumed already
            elif not handle.is_unsharded or not handle.has_unsharded_buffer:
                handle.grads.finalize()
        state.ran_pre_backward = False
        state.training_state = HandleTrainingState.IDLE
    ctx.final_callback_queued = False
    ctx.kept_unit_pending = None  # resharded above if this backward never reached it
    finish_first_iteration(ctx)


def _step_optimizers_in_backward(handle: FlatParamHandle) -> None:
    """Once a handle's reduction of a synchronized backward is complete: steps the optimizers
    ``_apply_optimizer_in_backward`` gave its parameters, if it has any.

    [Note: Optimizers in backward]
    ``torch.distributed.optim._apply_optimizer_in_backward`` gives each parameter its own
    optimizer (``param._in_backward_optimizers``) and steps it from a hook on the parameter's
    gradient accumulation. Under FSDP with ``use_orig_params=True`` no such accumulation happens
    (forward uses views of the FlatParameter), so the wrapper steps them, as torch FSDP1 does,
    unit by unit during the backward: as soon as a unit's reduction is complete (where it
    completes: in its post-backward hook without streams; on CUDA where its input is released,
    at the next unit's gradient assembly, see [Note: Overlapped gradient reduction]) its sharded gradient is finalized early (``.grad``
    set, any accumulated one added), every optimizer of a parameter with a gradient on this rank
    steps, and that gradient is dropped (a parameter this rank holds no part of has none and is
    skipped). The unit's reduced gradient then lives no longer than its reduction, and its
    parameters are updated while the rest of the backward runs, as in torch FSDP1. The
    FlatParameter's gradient is dropped too once every original one is None; otherwise it stays
    for the parameters the regular optimizer steps, and the stepped ones keep None (``.grad`` of
    a parameter whose gradient is None stays None when the flat gradient is rebuilt,
    ``sync_from_orig``). The end of backward skips the unit's finalization
    (``stepped_in_backward``). Nothing steps inside ``no_sync``, nor for a unit whose gradient
    did not arrive. ``use_orig_params=False`` is refused at lazy initialization, as torch
    FSDP1 does.
    """
    stepping = _optimizers_in_backward(handle)
    if not stepping:
        return
    handle.grads.finalize()
    handle.grads.stepped_in_backward = True
    for param, optimizers in stepping:
        if param.grad is None:
            continue
        for optimizer in optimizers:
            optimizer.step()
        optimizers[-1].zero_grad(set_to_none=True)
    if all(param.grad is None for param in handle.views.orig_params):
        handle.flat_param.grad = None


def _optimizers_in_backward(handle: FlatParamHandle) -> list[tuple[nn.Parameter, list[Any]]]:
    """The handle's original Parameters with optimizers in backward, and those optimizers."""
    if not handle.use_orig_params:
        return []
    return [
        (param, optimizers)
        for param in handle.views.orig_params
        if (optimizers := getattr(param, "_in_backward_optimizers", None))
    ]


@contextlib.contextmanager
def no_sync(root: nn.Module) -> Iterator[None]:
    """``FullyShardedDataParallel.no_sync``: every unit of ``root``'s tree skips its reduction.

    Gradients accumulate unsharded on each unit (see ``UnitState.reshards_after_backward``); the
    first backward outside the context reduces them. Each unit's previous setting is restored
    on exit, even after an exception.

    Raises:
        RuntimeError: ``root`` is a nested unit.
        ValueError: A unit of the tree is in forward, backward or ``summon_full_params``
            (torch FSDP1's type).
    """
    state = require_root(
        root,
        "no_sync()",
        torch_message="`no_sync()` on inner FSDP instances is not supported. Please call "
        "`no_sync()` on root FSDP module.",
        idle_error=ValueError,  # torch FSDP1's type
    )
    assert state.ctx is not None
    previous = [(unit, unit.sync_gradients) for unit in state.ctx.states]
    for unit, _ in previous:
        unit.sync_gradients = False
    try:
        yield
    finally:
        for unit, flag in previous:
            unit.sync_gradients = flag
