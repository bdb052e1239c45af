"""The constructor's steps, in the order ``FullyShardedDataParallel.__init__`` runs them.

1. :func:`plan_unit`: check every argument, resolve the groups and the device, plan every unit
   (nothing is changed yet, so a mistake anywhere fails with the model untouched).
2. :func:`build_handles`: materialize meta-device modules in pre-order, wrap nested units
   bottom-up, move this unit's modules to the device and flatten its parameters into
   FlatParamHandles.
3. :func:`new_unit_state`: the unit's runtime state.
4. :func:`finish_unit`: link the unit with the units nested in it and register its hooks.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Union

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from fsdp._comm._groups import ProcessGroupType, ShardingGroups
from fsdp._common import group_backend, group_rank, group_size, run_first_wrap_callbacks
from fsdp.api import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from fsdp.flat_param._policy import HYBRID_STRATEGIES, UnitPolicy
from fsdp.flat_param.flat_param import FlatParamHandle
from fsdp.init._auto_wrap import mixed_precision_classes
from fsdp.init._device import move_modules_to_device, resolve_compute_device
from fsdp.init._materialize import materialize_and_wrap
from fsdp.init._process_group import resolve_process_groups
from fsdp.init._sync import sync_buffers
from fsdp.init._unit_params import (
    mark_tied_owners,
    split_by_requires_grad,
    unit_modules,
    unit_params,
    validate_unit_params,
)
from fsdp.init._validate import (
    UnitPlan,
    plan_units,
    resolve_unit_offload,
    validate_init_args,
    warn_construction,
    warn_container,
)
from fsdp.runtime._hooks import register_flat_param_hooks
from fsdp.runtime._mixed_precision import (
    apply_mixed_precision_overrides,
    cast_unit_buffers,
    full_precision_in_eval_requested,
)
from fsdp.runtime._state import UnitState, is_fsdp, set_reported_ignored, unit_state

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class UnitArgs:
    """The constructor arguments every unit of a tree is built with.

    An auto-wrap policy builds each nested unit with these (:meth:`wrap_kwargs`), so their
    names and order are the constructor's.
    """

    process_group: ProcessGroupType
    sharding_strategy: Optional[ShardingStrategy]
    cpu_offload: Optional[CPUOffload]
    backward_prefetch: Optional[BackwardPrefetch]
    mixed_precision: Optional[MixedPrecision]
    param_init_fn: Optional[Callable[[nn.Module], None]]
    device_id: Union[None, int, str, torch.device]
    sync_module_states: bool
    forward_prefetch: bool
    limit_all_gathers: bool
    use_orig_params: bool
    device_mesh: Optional[DeviceMesh]

    def wrap_kwargs(self) -> dict[str, Any]:
        """The keyword arguments a nested unit is built with (the policy may override some)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class UnitSetup:
    """What step 1 worked out, before anything changed.

    Attributes:
        policy: The unit's schedule policy, resolved once here ([Note: One schedule] in
            ``flat_param/_policy.py``): the strategy in effect (NO_SHARD at world size 1, as
            torch FSDP1), the group sizes, whether it offloads ([Note: Fractional offload]: the
            nested units' kwargs in ``plan.targets`` carry their resolved ``cpu_offload``),
            prefetch.
        groups: The shard group (and for hybrid strategies the replicate group).
        device: The compute device.
        rank: This rank in the shard group.
        plan: The nested units, ignored states and tied-parameter owners.
        wrapped_before: The states of the units already nested in the module (wrapped by hand).
    """

    policy: UnitPolicy
    groups: ShardingGroups
    device: torch.device
    rank: int
    plan: UnitPlan
    wrapped_before: list[UnitState]


