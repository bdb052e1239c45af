"""Optimizer state dicts: the public entry points, and the formats they give and take.

Saving is ``_optim_save.py``, loading ``_optim_load.py``; the mapping between parameter names,
optimizer keys and the model's handles is ``_optim_keys.py``, the kinds of state values and
sharded (ShardedTensor / DTensor) values ``_values.py``.

[Note: Optimizer state dict formats]
The optimizer holds per-rank state for what it optimizes: with ``use_orig_params=False`` one
entry per FlatParameter (positive-dimension tensors such as Adam's ``exp_avg`` are 1-D and
shard-shaped, ``sharded_numel`` elements, padding at the end of the last ranks' shards); with
``use_orig_params=True`` one entry per original Parameter, whose tensors are this rank's 1-D part
of the shard (possibly empty, or absent on a rank that holds no part of the parameter).

- Saving (``optim_state_dict``): the state is re-keyed by the original parameters' fully
  qualified names (their names in the unwrapped model; a tied parameter once, under its first
  name). Each positive-dimension state of a handle is gathered into a fresh padded unsharded
  tensor and split per parameter in its original shape (views of it: no further copies, see
  [Note: State dict gathers]); scalar states (``step``) and non-tensor states are copied.
  FULL_STATE_DICT returns full tensors (``offload_to_cpu``; ``rank0_only``: the states are
  sent to the saving rank only, point to point, and the others return ``{}``). Otherwise
  each full value is chunked along dim 0 like ``torch.chunk`` over the handle's shard group,
  in torch FSDP1's form: a ``ShardedTensor``, or a ``DTensor`` on the unit's ``device_mesh``
  ([Note: Sharded value forms] in ``_values.py``).
  Key and value order follow torch FSDP1.
- Loading (``optim_state_dict_to_load``): the inverse. Sharded values are gathered back to
  full tensors, every name and shape is checked against the model before anything changes,
  then each parameter's state is flattened (missing parameters of a FlatParameter get zeros),
  padded, and this rank's slice taken; the result is keyed by this optimizer's parameter IDs.
- Tensor-parallel (DTensor) parameters ([Note: DTensor parameters] in
  ``flat_param/_layout.py``): each unit holds their tp-local tensors, so the gathered state is
  tp-local too; saving gives it as torch FSDP1 does, FULL as a DTensor on the tp mesh with the
  parameter's placements, SHARDED as the 2-D DTensor of [Note: 2-D sharded values] (a plain
  parameter's values on such a unit are 2-D as well, ``(Shard(0), Replicate())``); loading
  takes any form back to the tp-local tensor ([Note: Tensor-parallel values to load] in
  ``_values.py``). ``rank0_only`` is refused there: one rank cannot hold every tp piece.
- Named optimizers (``NamedOptimizer`` / TorchRec's ``KeyedOptimizer``, see
  [Note: Named optimizers]) key their own state dicts by parameter names instead of IDs.

Every collective runs over a handle's own process group, in the same order on every rank,
an order fixed by parameter names, never by a rank's optimizer IDs (see
[Note: Optimizer state keyed by names across ranks] in ``_optim_keys.py``). Exception
types follow torch FSDP1 (see [Note: Optimizer state dict exception types] in
``_optim_keys.py``); so do the ``FutureWarning`` s of the deprecated arguments and APIs.

[Note: Named optimizers]
A named optimizer's ``state_dict()`` keys ``state`` and each group's ``params`` by names, not
IDs. As in torch FSDP1, a parameter's name is the one ``model.named_parameters()`` gives the
parameter object the optimizer holds: with ``use_orig_params=False`` a FlatParameter's name
(``_fsdp_wrapped_module._flat_param``), with ``use_orig_params=True`` an original parameter's
name with the wrapper prefixes (``_fsdp_wrapped_module.layer._fsdp_wrapped_module.weight``),
and an unmanaged parameter's own name. The optimizer's parameter order (its IDs) is
``optim.param_groups``, as for any optimizer.

- Saving detects such a state dict by its string keys and re-keys it by IDs first (keeping
  each group's parameter order, which decides the order of the saved group's names); the
  result is the usual FQN-keyed state dict, whatever the optimizer.
- Loading with ``is_named_optimizer=True`` keys the result by these names, and each group's
  ``params`` are the sorted names (a named optimizer's ``state_dict()`` sorts them too).
  A parameter this rank holds no part of (use_orig_params) gets no loaded state there (its
  gradient is None there, so a plain optimizer has none; see ``_shard_orig_state`` in
  ``_optim_load.py``); with ``is_named_optimizer=True``, as in torch FSDP1, it keeps the
  optimizer's current state for it (``_keep_named_state``).
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from fsdp.api import StateDictType
from fsdp.runtime._state import is_fsdp, unit_state
from fsdp.state_dict import _settings
from fsdp.state_dict._optim_keys import NO_FSDP, OptimInput, OptimStateAttributeError, rekey, user_stacklevel
from fsdp.state_dict._optim_load import to_load
from fsdp.state_dict._optim_save import save
from fsdp.state_dict._values import refuse_local_with_mesh

__all__ = [
    "optim_state_dict_api",
    "optim_state_dict_to_load_api",
    "full_optim_state_dict",
    "sharded_optim_state_dict",
    "shard_full_optim_state_dict",
    "flatten_sharded_optim_state_dict",
    "scatter_full_optim_state_dict",
    "rekey_optim_state_dict",
]

# State dict values are Any here: torch types Optimizer.state_dict() as dict[str, Any].


def _warn_optim_input(optim_input: object) -> None:
    """Warns (``FutureWarning``, as torch FSDP1) when the deprecated ``optim_input`` is passed."""
    if optim_input is None:
        return
    warnings.warn(
        "The `optim_input` argument is deprecated and will be removed after PyTorch 1.13. You may "
        "remove it from your code without changing its functionality. "  # torch FSDP1's text
        "fsdp: the `optim_input` argument is deprecated (as in torch FSDP1) and will be "
        "removed. Pass the optimizer as `optim=` instead, or drop `optim_input` when the "
        "optimizer was built from model.parameters() in their order.",
        FutureWarning,
        stacklevel=user_stacklevel(),
    )


def _warn_legacy_api(current: str, replacement: str) -> None:
    """Warns (``FutureWarning``, as torch FSDP1) that a legacy optimizer state-dict API is used."""
    warnings.warn(
        f"``FullyShardedDataParallel.{current}``is being deprecated and is replaced by "  # torch FSDP1's text
        f"``FullyShardedDataParallel.{replacement}``. ``FullyShardedDataParallel.{current}`` may be "
        f"removed after PyTorch 2.2. "
        f"fsdp: FullyShardedDataParallel.{current} is deprecated (as in torch FSDP1); "
        f"use FullyShardedDataParallel.{replacement} with FullyShardedDataParallel.state_dict_type "
        f"instead.",
        FutureWarning,
        stacklevel=user_stacklevel(),
    )


def _settings_of(model: nn.Module) -> Any:
    units = [m for m in model.modules() if is_fsdp(m)]
    if not units:
        # torch FSDP1 fails with an AttributeError (its settings are None).
        raise OptimStateAttributeError(NO_FSDP)
    settings = _settings.get_state_dict_type(units)  # what FSDP.get_state_dict_type(model) returns
    if settings.state_dict_type is StateDictType.LOCAL_STATE_DICT:
        # Torch FSDP1 raises here for every unit, NO_SHARD included (its get_state_dict_type).
        refuse_local_with_mesh(
            [(name, unit_state(m)) for name, m in model.named_modules() if is_fsdp(m)],
            "an optimizer state dict API was called",
        )
    return settings


def optim_state_dict_api(
    model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: Optional[dict[str, Any]], group: Optional[dist.ProcessGroup]
) -> dict[str, Any]:
    """``FullyShardedDataParallel.optim_state_dict``: the format follows ``state_dict_type``."""
    settings = _settings_of(model)
    full = settings.state_dict_type is StateDictType.FULL_STATE_DICT
    config = settings.optim_state_dict_config
    return save(
        model, optim, optim_state_dict, group,
        full=full,
        rank0_only=bool(getattr(config, "rank0_only", False)) if full else False,
        offload=bool(getattr(config, "offload_to_cpu", True)),
    )


def optim_state_dict_to_load_api(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: dict[str, Any],
    is_named_optimizer: bool,
    load_directly: bool,
    group: Optional[dist.ProcessGroup],
) -> dict[str, Any]:
    """``FullyShardedDataParallel.optim_state_dict_to_load``."""
    settings = _settings_of(model)
    full = settings.state_dict_type is StateDictType.FULL_STATE_DICT
    rank0_only = full and bool(getattr(settings.optim_state_dict_config, "rank0_only", False))
    return to_load(
        model, optim, optim_state_dict, is_named_optimizer, load_directly, group,
        rank0_only=rank0_only, sharded=not full,
    )


def full_optim_state_dict(
    model: nn.Module, optim: torch.optim.Optimizer, optim_input: OptimInput, rank0_only: bool, group: Optional[dist.ProcessGroup]
) -> dict[str, Any]:
    """Legacy ``full_optim_state_dict``: full state keyed by FQNs, offloaded to CPU."""
    _warn_legacy_api("full_optim_state_dict", "optim_state_dict")
    _warn_optim_input(optim_input)
    return save(
        model, optim, optim.state_dict(), group, full=True, rank0_only=rank0_only, offload=True,
        optim_input=optim_input,
    )


def sharded_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, group: Optional[dist.ProcessGroup]) -> dict[str, Any]:
    """Legacy ``sharded_optim_state_dict``: per-parameter states chunked across ranks."""
    _warn_legacy_api("sharded_optim_state_dict", "optim_state_dict")
    return save(
        model, optim, optim.state_dict(), group, full=False, offload=True
    )


def shard_full_optim_state_dict(
    full_osd: dict[str, Any], model: nn.Module, optim_input: OptimInput, optim: Optional[torch.optim.Optimizer]
) -> dict[str, Any]:
    """Legacy ``shard_full_optim_state_dict``: every rank passes the full state dict."""
    _warn_legacy_api("shard_full_optim_state_dict", "optim_state_dict_to_load")
    _warn_optim_input(optim_input)
    return to_load(model, optim, full_osd, optim_input=optim_input)


def flatten_sharded_optim_state_dict(
    sharded_osd: dict[str, Any], model: nn.Module, optim: torch.optim.Optimizer
) -> dict[str, Any]:
    """Legacy ``flatten_sharded_optim_state_dict``."""
    _warn_legacy_api("flatten_sharded_optim_state_dict", "optim_state_dict_to_load")
    return to_load(model, optim, sharded_osd, sharded=True)


def scatter_full_optim_state_dict(
    full_osd: Optional[dict[str, Any]],
    model: nn.Module,
    optim_input: OptimInput,
    optim: Optional[torch.optim.Optimizer],
    group: Optional[dist.ProcessGroup],
) -> dict[str, Any]:
    """Legacy ``scatter_full_optim_state_dict``: only rank 0 needs the full state dict."""
    _warn_legacy_api("scatter_full_optim_state_dict", "optim_state_dict_to_load")
    _warn_optim_input(optim_input)
    return to_load(model, optim, full_osd, group=group, rank0_only=True, optim_input=optim_input)


def rekey_optim_state_dict(
    osd: dict[str, Any],
    key_type: Any,
    model: nn.Module,
    optim_input: OptimInput,
    optim: Optional[torch.optim.Optimizer],
) -> dict[str, Any]:
    """Re-keys ``osd`` by parameter names (PARAM_NAME) or by optimizer parameter IDs (PARAM_ID).

    Local: no collectives, each rank re-keys by its own optimizer's IDs.
    """
    _warn_optim_input(optim_input)
    return rekey(osd, key_type, model, optim_input, optim)
