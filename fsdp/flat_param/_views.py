"""What the original parameter names on the modules hold, and writing changes to them back.

:class:`ParamViews` is the views part of :class:`~fsdp.flat_param.flat_param.FlatParamHandle`:
it receives the layout and the storage at construction and owns the original Parameters
(use_orig_params) and the placeholders. While the unit is unsharded each name holds a view into
the unsharded FlatParameter (``split`` and ``view``, recorded by autograd, whose backward
concatenates the gradients into the FlatParameter's); while it is sharded a placeholder that
raises when used, or with use_orig_params the original Parameter viewing its part of the local
shard (see [Note: Original parameters] in docs/flat_param_lifecycle.md). What the user replaced
between steps (``.data``, a new Parameter) is written back into the flat parameter.
"""

from __future__ import annotations

import weakref
from typing import Callable, Iterable, Optional, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp._common import FSDPStateAssertionError
from fsdp.flat_param._layout import ParamInfo, SharedParamInfo, ShardLayout, local_tensor
from fsdp.flat_param._storage import FlatParamStorage

__all__ = ["ParamViews", "assign_grad"]


class _ShardedParamPlaceholder(torch.Tensor):
    """Stands in for an original parameter while its unit is sharded.

    Any use in a computation raises a RuntimeError naming the parameter and the unit, instead of
    a shape mismatch deep inside torch (for example when a submodule of a unit is called
    directly, outside the unit's forward).
    """

    # A weak reference: a strong one would keep a dropped model alive ([Note: Freeing a wrapped
    # model] in flat_param.py); the unit's name is read when needed (lazy init refines it).
    _fsdp_views_ref: "weakref.ref[ParamViews]"
    _fsdp_fqn: str
    _fsdp_module_name: str

    @staticmethod
    def make(views: "ParamViews", fqn: str, module_name: str, dtype: torch.dtype) -> "_ShardedParamPlaceholder":
        t = torch.Tensor._make_subclass(
            _ShardedParamPlaceholder, torch.empty(0, dtype=dtype, device=views.storage.device)
        )
        t._fsdp_views_ref = weakref.ref(views)
        t._fsdp_fqn = fqn
        t._fsdp_module_name = module_name
        return t

    @property
    def _fsdp_unit_name(self) -> str:
        views = self._fsdp_views_ref()
        return views.unit_name if views is not None else "<a dropped unit>"

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
        cls,
        func: Callable[..., object],
        types: Iterable[type],
        args: Sequence[object] = (),
        kwargs: Optional[dict[str, object]] = None,
    ) -> object:
        kwargs = kwargs or {}
        if func in _PLACEHOLDER_SAFE_FUNCS:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        for arg in list(args) + list(kwargs.values()):
            if isinstance(arg, _ShardedParamPlaceholder):
                raise RuntimeError(arg.describe())
        raise RuntimeError("fsdp: a sharded parameter placeholder was used in a computation")

    # mypy rejects every override of torch.Tensor.__repr__ (torch's own signature too: the
    # untyped keyword-only ``tensor_contents``).
    def __repr__(self, *args: object, **kwargs: object) -> str:  # type: ignore[override]
        return f"<sharded fsdp parameter '{self._fsdp_fqn}' of unit '{self._fsdp_unit_name}'>"