def plan_unit(
    module: nn.Module,
    args: UnitArgs,
    auto_wrap_policy: Optional[Callable],
    ignored_modules: Optional[Iterable[nn.Module]],
    ignored_states: Union[None, Iterable[nn.Parameter], Iterable[nn.Module]],
) -> UnitSetup:
    """Step 1: checks everything a user can get wrong and plans every unit, changing nothing.

    Only the mixed-precision overrides of an auto-wrapped tree (modules mixed precision skips
    keep their inputs in full precision) are applied here, once everything has been checked.

    Raises:
        ValueError / TypeError / RuntimeError: Naming the argument, unit or parameter at fault.
    """
    validate_init_args(
        module=module,
        sharding_strategy=args.sharding_strategy,
        cpu_offload=args.cpu_offload,
        auto_wrap_policy=auto_wrap_policy,
        backward_prefetch=args.backward_prefetch,
        mixed_precision=args.mixed_precision,
        param_init_fn=args.param_init_fn,
        use_orig_params=args.use_orig_params,
    )
    strategy = args.sharding_strategy or ShardingStrategy.FULL_SHARD
    groups = resolve_process_groups(args.process_group, args.device_mesh, strategy)
    rank, world_size = group_rank(groups.shard), group_size(groups.shard)
    device = resolve_compute_device(module, args.device_id, group_backend(groups.shard), rank)
    warn_container(module)
    if strategy in HYBRID_STRATEGIES:  # (a hybrid strategy stays in effect at any world size)
        _refuse_hybrid_tensor_parallel(module, strategy)
    root_kwargs = args.wrap_kwargs()
    plan = plan_units(
        module, auto_wrap_policy, root_kwargs, ignored_modules, ignored_states, warn_stacklevel=5
    )
    policy = UnitPolicy.resolve(  # once per unit ([Note: One schedule])
        args.sharding_strategy,
        world_size,
        group_size(groups.replicate) if groups.replicate is not None else 1,
        resolve_unit_offload(module, plan, args.cpu_offload),
        args.backward_prefetch,
        args.forward_prefetch,
        args.limit_all_gathers,
    )
    warn_construction(args.sharding_strategy, policy)
    if auto_wrap_policy is not None and args.mixed_precision is not None:
        apply_mixed_precision_overrides(module, mixed_precision_classes(root_kwargs))
    wrapped_before = [unit_state(sub) for sub in module.modules() if is_fsdp(sub)]
    return UnitSetup(policy, groups, device, rank, plan, wrapped_before)


def _refuse_hybrid_tensor_parallel(module: nn.Module, strategy: ShardingStrategy) -> None:
    """Hybrid sharding of tensor-parallel (DTensor) parameters, a 3-D (replicate, shard, tp)
    layout, is refused before anything changes: torch FSDP1 accepts the constructor and then
    fails in the first forward (``Cannot writeback when the parameter shape changes``), so there
    is no behaviour to match, and fsdp does not check its state dicts there.

    Raises:
        NotImplementedError: Naming the first DTensor parameter and the layouts that work.
    """
    from torch.distributed.tensor import DTensor

    for name, param in module.named_parameters():
        if isinstance(param, DTensor):
            raise NotImplementedError(
                f"fsdp: {strategy} with tensor-parallel (DTensor) parameters is not supported: "
                f"parameter '{name}' is a DTensor (placements {list(param.placements)}). Torch "
                f"FSDP1 fails on this layout too (at the first forward). Use FULL_SHARD or "
                f"SHARD_GRAD_OP with device_mesh=mesh['dp'] of a 2-D (dp, tp) mesh, or hybrid "
                f"sharding without tensor parallelism."
            )


def build_handles(
    wrapper: nn.Module, module: nn.Module, args: UnitArgs, setup: UnitSetup
) -> tuple[list[FlatParamHandle], list[nn.Module]]:
    """Step 2: materializes and wraps the nested units, then flattens this unit's parameters.

    Meta-device modules are materialized in pre-order and the planned nested units wrapped
    bottom-up (see [Note: Meta-device materialization order]); then this unit's own modules
    move to the device, ``module`` becomes ``wrapper``'s wrapped module, buffers are
    synchronized (``sync_module_states``) and the unit's parameters are flattened into one
    handle (two with ``use_orig_params`` when trainable and frozen ones mix).

    Returns:
        The unit's handles and its own modules (those no nested unit or ignored module claims).
    """
    plan = setup.plan
    with mark_tied_owners(plan.tied_owner):
        materialize_and_wrap(
            module,
            plan.targets,
            type(wrapper),
            setup.device,
            args.param_init_fn,
            is_skipped=lambda m: is_fsdp(m) or m in plan.ignored_modules,
        )
        own_modules = unit_modules(module, plan.ignored_modules)
        move_modules_to_device(own_modules, setup.device)
        wrapper._fsdp_wrapped_module = module
        params = unit_params(
            module, lambda m: is_fsdp(m) or m in plan.ignored_modules, plan.ignored_params
        )
        validate_unit_params(type(module).__name__, params, args.use_orig_params)
        if args.sync_module_states:
            sync_buffers(own_modules, setup.groups)
        handles = [
            FlatParamHandle(
                handle_params,
                module,
                setup.device,
                setup.groups.shard,
                uses_sharding=setup.policy.strategy_shards,
                unit_name=type(module).__name__,
                replicate_group=setup.groups.replicate,
                sync_module_states=args.sync_module_states,
                use_orig_params=args.use_orig_params,
                offload_params=setup.policy.offload_params,
                mixed_precision=args.mixed_precision,
                sharding_strategy=setup.policy.strategy,
            )
            for handle_params in split_by_requires_grad(params, args.use_orig_params)
        ]
    if not args.use_orig_params:  # [Note: Optimizer before wrapping]
        note_replaced_params(
            ((f"{prefix}.{name}" if prefix else name, param) for prefix, _, name, param in params),
            type(module).__name__,
        )
    return handles, own_modules


