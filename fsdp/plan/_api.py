"""``fsdp.estimate_memory``: predict each rank's peak memory of a training step, no process group."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, NamedTuple, Optional, TypeVar, Union

import torch
from torch import nn

from fsdp.api import BackwardPrefetch, ShardingStrategy
from fsdp.flat_param._policy import HYBRID_STRATEGIES, effective_strategy
from fsdp.flat_param._sharding import flat_layout
from fsdp.init._validate import validate_init_args
from fsdp.plan._estimate import MemoryEstimate, UnitEstimate
from fsdp.plan._optimizer import trace_optimizer
from fsdp.plan._schedule import ReplayResult, ScheduleConfig, replay
from fsdp.plan._trace import Trace, trace_forward_backward
from fsdp.plan._units import UnitLayout, UnitSpec, plan_unit_layouts, size_unit_specs
from fsdp.plan._workspace import step_workspace_bytes

__all__ = ["PlanCache", "estimate_memory"]

# Constructor arguments that need a process group or a device mesh: planning takes the world
# size (and intra_node_size) instead.
_NEEDS_GROUP = ("process_group", "device_mesh")


# Any: the FSDP constructor's keyword arguments and the optimizer's (mixed types, as torch types
# them), and ``loss_fn``'s argument: the model's output, which torch types Any (nn.Module.__call__).

_KwargsKey = tuple[tuple[str, Hashable], ...]  # the wrapper's kwargs, by value or identity
_K = TypeVar("_K")
_V = TypeVar("_V")


@dataclass
class PlanCache:
    """What one model's estimates share across world sizes and strategies (the ``--budget`` search).

    [Note: Plan cache]
    The activation trace depends on the model, its inputs, the loss and the compute dtypes, not
    on the world size, the strategy, offload or prefetching; the optimizer's state and step
    temporaries depend only on the shapes of what it steps. A search over hundreds of
    configurations therefore traces each model and precision once and each distinct set of
    shard shapes once, and only the cheap parts (unit sizes, the schedule replay) run per
    configuration. Nothing is approximated: an estimate made with a cache equals the one made
    without (``tests/test_plan_api.py`` checks it).

    A cache belongs to one model object and one ``example_inputs``/``loss_fn``; keys hold the
    unit modules' ids, so it must not outlive the model.

    Attributes:
        layouts: ``(wrapper kwargs) -> (unit layouts, ignored modules, ignored parameters)``:
            the wrap policy's units and each FlatParameter's parameters (sizes come later,
            per world size).
        traces: ``(param dtype, buffer dtype, unit module ids) -> Trace``.
        optimizer: ``(optimizer class, its kwargs, shard shapes, foreach) -> (state, temporaries)``.
    """

    layouts: dict[_KwargsKey, tuple[list[UnitLayout], set[nn.Module], set[nn.Parameter]]] = field(default_factory=dict)
    traces: dict[tuple[Optional[torch.dtype], Optional[torch.dtype], tuple[int, ...]], Trace] = field(
        default_factory=dict
    )
    optimizer: dict[tuple[type, str, tuple[tuple[int, torch.dtype], ...], bool], tuple[int, int]] = field(
        default_factory=dict
    )


def _kwargs_key(kwargs: dict[str, Any]) -> _KwargsKey:
    """A cache key for wrapper kwargs: config dataclasses by value, other objects by identity."""
    import dataclasses

    def key(value: object) -> Hashable:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return (type(value), repr(value))
        try:
            hash(value)
        except TypeError:
            return (type(value), id(value))
        return value

    return tuple(sorted((name, key(value)) for name, value in kwargs.items()))


def _fsdp_keywords() -> set[str]:
    from fsdp.fully_sharded_data_parallel import FullyShardedDataParallel

    names = set(inspect.signature(FullyShardedDataParallel.__init__).parameters)
    return names - {"self", "module"}


def estimate_memory(
    model: nn.Module,
    example_inputs: object,
    *,
    world_size: int,
    optimizer: type = torch.optim.AdamW,
    optimizer_kwargs: Optional[dict[str, Any]] = None,
    loss_fn: Optional[Callable[[Any], torch.Tensor]] = None,
    intra_node_size: Optional[int] = None,
    _cache: Optional[PlanCache] = None,
    **fsdp_kwargs: Any,
) -> MemoryEstimate:
    """Predicts the busiest rank's peak memory of one training step under FSDP.

    Nothing is materialized and no process group is needed: the units and shard sizes come
    from the wrapper's own planning code, activations from one forward and backward on fake
    tensors, and FSDP's schedule is replayed on top (see docs/memory.md).

    Args:
        model: The unwrapped model; may be on the meta device, whatever its modules' init
            methods ([Note: Planning needs no values]).
        example_inputs: One micro-batch: a tensor or a tuple of tensors (meta allowed).
        world_size: Number of ranks.
        optimizer: The optimizer class (its state and step temporaries are traced).
        optimizer_kwargs: Keyword arguments for ``optimizer``.
        loss_fn: Turns the model's output into a scalar loss; default: the output's sum.
        intra_node_size: Hybrid strategies: ranks per shard group (the node size).
        _cache: Internal: reuse traces and optimizer results across calls on the same model
            (the search; see [Note: Plan cache]).
        **fsdp_kwargs: ``FullyShardedDataParallel``'s keyword arguments, meaning the same
            (``device_id`` picks the training device; default CUDA).

    Returns:
        The :class:`MemoryEstimate`.

    Raises:
        TypeError: An unknown keyword, or a bad argument type.
        ValueError: A model without parameters, a world size that is not positive or that the
            hybrid layout does not divide, a forward that needs tensor values, and the
            wrapper's own argument errors.
    """
    setup = _setup(model, world_size, intra_node_size, fsdp_kwargs)
    planned = _plan_units(model, setup, _cache)
    trace = _trace(model, example_inputs, loss_fn, planned, setup, _cache)
    optimizer_bytes = _trace_optimizer(optimizer, optimizer_kwargs or {}, planned, setup, _cache)
    result = _schedule(model, planned, trace, optimizer_bytes, setup)
    return _report(result, planned.units, world_size, setup)


@dataclass
class _Setup:
    """The checked arguments of one estimate.

    Attributes:
        kwargs: The wrapper's keywords, its defaults filled in.
        strategy: The sharding strategy asked for.
        shard_world_size: Ranks a parameter is sharded over (the node size for hybrid).
        replicate_world_size: Hybrid replicas (1 otherwise).
        device: The training device.
    """

    kwargs: dict[str, Any]
    strategy: ShardingStrategy
    shard_world_size: int
    replicate_world_size: int
    device: torch.device


def _check_arguments(model: nn.Module, world_size: int, fsdp_kwargs: dict[str, Any]) -> set[str]:
    """Raises on a user mistake, before any planning; returns the wrapper's keyword names."""
    known = _fsdp_keywords()
    unknown = sorted(set(fsdp_kwargs) - known)
    if unknown:
        raise TypeError(
            f"fsdp.estimate_memory: unknown keyword argument(s) {unknown}; it takes "
            f"FullyShardedDataParallel's keywords ({sorted(known - set(_NEEDS_GROUP))}) plus "
            f"world_size, optimizer, optimizer_kwargs, loss_fn and intra_node_size."
        )
    for name in _NEEDS_GROUP:
        if fsdp_kwargs.get(name) is not None:
            raise ValueError(
                f"fsdp.estimate_memory: {name}= needs a process group; pass world_size= (and "
                f"intra_node_size= for hybrid strategies) instead."
            )
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"fsdp.estimate_memory: world_size must be a positive int, got {world_size!r}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"fsdp.estimate_memory: model must be an nn.Module, got {type(model).__name__}")
    if next(model.parameters(), None) is None:
        raise ValueError(
            f"fsdp.estimate_memory: the model ({type(model).__name__}) has no parameters; there "
            f"is nothing for FSDP to shard."
        )
    validate_init_args(
        module=model,
        sharding_strategy=fsdp_kwargs.get("sharding_strategy"),
        cpu_offload=fsdp_kwargs.get("cpu_offload"),
        auto_wrap_policy=fsdp_kwargs.get("auto_wrap_policy"),
        backward_prefetch=fsdp_kwargs.get("backward_prefetch"),
        mixed_precision=fsdp_kwargs.get("mixed_precision"),
        param_init_fn=fsdp_kwargs.get("param_init_fn"),
        use_orig_params=bool(fsdp_kwargs.get("use_orig_params")),
    )
    return known


