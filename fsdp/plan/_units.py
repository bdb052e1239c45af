"""The units and flat-parameter sizes the wrapper would build, worked out without a process group.

One source of truth: the units come from :func:`fsdp.init._validate.plan_units` (the wrap
policy run without wrapping, tied-parameter owners, ignored modules), the parameters of each
handle from :func:`fsdp.init._unit_params.unit_params` and ``split_by_requires_grad``, and the
padding from :mod:`fsdp.flat_param._sharding`, exactly as ``FullyShardedDataParallel.__init__``
and ``FlatParamHandle.__init__`` call them.
"""

from __future__ import annotations

from dataclasses import dataclass
# Any below: the FSDP constructor's keyword arguments (mixed types; torch's wrap policies type them so).
from typing import Any, Callable, Iterable, Optional, Union

import torch
from torch import nn

from fsdp.flat_param._policy import UnitPolicy
from fsdp.flat_param._precision import HandlePrecision
from fsdp.flat_param._sharding import FlatLayout, aligned_numel, flat_layout, padded_unsharded_numel
from fsdp.init._unit_params import mark_tied_owners, split_by_requires_grad, unit_params
from fsdp.init._validate import plan_units, resolve_unit_offload

__all__ = ["HandleSpec", "UnitSpec", "UnitLayout", "plan_unit_layouts", "size_unit_specs", "plan_unit_specs"]


@dataclass
class HandleSpec:
    """One FlatParameter of a unit, as the busiest rank holds it.

    Attributes:
        params: The unique original Parameters, in flat order.
        unpadded_unsharded_numel: Elements of all parameters back to back (with the alignment
            padding of use_orig_params; see [Note: Aligned flat parameter layout]).
        padded_unsharded_numel: Padded to a multiple of the shard world size (when sharding).
        sharded_numel: Elements of one rank's shard (the whole parameter when not sharding).
        uses_sharding: False for NO_SHARD and for a shard group of one rank.
        precision: The resolved dtypes (full, param, reduce).
        requires_grad: Whether the handle is trainable.
        layout: Where each parameter sits in the flat parameter (the handle's own layout).
    """

    params: list[nn.Parameter]
    unpadded_unsharded_numel: int
    padded_unsharded_numel: int
    sharded_numel: int
    uses_sharding: bool
    precision: HandlePrecision
    requires_grad: bool
    layout: Optional[FlatLayout] = None

    @property
    def has_unsharded_buffer(self) -> bool:
        """Whether forward and backward use a separate unsharded buffer (gathered or cast)."""
        return self.uses_sharding or self.precision.low_precision_params

    def unsharded_bytes(self) -> int:
        """Bytes of the padded unsharded buffer forward and backward use (0 if none)."""
        if not self.has_unsharded_buffer:
            return 0
        return self.padded_unsharded_numel * _itemsize(self.precision.param_dtype)

    def shard_bytes(self) -> int:
        """Bytes of the local (full-precision) shard."""
        return self.sharded_numel * _itemsize(self.precision.full_dtype)


@dataclass
class UnitSpec:
    """One FSDP unit: its module, name, handles and schedule policy.

    Attributes:
        name: The module's qualified name (``""`` for the root).
        module: The unit's module in the user's (unwrapped) model.
        handles: Its FlatParameters (two with use_orig_params and mixed requires_grad).
        policy: The record the runtime's hooks would run for it ([Note: One schedule]).
        is_root: Whether this is the root unit.
    """

    name: str
    module: nn.Module
    handles: list[HandleSpec]
    policy: UnitPolicy
    is_root: bool

    def frees_after_forward(self) -> bool:
        """``UnitPolicy.frees_after_forward`` for this unit (as ``UnitState.frees_after_forward``)."""
        return self.policy.frees_after_forward(self.is_root, any(h.has_unsharded_buffer for h in self.handles))

    @property
    def label(self) -> str:
        return self.name or f"<root {type(self.module).__name__}>"


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


@dataclass
class UnitLayout:
    """One unit as planned before any world size is known: its module, kwargs and parameters.

    Attributes:
        name: The module's qualified name (``""`` for the root).
        module: The unit's module.
        kwargs: The unit's constructor kwargs (the root's, with the policy's overrides).
        handle_params: Per FlatParameter, the unique original Parameters in flat order.
        is_root: Whether this is the root unit.
    """

    name: str
    module: nn.Module
    kwargs: dict[str, Any]
    handle_params: list[list[nn.Parameter]]
    is_root: bool