# torch's stubs declare these Tensor properties as plain attributes, without the descriptors'
# ``__get__`` they have at runtime (the functions __torch_function__ receives).
_PLACEHOLDER_SAFE_FUNCS = {
    torch.Tensor.dtype.__get__,  # type: ignore[attr-defined]
    torch.Tensor.device.__get__,
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


def _storage_key(tensor: torch.Tensor) -> int:
    """The identity of ``tensor``'s storage, kept when the storage is freed and refilled."""
    return tensor.untyped_storage()._cdata


def _set_module_tensor(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Sets ``module.name`` to a plain tensor attribute (not a registered parameter)."""
    module._parameters.pop(name, None)
    object.__setattr__(module, name, tensor)


def _set_module_param(module: nn.Module, name: str, param: nn.Parameter) -> None:
    """Registers ``param`` as ``module.name``, replacing a plain tensor attribute if any."""
    module.__dict__.pop(name, None)
    module._parameters[name] = param


class ParamViews:
    """What the original parameter names of one handle hold, in each state of its storage.

    Args:
        param_infos: Each original parameter, in flat order.
        shared_param_infos: The names that share (tie) a parameter of ``param_infos``.
        layout: The handle's shard layout.
        storage: The handle's storage (the FlatParameter, the local shard).
        orig_params: use_orig_params: the original Parameters (kept registered), else None.
        unit_name: The unit's name for messages (refined at lazy init).

    Attributes:
        orig_params: The original Parameters this handle keeps registered (use_orig_params;
            else empty).
        cast_generation: Casts after wrapping so far ([Note: Casting after wrapping] in
            ``_recast.py``).
        forward_cast_generation: ``cast_generation`` when the last forward that autograd may
            backpropagate took views.
        recorded_views: The views (as the names held them) that forward last took with
            autograd recording, and the storage they view, until backward has read them
            ([Note: Backward reads forward's views]).
    """

    def __init__(
        self,
        param_infos: list[ParamInfo],
        shared_param_infos: list[SharedParamInfo],
        layout: ShardLayout,
        storage: FlatParamStorage,
        orig_params: Optional[list[nn.Parameter]],
        unit_name: str,
    ) -> None:
        self.param_infos = param_infos
        self.shared_param_infos = shared_param_infos
        self.layout = layout
        self.storage = storage
        self.use_orig_params = orig_params is not None
        self.orig_params: list[nn.Parameter] = list(orig_params) if orig_params is not None else []
        self.unit_name = unit_name
        self._placeholders: Optional[list[_ShardedParamPlaceholder]] = None
        self.cast_generation = 0
        self.forward_cast_generation = 0
        self.recorded_views: Optional[tuple[int, list[torch.Tensor]]] = None

    def drop_placeholders(self) -> None:
        """Forgets the placeholders (a recast: they are made again in the new dtype)."""
        self._placeholders = None

    def module_tensors(self) -> list[torch.Tensor]:
        """The tensors the original parameter names currently hold (in ``param_infos`` order)."""
        return [getattr(info.module, info.param_name) for info in self.param_infos]

    def _set_module_tensors(self, tensors: Sequence[torch.Tensor]) -> None:
        """Every name (shared ones too) to its parameter's entry of ``tensors``, as plain tensors."""
        for info, tensor in zip(self.param_infos, tensors):
            _set_module_tensor(info.module, info.param_name, tensor)
        for shared in self.shared_param_infos:
            _set_module_tensor(shared.module, shared.param_name, tensors[shared.prim_index])

    def _set_module_params(self, params: Sequence[nn.Parameter]) -> None:
        """Every name (shared ones too) to its parameter's entry of ``params``, registered."""
        for info, param in zip(self.param_infos, params):
            _set_module_param(info.module, info.param_name, param)
        for shared in self.shared_param_infos:
            _set_module_param(shared.module, shared.param_name, params[shared.prim_index])

    def use_unsharded(self, as_params: bool, recorded: bool) -> None:
        """Points each original parameter name at a view into the unsharded FlatParameter.

        Args:
            as_params: Register the views as ``nn.Parameter`` (for summon_full_params) rather
                than as plain tensors (for forward).
            recorded: Autograd records the views (forward with grad), so their gradients flow
                into the FlatParameter's padded unsharded gradient.
        """
        views = self.layout.orig_tensors(self.layout.unsharded_views(self.storage.flat_param))
        if recorded:
            self.forward_cast_generation = self.cast_generation
            self.recorded_views = (_storage_key(self.storage.flat_param), views)
        if as_params:
            self._set_module_params(self.full_params(views))
            return
        self._set_module_tensors_and_orig(views)

    def use_recorded_views(self) -> bool:
        """Backward: points the names at the views forward recorded, if they view the current
        unsharded buffer; returns whether it did (else the caller takes fresh views).

        [Note: Backward reads forward's views]
        Backward runs with grad mode off, so views taken there are not recorded by autograd.
        A checkpointed region of the unit re-runs its forward during backward and reads the
        names: with unrecorded views, ops whose saved tensors depend on whether an input is
        recorded (``rms_norm``, ``x * weight``) save fewer tensors than in forward, and torch's
        non-reentrant checkpoint refuses the recomputation; a reentrant checkpoint builds its
        backward from the recomputation, where gradients of unrecorded views reach no
        FlatParameter (silently wrong input gradients). The views forward took, on the same
        buffer (refilled in place: [Note: Flat parameter storage lifecycle]), are what torch
        FSDP1's names still hold in backward. tests/test_activation_checkpointing.py's
        ``scaled`` modes run both checkpoints through such ops.
        """
        recorded = self.recorded_views
        if recorded is None or recorded[0] != _storage_key(self.storage.flat_param):
            return False
        self._set_module_tensors_and_orig(recorded[1])
        return True

    def drop_recorded_views(self) -> None:
        """Forgets forward's views (the unit's backward is done, or abandoned)."""
        self.recorded_views = None

    def _set_module_tensors_and_orig(self, views: Sequence[torch.Tensor]) -> None:
        """The names hold ``views``; with use_orig_params ``_parameters`` lists them too."""
        self._set_module_tensors(views)
        if self.use_orig_params:
            # As torch FSDP1: the views are also listed in ``_parameters``, so that
            # ``named_parameters()`` called inside forward (or before backward) lists the
            # parameters, as unsharded views. Attribute access still finds the view first.
            # torch types ``_parameters``' values as Parameters; these are plain tensor views.
            for info, view in zip(self.param_infos, views):
                info.module._parameters[info.param_name] = view  # type: ignore[assignment]
            for shared in self.shared_param_infos:
                shared.module._parameters[shared.param_name] = views[shared.prim_index]  # type: ignore[assignment]

    def full_params(self, views: Sequence[torch.Tensor]) -> list[nn.Parameter]:
        """The Parameters the original names hold while unsharded in full (summon_full_params).

        Args:
            views: What :meth:`ShardLayout.orig_tensors` gives for the unsharded flat tensor.

        Returns:
            With use_orig_params the original Parameters viewing ``views`` (a DTensor view cannot
            be an existing Parameter's ``.data``: it gets a new Parameter, as in torch FSDP1;
            [Note: DTensor parameters]); otherwise new Parameters of ``views``.
        """
        req = self.storage.flat_param.requires_grad
        params: list[nn.Parameter] = []
        for index, view in enumerate(views):
            if not self.use_orig_params or isinstance(view, DTensor):
                params.append(nn.Parameter(view.detach(), requires_grad=req))
            else:
                param = self.orig_params[index]
                param.data = view.detach()
                params.append(param)
        return params

    def use_sharded(self) -> None:
        """Points each original parameter name at what it holds while the unit is sharded.

        With use_orig_params: the original Parameter, its ``.data`` this rank's 1-D part of the
        local shard (possibly empty). Its ``.grad`` is left alone: between steps the original
        Parameters' gradients are authoritative (the optimizer and ``zero_grad`` act on them);
        :meth:`GradReduction.use_sharded_grad_views` re-derives them after a backward. Otherwise: a placeholder
        that raises when used.
        """
        if self.use_orig_params:
            for index, param in enumerate(self.orig_params):
                param.data = self.layout.orig_sharded_view(self.storage.local_shard, index)
            self._set_module_params(self.orig_params)
            return
        if not self.layout.uses_sharding:
            # NO_SHARD with low-precision parameters at rest: the local shard is the whole
            # parameter, so the names view it in full precision.
            with torch.no_grad():
                views = self.layout.orig_tensors(self.layout.unsharded_views(self.storage.flat_param))
            self._set_module_tensors(views)
            return
        if self._placeholders is None:  # made once: they hold no data and never change
            self._placeholders = [
                _ShardedParamPlaceholder.make(self, info.fqn, info.module_name, self.storage.precision.full_dtype)
                for info in self.param_infos
            ]
        self._set_module_tensors(self._placeholders)

    def check_not_replaced_since_forward(self, kept_unsharded: bool) -> None:
        """use_orig_params: raises if a parameter was changed between forward and backward.

        During forward (and until backward for a unit kept unsharded, ``kept_unsharded``) the
        names hold the unsharded views; once resharded, the original Parameters. A new
        ``nn.Parameter`` set on the module in between is neither, and a kept view whose ``.data``
        was replaced no longer views the unsharded FlatParameter: the backward would compute
        with (and send gradients for) the old values, so this raises instead, as torch FSDP1
        does for units it keeps unsharded (SHARD_GRAD_OP).

        Raises:
            FSDPStateAssertionError: A parameter was replaced, or a kept view's ``.data``; the
                message names it and the remedy. An ``AssertionError``, as torch FSDP1 raises,
                and a ``RuntimeError``.
        """
        if not self.use_orig_params:
            return
        views = self.layout.unsharded_views(self.storage.flat_param) if kept_unsharded else None
        for index, info in enumerate(self.param_infos):
            current = info.module._parameters.get(info.param_name)
            if isinstance(current, nn.Parameter):
                if current is self.orig_params[index]:
                    continue
                change = "was replaced by a new nn.Parameter"
            elif views is not None and isinstance(current, torch.Tensor) and not _same_view(current, views[index]):
                change = "had its .data replaced"
            else:
                continue
            raise FSDPStateAssertionError(
                f"fsdp: FSDP does not support changing the parameters between forward and "
                f"backward: parameter '{info.fqn}' of FSDP unit '{self.unit_name}' {change} "
                f"between forward and backward; this backward uses the values the forward saw. "
                f"Replace parameters before forward (between steps), or change them in place under "
                f"torch.no_grad() after the optimizer step."
            )

    def writeback(self) -> bool:
        """use_orig_params: adopts ``.data`` or Parameters the user replaced since the last step.

        The original Parameters' ``.data`` always view the local shard (forward only swaps the
        module attributes), so this works in any state; a stale gathered copy is dropped.
        An in-place change already lives in the local shard. A new ``.data`` (or a new
        Parameter set on the module) is copied in: either in the sharded 1-D shape the
        parameter has between steps, or in its original full shape (this rank's part is taken).

        Raises:
            RuntimeError: The new value has neither shape (torch FSDP1's type).
            RuntimeError, TypeError: A cast that reached the parameters around the wrapper
                cannot be honoured (see ``adopt_external_cast``).

        Returns:
            Whether anything changed (the caller then drops a stale gathered copy and points
            the names at the sharded views again).
        """
        if not self.use_orig_params:
            return False
        changed = False
        for index, info in enumerate(self.param_infos):
            current = info.module._parameters.get(info.param_name)
            tracked = self.orig_params[index]
            expected = self.layout.orig_sharded_view(self.storage.local_shard, index)
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
                self._copy_into_shard(index, info, current.detach(), expected)
            if current is not tracked:
                current.data = expected
                self.orig_params[index] = current
        return changed

    def _copy_into_shard(self, index: int, info: ParamInfo, new: torch.Tensor, expected: torch.Tensor) -> None:
        """Copies parameter ``index``'s new value, in its sharded or its full shape, into its part
        ``expected`` of the local shard.

        Raises:
            RuntimeError: ``new`` has neither shape (torch FSDP1's type).
        """
        layout = self.layout
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
            raise RuntimeError(  # torch FSDP1's type
                f"fsdp: Cannot writeback when the parameter shape changes: parameter "
                f"'{info.fqn}' of FSDP unit '{self.unit_name}' was given shape "
                f"{tuple(new.shape)}; it must keep its shape {tuple(info.shape)} (or its sharded "
                f"shape {tuple(expected.shape)} between steps)."
            )


def _same_view(tensor: torch.Tensor, view: torch.Tensor) -> bool:
    """Whether ``tensor`` is still (a tensor sharing) the unsharded view ``view``."""
    tensor = local_tensor(tensor)
    if tensor.shape != view.shape:
        return False
    return view.numel() == 0 or tensor.data_ptr() == view.data_ptr()
