"""Optimizer state and step temporaries, from two steps of the real optimizer on meta tensors."""

from __future__ import annotations

import inspect
# Any below: the optimizer's keyword arguments (mixed types, as torch.optim types them).
from typing import Any

import torch
from torch import nn

from fsdp.plan._trace import Trace, _StorageTracker

__all__ = ["trace_optimizer"]


def _live_bytes(trace: Trace) -> int:
    sizes: dict[int, int] = {}
    for event in trace.events:
        if event[0] == "alloc":
            sizes[event[1]] = event[2]
        elif event[0] == "free":
            sizes.pop(event[1], None)
    return sum(sizes.values())


def trace_optimizer(
    optimizer_cls: type,
    optimizer_kwargs: dict[str, Any],
    shard_shapes: list[tuple[int, torch.dtype]],
    foreach: bool,
) -> tuple[int, int]:
    """Returns ``(state_bytes, step_temporary_peak_bytes)`` for parameters of the given sizes.

    The optimizer sees what FSDP gives it: one full-precision tensor per trainable sharded
    FlatParameter (with use_orig_params, views of it; element-wise optimizers hold the same
    state either way). The first step creates the state; the peak above the state during the
    second is the step's temporaries. ``foreach`` is torch's default on the training device
    (True on CUDA, where the multi-tensor kernels allocate each temporary for all shards at
    once; False on CPU), used unless ``optimizer_kwargs`` says otherwise.

    The shards are meta tensors: an optimizer's step is device-agnostic element-wise (or
    multi-tensor) arithmetic whose allocations do not depend on the kernel chosen, and meta
    tensors run it several times faster than fake tensors, which matters to the ``--budget``
    search (one trace per distinct set of shard shapes).
    """
    if not shard_shapes:
        return 0, 0
    trace = Trace()
    # The shards on meta, not under a default-device context: optimizers make small state
    # (AdamW's step count) on the CPU and read it with .item().
    params = [nn.Parameter(torch.empty(numel, dtype=dtype, device="meta")) for numel, dtype in shard_shapes]
    for p in params:
        p.grad = torch.empty_like(p)
    kwargs = dict(optimizer_kwargs)
    if "foreach" in inspect.signature(optimizer_cls).parameters:
        kwargs.setdefault("foreach", foreach)
    try:
        optimizer = optimizer_cls(params, **kwargs)
    except TypeError as exc:
        raise TypeError(
            f"fsdp.estimate_memory: optimizer={optimizer_cls!r} could not be built with "
            f"optimizer_kwargs={optimizer_kwargs!r}: {exc}"
        ) from exc
    external = {p.untyped_storage()._cdata for p in params} | {
        p.grad.untyped_storage()._cdata for p in params if p.grad is not None
    }
    tracker = _StorageTracker(trace, external)
    with tracker:
        optimizer.step()
        state_bytes = _live_bytes(trace)
        trace.events.append(("mark",))
        optimizer.step()
    # Temporaries: what the second step allocates above the state, at its busiest.
    live, peak_second, second = 0, 0, False
    sizes: dict[int, int] = {}
    for event in trace.events:
        if event[0] == "mark":
            second = True
            continue
        if not second:
            continue
        if event[0] == "alloc":
            sizes[event[1]] = event[2]
            live += event[2]
            peak_second = max(peak_second, live)
        elif event[0] == "free" and event[1] in sizes:
            live -= sizes.pop(event[1])
    del optimizer, params
    return state_bytes, peak_second
