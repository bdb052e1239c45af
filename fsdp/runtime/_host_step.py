"""The optimizer step of offloaded units, pipelined with the next forward (issue 35, item 3).

[Note: Pipelined host step]
With CPU offload a unit's fp32 shard, its reduced gradient and its optimizer state are host
buffers, and the host step (AdamW over them, memory bound) is the slow part of the step. It
need not finish before the next forward starts: the next forward needs unit k's updated shard
only when it gathers unit k. :class:`PipelinedHostStep` therefore keeps one optimizer per unit
and, at ``step()``:

1. steps the units that stay on the device at once, on the calling thread (their updates are
   device work, ordered by the stream);
2. hands every offloaded unit's step (and its ``zero_grad``) to one worker thread, in the
   order the next forward gathers them (module pre-order, the root first), and records the
   pending work in each of the unit's handles (``FlatParamStorage.pending_update``).

Every gather of a handle (forward, backward, prefetch, ``summon_full_params``, full state dicts:
[Note: One gather path] in ``flat_param/_storage.py``) first waits for that handle's pending
update. So the next forward runs the first units while the host still steps the later ones, and
waits only where a unit is not ready; the copy of the updated shard to the device is the
gather's own copy, made right after the update. With the fraction rule of [Note: Fractional
offload] the offloaded units are the last ones, so they have the whole forward of the first
units to finish in.

Exactness: each unit's optimizer runs torch's own update over the same tensors as one optimizer
over all parameters would (AdamW's update is per parameter), in the same order per tensor, so
the result is bit-identical to the unpipelined step (``tests/test_fractional_offload.py``).
Gradient clipping stays exact: ``clip_grad_norm_`` needs every gradient, so it runs (with its
all-reduce) before ``step()``, as without the pipeline; the pipeline starts after it. Readers
that do not gather (sharded and local state dicts, ``optim_state_dict``, the user's own reads of
``flat_param``) call :meth:`PipelinedHostStep.wait` first; ``zero_grad`` is part of the
pipelined work (the next backward's gradient of a unit is written after its gather waited).

On a GPU the worker's copies would overlap the device's compute; the reduced gradients' copies
to pinned memory already overlap backward ([Note: A reduction finishes on its stream]).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional

import torch
from torch import nn

from fsdp.runtime._state import fsdp_modules, unit_state

__all__ = ["PipelinedHostStep"]


class PipelinedHostStep:
    """Per-unit optimizers whose offloaded units step on a worker thread (see [Note: Pipelined
    host step]).

    Args:
        model: The root FullyShardedDataParallel module.
        make_optimizer: Builds one optimizer from a list of parameters (e.g.
            ``lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True)``); called once per unit.
    """

    def __init__(self, model: nn.Module, make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]) -> None:
        self.units: list[tuple[list[Any], torch.optim.Optimizer, bool]] = []
        for unit in fsdp_modules(model):  # pre-order: the order the next forward gathers them
            handles = [h for h in unit_state(unit).handles if h.flat_param.requires_grad]
            if not handles:
                continue
            pipelined = all(h.storage.offload_params and h.storage.has_unsharded_buffer for h in handles)
            self.units.append((handles, make_optimizer([h.flat_param for h in handles]), pipelined))
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fsdp-host-step")
        self._pending: list[Future[Any]] = []

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The per-unit optimizers, in the order they step."""
        return [opt for _, opt, _ in self.units]

    def step(self, zero_grad: bool = True) -> None:
        """Steps every unit (device units now, offloaded units on the worker), then sets their
        gradients to None when ``zero_grad``."""
        self.wait()
        for handles, opt, pipelined in self.units:
            if not pipelined:
                opt.step()
                if zero_grad:
                    opt.zero_grad(set_to_none=True)
                continue
            future = self._worker.submit(_step, opt, zero_grad)
            self._pending.append(future)
            for handle in handles:
                handle.storage.pending_update = future

    def wait(self, timeout: Optional[float] = None) -> None:
        """Waits for every pending unit step (re-raises the first error)."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.result(timeout)

    def close(self) -> None:
        """Waits for the pending steps and stops the worker."""
        self.wait()
        self._worker.shutdown()


def _step(opt: torch.optim.Optimizer, zero_grad: bool) -> None:
    opt.step()
    if zero_grad:
        opt.zero_grad(set_to_none=True)
