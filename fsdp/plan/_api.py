"""``fsdp.estimate_memory``: predict each rank's peak memory of a training step, no process group."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from fsdp.api import BackwardPrefetch, ShardingStrategy
from fsdp.flat_param._sharding import flat_layout
from fsdp.init._validate import validate_init_args
from fsdp.plan._estimate import MemoryEstimate, UnitEstimate
from fsdp.plan._optimizer import trace_optimizer
from fsdp.plan._schedule import ScheduleConfig, replay
from fsdp.plan._trace import trace_forward_backward
from fsdp.plan._units import plan_unit_layouts, size_unit_specs

__all__ = ["PlanCache", "estimate_memory"]

_HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
# Constructor arguments that need a process group or a device mesh: planning takes the world
# size (and intra_node_size) instead.
_NEEDS_GROUP = ("process_group", "device_mesh")


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

    layouts: dict[Any, Any] = field(default_factory=dict)
    traces: dict[Any, Any] = field(default_factory=dict)
    optimizer: dict[Any, tuple[int, int]] = field(default_factory=dict)


def _kwargs_key(kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """A cache key for wrapper kwargs: config dataclasses by value, other objects by identity."""
    import dataclasses

    def key(value: Any) -> Any:
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
    example_inputs: Any,
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
        model: The unwrapped model; may be on the meta device.
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
            hybrid layout does not divide, and the wrapper's own argument errors.
    """
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
    strategy = fsdp_kwargs.get("sharding_strategy") or ShardingStrategy.FULL_SHARD
    if strategy in _HYBRID:
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
        shard_ws, replicate_ws = intra_node_size, world_size // intra_node_size
    else:
        if intra_node_size is not None:
            raise ValueError(
                f"fsdp.estimate_memory: intra_node_size= applies to hybrid strategies only, "
                f"not {strategy.name}."
            )
        shard_ws, replicate_ws = world_size, 1
    device_id = fsdp_kwargs.get("device_id")
    device = torch.device(device_id) if device_id is not None else torch.device("cuda")
    if isinstance(device_id, int):
        device = torch.device("cuda", device_id)
    defaults = {
        k: p.default
        for k, p in inspect.signature(
            __import__("fsdp").FullyShardedDataParallel.__init__
        ).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    kwargs = {**{k: v for k, v in defaults.items() if k in known}, **fsdp_kwargs}
    root_kwargs = {k: v for k, v in kwargs.items() if k not in ("auto_wrap_policy", "ignored_modules", "ignored_states")}
    layout_key = _kwargs_key(kwargs)
    planned = _cache.layouts.get(layout_key) if _cache is not None else None
    if planned is None:
        planned = plan_unit_layouts(
            model,
            auto_wrap_policy=kwargs.get("auto_wrap_policy"),
            root_kwargs=root_kwargs,
            ignored_modules=kwargs.get("ignored_modules"),
            ignored_states=kwargs.get("ignored_states"),
        )
        if _cache is not None:
            _cache.layouts[layout_key] = planned
    layouts, _ignored_modules, ignored_params = planned
    units = size_unit_specs(layouts, shard_ws)
    mixed_precision = kwargs.get("mixed_precision")
    buffer_dtype = getattr(mixed_precision, "buffer_dtype", None) if mixed_precision is not None else None
    # The trace depends on the compute dtypes and the unit modules, not on the world size: a
    # search over world sizes and strategies (python -m fsdp.plan --budget) traces once.
    cache_key = (
        getattr(mixed_precision, "param_dtype", None),
        buffer_dtype,
        tuple(id(u.module) for u in units),
    )
    trace = _cache.traces.get(cache_key) if _cache is not None else None
    if trace is None:
        trace = trace_forward_backward(model, example_inputs, units, ignored_params, loss_fn, buffer_dtype)
        if _cache is not None:
            _cache.traces[cache_key] = trace
    cpu_offload = kwargs.get("cpu_offload")
    offload = bool(cpu_offload and cpu_offload.offload_params) and device.type != "cpu"
    # The optimizer sees each trainable shard in full precision, and ignored parameters whole.
    # With use_orig_params it sees each original parameter's slice of the shard instead (rank
    # 0's: the first ranks hold no padding), which changes the step's per-tensor temporaries.
    shapes: list[tuple[int, torch.dtype]] = []
    for u in units:
        for h in u.handles:
            if not h.requires_grad:
                continue
            if not kwargs.get("use_orig_params"):
                shapes.append((h.sharded_numel, h.precision.full_dtype))
                continue
            numels = [p.numel() for p in h.params]
            if h.uses_sharding:
                # The handle's layout (alignment padding skipped): rank 0's parts.
                layout = h.layout or flat_layout(numels, shard_ws)
                numels = [s.numel for s in layout.slices_in_shard(0)]
            shapes += [(n, h.precision.full_dtype) for n in numels]
    shapes += [(p.numel(), p.dtype) for p in ignored_params if p.requires_grad]
    foreach = device.type == "cuda"
    optimizer_key = (optimizer, repr(sorted((optimizer_kwargs or {}).items())), tuple(shapes), foreach)
    optimizer_result = _cache.optimizer.get(optimizer_key) if _cache is not None else None
    if optimizer_result is None:
        optimizer_result = trace_optimizer(optimizer, optimizer_kwargs or {}, shapes, foreach=foreach)
        if _cache is not None:
            _cache.optimizer[optimizer_key] = optimizer_result
    state_bytes, temp_bytes = optimizer_result
    static = sum(b.numel() * b.element_size() for b in model.buffers())
    static += sum(p.numel() * p.element_size() for p in ignored_params)
    cfg = ScheduleConfig(
        device_is_cpu=device.type == "cpu",
        offload_params=offload,
        backward_prefetch=kwargs.get("backward_prefetch"),
        forward_prefetch=bool(kwargs.get("forward_prefetch")),
        shard_world_size=shard_ws,
        replicate_world_size=replicate_ws,
        static_bytes=static,
        optim_state_bytes=state_bytes,
        optim_temp_bytes=temp_bytes,
    )
    result = replay(units, trace, cfg)
    effective = strategy if (shard_ws > 1 or strategy in _HYBRID) else ShardingStrategy.NO_SHARD
    prefetch = kwargs.get("backward_prefetch")
    config = {
        "strategy": effective.name,
        "param_dtype": str(getattr(mixed_precision, "param_dtype", None) or "full").replace("torch.", ""),
        "offload": str(bool(cpu_offload and cpu_offload.offload_params)),
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
            )
            for u in units
        ],
        world_size=world_size,
        config=config,
    )
