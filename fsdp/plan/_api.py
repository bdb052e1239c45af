"""``fsdp.estimate_memory``: predict each rank's peak memory of a training step, no process group."""

from __future__ import annotations

import inspect
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
from fsdp.plan._units import plan_unit_specs

__all__ = ["estimate_memory"]

_HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
# Constructor arguments that need a process group or a device mesh: planning takes the world
# size (and intra_node_size) instead.
_NEEDS_GROUP = ("process_group", "device_mesh")


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
    _trace_cache: Optional[dict[Any, Any]] = None,
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
        _trace_cache: Internal: reuse traces across calls on the same model (the search).
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
    units, _ignored_modules, ignored_params = plan_unit_specs(
        model,
        auto_wrap_policy=kwargs.get("auto_wrap_policy"),
        root_kwargs=root_kwargs,
        ignored_modules=kwargs.get("ignored_modules"),
        ignored_states=kwargs.get("ignored_states"),
        shard_world_size=shard_ws,
        replicate_world_size=replicate_ws,
    )
    mixed_precision = kwargs.get("mixed_precision")
    buffer_dtype = getattr(mixed_precision, "buffer_dtype", None) if mixed_precision is not None else None
    # The trace depends on the compute dtypes and the unit modules, not on the world size: a
    # search over world sizes and strategies (python -m fsdp.plan --budget) traces once.
    cache_key = (
        getattr(mixed_precision, "param_dtype", None),
        buffer_dtype,
        tuple(id(u.module) for u in units),
    )
    trace = _trace_cache.get(cache_key) if _trace_cache is not None else None
    if trace is None:
        trace = trace_forward_backward(model, example_inputs, units, ignored_params, loss_fn, buffer_dtype)
        if _trace_cache is not None:
            _trace_cache[cache_key] = trace
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
    state_bytes, temp_bytes = trace_optimizer(
        optimizer, optimizer_kwargs or {}, shapes, foreach=device.type == "cuda"
    )
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
