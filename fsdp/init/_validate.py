"""Argument checks and unit planning: every user mistake is caught here, before any change.

``plan_units`` works out which modules will become units (running the wrap policy without
wrapping anything), which parameters are ignored, and which unit owns a parameter that
several units use (tied weights), then checks every unit's parameters, so that a bad unit deep
in the tree fails the constructor with the model untouched.

[Note: Tied parameters across units]
When one Parameter is used by modules in two units (an embedding in one, an output head in
another), it is flattened into their lowest common ancestor unit, which is unsharded whenever
either user runs: an ancestor's forward encloses its descendants' forwards, and its gradient is
reduced only after every use's backward. Both names become views of the ancestor's flat
parameter, so gradients of both uses sum in one place and state dicts hold one copy. This
needs the units to be planned together (auto-wrap); when a nested unit was wrapped by hand and
already flattened the parameter, construction fails with an error naming both places.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn

from fsdp._common import clean_fqn
from fsdp.api import BackwardPrefetch, CPUOffload, ShardingStrategy
from fsdp.flat_param._policy import UnitPolicy, offloaded_units
from fsdp.flat_param.flat_param import FLATTENED_ATTR, FlatParameter
from fsdp.init._auto_wrap import policy_targets, validate_auto_wrap_policy
from fsdp.wrap import _Policy
from fsdp.init._materialize import check_materializable, validate_param_init_fn
from fsdp.init._unit_params import (
    UnitParam,
    check_not_flattened_elsewhere,
    mark_tied_owners,
    unit_params,
    validate_unit_params,
)
from fsdp.runtime._state import is_fsdp, unit_state


def validate_init_args(
    *,
    module: Any,
    sharding_strategy: Any,
    cpu_offload: Any,
    auto_wrap_policy: Any,
    backward_prefetch: Any,
    mixed_precision: Any,
    param_init_fn: Any,
    use_orig_params: bool,
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
    if cpu_offload is not None and not isinstance(cpu_offload, CPUOffload):
        raise TypeError(f"fsdp: cpu_offload must be a CPUOffload or None, got {cpu_offload!r}")
    if auto_wrap_policy is not None:
        validate_auto_wrap_policy(auto_wrap_policy)
    if backward_prefetch is not None and not isinstance(backward_prefetch, BackwardPrefetch):
        raise TypeError(
            f"fsdp: backward_prefetch must be a BackwardPrefetch or None, got {backward_prefetch!r}"
        )
    validate_mixed_precision(mixed_precision)
    validate_param_init_fn(param_init_fn)


def warn_container(module: nn.Module) -> None:
    """The construction warning torch FSDP1 emits first, before planning: a container root."""
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        warnings.warn(
            f"fsdp: FSDP will not all-gather parameters for containers that do not implement "
            f"forward: {type(module).__name__}. FSDP gathers a unit's parameters only when its "
            f"forward runs, so these parameters are never gathered by it. Wrap the container's "
            f"elements (or the module that calls them) instead.",
            stacklevel=4,  # the caller of FullyShardedDataParallel(...)
        )


def warn_construction(requested: Optional[ShardingStrategy], policy: UnitPolicy) -> None:
    """Emits the strategy warnings torch FSDP1 emits for the same arguments, once the units
    are planned (after the auto-wrap warnings, in torch FSDP1's order).

    Args:
        requested: The ``sharding_strategy`` argument itself (None: FULL_SHARD).
        policy: The unit's resolved policy (the strategy in effect, the shard group's size).
    """
    strategy = requested or ShardingStrategy.FULL_SHARD
    switched = policy.strategy is ShardingStrategy.NO_SHARD
    if strategy is not ShardingStrategy.NO_SHARD and switched:
        # Torch FSDP1's words exactly, attributed (as torch attributes it) to the wrapper's
        # constructor rather than its caller: one location, so Python's default filter shows it
        # once per process however many units are built, as torch's shows.
        warnings.warn(
            f"FSDP is switching to use `NO_SHARD` instead of {strategy} since the world size is 1.",
            stacklevel=3,  # FullyShardedDataParallel.__init__ -> build step -> here
        )
    elif policy.shard_world_size > 1 and requested is ShardingStrategy.NO_SHARD:
        warnings.warn(
            "fsdp: the NO_SHARD sharding strategy is deprecated in torch FSDP1 (which "
            "recommends DistributedDataParallel instead); fsdp keeps supporting it.",
            FutureWarning,
            stacklevel=4,
        )


_MIXED_PRECISION_DTYPES = ("param_dtype", "reduce_dtype", "buffer_dtype")


def validate_mixed_precision(mixed_precision: Any) -> None:
    """``MixedPrecision`` (ours or torch's, duck-typed) with floating-point dtypes or None."""
    if mixed_precision is None:
        return
    missing = [
        name
        for name in _MIXED_PRECISION_DTYPES + ("keep_low_precision_grads", "_module_classes_to_ignore")
        if not hasattr(mixed_precision, name)
    ]
    if missing:
        raise TypeError(
            f"fsdp: mixed_precision must be a fsdp.MixedPrecision (or None), got "
            f"{type(mixed_precision).__name__} without {missing}."
        )
    for name in _MIXED_PRECISION_DTYPES:
        dtype = getattr(mixed_precision, name)
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            raise ValueError(
                f"fsdp: MixedPrecision.{name} must be a floating-point torch.dtype or None, got "
                f"{dtype!r}."
            )


def _flattened_by_a_unit(param: nn.Parameter) -> bool:
    """A FlatParameter, or an original parameter a live FSDP unit already flattened."""
    if isinstance(param, FlatParameter):
        return True
    marker = getattr(param, FLATTENED_ATTR, None)
    return marker is not None and marker[0]() is not None


def resolve_ignored(
    module: nn.Module,
    ignored_modules: Optional[Iterable[Any]],
    ignored_states: Optional[Iterable[Any]],
    warn_stacklevel: int = 4,
) -> tuple[set[nn.Module], set[nn.Parameter]]:
    """Returns the ignored modules (closed under descendants) and all ignored parameters.

    As in torch FSDP1: an ignored module may contain FSDP units; those stay units (wrapped
    before, managed by their own wrapper) while the rest of the ignored subtree is left alone,
    and their flat (or already flattened) parameters are not ignored parameters. Ignoring the
    module being wrapped itself warns (every parameter would be ignored).

    Raises:
        ValueError: Both arguments given; elements that are not all modules (ignored_modules)
            or not all modules or all parameters (ignored_states); an ignored module that is
            itself an FSDP instance.
        TypeError: ``ignored_modules``/``ignored_states`` is not iterable.
    """
    modules_arg = _as_list(ignored_modules, "ignored_modules")
    states_arg = _as_list(ignored_states, "ignored_states")
    if ignored_modules is not None and ignored_states is not None:
        raise ValueError(
            "fsdp: Cannot pass both ignored_modules and ignored_states at the same time. "
            "Please just pass ignored_states (it accepts modules too)."
        )
    roots: list[nn.Module] = []
    params: set[nn.Parameter] = set()
    if states_arg:
        if all(isinstance(s, nn.Parameter) for s in states_arg):
            params.update(p for p in states_arg if not _flattened_by_a_unit(p))
        elif all(isinstance(s, nn.Module) for s in states_arg):
            roots = states_arg
        else:
            raise ValueError(
                f"fsdp: ignored_states expects all nn.Parameter or all nn.Module list elements "
                f"but got types {_sorted_types(states_arg)}. Pass only parameters or only "
                f"modules."
            )
    if not all(isinstance(m, nn.Module) for m in modules_arg):
        raise ValueError(  # torch FSDP1's type for this mistake
            f"fsdp: ignored_modules expects nn.Module list elements but got types "
            f"{_sorted_types(modules_arg)}. Pass the modules (e.g. [model.frozen_encoder]); "
            f"use ignored_states for parameters."
        )
    roots.extend(modules_arg)
    names = {m: n for n, m in module.named_modules()}
    closed: set[nn.Module] = set()
    for root in roots:
        if is_fsdp(root):
            where = names.get(root, type(root).__name__)
            raise ValueError(
                f"fsdp: `ignored_modules` should not include FSDP modules, but "
                f"'{clean_fqn(where)}' is a FullyShardedDataParallel instance. Ignore the "
                f"module it wraps ('.module') before wrapping it, or do not ignore it."
            )
        closed.update(sub for sub in root.modules() if not is_fsdp(sub))
    if module in closed:
        warnings.warn(
            f"fsdp: Trying to ignore the top-level module passed into the FSDP constructor "
            f"itself will result in all parameters being ignored and is not well-supported: "
            f"{type(module).__name__} is itself in ignored_modules/ignored_states, so FSDP "
            f"shards nothing. Ignore its submodules instead.",
            stacklevel=warn_stacklevel,
        )
    for sub in closed:
        params.update(p for p in sub.parameters(recurse=False) if not _flattened_by_a_unit(p))
    return closed, params


def _post_order(module: nn.Module) -> list[nn.Module]:
    """``module``'s tree, children before parents (iterative: no recursion limit, no cycle)."""
    order: list[nn.Module] = []
    stack: list[tuple[nn.Module, bool]] = [(module, False)]
    seen: set[int] = set()
    while stack:
        mod, children_done = stack.pop()
        if children_done:
            order.append(mod)
            continue
        if id(mod) in seen:
            continue
        seen.add(id(mod))
        stack.append((mod, True))
        stack.extend((child, False) for child in reversed(list(mod.children())))
    return order


def _sorted_types(values: list[Any]) -> list[type]:
    """The elements' types as torch FSDP1 lists them in its messages (sorted by repr)."""
    return sorted({type(v) for v in values}, key=repr)


def _as_list(values: Optional[Iterable[Any]], what: str) -> list[Any]:
    if values is None:
        return []
    try:
        return list(values)
    except TypeError:
        raise TypeError(
            f"fsdp: {what} must be an iterable of modules or parameters, got "
            f"{type(values).__name__}."
        ) from None


@dataclass
class UnitPlan:
    """What the constructor will build, worked out before anything changes.

    Attributes:
        targets: Modules to wrap as nested units (post-order) with their kwargs.
        ignored_modules: Ignored modules, closed under descendants.
        ignored_params: Parameters no unit manages.
        tied_owner: For a Parameter used by several units: the Parameter and the unit module
            that owns it, by id (see [Note: Tied parameters across units]).
    """

    targets: dict[nn.Module, dict[str, Any]] = field(default_factory=dict)
    ignored_modules: set[nn.Module] = field(default_factory=set)
    ignored_params: set[nn.Parameter] = field(default_factory=set)
    tied_owner: dict[int, tuple[nn.Parameter, nn.Module]] = field(default_factory=dict)


def _unit_tree(module: nn.Module, unit_modules: set[nn.Module]) -> dict[nn.Module, Optional[nn.Module]]:
    """Maps each unit module to its parent unit module (None for the root)."""
    parent: dict[nn.Module, Optional[nn.Module]] = {module: None}
    # An explicit stack, not a recursive closure: a closure that calls itself is a reference
    # cycle, which would keep the modules it saw alive until the cyclic collector runs.
    # Entries are (module, the unit above it), popped in the recursive walk's pre-order.
    stack: list[tuple[nn.Module, nn.Module]] = [(c, module) for c in reversed(list(module.children()))]
    while stack:
        child, current = stack.pop()
        if child in unit_modules and child not in parent:
            parent[child] = current
            current = child
        stack.extend((grandchild, current) for grandchild in reversed(list(child.children())))
    return parent


def _lowest_common_unit(units: list[nn.Module], parent: dict[nn.Module, Optional[nn.Module]]) -> nn.Module:
    def chain(u: nn.Module) -> list[nn.Module]:
        out: list[nn.Module] = []
        cur: Optional[nn.Module] = u
        while cur is not None:
            out.append(cur)
            cur = parent[cur]
        return out

    common = chain(units[0])
    for u in units[1:]:
        ancestors = set(chain(u))
        common = [c for c in common if c in ancestors]
    return common[0]


def warn_mixed_frozen_unit(unit_name: str, params: list[UnitParam], fqn_prefix: str, stacklevel: int) -> None:
    """use_orig_params: warns about a unit mixing frozen and trainable parameters, as torch
    FSDP1 does for each module its policy object (``ModuleWrapPolicy``, ``CustomPolicy``) picks,
    in post-order, before wrapping anything (a callable policy or none: no warning, as torch).

    torch FSDP1's reason (the flat gradient covers the frozen parameters too) does not hold
    here: the frozen parameters go into a second flat parameter without a gradient ([Note:
    Original parameters] in docs/flat_param_lifecycle.md). The recommendation still does, for
    another reason, which the message gives: the unit gathers two flat parameters each time.
    """
    numels = {True: 0, False: 0}
    fqns: dict[bool, list[str]] = {True: [], False: []}
    seen: set[int] = set()
    for module_name, _, name, param in params:
        fqns[param.requires_grad].append(fqn_prefix + (f"{module_name}.{name}" if module_name else name))
        if id(param) not in seen:
            seen.add(id(param))
            numels[param.requires_grad] += param.numel()
    if not fqns[True] or not fqns[False]:
        return
    warnings.warn(
        f"{unit_name} has both parameters with requires_grad=True and False. We do not "
        f"recommend wrapping such modules: fsdp keeps the frozen parameters in a second flat "
        f"parameter without a gradient (gradient memory for {numels[True]} numel, where torch "
        f"FSDP1's would cover {numels[True] + numels[False]} numel), but the unit then "
        f"all-gathers two flat parameters each time it is unsharded. If possible, wrap the "
        f"frozen parameters with FSDP separately.\n"
        f"The following parameters have requires_grad=True:\n{fqns[True]}\n"
        f"The following parameters have requires_grad=False:\n{fqns[False]}",
        stacklevel=stacklevel,
    )


def plan_units(
    module: nn.Module,
    policy: Optional[Callable],
    root_kwargs: dict[str, Any],
    ignored_modules: Optional[Iterable[Any]],
    ignored_states: Optional[Iterable[Any]],
    warn_stacklevel: int = 4,
) -> UnitPlan:
    """Plans and validates every unit (see the module docstring).

    ``warn_stacklevel`` attributes the warning about an ignored wrapped module, counted from
    :func:`resolve_ignored` (4: the caller of ``plan_units``' caller).

    Raises:
        ValueError / TypeError: Naming the unit, parameters or argument at fault.
    """
    closed, ignored_params = resolve_ignored(module, ignored_modules, ignored_states, warn_stacklevel)
    plan = UnitPlan(ignored_modules=closed, ignored_params=ignored_params)
    check_materializable(
        module, root_kwargs.get("param_init_fn"), lambda m: is_fsdp(m) or m in closed
    )
    plan.targets = policy_targets(module, policy, root_kwargs, closed, ignored_params, include_root=True)
    picked_root = plan.targets.pop(module, None) is not None
    unit_modules = set(plan.targets)
    names = {m: name for name, m in module.named_modules()}

    def is_other_unit(m: nn.Module) -> bool:
        return m in unit_modules or is_fsdp(m) or m in closed

    def unit_name(u: nn.Module) -> str:
        return names.get(u, "") or f"<root {type(module).__name__}>"

    claims: dict[int, list[nn.Module]] = {}
    units: dict[nn.Module, list[UnitParam]] = {}
    for unit in list(plan.targets) + [module]:
        params = unit_params(unit, is_other_unit, ignored_params)
        units[unit] = params
        for _, _, _, param in params:
            owners = claims.setdefault(id(param), [])
            if unit not in owners:
                owners.append(unit)
    parent = _unit_tree(module, unit_modules)
    by_id = {id(p[3]): p[3] for ps in units.values() for p in ps}
    for pid, owners in claims.items():
        if len(owners) > 1:
            plan.tied_owner[pid] = (by_id[pid], _lowest_common_unit(owners, parent))

    def owns(unit: nn.Module, param: nn.Parameter) -> bool:
        return id(param) not in plan.tied_owner or plan.tied_owner[id(param)][1] is unit

    # In post-order, as torch FSDP1 checks them (its message names the first it finds).
    post_order = {m: i for i, m in enumerate(_post_order(module))}
    use_orig_params = bool(root_kwargs.get("use_orig_params"))
    for unit, params in sorted(units.items(), key=lambda item: post_order.get(item[0], -1)):
        name = names.get(unit, "")
        owned = [p for p in params if owns(unit, p[3])]
        validate_unit_params(unit_name(unit), owned, use_orig_params, fqn_prefix=f"{name}." if name else "")
        if use_orig_params and isinstance(policy, _Policy) and (unit is not module or picked_root):
            warn_mixed_frozen_unit(unit_name(unit), owned, f"{name}." if name else "", warn_stacklevel)
    # Parameters already flattened by units wrapped by hand cannot move.
    handle_names: dict[object, str] = {}
    for name, sub in module.named_modules():
        if is_fsdp(sub):
            for handle in unit_state(sub).handles:
                handle_names[handle] = clean_fqn(name)
    for unit, params in units.items():
        check_not_flattened_elsewhere(
            unit_name(unit), [p for p in params if owns(unit, p[3])], handle_names
        )
    # Nested units leave ignored states alone too.
    for target, kwargs in plan.targets.items():
        inner_modules = [m for m in target.modules() if m in closed and m is not target]
        inner_params = [p for p in target.parameters() if p in ignored_params]
        if ignored_modules is not None or (ignored_states is not None and inner_modules):
            kwargs["ignored_states"] = inner_modules or None
        elif inner_params:
            kwargs["ignored_states"] = inner_params
    return plan


def resolve_unit_offload(module: nn.Module, plan: UnitPlan, root_offload: Optional[CPUOffload]) -> Optional[CPUOffload]:
    """Resolves which planned units offload ([Note: Fractional offload] in
    ``flat_param/_policy.py``): the constructor (``init/_steps.py``) and the memory planner
    (``plan/_units.py``) both call this, after :func:`plan_units`, so both choose the same units.

    A nested unit's ``cpu_offload`` in ``plan.targets`` that selects units becomes
    ``CPUOffload(offload_params=chosen)`` (what the nested constructor then runs); configs that
    offload all units or none are left as they are.

    Returns:
        The root's resolved config (the constructor's unless it selects units).
    """
    configs = {unit: kwargs.get("cpu_offload") for unit, kwargs in plan.targets.items()}
    configs[module] = root_offload
    if not any(c is not None and c.selects_units for c in configs.values()):
        return root_offload
    units = [m for m in module.modules() if m in configs]  # pre-order, the root first

    numels: list[int] = []
    with mark_tied_owners(plan.tied_owner):
        for unit in units:

            def is_other_unit(m: nn.Module, unit: nn.Module = unit) -> bool:
                return (m in configs and m is not unit) or is_fsdp(m) or m in plan.ignored_modules

            params = unit_params(unit, is_other_unit, plan.ignored_params)
            numels.append(sum(p.numel() for p in {id(p[3]): p[3] for p in params}.values()))
    chosen = offloaded_units([(unit, configs[unit], numel) for unit, numel in zip(units, numels)])
    resolved = {unit: CPUOffload(offload_params=c) for unit, c in zip(units, chosen)}
    for unit, kwargs in plan.targets.items():
        config = kwargs.get("cpu_offload")
        if config is not None and config.selects_units:
            kwargs["cpu_offload"] = resolved[unit]
    return resolved[module] if root_offload is not None and root_offload.selects_units else root_offload