def new_unit_state(
    module: nn.Module,
    args: UnitArgs,
    setup: UnitSetup,
    handles: list[FlatParamHandle],
    own_modules: list[nn.Module],
) -> UnitState:
    """Step 3: the runtime state of the unit built on ``module``."""
    mixed_precision = args.mixed_precision
    return UnitState(
        handles=handles,
        process_group=setup.groups.shard,
        replicate_group=setup.groups.replicate,
        rank=setup.rank,
        world_size=setup.policy.shard_world_size,
        policy=setup.policy,
        compute_device=setup.device,
        unit_name=type(module).__name__,
        mixed_precision=mixed_precision,
        full_precision_in_eval=full_precision_in_eval_requested(),
        cast_buffers=cast_unit_buffers(
            own_modules, mixed_precision.buffer_dtype if mixed_precision is not None else None
        ),
        cpu_offload=args.cpu_offload,
        use_orig_params=args.use_orig_params,
        ignored_modules=setup.plan.ignored_modules,
        ignored_params=setup.plan.ignored_params,
        device_mesh=args.device_mesh,
    )


def finish_unit(new_state: UnitState, module: nn.Module, setup: UnitSetup) -> None:
    """Step 4: marks the units nested in ``module`` as such and registers the unit's hooks.

    Also sets the ignored states the wrappers report ([Note: Reported ignored states]) and
    the attributes through which Dynamo recognizes FSDP-managed modules ([Note: torch.compile]).
    """
    run_first_wrap_callbacks()  # [Note: What fsdp changes in torch]
    annotate_for_dynamo(module, setup.plan.ignored_modules, new_state.use_orig_params)
    for sub in module.modules():
        if is_fsdp(sub):
            unit_state(sub).has_fsdp_parent = True
    targets = setup.plan.targets
    set_reported_ignored(
        new_state,
        setup.wrapped_before,
        [unit_state(sub) for sub in module.modules() if is_fsdp(sub) and sub.module in targets],
    )
    register_flat_param_hooks(new_state)


# [Note: Optimizer before wrapping]
# Without ``use_orig_params``, wrapping replaces a unit's parameters by one flat parameter: the
# original ``nn.Parameter`` objects are no longer part of the model. An optimizer built from
# ``model.parameters()`` *before* wrapping holds those originals; its ``step()`` updates tensors that
# nothing reads, so the model silently trains nothing (torch FSDP1 behaves the same). The wrapper
# records every parameter it replaces (weakly: a replaced parameter the user dropped is forgotten),
# and one process-wide optimizer step pre-hook (``torch.optim.Optimizer``'s global hook) raises
# before the first step of an optimizer that holds one. The check runs once per optimizer (again
# only if its parameter count changes), so it costs nothing per step afterwards.

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


def annotate_for_dynamo(module: nn.Module, ignored_modules: set[nn.Module], use_orig_params: bool) -> None:
    """Sets torch FSDP1's Dynamo attributes on every module of the unit's tree but the ignored.

    ``_is_fsdp_managed_module`` makes Dynamo trace these modules as it does torch FSDP1's:
    unspecialized, parameters taken as graph inputs on every call (the unsharded views are new
    tensors every step), guards on their parameters skipped. ``_fsdp_use_orig_params`` False
    makes Dynamo refuse them (the module runs eagerly), as for torch FSDP1: without
    ``use_orig_params`` a module's parameter names are not parameters during forward. Nested
    units' modules are set again by each enclosing unit, as torch does.
    """
    for sub in module.modules():
        if sub not in ignored_modules:
            # nn.Module.__setattr__ is typed to take tensors and modules.
            sub._is_fsdp_managed_module = True  # type: ignore[assignment]
            sub._fsdp_use_orig_params = use_orig_params  # type: ignore[assignment]