def _shard_world_sizes(
    strategy: ShardingStrategy, world_size: int, intra_node_size: Optional[int]
) -> tuple[int, int]:
    """``(shard world size, replicate world size)``; raises on a bad ``intra_node_size``."""
    if strategy in HYBRID_STRATEGIES:
        if intra_node_size is None:
            raise ValueError(
                f"fsdp.estimate_memory: {strategy.name} needs intra_node_size= (ranks per node, "
                f"the shard group size)."
            )
        if intra_node_size < 1 or world_size % intra_node_size != 0:
            raise ValueError(
                f"fsdp.estimate_memory: intra_node_size={intra_node_size} does not divide "
                f"world_size={world_size}; the hybrid layout needs whole nodes."
            )
        return intra_node_size, world_size // intra_node_size
    if intra_node_size is not None:
        raise ValueError(
            f"fsdp.estimate_memory: intra_node_size= applies to hybrid strategies only, "
            f"not {strategy.name}."
        )
    return world_size, 1


def _training_device(device_id: Union[None, int, str, torch.device]) -> torch.device:
    """The device ``device_id`` names (an int is a CUDA index); CUDA when it is None."""
    device = torch.device(device_id) if device_id is not None else torch.device("cuda")
    if isinstance(device_id, int):
        device = torch.device("cuda", device_id)
    return device


