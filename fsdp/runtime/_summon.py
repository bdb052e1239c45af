"""``summon_full_params``: expose a module's full parameters (and optionally gradients).

Inside the context each unit's FlatParameter is deregistered and its original parameters are
registered back on their modules as ``nn.Parameter`` views of the unsharded flat tensor, so
``named_parameters()`` shows the original names and shapes. On exit, changes are written back
to the local shards (``writeback=True``) and everything is resharded.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from typing import Callable, Iterator, Optional, TypeVar

import torch
from torch import nn

from fsdp._common import FLAT_PARAM, FSDPStateAssertionError, strip_fsdp_segments
from fsdp.flat_param.flat_param import FlatParamHandle, HandleState, assign_grad
from fsdp.flat_param._layout import local_tensor
from fsdp.flat_param._recast import adopt_external_cast
from fsdp._comm import _collectives as comm
from fsdp._comm._phase import collective_phase
from fsdp.runtime._lazy_init import lazy_init, reset_lazy_init
from fsdp.runtime._state import (
    HandleTrainingState,
    UnitState,
    check_idle,
    state_mismatch_message,
    is_fsdp,
    named_fsdp_states,
    transition,
    unit_state,
)


def _validate_args(writeback: bool, rank0_only: bool, offload_to_cpu: bool, with_grads: bool) -> None:
    # The exception types are torch FSDP1's for the same arguments.
    if writeback and rank0_only:
        raise NotImplementedError(
            "fsdp: writeback=True and rank0_only=True is not supported yet in "
            "summon_full_params: only "
            "rank 0 would hold full parameters, so ranks would write back different data. Pass "
            "writeback=False with rank0_only=True, or rank0_only=False to write back."
        )
    if with_grads and offload_to_cpu:
        raise NotImplementedError(
            "fsdp: summon_full_params(with_grads=True, offload_to_cpu=True) is not supported; "
            "pass offload_to_cpu=False to see gradients, or with_grads=False to offload."
        )
    if offload_to_cpu and not rank0_only:
        warnings.warn(  # torch FSDP1's sentence (its missing space included), then ours
            "offload_to_cpu=True and rank0_only=False may result in the"
            "unsharded parameters being redundantly copied to CPU memory for "
            "GPUs sharing the same CPU memory, which risks CPU OOM. We "
            "recommend using offload_to_cpu=True with rank0_only=True. (fsdp: "
            "summon_full_params(offload_to_cpu=True, rank0_only=False) copies the full "
            "parameters to CPU memory on every rank; ranks sharing a host may run out of CPU "
            "memory. rank0_only=True keeps only rank 0's copy.)",
            stacklevel=2,
        )


def _top_level_fsdp(module: nn.Module) -> list[nn.Module]:
    """FSDP instances in ``module`` that have no FSDP ancestor inside ``module``."""
    if is_fsdp(module):
        return [module]
    result: list[nn.Module] = []
    for child in module.children():
        result.extend(_top_level_fsdp(child))
    return result


def _modules_to_summon(module: nn.Module, recurse: bool) -> list[nn.Module]:
    tops = _top_level_fsdp(module)
    if not recurse:
        return tops
    out: list[nn.Module] = []
    for top in tops:
        out.extend(wrapper for _, wrapper, _ in named_fsdp_states(top))
    return out


@contextlib.contextmanager
def _summon_unit(
    wrapper: nn.Module,
    state: UnitState,
    writeback: bool,
    rank0_only: bool,
    offload_to_cpu: bool,
    with_grads: bool,
) -> Iterator[None]:
    if state.training_state is HandleTrainingState.SUMMON_FULL_PARAMS:
        yield  # already summoned by an enclosing context
        return
    transition(state, HandleTrainingState.SUMMON_FULL_PARAMS)
    try:
        with contextlib.ExitStack() as stack:
            for handle in state.handles:
                stack.enter_context(
                    _summon_handle(
                        wrapper, handle, state.rank, writeback, rank0_only, offload_to_cpu, with_grads
                    )
                )
            yield
    finally:
        state.training_state = HandleTrainingState.IDLE


@contextlib.contextmanager
def _summon_handle(
    wrapper: nn.Module,
    handle: FlatParamHandle,
    rank: int,
    writeback: bool,
    rank0_only: bool,
    offload_to_cpu: bool,
    with_grads: bool,
) -> Iterator[None]:
    adopt_external_cast(handle)  # [Note: Casting after wrapping]
    handle.writeback_orig_params()
    state_before = handle.state
    was_sharded = state_before is HandleState.SHARDED
    # [Note: A kept unit shows its local shard] in flat_param.py: shown again on the way out.
    showed_local_shard = handle.storage.shows_local_shard
    try:
        handle.grads.sync_from_orig()
        handle.unshard(full_precision=True)  # the parameters' own dtype, not param_dtype
        full_grad = _gather_grad(handle) if with_grads else None
        if rank0_only and rank != 0:
            # Other ranks took part in the collectives but keep only their shards.
            if was_sharded:
                handle.reshard()
            yield
            return
        flat = handle.flat_param
        source = flat.data
        if offload_to_cpu and source.device.type != "cpu":
            source = source.cpu()
            if was_sharded:
                handle.reshard()
        # The module the FlatParameter is registered on (a checkpoint wrapper may since have
        # been put between the FSDP wrapper and it).
        wrapped = handle.wrapped_module
        registered = wrapped._parameters.pop(FLAT_PARAM, None) is not None
        layout = handle.shard_layout
        params = handle.views.full_params(layout.orig_tensors(layout.unsharded_views(source)))
        grad_views = layout.orig_tensors(layout.unsharded_views(full_grad)) if full_grad is not None else []
        for param, grad_view in zip(params, grad_views):
            assign_grad(param, grad_view)
        if full_grad is None:
            for param in params:
                param.grad = None
        register_params(handle, params)
        try:
            yield
        finally:
            if writeback:
                _write_back(handle, params, source)
                if full_grad is not None:
                    _write_back_grad(handle, params, full_grad)
            if not handle.use_orig_params:
                deregister_params(handle)
            if registered:
                wrapped.register_parameter(FLAT_PARAM, flat)
    finally:
        if was_sharded:
            handle.reshard()
        else:
            if handle.state is not state_before:
                # Unsharded in param_dtype before (the root between forward and backward):
                # gather that copy again; autograd's saved views see the same storage refilled.
                handle.unshard(full_precision=state_before is HandleState.UNSHARDED_FULL_PRECISION)
            _restore_names(handle)
            if showed_local_shard:
                handle.show_local_shard()
        handle.grads.use_sharded_grad_views()  # use_orig_params: grads were replaced inside


def _restore_names(handle: FlatParamHandle) -> None:
    """Points the names of a handle that stays unsharded back at what forward expects."""
    if handle.use_orig_params:
        handle.views.use_sharded()
    elif handle.is_unsharded:
        handle.use_unsharded_views()


def _gather_grad(handle: FlatParamHandle) -> Optional[torch.Tensor]:
    grad = handle.flat_param.grad
    if handle.grads.holds_unsynced:
        # Inside no_sync: this rank's accumulated unsharded gradient, as it is ([Note: The
        # gradient no_sync accumulates]); torch FSDP1 fails there, gathering it as if it were a shard.
        return grad
    if grad is None:
        return None
    if not handle.shard_layout.uses_sharding:
        return grad
    # On the compute device, where the full parameters were gathered: with CPU offload the
    # sharded gradient lives on the CPU, and a CPU tensor is refused by a pure NCCL group
    # (world size 1 too: offload keeps the sharded path there, [Note: CPU offload on one rank]).
    full = torch.empty(handle.shard_layout.padded_unsharded_numel, dtype=grad.dtype, device=handle.device)
    with collective_phase(None, handle):
        comm.all_gather_flat(full, grad.to(handle.device), handle.process_group)
    return full


def register_params(handle: FlatParamHandle, params: list[nn.Parameter]) -> None:
    """Registers ``params`` under the handle's original names (shared names too)."""
    for info, param in zip(handle.param_infos, params):
        info.module.__dict__.pop(info.param_name, None)
        info.module._parameters[info.param_name] = param
    for shared in handle.shared_param_infos:
        shared.module.__dict__.pop(shared.param_name, None)
        shared.module._parameters[shared.param_name] = params[shared.prim_index]


