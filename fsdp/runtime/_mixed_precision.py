"""Mixed precision outside the flat parameter: forward inputs and buffers.

Parameters and gradients change dtype inside :class:`~fsdp.flat_param.FlatParamHandle` (see
[Note: Mixed precision dtypes] in ``fsdp/flat_param/_precision.py``). This file does the rest:

- **Forward inputs**: the root casts floating-point inputs to ``param_dtype``
  (``cast_root_forward_inputs``, on by default); with ``cast_forward_inputs`` every unit that
  owns parameters casts its own inputs too. Integer tensors (token ids) are left alone.
- **Buffers**: with ``buffer_dtype``, each unit's buffers are cast once, at construction.
- **Full precision in eval**: with the environment variable ``FSDP_USE_FULL_PREC_IN_EVAL=1``
  (read at construction, as torch FSDP1 does), a unit whose module is in ``eval()`` mode runs
  its forward (and any backward) with full-precision parameters, uncast inputs and
  full-precision buffers, and reduces gradients without casting them down; ``train()`` mode
  goes back to mixed precision.

[Note: Full-precision buffers in state dicts]
Casting a buffer to bf16 rounds it. torch FSDP1 saves that rounded value, upcast, so a model
saved after wrapping no longer holds the values it was built with (a positional table, a
constant scale). fsdp keeps the full-precision value of every buffer it casts and state dicts
return it as long as the buffer still holds its cast (``full.to(low) == buffer``); a buffer
that forward updated since (running statistics kept in low precision) is saved upcast, like
torch. Loading a state dict refreshes the kept values from it, so save -> load -> save gives
back the same full-precision numbers.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable, Mapping, Optional

import torch
from torch import nn

from fsdp._common import apply_to_tensors, clean_fqn
from fsdp.runtime._state import CastBuffer, UnitState

__all__ = [
    "FULL_PRECISION_IN_EVAL_ENV",
    "CastBuffer",
    "cast_forward_inputs",
    "apply_mixed_precision_overrides",
    "cast_unit_buffers",
    "full_precision_in_eval_requested",
    "refresh_cast_buffers",
    "set_buffers_full_precision",
]

FULL_PRECISION_IN_EVAL_ENV = "FSDP_USE_FULL_PREC_IN_EVAL"


def full_precision_in_eval_requested() -> bool:
    """Whether ``FSDP_USE_FULL_PREC_IN_EVAL=1`` is set (read once per unit, at construction)."""
    return os.environ.get(FULL_PRECISION_IN_EVAL_ENV, "") == "1"


def cast_forward_inputs(
    state: "UnitState", args: tuple[object, ...], kwargs: dict[str, object]
) -> tuple[tuple[object, ...], dict[str, object]]:
    """Casts floating-point forward inputs to the unit's ``param_dtype`` where configured."""
    mixed_precision = state.mixed_precision
    if mixed_precision is None or mixed_precision.param_dtype is None or state.forward_in_full_precision:
        return args, kwargs
    by_root = bool(state.is_root) and mixed_precision.cast_root_forward_inputs
    by_unit = mixed_precision.cast_forward_inputs and bool(state.handles)
    if not (by_root or by_unit):
        return args, kwargs
    dtype: torch.dtype = mixed_precision.param_dtype

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if torch.is_floating_point(t) and t.dtype != dtype else t

    return apply_to_tensors(cast, args), apply_to_tensors(cast, kwargs)


def cast_unit_buffers(modules: list[nn.Module], buffer_dtype: Optional[torch.dtype]) -> list[CastBuffer]:
    """Casts the floating-point buffers of ``modules`` to ``buffer_dtype``; returns the records.

    Each module with a cast buffer gets a state-dict post-hook that puts the full-precision
    value back in its state dicts.
    """
    if buffer_dtype is None:
        return []
    records: list[CastBuffer] = []
    for module in modules:
        own: list[CastBuffer] = []
        for name, buffer in module._buffers.items():
            if buffer is None or not torch.is_floating_point(buffer) or buffer.dtype == buffer_dtype:
                continue
            own.append(CastBuffer(module, name, buffer.detach().clone(), buffer_dtype))
            buffer.data = buffer.data.to(buffer_dtype)
        if own:
            module.register_state_dict_post_hook(_restore_hook(own))
            records.extend(own)
    return records


# Any in state dicts: torch types state dicts and their metadata as Dict[str, Any]; loaded values
# may be tensor-like objects read by duck typing ([Note: Tensor-like values]).
def _restore_hook(records: list[CastBuffer]) -> Callable[[nn.Module, dict[str, Any], str, dict[str, Any]], None]:
    def hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any]) -> None:
        for record in records:
            key = prefix + record.name
            if key in state_dict:
                state_dict[key] = record.state_dict_value()

    return hook


