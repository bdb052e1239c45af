"""What the original parameter names on the modules hold, and writing changes to them back.

The views concern of :class:`~fsdp.flat_param.flat_param.FlatParamHandle`: while the unit is
unsharded each name holds a view into the unsharded FlatParameter (``split`` and ``view``,
recorded by autograd, whose backward concatenates the gradients into the FlatParameter's);
while it is sharded a placeholder that raises
when used, or with use_orig_params the original Parameter viewing its part of the local shard
(see [Note: Original parameters] in docs/flat_param_lifecycle.md). With use_orig_params the
original Parameters' ``.grad`` view the sharded gradient, and what the user replaced between
steps (``.data``, ``.grad``, a new Parameter) is written back into the flat parameter.

The functions take the handle (:class:`_Handle` names what they use of it); the handle's
methods of the same names call them.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional, Protocol, Sequence

import torch
from torch import nn

from fsdp.flat_param._layout import ParamInfo, SharedParamInfo, ShardLayout
from fsdp.flat_param._precision import HandlePrecision
from fsdp.flat_param._storage import HandleState

__all__ = ["assign_grad"]


class _Grads(Protocol):
    unsynced_unsharded_grad: Optional[torch.Tensor]


class _Handle(Protocol):
    """What this module uses of a ``FlatParamHandle`` (a structural type: ``flat_param.py``
    imports this module, so importing the class here would be a cycle)."""

    unit_name: str
    device: torch.device
    use_orig_params: bool
    param_infos: list[ParamInfo]
    shared_param_infos: list[SharedParamInfo]
    shard_layout: ShardLayout
    flat_param: nn.Parameter
    grads: _Grads
    cast_generation: int
    forward_cast_generation: int
    _orig_params: list[nn.Parameter]
    _placeholders: Optional[list["_ShardedParamPlaceholder"]]

    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def precision(self) -> HandlePrecision: ...
    @property
    def state(self) -> HandleState: ...
    @property
    def _local_shard(self) -> torch.Tensor: ...
    @property
    def has_unsharded_buffer(self) -> bool: ...
    @property
    def is_unsharded(self) -> bool: ...
    def reshard(self) -> None: ...
    def use_sharded_views(self) -> None: ...
    def _set_sharded_grad(self, grad: Optional[torch.Tensor]) -> None: ...
    def _unsharded_views(self, source: torch.Tensor) -> list[torch.Tensor]: ...


class _ShardedParamPlaceholder(torch.Tensor):
    """Stands in for an original parameter while its unit is sharded.

    Any use in a computation raises a RuntimeError naming the parameter and the unit, instead of
    a shape mismatch deep inside torch (for example when a submodule of a unit is called
    directly, outside the unit's forward).
    """

    # A weak reference: a strong one would keep a dropped model alive ([Note: Freeing a wrapped
    # model] in flat_param.py); the unit's name is read when needed (lazy init refines it).
    _fsdp_handle_ref: "weakref.ref[_Handle]"
    _fsdp_fqn: str
    _fsdp_module_name: str

    @staticmethod
    def make(handle: _Handle, fqn: str, module_name: str, dtype: torch.dtype) -> "_ShardedParamPlaceholder":
        t = torch.Tensor._make_subclass(
            _ShardedParamPlaceholder, torch.empty(0, dtype=dtype, device=handle.device)
        )
        t._fsdp_handle_ref = weakref.ref(handle)
        t._fsdp_fqn = fqn
        t._fsdp_module_name = module_name
        return t

    @property
    def _fsdp_unit_name(self) -> str:
        handle = self._fsdp_handle_ref()
        return handle.unit_name if handle is not None else "<a dropped unit>"

    def describe(self) -> str:
        unit = self._fsdp_unit_name
        module = self._fsdp_module_name or "<the unit's module>"
        return (
            f"fsdp: parameter '{self._fsdp_fqn}' belongs to the FSDP unit '{unit}', which is "
            f"sharded right now, so it holds no data. Submodule '{module}' was used outside its "
            f"unit's forward. Call the FSDP-wrapped module (or the root) instead of its submodule, "
            f"or access full parameters inside FullyShardedDataParallel.summon_full_params(model)."
        )

    @classmethod
    def __torch_function__(
        cls, func: Callable, types: Any, args: Sequence[Any] = (), kwargs: Optional[dict] = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _PLACEHOLDER_SAFE_FUNCS:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        for arg in list(args) + list(kwargs.values()):
            if isinstance(arg, _ShardedParamPlaceholder):
                raise RuntimeError(arg.describe())
        raise RuntimeError("fsdp: a sharded parameter placeholder was used in a computation")

    def __repr__(self, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]
        return f"<sharded fsdp parameter '{self._fsdp_fqn}' of unit '{self._fsdp_unit_name}'>"


_PLACEHOLDER_SAFE_FUNCS = {
    torch.Tensor.dtype.__get__,  # type: ignore[attr-defined]
    torch.Tensor.device.__get__,  # type: ignore[attr-defined]
    torch.Tensor.requires_grad.__get__,  # type: ignore[attr-defined]
    torch.Tensor.is_cuda.__get__,  # type: ignore[attr-defined]
    torch.Tensor.layout.__get__,  # type: ignore[attr-defined]
    torch.Tensor.__repr__,
}


def assign_grad(param: nn.Parameter, grad: Optional[torch.Tensor]) -> None:
    """``param.grad = grad``, also when ``grad`` differs from ``param`` in dtype or shape.

    autograd refuses a ``.grad`` of another dtype or shape, so a low-precision gradient
    (keep_low_precision_grads), or an unsharded gradient on a sharded original parameter
    (use_orig_params inside ``no_sync``, as torch FSDP1 shows it), goes in through ``.grad.data``
    on a stand-in like ``param``; the stand-in has zero strides, so it costs one element.
    """
    if grad is None or (grad.dtype == param.dtype and grad.shape == param.shape):
        param.grad = grad
        return
    param.grad = torch.empty_strided(
        param.shape, [0] * param.dim(), dtype=param.dtype, device=param.device
    )
    param.grad.data = grad


def _set_module_tensor(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Sets ``module.name`` to a plain tensor attribute (not a registered parameter)."""
    module._parameters.pop(name, None)
    object.__setattr__(module, name, tensor)


def _set_module_param(module: nn.Module, name: str, param: nn.Parameter) -> None:
    """Registers ``param`` as ``module.name``, replacing a plain tensor attribute if any."""
    module.__dict__.pop(name, None)
    module._parameters[name] = param


def _set_module_tensors(handle: _Handle, tensors: Sequence[torch.Tensor]) -> None:
    """Every name (shared ones too) to its parameter's entry of ``tensors``, as plain tensors."""
    for info, tensor in zip(handle.param_infos, tensors):
        _set_module_tensor(info.module, info.param_name, tensor)
    for shared in handle.shared_param_infos:
        _set_module_tensor(shared.module, shared.param_name, tensors[shared.prim_index])


def _set_module_params(handle: _Handle, params: Sequence[nn.Parameter]) -> None:
    """Every name (shared ones too) to its parameter's entry of ``params``, registered."""
    for info, param in zip(handle.param_infos, params):
        _set_module_param(info.module, info.param_name, param)
    for shared in handle.shared_param_infos:
        _set_module_param(shared.module, shared.param_name, params[shared.prim_index])


def use_unsharded_views(handle: _Handle, as_params: bool, recorded: bool) -> None:
    """Points each original parameter name at a view into the unsharded FlatParameter.

    Args:
        handle: The handle, UNSHARDED (of either precision).
        as_params: Register the views as ``nn.Parameter`` (for summon_full_params) rather
            than as plain tensors (for forward).
        recorded: Autograd records the views (forward with grad), so their gradients flow
            into the FlatParameter's padded unsharded gradient.
    """
    views = handle._unsharded_views(handle.flat_param)
    if recorded:
        handle.forward_cast_generation = handle.cast_generation
    if as_params:
        req = handle.flat_param.requires_grad
        if handle.use_orig_params:
            params = handle._orig_params
            for param, view in zip(params, views):
                param.data = view.detach()
        else:
            params = [nn.Parameter(view, requires_grad=req) for view in views]
        _set_module_params(handle, params)
        return
    _set_module_tensors(handle, views)
    if handle.use_orig_params:
        # As torch FSDP1: the views are also listed in ``_parameters``, so that
        # ``named_parameters()`` called inside forward (or before backward) lists the
        # parameters, as unsharded views. Attribute access still finds the view first.
        for info, view in zip(handle.param_infos, views):
            info.module._parameters[info.param_name] = view  # type: ignore[assignment]
        for shared in handle.shared_param_infos:
            shared.module._parameters[shared.param_name] = views[shared.prim_index]  # type: ignore[assignment]


def use_sharded_views(handle: _Handle) -> None:
    """Points each original parameter name at what it holds while the unit is sharded.

    With use_orig_params: the original Parameter, its ``.data`` this rank's 1-D part of the
    local shard (possibly empty). Its ``.grad`` is left alone: between steps the original
    Parameters' gradients are authoritative (the optimizer and ``zero_grad`` act on them);
    :func:`use_sharded_grad_views` re-derives them after a backward. Otherwise: a placeholder
    that raises when used.
    """
    if handle.use_orig_params:
        for index, param in enumerate(handle._orig_params):
            param.data = handle.shard_layout.orig_sharded_view(handle._local_shard, index)
        _set_module_params(handle, handle._orig_params)
        return
    if not handle.shard_layout.uses_sharding:
        # NO_SHARD with low-precision parameters at rest: the local shard is the whole
        # parameter, so the names view it in full precision.
        with torch.no_grad():
            views = handle._unsharded_views(handle.flat_param)
        _set_module_tensors(handle, views)
        return
    if handle._placeholders is None:  # made once: they hold no data and never change
        handle._placeholders = [
            _ShardedParamPlaceholder.make(handle, info.fqn, info.module_name, handle.dtype)
            for info in handle.param_infos
        ]
    _set_module_tensors(handle, handle._placeholders)


def use_sharded_grad_views(handle: _Handle) -> None:
    """use_orig_params: each original Parameter's ``.grad`` views the sharded gradient.

    Inside ``no_sync`` (an unsynchronized gradient is held) they view that accumulated
    unsharded gradient instead, in their original shapes, as torch FSDP1 shows them; any
    sharded gradient from before stays on the FlatParameter, hidden until the next
    synchronized backward adds the reduced gradient to it.
    """
    if not handle.use_orig_params:
        return
    unsynced = handle.grads.unsynced_unsharded_grad
    if unsynced is not None:
        for view, param in zip(handle._unsharded_views(unsynced), handle._orig_params):
            assign_grad(param, view if param.requires_grad else None)
        return
    grad = handle.flat_param.grad
    for index, param in enumerate(handle._orig_params):
        if (
            grad is None
            or grad.shape != handle._local_shard.shape
            or not param.requires_grad
            or handle.shard_layout.shard_slices[index] is None
        ):
            # A parameter this rank holds no part of gets no gradient (None, as torch
            # FSDP1 gives it), not an empty one: code that walks ``.grad`` (an inf-norm
            # over every gradient, say) must not meet empty tensors.
            param.grad = None
        else:
            assign_grad(param, handle.shard_layout.orig_sharded_view(grad, index))


def sync_flat_grad_from_orig(handle: _Handle) -> Optional[torch.Tensor]:
    """Makes the sharded flat gradient agree with the original Parameters' ``.grad``.

    With use_orig_params the optimizer and the user see the original Parameters: after
    ``zero_grad(set_to_none=True)`` their grads are None (so is the flat gradient then),
    and a replaced ``.grad`` is copied into the flat gradient. Returns the flat gradient.
    """
    flat_grad = handle.flat_param.grad
    local_shard = handle._local_shard
    if not handle.use_orig_params or (flat_grad is not None and flat_grad.shape != local_shard.shape):
        return flat_grad
    grads = [p.grad for p in handle._orig_params]
    if handle.grads.unsynced_unsharded_grad is not None:
        _sync_unsynced_grad_from_orig(handle, grads)
        return flat_grad
    if all(g is None for g in grads):
        handle.flat_param.grad = None
        return None
    layout = handle.shard_layout
    if flat_grad is not None and all(
        g is not None and g.data_ptr() == layout.orig_sharded_view(flat_grad, i).data_ptr()
        for i, g in enumerate(grads)
        if layout.sharded_ranges[i][1] > 0
    ):
        return flat_grad
    rebuilt = torch.zeros_like(local_shard, dtype=handle.precision.grad_dtype)
    for index, grad in enumerate(grads):
        if grad is not None and layout.sharded_ranges[index][1] > 0:
            layout.orig_sharded_view(rebuilt, index).copy_(grad.reshape(layout.orig_sharded_view(rebuilt, index).shape))
    handle._set_sharded_grad(rebuilt)
    return rebuilt


def _sync_unsynced_grad_from_orig(handle: _Handle, grads: Sequence[Optional[torch.Tensor]]) -> None:
    """Inside ``no_sync``: makes the held unsharded gradient agree with the original grads.

    They normally still view it (then nothing changes). All None (``zero_grad`` with
    ``set_to_none=True``): the accumulated gradients are dropped, the held unsharded one
    and any sharded one from before. Otherwise each replaced gradient is copied in (zeros
    for a None one).

    Raises:
        ValueError: A replaced gradient has neither the parameter's original shape nor
            its number of elements.
    """
    unsynced = handle.grads.unsynced_unsharded_grad
    assert unsynced is not None
    if all(g is None for g in grads):
        handle.grads.unsynced_unsharded_grad = None
        handle.flat_param.grad = None
        return
    views = handle._unsharded_views(unsynced)
    for grad, view, info in zip(grads, views, handle.param_infos):
        if grad is not None and grad.data_ptr() == view.data_ptr() and grad.shape == view.shape:
            continue
        if grad is None:
            view.zero_()
        elif grad.numel() != view.numel():
            raise ValueError(
                f"fsdp: the gradient of parameter '{info.fqn}' (FSDP unit "
                f"'{handle.unit_name}') was replaced inside no_sync() by one of shape "
                f"{tuple(grad.shape)}; it must have the parameter's shape {tuple(info.shape)}."
            )
        else:
            view.copy_(grad.reshape(view.shape))


def check_params_not_replaced_since_forward(handle: _Handle) -> None:
    """use_orig_params: raises if a parameter was replaced between forward and backward.

    During forward (and until backward for a unit kept unsharded) the names hold the
    unsharded views; once resharded, the original Parameters. A new ``nn.Parameter`` set on
    the module in between is neither: the backward would compute with (and send gradients
    for) the old values, so this raises instead (torch FSDP1 fails with a RuntimeError).

    Raises:
        RuntimeError: A parameter was replaced (or the unit cast since that forward); the
            message names it and the remedy.
    """
    if not handle.use_orig_params:
        return
    for index, info in enumerate(handle.param_infos):
        current = info.module._parameters.get(info.param_name)
        if not isinstance(current, nn.Parameter) or current is handle._orig_params[index]:
            continue
        raise RuntimeError(
            f"fsdp: parameter '{info.fqn}' of FSDP unit '{handle.unit_name}' was replaced by a "
            f"new nn.Parameter between forward and backward; this backward uses the values "
            f"the forward saw. Replace parameters before forward (between steps), or change "
            f"them in place under torch.no_grad() after the optimizer step."
        )


def writeback_orig_params(handle: _Handle) -> None:
    """use_orig_params: adopts ``.data`` or Parameters the user replaced since the last step.

    The original Parameters' ``.data`` always view the local shard (forward only swaps the
    module attributes), so this works in any state; a stale gathered copy is dropped.
    An in-place change already lives in the local shard. A new ``.data`` (or a new
    Parameter set on the module) is copied in: either in the sharded 1-D shape the
    parameter has between steps, or in its original full shape (this rank's part is taken).

    Raises:
        ValueError: The new value has neither shape.
        RuntimeError, TypeError: A cast that reached the parameters around the wrapper
            cannot be honoured (see ``adopt_external_cast``).
    """
    if not handle.use_orig_params:
        return
    changed = False
    for index, info in enumerate(handle.param_infos):
        current = info.module._parameters.get(info.param_name)
        tracked = handle._orig_params[index]
        expected = handle.shard_layout.orig_sharded_view(handle._local_shard, index)
        if (
            current is tracked
            and (expected.numel() == 0 or current.data_ptr() == expected.data_ptr())
            and current.shape == expected.shape
        ):
            continue
        if current is None or not isinstance(current, nn.Parameter):
            continue  # name currently holds a view (forward in progress)
        changed = True
        with torch.no_grad():
            _copy_into_shard(handle, index, info, current.detach(), expected)
        if current is not tracked:
            current.data = expected
            handle._orig_params[index] = current
    if not changed:
        return
    if handle.has_unsharded_buffer and handle.is_unsharded:
        handle.reshard()  # the gathered copy is stale; the next unshard gathers the new values
    handle.use_sharded_views()


def _copy_into_shard(handle: _Handle, index: int, info: ParamInfo, new: torch.Tensor, expected: torch.Tensor) -> None:
    """Copies parameter ``index``'s new value, in its sharded or its full shape, into its part
    ``expected`` of the local shard.

    Raises:
        ValueError: ``new`` has neither shape.
    """
    layout = handle.shard_layout
    if new.shape == expected.shape:
        expected.copy_(new)
    elif new.shape == info.shape:
        full = new.reshape(-1)
        if layout.uses_sharding:
            start, _ = layout.shard_bounds()
            offset, numel = layout.sharded_ranges[index]
            param_start = layout.flat.param_offsets[index]
            lo = start + offset - param_start
            expected.copy_(full[lo : lo + numel])
        else:
            expected.copy_(new)
    else:
        raise ValueError(
            f"fsdp: parameter '{info.fqn}' of FSDP unit '{handle.unit_name}' was given "
            f"shape {tuple(new.shape)}; it must keep its shape {tuple(info.shape)} (or "
            f"its sharded shape {tuple(expected.shape)} between steps)."
        )
