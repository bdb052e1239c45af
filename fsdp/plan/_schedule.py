"""Replays FSDP's unshard / reshard / prefetch / reduction schedule on an activation trace.

[Note: Schedule replay]
The trace ([Note: Activation trace]) says when each unit's forward and backward start and
end, and when each parameter gradient is ready. On top of its activations this replay adds,
per handle, what ``FlatParamHandle`` and the hooks in ``fsdp/runtime/_hooks.py`` allocate
and free in a steady-state step (the second on, when prefetching is on):

- pre-forward / pre-backward: the padded unsharded parameter (``param_dtype``), plus, while
  the all-gather runs, the shard cast to ``param_dtype`` and (offload) its device copy;
  ``forward_prefetch`` / ``BACKWARD_PRE`` gather the next unit of the recorded order too.
- post-forward: FULL_SHARD and HYBRID_SHARD free it (never the root, nor the unit whose
  backward comes first and that all-gathers: [Note: The first backward unit stays gathered] in
  ``runtime/_prefetch.py``, the same rule through ``unit_kept_for_backward``); SHARD_GRAD_OP
  keeps it.
- gradients: each parameter's gradient lives until the handle's last one is ready; then
  they are concatenated into the padded unsharded gradient (cast to ``reduce_dtype`` if it
  differs) and reduced into a new sharded gradient (NO_SHARD: in place). The reduction stays
  in flight (its buffers alive) until the next handle's first gradient or post-backward, one
  at a time, where the unit's ``UnitPolicy.reduction_stays_in_flight`` says so (every one on
  an accelerator's post-backward stream; none on CPU); then the sharded gradient is cast to
  full precision (offload: copied to the host buffer) and kept; on an accelerator that happens
  on the post-backward stream right after the collective (kept from the post-backward on).
- post-backward: the unit's unsharded parameters are freed and ``BACKWARD_POST`` gathers the
  next unit, both before the reduction is launched.
- optimizer step: shards, sharded gradients and optimizer state plus the step's temporaries.
- on CUDA, the cuBLAS workspaces, for the whole step ([Note: cuBLAS workspaces] in
  ``plan/_workspace.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from fsdp.api import BackwardPrefetch
from fsdp.plan._trace import Trace
from fsdp.plan._units import HandleSpec, UnitSpec
from fsdp.runtime._prefetch import unit_kept_for_backward

__all__ = ["ScheduleConfig", "ReplayResult", "replay"]

SHARDED_PARAMS = "sharded parameters"
BUFFERS = "buffers and ignored parameters"
OPTIM_STATE = "optimizer state"
OPTIM_TEMP = "optimizer step temporaries"
GRADS = "sharded gradients"
UNSHARDED_GRADS = "unsharded gradients"
GATHERED = "gathered units"
PREFETCHED = "prefetched units"
SAVED = "saved activations"
TEMPS = "backward temporaries"
COMM = "communication buffers"
LOW = "low-precision copies"
INPUTS = "inputs"
WORKSPACES = "cuBLAS workspaces"


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


@dataclass
class ScheduleConfig:
    """What the replay needs to know besides the units.

    Attributes:
        device_is_cpu: The training device is the CPU (one memory: the host buffers of
            offload count in the same peak).
        offload_params: Whether any unit offloads (host buffers and their copies, on a CPU
            training device too, as in ``FlatParamHandle``); which units do is each unit's
            ``policy.offload_params`` ([Note: Fractional offload]).
        static_bytes: Buffers and ignored parameters (device).
        workspace_bytes: The CUDA libraries' workspaces ([Note: cuBLAS workspaces] in
            ``fsdp/plan/_workspace.py``), held for the whole step.
        optim_state_bytes: Optimizer state.
        optim_temp_bytes: Peak temporaries of one optimizer step.
    """

    device_is_cpu: bool
    offload_params: bool
    static_bytes: int = 0
    workspace_bytes: int = 0
    optim_state_bytes: int = 0
    optim_temp_bytes: int = 0


@dataclass
class ReplayResult:
    """The replay's peak (device; the host's too where offload keeps buffers there).

    Attributes:
        peak_bytes, peak_phase, breakdown: The peak, the phase it is reached in, and what it is
            made of, by category.
        cpu_peak_bytes: The host's peak (offload's buffers).
        gathered_at_hooks: After each hook of the step, in order: ``(hook, unit index,
            bytes of gathered and prefetched unsharded parameters)``, the hooks being
            ``"fwd_pre"``, ``"fwd_post"``, ``"bwd_pre"`` (a unit's first) and ``"bwd_post"``
            (per handle): what the runtime holds at its hooks, checked exactly by
            tests/test_plan_replay_gathered.py.
    """

    peak_bytes: int = 0
    peak_phase: str = "forward"
    breakdown: dict[str, int] = field(default_factory=dict)
    cpu_peak_bytes: int = 0
    gathered_at_hooks: list[tuple[str, int, int]] = field(default_factory=list)


class _Replay:
    def __init__(self, units: list[UnitSpec], trace: Trace, cfg: ScheduleConfig) -> None:
        self.units, self.trace, self.cfg = units, trace, cfg
        self.device: dict[str, int] = {}
        self.cpu: dict[str, int] = {}
        self.result = ReplayResult()
        self.phase = "forward"
        self.gathered: dict[tuple[int, int], str] = {}  # handle -> GATHERED / PREFETCHED
        self.pending_comm: dict[tuple[int, int], int] = {}  # prefetch: cast shard kept until used
        self.act_sizes: dict[int, tuple[int, str]] = {}
        self.held: dict[tuple[int, int], list[int]] = {}  # per-parameter gradients awaiting reduction
        self.held_keys: set[int] = set()
        self.inflight: Optional[tuple[tuple[int, int], list[tuple[str, int]]]] = None
        self.ran_pre_backward: set[int] = set()
        self.host_share = 0.0  # of the shards (and optimizer state) on the host, set by run()
        self.forward_order: list[int] = []
        self.backward_order: list[int] = []
        for event in trace.events:
            if event[0] == "fwd_pre" and event[1] not in self.forward_order:
                self.forward_order.append(event[1])
            elif event[0] == "bwd_pre" and event[1] not in self.backward_order:
                self.backward_order.append(event[1])
        roots = [index for index, unit in enumerate(units) if unit.is_root]
        self.kept_unit = (
            unit_kept_for_backward(
                self.forward_order,
                self.backward_order,
                roots[0],
                units[roots[0]].policy.backward_prefetch,
                {index for index, unit in enumerate(units) if any(h.uses_sharding for h in unit.handles)},
            )
            if roots
            else None
        )

    # ------------------------------------------------------------------ accounting
    def add(self, kind: str, nbytes: int, cpu: bool = False) -> None:
        pool = self.cpu if cpu else self.device
        pool[kind] = pool.get(kind, 0) + nbytes
        self.observe()

    def add_split(self, kind: str, nbytes: int) -> None:
        """Adds ``nbytes`` split between host and device as the shards are (``host_share``)."""
        host = round(nbytes * self.host_share)
        if host:
            self.add(kind, host, cpu=True)
        if nbytes - host:
            self.add(kind, nbytes - host)

    def observe(self) -> None:
        total = sum(self.device.values())
        merged = dict(self.device)
        if self.cfg.device_is_cpu:
            total += sum(self.cpu.values())
            for k, v in self.cpu.items():
                merged[k] = merged.get(k, 0) + v
        if total > self.result.peak_bytes:
            self.result.peak_bytes = total
            self.result.peak_phase = self.phase
            self.result.breakdown = {k: v for k, v in merged.items() if v}
        self.result.cpu_peak_bytes = max(self.result.cpu_peak_bytes, sum(self.cpu.values()))

    def log_hook(self, hook: str, u: int) -> None:
        gathered = self.device.get(GATHERED, 0) + self.device.get(PREFETCHED, 0)
        self.result.gathered_at_hooks.append((hook, u, gathered))

    def handle(self, hid: tuple[int, int]) -> HandleSpec:
        return self.units[hid[0]].handles[hid[1]]

    # ------------------------------------------------------------------ parameters
    def unshard(self, u: int, kind: str) -> None:
        for h, spec in enumerate(self.units[u].handles):
            hid = (u, h)
            if not spec.has_unsharded_buffer:
                continue
            if hid in self.gathered:
                if kind == GATHERED and self.gathered[hid] == PREFETCHED:
                    self.add(PREFETCHED, -spec.unsharded_bytes())
                    self.add(GATHERED, spec.unsharded_bytes())
                    self.gathered[hid] = GATHERED
                    self.add(COMM, -self.pending_comm.pop(hid, 0))  # prefetch's cast shard
                continue
            self.add(kind, spec.unsharded_bytes())
            self.gathered[hid] = kind
            comm = 0
            if self.units[u].policy.offload_params:
                comm += spec.shard_bytes()  # the shard copied to the device
            if spec.precision.low_precision_params:
                comm += spec.sharded_numel * _itemsize(spec.precision.param_dtype)
            if comm:
                self.add(COMM, comm)
                if kind == PREFETCHED and not self.cfg.device_is_cpu:
                    self.pending_comm[hid] = comm  # held by the pending gather until used
                else:  # complete here (on CPU a prefetch too: [Note: On CPU a collective
                    self.add(COMM, -comm)  # completes where it is launched] in flat_param/_policy.py)

    def reshard(self, u: int, only_frozen_besides: Optional[int] = None) -> None:
        for h, spec in enumerate(self.units[u].handles):
            hid = (u, h)
            if only_frozen_besides is not None and h != only_frozen_besides and spec.requires_grad:
                continue
            kind = self.gathered.pop(hid, None)
            if kind is not None:
                self.add(kind, -spec.unsharded_bytes())
                self.add(COMM, -self.pending_comm.pop(hid, 0))

    def prefetch(self, u: int, order: list[int], backward: bool) -> None:
        if u not in order:
            return
        position = order.index(u)
        if position + 1 >= len(order):
            return
        target = order[position + 1]
        if backward and target in self.ran_pre_backward:
            return
        self.unshard(target, PREFETCHED)

    # ------------------------------------------------------------------ gradients
    def wait_reduction(self) -> None:
        if self.inflight is None:
            return
        _, buffers = self.inflight
        self.inflight = None
        for kind, nbytes in buffers:
            self.add(kind, -nbytes)

    def accumulate(self, hid: tuple[int, int], sharded_reduce_bytes: int) -> None:
        """A reduced sharded gradient in reduce_dtype becomes the full-precision sharded grad."""
        spec = self.handle(hid)
        full = spec.sharded_numel * _itemsize(spec.precision.full_dtype)
        offloads = self.units[hid[0]].policy.offload_params
        if sharded_reduce_bytes != full or offloads:
            self.add(GRADS, full, cpu=offloads)
            self.add(GRADS, -sharded_reduce_bytes)
        # (else the reduced tensor itself is kept)

    def on_grad(self, hid: tuple[int, int], key: int, nbytes: int) -> None:
        if self.inflight is not None and self.inflight[0] != hid:
            self.wait_reduction()  # the view hook of the next unit's gradient
        self.held.setdefault(hid, []).append(key)
        self.held_keys.add(key)
        # The gradient was counted as a temporary when the operator made it; it now belongs to
        # the unit's pending reduction.
        size, kind = self.act_sizes.get(key, (nbytes, TEMPS))
        self.act_sizes[key] = (size, UNSHARDED_GRADS)
        self.add(kind, -size)
        self.add(UNSHARDED_GRADS, size)

    def post_backward(self, hid: tuple[int, int]) -> None:
        cfg = self.cfg
        spec = self.handle(hid)
        self.wait_reduction()
        held_bytes = 0
        for key in self.held.pop(hid, []):
            self.held_keys.discard(key)
            size, _ = self.act_sizes.pop(key, (0, ""))
            held_bytes += size
        param_b = _itemsize(spec.precision.param_dtype)
        reduce_b = _itemsize(spec.precision.reduce_dtype)
        sharded_reduce = spec.sharded_numel * reduce_b
        unsharded = spec.padded_unsharded_numel * param_b
        self.add(UNSHARDED_GRADS, unsharded)  # the concatenation
        self.add(UNSHARDED_GRADS, -held_bytes)
        # [Note: Reshard before reducing] in runtime/_hooks.py: freed (and BACKWARD_POST's
        # gather launched) before the reduction.
        self.reshard(hid[0], only_frozen_besides=hid[1])
        if self.units[hid[0]].policy.backward_prefetch is BackwardPrefetch.BACKWARD_POST:
            self.prefetch(hid[0], self.backward_order, backward=True)
        # [Note: One schedule] in flat_param/_policy.py: the rule the post-backward hook runs.
        in_flight = self.units[hid[0]].policy.reduction_stays_in_flight(not cfg.device_is_cpu)
        original = unsharded  # the gradient as autograd made it (param_dtype)
        if reduce_b != param_b:
            # The cast to reduce_dtype: on CPU the original dies with it; on an accelerator it
            # runs on the post-backward stream and the original stays in flight until released
            # ([Note: The reduction's input outlives its readers] in flat_param/_reduction.py).
            self.add(LOW, spec.padded_unsharded_numel * reduce_b)
            if not in_flight:
                self.add(UNSHARDED_GRADS, -unsharded)
            unsharded_kind, unsharded = LOW, spec.padded_unsharded_numel * reduce_b
        else:
            unsharded_kind = UNSHARDED_GRADS
        cast_in_flight = in_flight and unsharded_kind == LOW
        reduced = sharded_reduce if spec.uses_sharding else unsharded  # NO_SHARD: in place
        if spec.uses_sharding:
            self.add(GRADS, sharded_reduce)
        else:
            self.add(GRADS, unsharded)
            self.add(unsharded_kind, -unsharded)
        if in_flight:
            # [Note: A reduction finishes on its stream] in flat_param/_reduction.py: the kept
            # form (cast, offload copy) is made right after the collective; the reduction's input
            # as autograd made it stays alive until released (NO_SHARD: the gradient reduced in
            # place), the reduce_dtype copy is freed on the post-backward stream once issued.
            if spec.uses_sharding:
                if cast_in_flight:
                    self.add(LOW, -unsharded)
                self.accumulate(hid, reduced)
                self.inflight = (hid, [(UNSHARDED_GRADS, original)])
            else:
                full = spec.sharded_numel * _itemsize(spec.precision.full_dtype)
                offloads = self.units[hid[0]].policy.offload_params
                kept_apart = reduced != full or offloads
                if kept_apart:
                    self.add(GRADS, full, cpu=offloads)
                if cast_in_flight:
                    if kept_apart:
                        self.add(GRADS, -reduced)
                    self.inflight = (hid, [(UNSHARDED_GRADS, original)])
                else:
                    self.inflight = (hid, [(GRADS, reduced)] if kept_apart else [])
        else:
            if spec.uses_sharding:
                self.add(unsharded_kind, -unsharded)
            self.accumulate(hid, reduced)

    # ------------------------------------------------------------------ the stream
    def run(self) -> ReplayResult:
        cfg = self.cfg
        # Per unit where its policy keeps it ([Note: Fractional offload]); the optimizer's state
        # and temporaries split as the shards do (its state is allocated like each parameter).
        host = sum(h.shard_bytes() for u in self.units if u.policy.offload_params for h in u.handles)
        shards = sum(h.shard_bytes() for u in self.units for h in u.handles)
        if host:
            self.add(SHARDED_PARAMS, host, cpu=True)
        self.add(SHARDED_PARAMS, shards - host)
        self.add(BUFFERS, cfg.static_bytes)
        self.add(WORKSPACES, cfg.workspace_bytes)
        self.host_share = host / shards if shards else float(cfg.offload_params)
        self.add_split(OPTIM_STATE, cfg.optim_state_bytes)
        self.add(INPUTS, self.trace.input_bytes)
        for event in self.trace.events:
            kind = event[0]
            if kind == "alloc":
                category = SAVED if self.phase == "forward" else TEMPS
                self.act_sizes[event[1]] = (event[2], category)
                self.add(category, event[2])
            elif kind == "free":
                if event[1] in self.held_keys:
                    continue  # a parameter gradient: freed by the reduction
                size, category = self.act_sizes.pop(event[1], (0, SAVED))
                if size:
                    self.add(category, -size)
            elif kind == "fwd_pre":
                u = event[1]
                self.unshard(u, GATHERED)
                if self.phase == "forward" and self.units[u].policy.forward_prefetch:
                    self.prefetch(u, self.forward_order, backward=False)
                self.log_hook(kind, u)
            elif kind == "fwd_post":
                u = event[1]
                if self.phase == "forward" and self.units[u].frees_after_forward() and u != self.kept_unit:
                    self.reshard(u)
                self.log_hook(kind, u)
            elif kind == "bwd_pre":
                u = event[1]
                first = u not in self.ran_pre_backward
                self.ran_pre_backward.add(u)
                self.unshard(u, GATHERED)
                if self.units[u].policy.backward_prefetch is BackwardPrefetch.BACKWARD_PRE:
                    self.prefetch(u, self.backward_order, backward=True)
                if first:
                    self.log_hook(kind, u)
            elif kind == "grad":
                self.on_grad((event[1], event[2]), event[3], event[4])
            elif kind == "bwd_post":
                self.post_backward((event[1], event[2]))
                self.log_hook(kind, event[1])
            elif kind == "phase":
                self.phase = event[1]
        # Final callback: finish the reduction in flight, free what is still gathered.
        self.wait_reduction()
        for u in range(len(self.units)):
            self.reshard(u)
        self.phase = "optimizer step"
        self.add_split(OPTIM_TEMP, cfg.optim_temp_bytes)
        self.add_split(OPTIM_TEMP, -cfg.optim_temp_bytes)
        return self.result


def replay(units: list[UnitSpec], trace: Trace, cfg: ScheduleConfig) -> ReplayResult:
    """Replays one steady-state step (see [Note: Schedule replay])."""
    return _Replay(units, trace, cfg).run()
