"""Casting a wrapped tree after wrapping: the wrapper's ``nn.Module._apply``.

``to``, ``half``, ``float``, ``double``, ``bfloat16`` and the like all go through ``_apply``.
Each unit's local shard is cast and its handle rebuilt around it (see [Note: Casting after
wrapping] in ``fsdp/flat_param/_recast.py``); everything else goes through ``nn.Module._apply``.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from fsdp.flat_param._recast import hidden_from_module_apply, planned_local_shard, recast_handle
from fsdp.runtime._state import check_idle, fsdp_modules, unit_state

TensorFn = Callable[[torch.Tensor], torch.Tensor]


def cast_units(
    wrapper: nn.Module, fn: TensorFn, recurse: bool, module_apply: Callable[[TensorFn, bool], nn.Module]
) -> nn.Module:
    """``FullyShardedDataParallel._apply``: applies ``fn`` to the tree, shards included.

    Every unit's change is planned first; the tree must be idle if any shard changes. Then
    buffers, unmanaged parameters and nested units go through ``module_apply`` (nested units
    cast their own shards there) with this unit's FlatParameters hidden from it, and this
    unit's handles are rebuilt around their cast shards.

    Args:
        wrapper: An FSDP instance.
        fn: The tensor function (a dtype or device conversion).
        recurse: ``nn.Module._apply``'s argument (False: only ``wrapper``'s own states, no
            shards).
        module_apply: ``nn.Module._apply`` bound to ``wrapper``.

    Returns:
        ``wrapper`` (with ``recurse=False``: what ``module_apply`` returns).

    Raises:
        RuntimeError: A unit of the tree is in forward, backward or ``summon_full_params``,
            or the cast would move a shard to another device than its unit's. Nothing is
            changed.
        TypeError: The cast would give a non-floating-point dtype. Nothing is changed.
    """
    if not recurse:
        return module_apply(fn, recurse)
    units = [unit_state(m) for m in fsdp_modules(wrapper)]
    changing = [h for unit in units for h in unit.handles if planned_local_shard(h, fn) is not None]
    if changing:
        check_idle(
            wrapper,
            "model.half(), .float(), .to(dtype) or another cast of the parameters",
            error=RuntimeError,
        )
    own = unit_state(wrapper).handles
    with hidden_from_module_apply(own):
        module_apply(fn, recurse)
    for handle in own:
        if any(handle is h for h in changing):
            recast_handle(handle, fn, handle.mixed_precision_config)
    return wrapper