def _setup(
    model: nn.Module, world_size: int, intra_node_size: Optional[int], fsdp_kwargs: dict[str, Any]
) -> _Setup:
    """Checks the arguments and resolves the strategy's group sizes and the device."""
    from fsdp.fully_sharded_data_parallel import FullyShardedDataParallel

    known = _check_arguments(model, world_size, fsdp_kwargs)
    strategy = fsdp_kwargs.get("sharding_strategy") or ShardingStrategy.FULL_SHARD
    shard_ws, replicate_ws = _shard_world_sizes(strategy, world_size, intra_node_size)
    device = _training_device(fsdp_kwargs.get("device_id"))
    defaults = {
        k: p.default
        for k, p in inspect.signature(FullyShardedDataParallel.__init__).parameters.items()
        if p.default is not inspect.Parameter.empty and k in known
    }
    return _Setup({**defaults, **fsdp_kwargs}, strategy, shard_ws, replicate_ws, device)


def _cached(store: Optional[dict[_K, _V]], key: _K, make: Callable[[], _V]) -> _V:
    """``store[key]``, made by ``make()`` and kept the first time; just ``make()`` without a store."""
    value = store.get(key) if store is not None else None
    if value is None:
        value = make()
        if store is not None:
            store[key] = value
    return value


class _Planned(NamedTuple):
    """The planned units and the parameters none of them manages.

    Attributes:
        units: The units (forward order, root last), sized for the shard world size.
        ignored_params: Parameters no unit manages (they keep ordinary ``.grad``).
    """

    units: list[UnitSpec]
    ignored_params: set[nn.Parameter]


