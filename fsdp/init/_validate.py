"""Argument checks and unit planning: every user mistake is caught here, before any change.

``plan_and_validate_units`` works out which modules will become units (running the wrap policy
without wrapping anything), then checks every unit's parameters, so that a bad unit deep in the
tree fails the constructor with the model untouched.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from torch import nn

from fsdp.api import BackwardPrefetch, CPUOffload, ShardingStrategy
from fsdp.init._unit_params import (
    UnitParam,
    check_no_param_in_two_units,
    collect_unit_params,
    validate_unit_params,
)
from fsdp.runtime._lazy_init import is_fsdp


def _not_yet(argument: str, value: Any, feature: str) -> NotImplementedError:
    return NotImplementedError(
        f"fsdp: {argument}={value!r} is not supported yet ({feature} is a planned feature; see "
        f"the feature table in README.md). Remove the argument to train without it."
    )


def validate_init_args(
    *,
    module: Any,
    sharding_strategy: Any,
    cpu_offload: Any,
    auto_wrap_policy: Any,
    backward_prefetch: Any,
    mixed_precision: Any,
    ignored_modules: Any,
    param_init_fn: Any,
    sync_module_states: bool,
    use_orig_params: bool,
    ignored_states: Any,
) -> None:
    """Raises a clear error for any argument the constructor cannot take."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"fsdp: module must be an nn.Module, got {type(module).__name__}")
    if is_fsdp(module):
        raise ValueError(
            f"fsdp: the module passed to FullyShardedDataParallel is already wrapped with "
            f"FullyShardedDataParallel (it wraps a {type(module.module).__name__}). Wrap each "
            f"module once: pass the inner module, or use the existing wrapper as it is."
        )
    if sharding_strategy is not None and not isinstance(sharding_strategy, ShardingStrategy):
        raise TypeError(
            f"fsdp: sharding_strategy must be a ShardingStrategy or None, got {sharding_strategy!r}"
        )
    if cpu_offload is not None:
        if not isinstance(cpu_offload, CPUOffload):
            raise TypeError(f"fsdp: cpu_offload must be a CPUOffload or None, got {cpu_offload!r}")
        if cpu_offload.offload_params:
            raise _not_yet("cpu_offload", cpu_offload, "CPU offload")
    if auto_wrap_policy is not None:
        from fsdp.wrap import _validate_auto_wrap_policy

        _validate_auto_wrap_policy(auto_wrap_policy)
    if backward_prefetch is not None and not isinstance(backward_prefetch, BackwardPrefetch):
        raise TypeError(
            f"fsdp: backward_prefetch must be a BackwardPrefetch or None, got {backward_prefetch!r}"
        )
    if mixed_precision is not None:
        raise _not_yet("mixed_precision", mixed_precision, "mixed precision")
    if ignored_modules is not None and list(ignored_modules):
        raise _not_yet("ignored_modules", ignored_modules, "ignored modules")
    if ignored_states is not None and list(ignored_states):
        raise _not_yet("ignored_states", ignored_states, "ignored states")
    if param_init_fn is not None:
        raise _not_yet("param_init_fn", param_init_fn, "deferred (meta-device) init")
    meta = [name for name, p in module.named_parameters() if p.is_meta]
    if meta:
        raise NotImplementedError(
            f"fsdp: parameters on the meta device (e.g. '{meta[0]}') are not supported yet "
            f"(deferred init is a planned feature); build the module on CPU or CUDA."
        )
    if sync_module_states:
        raise _not_yet("sync_module_states", sync_module_states, "module-state sync")
    if use_orig_params:
        raise _not_yet("use_orig_params", use_orig_params, "use_orig_params")


def plan_units(module: nn.Module, policy: Optional[Callable], root_kwargs: dict[str, Any]) -> list[nn.Module]:
    """Returns the modules ``policy`` would wrap (bottom-up), without changing anything."""
    if policy is None:
        return []
    from fsdp.wrap import _Policy, _check_no_existing_wrappers, _recursive_wrap

    from fsdp.fully_sharded_data_parallel import FullyShardedDataParallel

    _check_no_existing_wrappers(module, FullyShardedDataParallel)
    if isinstance(policy, _Policy):
        targets = policy._run_policy(module, set(), dict(root_kwargs))
        return [m for m in module.modules() if m in targets and m is not module][::-1]
    planned: list[nn.Module] = []

    def record(m: nn.Module) -> nn.Module:
        planned.append(m)
        return m  # returning the module itself leaves the tree unchanged

    _recursive_wrap(module, policy, record, set(), set(), {}, is_root=True)
    return planned


def plan_and_validate_units(
    module: nn.Module, policy: Optional[Callable], wrapper_cls: type, root_kwargs: dict[str, Any]
) -> None:
    """Checks every future unit's parameters (dtypes, requires_grad, tied across units).

    Raises:
        ValueError: Naming the unit and parameters at fault (see ``validate_unit_params``).
    """
    planned = plan_units(module, policy, root_kwargs)
    unit_modules = set(planned)
    names = {m: name for name, m in module.named_modules()}

    def is_other_unit(m: nn.Module) -> bool:
        return m in unit_modules or is_fsdp(m)

    units: dict[str, list[UnitParam]] = {}
    for unit in planned + [module]:
        name = names.get(unit, "") or f"<root {type(module).__name__}>"
        params = collect_unit_params(unit, is_other_unit)
        validate_unit_params(name, params)
        units[name] = params
    # Parameters already owned by nested FSDP instances count as their units' too.
    for name, sub in module.named_modules():
        if is_fsdp(sub) and sub._fsdp_state.handle is not None:  # type: ignore[union-attr]
            handle = sub._fsdp_state.handle  # type: ignore[union-attr]
            units.setdefault(name, []).extend(
                (info.module_name, info.module, info.param_name, param)
                for info, param in zip(handle.param_infos, handle.original_params())
                if param is not None
            )
    check_no_param_in_two_units(units)