def plan_unit_layouts(
    module: nn.Module,
    *,
    auto_wrap_policy: Optional[Callable[..., object]],
    root_kwargs: dict[str, Any],
    ignored_modules: Optional[Iterable[nn.Module]],
    ignored_states: Union[None, Iterable[nn.Parameter], Iterable[nn.Module]],
) -> tuple[list[UnitLayout], set[nn.Module], set[nn.Parameter]]:
    """Plans the units and their parameters as the wrapper would; no world size involved.

    Args:
        module: The user's model (any device, meta included).
        auto_wrap_policy: As given to ``FullyShardedDataParallel``.
        root_kwargs: The constructor's other keyword arguments (what nested units inherit).
        ignored_modules: As given to ``FullyShardedDataParallel``.
        ignored_states: As given to ``FullyShardedDataParallel``.

    Returns:
        The units in forward (post-order, root last) order, the ignored modules and the
        ignored parameters.
    """
    plan = plan_units(module, auto_wrap_policy, root_kwargs, ignored_modules, ignored_states)
    # The units that offload, chosen as the wrapper chooses them ([Note: Fractional offload]).
    root_kwargs = {**root_kwargs, "cpu_offload": resolve_unit_offload(module, plan, root_kwargs.get("cpu_offload"))}
    names = {m: n for n, m in module.named_modules()}
    targets = list(plan.targets)
    target_set = set(targets)
    layouts: list[UnitLayout] = []
    with mark_tied_owners(plan.tied_owner):
        for unit in targets + [module]:
            kwargs = plan.targets.get(unit, root_kwargs)

            def is_other_unit(m: nn.Module, unit: nn.Module = unit) -> bool:
                return (m in target_set and m is not unit) or m in plan.ignored_modules

            params = unit_params(unit, is_other_unit, plan.ignored_params)
            handle_params: list[list[nn.Parameter]] = []
            for group in split_by_requires_grad(params, bool(kwargs.get("use_orig_params"))):
                unique: list[nn.Parameter] = []
                seen: set[int] = set()
                for _, _, _, p in group:
                    if id(p) not in seen:
                        seen.add(id(p))
                        unique.append(p)
                handle_params.append(unique)
            layouts.append(UnitLayout(names.get(unit, ""), unit, kwargs, handle_params, unit is module))
    return layouts, plan.ignored_modules, plan.ignored_params


def size_unit_specs(layouts: list[UnitLayout], shard_world_size: int, replicate_world_size: int = 1) -> list[UnitSpec]:
    """Sizes every FlatParameter of the planned units for one shard world size.

    Args:
        layouts: From :func:`plan_unit_layouts`.
        shard_world_size: Ranks a parameter is sharded over (the intra-node size for hybrid).
            With CPU offload a handle takes the sharded path even on one rank, whatever the
            training device (``UnitPolicy.uses_sharding``).
        replicate_world_size: Hybrid replicas (1 otherwise).
    """
    specs: list[UnitSpec] = []
    for layout in layouts:
        policy = UnitPolicy.from_kwargs(layout.kwargs, shard_world_size, replicate_world_size)
        uses_sharding = policy.uses_sharding
        use_orig_params = bool(layout.kwargs.get("use_orig_params"))
        handles: list[HandleSpec] = []
        for unique in layout.handle_params:
            precision = HandlePrecision.resolve(layout.kwargs.get("mixed_precision"), unique[0].dtype)
            # The handle's own flat layout (use_orig_params aligns each parameter to 16 bytes).
            flat = flat_layout(
                [p.numel() for p in unique],
                shard_world_size,
                aligned_numel(_itemsize(precision.param_dtype)) if use_orig_params else 0,
            )
            unpadded = flat.unpadded_unsharded_numel
            padded = padded_unsharded_numel(unpadded, shard_world_size) if uses_sharding else unpadded
            handles.append(
                HandleSpec(
                    params=unique,
                    unpadded_unsharded_numel=unpadded,
                    padded_unsharded_numel=padded,
                    sharded_numel=padded // (shard_world_size if uses_sharding else 1),
                    uses_sharding=uses_sharding,
                    precision=precision,
                    requires_grad=unique[0].requires_grad,
                    layout=flat,
                )
            )
        specs.append(
            UnitSpec(
                name=layout.name,
                module=layout.module,
                handles=handles,
                policy=policy,
                is_root=layout.is_root,
            )
        )
    return specs


def plan_unit_specs(
    module: nn.Module,
    *,
    auto_wrap_policy: Optional[Callable[..., object]],
    root_kwargs: dict[str, Any],
    ignored_modules: Optional[Iterable[nn.Module]],
    ignored_states: Union[None, Iterable[nn.Parameter], Iterable[nn.Module]],
    shard_world_size: int,
    replicate_world_size: int,
) -> tuple[list[UnitSpec], set[nn.Module], set[nn.Parameter]]:
    """Plans the units as the wrapper would, and sizes every FlatParameter.

    :func:`plan_unit_layouts` then :func:`size_unit_specs` (the search caches the first).

    Args:
        module: The user's model (any device, meta included).
        auto_wrap_policy: As given to ``FullyShardedDataParallel``.
        root_kwargs: The constructor's other keyword arguments (what nested units inherit).
        ignored_modules: As given to ``FullyShardedDataParallel``.
        ignored_states: As given to ``FullyShardedDataParallel``.
        shard_world_size: Ranks a parameter is sharded over (the intra-node size for hybrid).
        replicate_world_size: Ranks that hold the same shard (hybrid); 1 otherwise. Sizes do
            not depend on it.

    Returns:
        The units in forward (post-order, root last) order, the ignored modules and the
        ignored parameters.
    """
    layouts, ignored, ignored_params = plan_unit_layouts(
        module,
        auto_wrap_policy=auto_wrap_policy,
        root_kwargs=root_kwargs,
        ignored_modules=ignored_modules,
        ignored_states=ignored_states,
    )
    return size_unit_specs(layouts, shard_world_size, replicate_world_size), ignored, ignored_params