def _values_not_needed(module: nn.Module) -> None:
    """The ``param_init_fn`` planning hands the wrapper's unit planning: never called.

    [Note: Planning needs no values]
    ``FullyShardedDataParallel`` materializes meta modules, so its unit planning
    (:func:`fsdp.init._validate.plan_units`) first checks that every meta module can be
    materialized: ``param_init_fn`` given, or a ``reset_parameters()`` on each module with meta
    states (torch FSDP1 fails there too, calling ``reset_parameters()``). That check is the
    wrapper's contract and stays. Planning materializes nothing: units and sizes need shapes and
    dtypes only, and the trace runs on fake copies ([Note: Activation trace]). So planning
    passes this function as ``param_init_fn`` when the user gave none, and any model that can be
    built on the meta device plans, ``nn.MultiheadAttention`` (no ``reset_parameters()``)
    included. Nothing else in unit planning reads ``param_init_fn``.
    """
    raise AssertionError("fsdp.plan: planning never materializes a module")  # pragma: no cover


def _plan_units(model: nn.Module, setup: _Setup, cache: Optional[PlanCache]) -> _Planned:
    """The wrap policy's units, sized for the shard world size, and the ignored parameters."""
    kwargs = setup.kwargs
    root_kwargs = {
        k: v for k, v in kwargs.items() if k not in ("auto_wrap_policy", "ignored_modules", "ignored_states")
    }
    if root_kwargs.get("param_init_fn") is None:
        root_kwargs["param_init_fn"] = _values_not_needed  # [Note: Planning needs no values]
    layouts, _ignored_modules, ignored_params = _cached(
        cache.layouts if cache is not None else None,
        _kwargs_key(kwargs),
        lambda: plan_unit_layouts(
            model,
            auto_wrap_policy=kwargs.get("auto_wrap_policy"),
            root_kwargs=root_kwargs,
            ignored_modules=kwargs.get("ignored_modules"),
            ignored_states=kwargs.get("ignored_states"),
        ),
    )
    return _Planned(size_unit_specs(layouts, setup.shard_world_size, setup.replicate_world_size), ignored_params)


def _trace(
    model: nn.Module,
    example_inputs: object,
    loss_fn: Optional[Callable[[Any], torch.Tensor]],
    planned: _Planned,
    setup: _Setup,
    cache: Optional[PlanCache],
) -> Trace:
    """The activation trace ([Note: Activation trace]), shared across world sizes in a search."""
    mixed_precision = setup.kwargs.get("mixed_precision")
    buffer_dtype = getattr(mixed_precision, "buffer_dtype", None) if mixed_precision is not None else None
    # The trace depends on the compute dtypes and the unit modules, not on the world size: a
    # search over world sizes and strategies (python -m fsdp.plan --budget) traces once.
    key = (
        getattr(mixed_precision, "param_dtype", None),
        buffer_dtype,
        tuple(id(u.module) for u in planned.units),
    )
    return _cached(
        cache.traces if cache is not None else None,
        key,
        lambda: trace_forward_backward(
            model, example_inputs, planned.units, planned.ignored_params, loss_fn, buffer_dtype
        ),
    )


def _optimizer_shapes(planned: _Planned, setup: _Setup) -> list[tuple[int, torch.dtype]]:
    """``(numel, dtype)`` of every tensor the optimizer steps on the busiest rank."""
    # The optimizer sees each trainable shard in full precision, and ignored parameters whole.
    # With use_orig_params it sees each original parameter's slice of the shard instead (rank
    # 0's: the first ranks hold no padding), which changes the step's per-tensor temporaries.
    shapes: list[tuple[int, torch.dtype]] = []
    for u in planned.units:
        for h in u.handles:
            if not h.requires_grad:
                continue
            if not setup.kwargs.get("use_orig_params"):
                shapes.append((h.sharded_numel, h.precision.full_dtype))
                continue
            numels = [p.numel() for p in h.params]
            if h.uses_sharding:
                # The handle's layout (alignment padding skipped): rank 0's parts.
                layout = h.layout or flat_layout(numels, setup.shard_world_size)
                numels = [s.numel for s in layout.slices_in_shard(0)]
            shapes += [(n, h.precision.full_dtype) for n in numels]
    shapes += [(p.numel(), p.dtype) for p in planned.ignored_params if p.requires_grad]
    return shapes