def refresh_cast_buffers(
    root: nn.Module, states: list["UnitState"], state_dict: Mapping[str, Any]
) -> None:
    """After a successful load: the loaded values become the kept full-precision values."""
    records = [record for state in states for record in state.cast_buffers]
    if not records:
        return
    names = {id(module): name for name, module in root.named_modules()}
    by_clean_key = {clean_fqn(key): value for key, value in state_dict.items()}
    for record in records:
        module_name = names.get(id(record.module))
        if module_name is None:
            continue
        key = clean_fqn(f"{module_name}.{record.name}" if module_name else record.name)
        value = by_clean_key.get(key)
        if value is not None and not isinstance(value, torch.Tensor) and torch.overrides.is_tensor_like(value):
            # A lazily loaded checkpoint value (Lightning's); read it through a torch function,
            # as the load did ([Note: Tensor-like values] in state_dict/_model_state_dict.py).
            value = torch.flatten(value).view(tuple(value.shape))
        if isinstance(value, torch.Tensor) and value.shape == record.full_value.shape:
            full = getattr(value, "full_tensor", None)
            value = full() if callable(full) else value
            record.full_value = value.detach().to(
                device=record.full_value.device, dtype=record.full_value.dtype
            ).clone()


def set_buffers_full_precision(states: list["UnitState"], full: bool) -> None:
    """Puts every cast buffer in full precision (its kept value while current) or back."""
    for state in states:
        for record in state.cast_buffers:
            buffer = record.module._buffers[record.name]
            assert buffer is not None
            if full and buffer.dtype != record.full_value.dtype:
                buffer.data = record.state_dict_value()
            elif not full and buffer.dtype != record.compute_dtype:
                record.full_value = buffer.detach().clone()
                buffer.data = buffer.data.to(record.compute_dtype)


# ----------------------------------------------------------------------------- skipped modules
# [Note: Modules mixed precision skips] Under an auto-wrap policy, every instance of
# ``MixedPrecision._module_classes_to_ignore`` (``_BatchNorm`` by default) becomes its own unit
# with ``mixed_precision=None`` (planned in fsdp/init/_auto_wrap.py) and runs in float32 between
# low-precision neighbours, through the forward hooks below, as in torch FSDP1.


def _map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: object) -> object:
    """Apply ``fn`` to every tensor inside nested lists / tuples / namedtuples / dicts."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        make_namedtuple: Callable[..., object] = type(obj)  # takes its fields positionally
        return make_namedtuple(*(_map_tensors(fn, item) for item in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(fn, item) for item in obj)
    if isinstance(obj, dict):
        mapped = {key: _map_tensors(fn, value) for key, value in obj.items()}
        try:
            out = type(obj)()
            out.update(mapped)
            return out
        except TypeError:
            return mapped
    return obj


def _register_full_precision_hooks(module: nn.Module) -> None:
    """Run ``module`` in float32 and hand its outputs back in its inputs' floating dtype.

    Modules that mixed precision skips keep float32 parameters but sit between low-precision
    modules, so their floating-point inputs are upcast before forward and the outputs are cast
    back to the inputs' dtype afterwards. The hooks are appended so they run after other hooks.
    """
    state: dict[str, torch.dtype] = {}

    def cast_to(dtype: torch.dtype, tensor: torch.Tensor, record: bool) -> torch.Tensor:
        if not torch.is_floating_point(tensor) or tensor.dtype == dtype:
            return tensor
        if record:
            state["input_dtype"] = tensor.dtype
        return tensor.to(dtype)

    def pre_hook(_module: nn.Module, args: tuple[object, ...]) -> object:
        state.pop("input_dtype", None)
        return _map_tensors(lambda t: cast_to(torch.float32, t, True), args)

    def post_hook(_module: nn.Module, args: tuple[object, ...], output: object) -> object:
        input_dtype = state.pop("input_dtype", None)
        if input_dtype is None:  # no low-precision floating input: leave the output alone
            return None
        return _map_tensors(lambda t: cast_to(input_dtype, t, False), output)

    module.register_forward_pre_hook(pre_hook, prepend=False)
    module.register_forward_hook(post_hook, prepend=False)


def apply_mixed_precision_overrides(
    root_module: nn.Module, classes: tuple[type, ...]
) -> set[type[nn.Module]]:
    """Register full-precision hooks on every instance of ``classes``; return the found types."""
    found: set[type[nn.Module]] = set()
    for module in root_module.modules():
        if isinstance(module, classes):
            found.add(type(module))
            _register_full_precision_hooks(module)
    if found:
        warnings.warn(
            "Both mixed precision and an auto_wrap_policy were specified to FSDP, where the "
            f"wrapped module has submodules of type {sorted(cls.__name__ for cls in found)}, "
            "which mixed precision skips (MixedPrecision._module_classes_to_ignore). These "
            "modules will be wrapped as separate FSDP instances with mixed precision disabled "
            "(mixed_precision=None: they run in float32).",
            stacklevel=4,  # the caller of FullyShardedDataParallel(...)
        )
    return found