def deregister_params(handle: FlatParamHandle) -> None:
    """Removes the Parameters :func:`register_params` registered."""
    for info in handle.param_infos:
        info.module._parameters.pop(info.param_name, None)
    for shared in handle.shared_param_infos:
        shared.module._parameters.pop(shared.param_name, None)


def _write_back(handle: FlatParamHandle, params: list[nn.Parameter], source: torch.Tensor) -> None:
    """Copies changes made inside the context into the local shard.

    In-place changes already live in ``source``. A parameter whose ``.data`` or module
    attribute was replaced is copied in as well (torch FSDP1 silently drops those).
    """
    views = handle.shard_layout.unsharded_views(source)
    with torch.no_grad():
        for info, param, view in zip(handle.param_infos, params, views):
            current = info.module._parameters.get(info.param_name, getattr(info.module, info.param_name, None))
            if current is None:
                current = param
            current = local_tensor(current)  # [Note: DTensor parameters]
            if current.data_ptr() != view.data_ptr():
                if current.shape != view.shape:
                    raise RuntimeError(  # torch FSDP1's type
                        f"fsdp: summon_full_params writeback: '{info.fqn}' was given shape "
                        f"{tuple(current.shape)} but the flat parameter stores {tuple(view.shape)}; "
                        f"keep parameter shapes unchanged (copy into it in place instead)."
                    )
                view.copy_(current.detach().to(view.device))
        handle.write_back_shard(source)


