"""Detects an optimizer that was created before wrapping ([Note: Optimizer before wrapping]).

[Note: Optimizer before wrapping]
Without ``use_orig_params``, wrapping replaces a unit's parameters by one flat parameter: the
original ``nn.Parameter`` objects are no longer part of the model. An optimizer built from
``model.parameters()`` *before* wrapping holds those originals; its ``step()`` updates tensors that
nothing reads, so the model silently trains nothing (torch FSDP1 behaves the same). The wrapper
records every parameter it replaces (weakly: a replaced parameter the user dropped is forgotten),
and one process-wide optimizer step pre-hook (``torch.optim.Optimizer``'s global hook) raises
before the first step of an optimizer that holds one. The check runs once per optimizer (again
only if its parameter count changes), so it costs nothing per step afterwards.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["note_replaced_params"]

# Replaced original parameter -> how to name it in the error.
_replaced: WeakIdKeyDictionary = WeakIdKeyDictionary()
# Optimizer -> number of parameters it held when last checked.
_checked: WeakIdKeyDictionary = WeakIdKeyDictionary()
_hook: Optional[Any] = None


def note_replaced_params(params: Iterable[tuple[str, nn.Parameter]], unit_name: str) -> None:
    """Records parameters that a flat parameter replaced (``(name in the unit, parameter)``)."""
    global _hook
    for name, param in params:
        _replaced[param] = f"'{name}' (shape {list(param.shape)}) of the wrapped module {unit_name}"
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(_check_optimizer)


def _check_optimizer(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    count = sum(len(group["params"]) for group in optimizer.param_groups)
    if _checked.get(optimizer) == count or not len(_replaced):
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            described = _replaced.get(param)
            if described is not None:
                raise RuntimeError(
                    f"fsdp: {type(optimizer).__name__}.step() would train nothing: the optimizer "
                    f"holds the parameter {described}, which FullyShardedDataParallel replaced by "
                    f"a flat parameter when it wrapped the model, so the model never sees its "
                    f"updates. Create the optimizer after wrapping, from the wrapped model's "
                    f"parameters: optimizer = {type(optimizer).__name__}(fsdp_model.parameters(), "
                    f"...). (With use_orig_params=True the original parameters stay in use.)"
                )
    _checked[optimizer] = count