def _trace_optimizer(
    optimizer: type,
    optimizer_kwargs: dict[str, Any],
    planned: _Planned,
    setup: _Setup,
    cache: Optional[PlanCache],
) -> tuple[int, int]:
    """``(optimizer state bytes, step temporaries' peak bytes)``, shared by equal shard shapes."""
    shapes = _optimizer_shapes(planned, setup)
    foreach = setup.device.type == "cuda"
    key = (optimizer, repr(sorted(optimizer_kwargs.items())), tuple(shapes), foreach)
    return _cached(
        cache.optimizer if cache is not None else None,
        key,
        lambda: trace_optimizer(optimizer, optimizer_kwargs, shapes, foreach=foreach),
    )


def _offloads(setup: _Setup, units: Optional[list[UnitSpec]] = None) -> bool:
    """Whether any unit offloads (each unit's own choice is its ``policy.offload_params``)."""
    if units is not None:
        return any(u.policy.offload_params for u in units)
    cpu_offload = setup.kwargs.get("cpu_offload")
    return bool(cpu_offload and cpu_offload.offload_params)


def _schedule(
    model: nn.Module,
    planned: _Planned,
    trace: Trace,
    optimizer_bytes: tuple[int, int],
    setup: _Setup,
) -> ReplayResult:
    """Replays FSDP's schedule on the trace (see :mod:`fsdp.plan._schedule`)."""
    state_bytes, temp_bytes = optimizer_bytes
    static = sum(b.numel() * b.element_size() for b in model.buffers())
    static += sum(p.numel() * p.element_size() for p in planned.ignored_params)
    cfg = ScheduleConfig(
        device_is_cpu=setup.device.type == "cpu",
        offload_params=_offloads(setup, planned.units),
        static_bytes=static,
        workspace_bytes=step_workspace_bytes(setup.device),
        optim_state_bytes=state_bytes,
        optim_temp_bytes=temp_bytes,
    )
    return replay(planned.units, trace, cfg)


def _offload_text(setup: _Setup, units: list[UnitSpec]) -> str:
    """``"True"`` / ``"False"`` (every unit or none, as before), or ``"k of n units"``."""
    chosen = sum(u.policy.offload_params for u in units)
    config = setup.kwargs.get("cpu_offload")
    if config is None or not config.selects_units:
        return str(_offloads(setup))
    return f"{chosen} of {len(units)} units"


def _report(result: ReplayResult, units: list[UnitSpec], world_size: int, setup: _Setup) -> MemoryEstimate:
    """The :class:`MemoryEstimate`: the replay's peak, the unit sizes, the configuration in words."""
    kwargs, strategy, device = setup.kwargs, setup.strategy, setup.device
    effective = effective_strategy(strategy, setup.shard_world_size)
    prefetch = kwargs.get("backward_prefetch")
    mixed_precision = kwargs.get("mixed_precision")
    config = {
        "strategy": effective.name,
        "param_dtype": str(getattr(mixed_precision, "param_dtype", None) or "full").replace("torch.", ""),
        "offload": _offload_text(setup, units),
        "backward_prefetch": prefetch.name if isinstance(prefetch, BackwardPrefetch) else "None",
        "forward_prefetch": str(bool(kwargs.get("forward_prefetch"))),
        "device": device.type,
    }
    return MemoryEstimate(
        peak_bytes=result.peak_bytes,
        cpu_peak_bytes=result.peak_bytes if device.type == "cpu" else result.cpu_peak_bytes,
        peak_phase=result.peak_phase,
        breakdown=result.breakdown,
        units=[
            UnitEstimate(
                name=u.label,
                unpadded_unsharded_numel=sum(h.unpadded_unsharded_numel for h in u.handles),
                padded_unsharded_numel=sum(h.padded_unsharded_numel for h in u.handles),
                padded_sharded_numel=sum(h.sharded_numel for h in u.handles),
                unsharded_bytes=sum(h.unsharded_bytes() for h in u.handles),
                offload_params=u.policy.offload_params,
            )
            for u in units
        ],
        world_size=world_size,
        config=config,
    )