def _write_back_grad(handle: FlatParamHandle, params: list[nn.Parameter], full_grad: torch.Tensor) -> None:
    """Copies gradient edits made inside the context into the sharded ``.grad``."""
    with torch.no_grad():
        for info, param, view in zip(handle.param_infos, params, handle.shard_layout.unsharded_views(full_grad)):
            grad = None if param.grad is None else local_tensor(param.grad)
            if grad is not None and grad.data_ptr() != view.data_ptr():
                if grad.shape != view.shape:
                    raise RuntimeError(  # torch FSDP1's type
                        f"fsdp: summon_full_params writeback: the gradient of '{info.fqn}' was "
                        f"given shape {tuple(grad.shape)}, expected {tuple(view.shape)}."
                    )
                view.copy_(grad)
        sharded_grad = handle.flat_param.grad
        if sharded_grad is not None and sharded_grad.data_ptr() != full_grad.data_ptr():
            sharded_grad.copy_(handle.shard_layout.local_slice(full_grad))


@contextlib.contextmanager
def summon_full_params(
    module: nn.Module,
    recurse: bool = True,
    writeback: bool = True,
    rank0_only: bool = False,
    offload_to_cpu: bool = False,
    with_grads: bool = False,
) -> Iterator[None]:
    """See :meth:`fsdp.FullyShardedDataParallel.summon_full_params`."""
    _validate_args(writeback, rank0_only, offload_to_cpu, with_grads)
    wrappers = _modules_to_summon(module, recurse)
    for top in _top_level_fsdp(module):
        lazy_init(top)
        check_idle(
            top,
            "summon_full_params()",
            allow_summon=True,
            error=FSDPStateAssertionError,
            torch_message="Cannot manually unshard parameters during forward/backward",
        )
    # The phase covers entering and leaving (gathers, write-backs), not the body in between
    # ([Note: Collective phase] in fsdp/_comm/_phase.py): a state dict inside is its own phase.
    stack = contextlib.ExitStack()
    with collective_phase("summon_full_params"), stack:
        for wrapper in wrappers:
            state: UnitState = unit_state(wrapper)
            stack.enter_context(
                _summon_unit(wrapper, state, writeback, rank0_only, offload_to_cpu, with_grads)
            )
        stack = stack.pop_all()  # entered: closed after the body
    try:
        yield
    except BaseException:
        with collective_phase("summon_full_params"):
            if not stack.__exit__(*sys.exc_info()):
                raise
    else:
        with collective_phase("summon_full_params"):
            stack.close()


_Named = TypeVar("_Named")
_M = TypeVar("_M", bound=nn.Module)


def names_in_summon(
    wrapper: nn.Module,
    named: Callable[..., Iterator[tuple[str, _Named]]],
    args: tuple[object, ...],
    kwargs: dict[str, object],
) -> Iterator[tuple[str, _Named]]:
    """``named(*args, **kwargs)`` (``nn.Module.named_parameters``/``named_buffers``), unprefixed in summon.

    While ``wrapper``'s unit is inside ``summon_full_params`` the names lose their
    ``_fsdp_wrapped_module`` segments, as in torch FSDP1; otherwise they are left alone. A
    generator: nothing (not even ``named``'s argument check) runs before the first item is
    asked for.
    """
    clean = unit_state(wrapper).training_state is HandleTrainingState.SUMMON_FULL_PARAMS
    for name, value in named(*args, **kwargs):
        yield (strip_fsdp_segments(name) if clean else name), value


def apply_summoned(wrapper: nn.Module, fn: Callable[[nn.Module], None], module_apply: Callable[..., _M]) -> _M:
    """``FullyShardedDataParallel.apply``: ``module_apply(fn)`` with this unit's parameters full.

    The unit's full parameters are gathered (nested units gather their own, as
    ``module_apply`` reaches their ``apply``) and written back. A tree that was not lazily
    initialized before is left uninitialized, so it can still be wrapped further.

    Args:
        wrapper: An FSDP instance.
        fn: The function applied to every submodule.
        module_apply: ``nn.Module.apply`` bound to ``wrapper``.

    Raises:
        ValueError: Called inside forward, backward or ``summon_full_params``.
    """
    state = unit_state(wrapper)
    uninitialized = state.is_root is None
    check_idle(wrapper, "apply()", allow_summon=True, error=ValueError)
    if state.training_state is HandleTrainingState.SUMMON_FULL_PARAMS:
        # (Nested units' apply, called by this apply's recursion, finds them idle.)
        raise ValueError(
            f"fsdp: {state_mismatch_message(state.training_state)}: "
            f"apply() cannot be called inside summon_full_params on unit "
            f"'{state.unit_name}' (the enclosing summon decides whether changes "
            f"are written back, so apply's would be lost with writeback=False). Call apply() "
            f"outside summon_full_params, or modify the parameters inside it directly."
        )
    with summon_full_params(wrapper, recurse=False, writeback=True):
        ret = module_apply(fn)
    if uninitialized:
        reset_lazy_init(wrapper)
    return ret
