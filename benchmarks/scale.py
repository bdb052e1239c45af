"""Scale on one GPU: play rank ``r`` of ``N`` on torch's fake process group, with every collective
given the time it would take on a real fabric.

No machine here has two GPUs, and our users train on 8 to 512. torch ships a process group that
moves no data (``torch.testing._internal.distributed.fake_pg``, backend ``"fake"``): on it one
process holds exactly one rank's share of an ``N``-rank run (its shards, its gathered units, its
activations) and fsdp, torch FSDP1 and torch FSDP2 all train unchanged (on garbage values: the
collectives hallucinate). This module adds time to those collectives and measures what a rank
feels::

    python -m benchmarks.scale --device cuda --model llama-1b --world-size 8 --fabric nvlink
    python -m benchmarks.scale --device cuda --model llama-8b --world-size 64 --fabric ib \\
        --strategies FULL_SHARD,HYBRID_SHARD --json out.json
    python -m benchmarks.scale --cpu-dry-run        # the tooling on CPU (CI): memory, no timing

[Note: Emulated collectives]
:class:`EmulatedFabric` wraps the ``torch.distributed`` collectives that fsdp, torch FSDP1 and
torch FSDP2 issue (the all-gather, reduce-scatter and all-reduce in their tensor, base, single and
list forms). After the fake collective returns, it queues ``torch.cuda._sleep`` on the stream the
collective was issued on (the current stream at the call, which is the stream each implementation
orders its collective on), for::

    time = factor * bytes / bus_bandwidth + latency

with ``bytes`` the collective's whole (unsharded) buffer, ``factor`` = (n-1)/n for an all-gather
or reduce-scatter and 2(n-1)/n for an all-reduce over a group of ``n`` ranks: nccl-tests' bus
bandwidth convention (its doc/PERFORMANCE.md), so a measured NCCL bus bandwidth plugs in as it
is. A group whose ranks lie in one node (``--ranks-per-node``, 8) moves at the intra-node bus
bandwidth, any other at the inter-node one. The sleep is ``seconds * cycles_per_second`` GPU
cycles, calibrated against CUDA events once per run. On CPU nothing sleeps: the modelled
seconds are summed per step instead (a deterministic figure the tests compare).

Fabric presets (flags override each number):

- ``nvlink``: one node of H100 SXM. NVLink 4 moves 900 GB/s per GPU, both directions together
  (NVIDIA H100 Tensor Core GPU datasheet), 450 GB/s each way; the bus bandwidth is that line
  rate times ``--efficiency`` (0.8 by default: 360 GB/s, near what nccl-tests reports for
  all-gather and reduce-scatter on 8 H100 SXM), 10 us per collective.
- ``ib``: 400 Gb/s InfiniBand between nodes, one NDR port per GPU (as in a DGX H100: eight
  ConnectX-7 at 400 Gb/s), 50 GB/s each way, times ``--efficiency`` (40 GB/s), 25 us per
  collective; inside a node NVLink as above (HYBRID_SHARD's shard group stays in the node).

What it does not model, and so what a real run adds or saves: NCCL's kernels sharing the SMs
with compute (a real collective slows the matmuls it overlaps; a sleep does not), congestion
between concurrent collectives (two sleeps on two streams overlap perfectly; two collectives on
one fabric share it), the order NCCL imposes within one process group (it runs a group's
collectives one after another on its own stream: a backward prefetch's all-gather and a
reduce-scatter over the same group do not overlap there; here each sleeps on the stream it was
issued on, as do the hybrid strategies' collectives over different groups, which do overlap), stragglers and jitter, latency growing with the ring's length, and the
values (collectives return garbage, so losses are meaningless; the arithmetic takes the same
time).

Reported per implementation and configuration: step seconds with the emulated fabric and with
zero-time collectives, the exposed communication (their difference), the modelled communication
seconds per step, the per-rank max allocated and reserved memory, and fsdp's planner
(:func:`fsdp.estimate_memory`) for the same rank beside it. Targets are issue 30's.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import math
import sys
import time
from typing import Any, Callable, Iterator, Optional, Sequence, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = [
    "Fabric",
    "PRESETS",
    "EmulatedFabric",
    "LlamaConfig",
    "LLAMAS",
    "Llama",
    "ScaleConfig",
    "run_config",
    "main",
]

IMPLS = ("fsdp", "torch_fsdp1", "torch_fsdp2")


# ------------------------------------------------------------------------------ the fabric
@dataclasses.dataclass(frozen=True)
class Fabric:
    """Bus bandwidths (bytes/s, nccl-tests' convention) and per-collective latencies (s)."""

    name: str
    intra_bw: float
    inter_bw: float
    intra_latency_s: float
    inter_latency_s: float
    ranks_per_node: int = 8

    def collective_seconds(self, kind: str, nbytes: int, group_ranks: Sequence[int]) -> float:
        """Seconds of one collective of ``kind`` over ``nbytes`` (the whole buffer) on these ranks."""
        n = len(group_ranks)
        if n <= 1:
            return 0.0
        one_node = len({r // self.ranks_per_node for r in group_ranks}) == 1
        bw, latency = (self.intra_bw, self.intra_latency_s) if one_node else (self.inter_bw, self.inter_latency_s)
        factor = 2.0 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n
        return factor * nbytes / bw + latency


_NVLINK_LINE = 450e9  # NVLink 4, H100 SXM: 900 GB/s both directions
_IB_LINE = 50e9  # 400 Gb/s NDR InfiniBand, one port per GPU


def PRESETS(efficiency: float = 0.8) -> dict[str, Fabric]:  # noqa: N802 (a table, read like one)
    """The fabric presets at ``efficiency`` times their line rates (see the module docstring)."""
    nvlink = Fabric("nvlink", _NVLINK_LINE * efficiency, _NVLINK_LINE * efficiency, 10e-6, 10e-6)
    ib = Fabric("ib", _NVLINK_LINE * efficiency, _IB_LINE * efficiency, 10e-6, 25e-6)
    return {"nvlink": nvlink, "ib": ib}


# The collectives the three implementations issue, by torch.distributed's names (those missing
# from a torch release are skipped) and what they move.
_COLLECTIVES = {
    "all_gather_into_tensor": "all_gather",
    "_all_gather_base": "all_gather",
    "all_gather_single": "all_gather",
    "all_gather": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter": "reduce_scatter",
    "all_reduce": "all_reduce",
}


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _collective_bytes(args: Sequence[Any], kwargs: dict[str, Any]) -> int:
    """The whole buffer of a collective: its largest tensor argument (a list counted whole).

    An all-gather's output and a reduce-scatter's input are the unsharded buffer, the largest
    of its arguments; an all-reduce has one tensor.
    """
    sizes = [_tensor_bytes(v) for v in list(args) + list(kwargs.values())]
    return max(sizes, default=0)


def _group_ranks(kwargs: dict[str, Any], args: Sequence[Any]) -> list[int]:
    group = kwargs.get("group")
    if group is None:
        group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)


class EmulatedFabric:
    """Context manager: the collectives take ``fabric``'s time (see [Note: Emulated collectives]).

    ``enabled`` may be switched inside the context (the same model measured with and without
    the fabric's time). :attr:`modelled_s` sums the modelled seconds of every collective;
    :attr:`calls` counts them by kind.
    """

    def __init__(self, fabric: Fabric, device: torch.device) -> None:
        self.fabric = fabric
        self.device = device
        self.enabled = True
        self.modelled_s = 0.0
        self.calls: dict[str, int] = {}
        self._originals: dict[str, Any] = {}
        self._cycles_per_s = calibrate_sleep() if device.type == "cuda" else 0.0

    def reset(self) -> None:
        self.modelled_s = 0.0
        self.calls = {}

    def _patched(self, original: Callable[..., Any], kind: str) -> Callable[..., Any]:
        def collective(*args: Any, **kwargs: Any) -> Any:
            work = original(*args, **kwargs)
            seconds = self.fabric.collective_seconds(kind, _collective_bytes(args, kwargs), _group_ranks(kwargs, args))
            self.modelled_s += seconds
            self.calls[kind] = self.calls.get(kind, 0) + 1
            if self.enabled and seconds > 0 and self._cycles_per_s > 0:
                torch.cuda._sleep(max(1, int(seconds * self._cycles_per_s)))  # on the issuing stream
            return work

        return collective

    def __enter__(self) -> "EmulatedFabric":
        for name, kind in _COLLECTIVES.items():
            original = getattr(dist, name, None)
            if original is not None:
                self._originals[name] = original
                setattr(dist, name, self._patched(original, kind))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals.clear()


def calibrate_sleep(cycles: int = 200_000_000) -> float:
    """GPU cycles per second of ``torch.cuda._sleep`` on the current device (timed by events)."""
    torch.cuda._sleep(1000)  # warm the kernel
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) / 1e3)


# ------------------------------------------------------------------------------ the model
@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """A Llama-shaped decoder: RMSNorm, grouped-query attention, SwiGLU, untied head.

    Rotary embeddings are left out (elementwise, no parameters: they move no bytes between
    ranks and cost little next to the matmuls).
    """

    d_model: int
    layers: int
    heads: int
    kv_heads: int
    ff: int
    vocab: int

    def params(self) -> int:
        """Parameters of the whole model."""
        head_dim = self.d_model // self.heads
        attn = 2 * self.d_model * self.d_model + 2 * self.d_model * self.kv_heads * head_dim
        block = attn + 3 * self.d_model * self.ff + 2 * self.d_model
        return self.layers * block + 2 * self.vocab * self.d_model + self.d_model


#: Llama 3.2 1B's and Llama 3 8B's shapes (the 1B's head untied: 1.50e9 parameters), and a tiny
#: one for the CPU run.
LLAMAS = {
    "llama-1b": LlamaConfig(d_model=2048, layers=16, heads=32, kv_heads=8, ff=8192, vocab=128256),
    "llama-8b": LlamaConfig(d_model=4096, layers=32, heads=32, kv_heads=8, ff=14336, vocab=128256),
    "tiny": LlamaConfig(d_model=64, layers=4, heads=4, kv_heads=2, ff=160, vocab=256),
}


class LlamaBlock(nn.Module):
    """One decoder layer; ``checkpoint``: its forward under ``torch.utils.checkpoint`` (non-reentrant)."""

    def __init__(self, cfg: LlamaConfig, checkpoint: bool = False) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.d_model // cfg.heads
        self.checkpoint = checkpoint
        self.attn_norm = nn.RMSNorm(cfg.d_model)
        self.wq = nn.Linear(cfg.d_model, cfg.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.heads * self.head_dim, cfg.d_model, bias=False)
        self.mlp_norm = nn.RMSNorm(cfg.d_model)
        self.w1 = nn.Linear(cfg.d_model, cfg.ff, bias=False)
        self.w3 = nn.Linear(cfg.d_model, cfg.ff, bias=False)
        self.w2 = nn.Linear(cfg.ff, cfg.d_model, bias=False)

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))

    def _layer(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self._attention(self.attn_norm(x))
        m = self.mlp_norm(h)
        return h + self.w2(F.silu(self.w1(m)) * self.w3(m))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint:
            return cast(torch.Tensor, torch.utils.checkpoint.checkpoint(self._layer, x, use_reentrant=False))
        return self._layer(x)


class Llama(nn.Module):
    """Embedding, ``layers`` :class:`LlamaBlock`, RMSNorm, head."""

    def __init__(self, cfg: LlamaConfig, checkpoint: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.layers = nn.ModuleList(LlamaBlock(cfg, checkpoint) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


# ------------------------------------------------------------------------------ one configuration
@dataclasses.dataclass(frozen=True)
class ScaleConfig:
    """One measured configuration (every implementation runs it)."""

    model: str = "llama-1b"
    world_size: int = 8
    rank: int = 0
    strategy: str = "FULL_SHARD"
    forward_prefetch: bool = False
    checkpoint: bool = False
    batch: int = 4
    seq: int = 2048
    fabric: str = "nvlink"

    def label(self) -> str:
        return (
            f"{self.model} N={self.world_size} {self.fabric} {self.strategy}"
            f"{' fwd-prefetch' if self.forward_prefetch else ''}{' AC' if self.checkpoint else ''}"
            f" {self.batch}x{self.seq}"
        )


def _mesh(cfg: ScaleConfig, device: torch.device, ranks_per_node: int) -> Any:
    """HYBRID: a (replicate, shard) mesh with the node as the shard group; else a 1-D mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    if "HYBRID" in cfg.strategy:
        shard = min(ranks_per_node, cfg.world_size)
        return init_device_mesh(device.type, (cfg.world_size // shard, shard), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device.type, (cfg.world_size,))


def _init_local(model: nn.Module) -> None:
    """Finite values in every local parameter (the materialized memory is uninitialized)."""
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.normal_(0.0, 0.02)


def _wrap(impl: str, cfg: ScaleConfig, device: torch.device, ranks_per_node: int) -> nn.Module:
    """A meta-built :class:`Llama` wrapped by ``impl`` (one unit per block), bf16 parameters and
    fp32 reductions, materialized on ``device``."""
    with torch.device("meta"):
        model = Llama(LLAMAS[cfg.model], checkpoint=cfg.checkpoint)
    mesh = _mesh(cfg, device, ranks_per_node) if "HYBRID" in cfg.strategy else None
    if impl == "torch_fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        kwargs: dict[str, Any] = dict(
            mesh=mesh if mesh is not None else _mesh(cfg, device, ranks_per_node),
            reshard_after_forward=cfg.strategy != "SHARD_GRAD_OP",
            mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        )
        for layer in model.layers:
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
        if cfg.forward_prefetch:
            layers = list(model.layers)
            for layer, nxt in zip(layers, layers[1:]):
                cast(Any, layer).set_modules_to_forward_prefetch([nxt])
        model.to_empty(device=device)
        _init_local(model)
        return model
    if impl == "fsdp":
        import fsdp as api
        from fsdp.wrap import ModuleWrapPolicy
    else:
        import torch.distributed.fsdp as api  # type: ignore[no-redef]
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy  # type: ignore[no-redef,assignment]
    wrapped = api.FullyShardedDataParallel(
        model,
        auto_wrap_policy=ModuleWrapPolicy({LlamaBlock}),
        sharding_strategy=api.ShardingStrategy[cfg.strategy],
        mixed_precision=api.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        backward_prefetch=api.BackwardPrefetch.BACKWARD_PRE,
        forward_prefetch=cfg.forward_prefetch,
        limit_all_gathers=True,
        device_id=device,
        device_mesh=mesh,
        param_init_fn=lambda m: m.to_empty(device=device, recurse=False),
    )
    _init_local(wrapped)
    return wrapped


def _planned_bytes(cfg: ScaleConfig, device: torch.device, ranks_per_node: int) -> Optional[int]:
    """fsdp's planner for this rank: :func:`fsdp.estimate_memory` on the meta model."""
    import fsdp
    from fsdp.wrap import ModuleWrapPolicy

    with torch.device("meta"):
        model = Llama(LLAMAS[cfg.model], checkpoint=cfg.checkpoint)
        tokens = torch.zeros(cfg.batch, cfg.seq, dtype=torch.long)
    estimate = fsdp.estimate_memory(
        model,
        tokens,
        world_size=cfg.world_size,
        intra_node_size=min(ranks_per_node, cfg.world_size) if "HYBRID" in cfg.strategy else None,
        optimizer=torch.optim.AdamW,
        optimizer_kwargs=dict(lr=1e-4),
        # The targets are made inside the planner's trace (it runs on fake tensors).
        loss_fn=lambda logits: _loss(logits, logits.new_zeros(logits.shape[:-1], dtype=torch.long)),
        auto_wrap_policy=ModuleWrapPolicy({LlamaBlock}),
        sharding_strategy=fsdp.ShardingStrategy[cfg.strategy],
        mixed_precision=fsdp.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        forward_prefetch=cfg.forward_prefetch,
        device_id=device,
    )
    return int(estimate.peak_bytes)


def _step(model: nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor) -> None:
    _loss(model(tokens), tokens).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_steps(model: nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor, steps: int, device: torch.device) -> float:
    """Seconds per step over ``steps`` steps (the device synchronized at both ends)."""
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        _step(model, opt, tokens)
    _sync(device)
    return (time.perf_counter() - start) / steps


def run_impl(
    impl: str, cfg: ScaleConfig, fabric: Fabric, device: torch.device, warmup: int, steps: int, rounds: int
) -> dict[str, Any]:
    """One implementation on one configuration: ``rounds`` alternations of ``steps`` timed steps
    with the fabric's time and without it, after ``warmup`` steps; memory over all of them."""
    model = _wrap(impl, cfg, device, fabric.ranks_per_node)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, LLAMAS[cfg.model].vocab, (cfg.batch, cfg.seq), device=device)
    with EmulatedFabric(fabric, device) as emu:
        for _ in range(warmup):
            _step(model, opt, tokens)
        _sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        emu.reset()
        emu.enabled = True
        _timed_steps(model, opt, tokens, 1, device)  # one step of modelled time, counted alone
        modelled_s, calls = emu.modelled_s, dict(emu.calls)
        with_fabric, without = [], []
        for _ in range(rounds):
            emu.enabled = True
            with_fabric.append(_timed_steps(model, opt, tokens, steps, device))
            emu.enabled = False
            without.append(_timed_steps(model, opt, tokens, steps, device))
    row: dict[str, Any] = dict(
        impl=impl,
        step_s=min(with_fabric),
        step_zero_comm_s=min(without),
        exposed_s=min(with_fabric) - min(without),
        modelled_comm_s=modelled_s,
        collectives=calls,
    )
    if device.type == "cuda":
        row["max_allocated"] = torch.cuda.max_memory_allocated(device)
        row["max_reserved"] = torch.cuda.max_memory_reserved(device)
    else:
        row["step_peak_above_start"] = _cpu_step_peak(model, opt, tokens)
    del model, opt, tokens
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def _cpu_step_peak(model: nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor) -> int:
    """CPU: the peak live bytes one step allocates above what is alive before it, from the
    profiler's allocation events (:class:`benchmarks.memory.MemoryTrace`; torch keeps no
    allocator statistics on CPU)."""
    from benchmarks.memory import MemoryTrace

    with MemoryTrace() as trace:
        with trace.window("step"):
            _step(model, opt, tokens)
    return int(trace.peaks.get("step", 0))


@contextlib.contextmanager
def fake_world(world_size: int, rank: int) -> Iterator[None]:
    """This process as rank ``rank`` of ``world_size`` on torch's fake process group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def run_config(
    cfg: ScaleConfig,
    fabric: Fabric,
    device: torch.device,
    impls: Sequence[str] = IMPLS,
    warmup: int = 2,
    steps: int = 3,
    rounds: int = 2,
    plan: bool = True,
) -> dict[str, Any]:
    """Every implementation in ``impls`` on ``cfg``; the planner's estimate for fsdp beside."""
    result: dict[str, Any] = dict(config=dataclasses.asdict(cfg), label=cfg.label(), rows=[])
    with fake_world(cfg.world_size, cfg.rank):
        for impl in impls:
            if impl == "torch_fsdp2" and cfg.strategy == "NO_SHARD":
                continue
            print(f"[scale] {cfg.label()}: {impl} ...", file=sys.stderr, flush=True)
            result["rows"].append(run_impl(impl, cfg, fabric, device, warmup, steps, rounds))
        if plan:
            result["planned_bytes"] = _planned_bytes(cfg, device, fabric.ranks_per_node)
    return result


# ------------------------------------------------------------------------------ report
def _row(result: dict[str, Any], impl: str) -> Optional[dict[str, Any]]:
    return next((r for r in result["rows"] if r["impl"] == impl), None)


def _target(name: str, value: Optional[float], limit: float) -> dict[str, Any]:
    status = "n/a" if value is None else ("met" if value <= limit else "NOT met")
    return dict(target=name, ratio=value, status=status)


def targets(result: dict[str, Any], timed: bool) -> list[dict[str, Any]]:
    """Issue 30's targets for one configuration (ratios of fsdp's figures to torch's)."""
    ours, fsdp1, fsdp2 = (_row(result, i) for i in IMPLS)
    out: list[dict[str, Any]] = []
    label = result["label"]

    def ratio(key: str, other: Optional[dict[str, Any]]) -> Optional[float]:
        if ours is None or other is None or key not in ours or not other.get(key):
            return None
        return float(ours[key]) / float(other[key])

    # The communication the rank issues, priced by the same fabric: at most torch FSDP1's.
    out.append(_target(f"{label}: modelled comm seconds <= torch FSDP1's", ratio("modelled_comm_s", fsdp1), 1.0))
    if timed:
        out.append(_target(f"{label}: exposed comm <= torch FSDP2's", ratio("exposed_s", fsdp2), 1.0))
        out.append(_target(f"{label}: exposed comm <= 0.5x torch FSDP1's", ratio("exposed_s", fsdp1), 0.5))
        cfg = result["config"]
        if cfg["fabric"] == "ib" and cfg["world_size"] >= 64 and cfg["strategy"] == "FULL_SHARD" and not cfg["forward_prefetch"]:
            out.append(_target(f"{label}: step <= torch FSDP2's", ratio("step_s", fsdp2), 1.0))
            out.append(_target(f"{label}: step <= 0.9x torch FSDP1's", ratio("step_s", fsdp1), 0.9))
        lowest = [r["max_allocated"] for r in (fsdp1, fsdp2) if r is not None and "max_allocated" in r]
        if ours is not None and "max_allocated" in ours and lowest:
            out.append(_target(f"{label}: max allocated <= min(torch FSDP1, FSDP2)", ours["max_allocated"] / min(lowest), 1.0))
        planned = result.get("planned_bytes")
        if planned and ours is not None and "max_allocated" in ours and result["config"]["world_size"] >= 64:
            error = abs(planned - ours["max_allocated"]) / ours["max_allocated"]
            out.append(dict(target=f"{label}: planner within 5% of measured", value=error,
                            status="met" if error <= 0.05 else "NOT met"))
    return out


def _format(result: dict[str, Any], timed: bool) -> str:
    lines = [f"== {result['label']}"]
    memory = "alloc_MiB  resv_MiB" if timed else "step peak above start, MiB"
    lines.append(f"  {'impl':<12} {'step_s':>8} {'zero_s':>8} {'exposed':>8} {'model_s':>8}  {memory}")
    for r in result["rows"]:
        if timed:
            mem = f"{r['max_allocated'] / 2**20:9.1f} {r['max_reserved'] / 2**20:9.1f}"
        else:
            mem = f"{r['step_peak_above_start'] / 2**20:9.2f}"
        timing = (
            f"{r['step_s']:8.4f} {r['step_zero_comm_s']:8.4f} {r['exposed_s']:8.4f}"
            if timed
            else f"{'-':>8} {'-':>8} {'-':>8}"
        )
        lines.append(f"  {r['impl']:<12} {timing} {r['modelled_comm_s']:8.4f}  {mem}")
    if result.get("planned_bytes"):
        lines.append(f"  fsdp's planner for this rank: peak {result['planned_bytes'] / 2**20:.1f} MiB")
    return "\n".join(lines)


NOT_MODELLED = (
    "not modelled: NCCL kernels sharing SMs with compute, congestion between concurrent collectives, "
    "one process group's collectives running one after another on NCCL's stream (here each sleeps on "
    "the stream it was issued on), stragglers and jitter, latency growing with the ring; values are "
    "garbage (fake collectives)"
)


def default_configs(device: torch.device) -> list[ScaleConfig]:
    """The prepared GPU run's set (about 3 minutes on an H100), or the CPU run's tiny one."""
    if device.type != "cuda":
        return [
            ScaleConfig(model="tiny", world_size=8, strategy="FULL_SHARD", batch=2, seq=32, fabric="nvlink"),
            ScaleConfig(model="tiny", world_size=64, strategy="HYBRID_SHARD", batch=2, seq=32, fabric="ib"),
            ScaleConfig(model="tiny", world_size=64, strategy="SHARD_GRAD_OP", checkpoint=True, batch=2, seq=32, fabric="ib"),
        ]
    return [
        ScaleConfig(model="llama-1b", world_size=8, strategy="FULL_SHARD", fabric="nvlink"),
        ScaleConfig(model="llama-1b", world_size=64, strategy="FULL_SHARD", fabric="ib"),
        ScaleConfig(model="llama-1b", world_size=64, strategy="HYBRID_SHARD", fabric="ib"),
        ScaleConfig(model="llama-8b", world_size=64, strategy="FULL_SHARD", batch=2, fabric="ib"),
    ]


def _parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (timed) or cpu (memory and modelled time only)")
    p.add_argument("--cpu-dry-run", action="store_true", help="the CPU tooling run: --device cpu, tiny model")
    p.add_argument("--model", default=None, choices=sorted(LLAMAS), help="one model (default: the prepared set)")
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--rank", type=int, default=0, help="the rank this process plays")
    p.add_argument("--strategies", default="FULL_SHARD", help="comma-separated ShardingStrategy names")
    p.add_argument("--forward-prefetch", default="off", choices=("off", "on", "both"))
    p.add_argument("--checkpoint", default="off", choices=("off", "on", "both"), help="activation checkpointing")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--fabric", default="nvlink", choices=("nvlink", "ib"))
    p.add_argument("--efficiency", type=float, default=0.8, help="bus bandwidth / line rate")
    p.add_argument("--intra-gbps", type=float, default=None, help="intra-node bus bandwidth, GB/s")
    p.add_argument("--inter-gbps", type=float, default=None, help="inter-node bus bandwidth, GB/s")
    p.add_argument("--latency-us", type=float, default=None, help="per-collective latency (both), us")
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--no-plan", action="store_true", help="skip fsdp's planner estimate")
    p.add_argument("--time-budget", type=float, default=None, help="seconds; no configuration starts after")
    p.add_argument("--trace", default=None, help="folder: a torch.profiler trace of one fsdp step per config")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def _fabric(a: argparse.Namespace, name: str) -> Fabric:
    fabric = PRESETS(a.efficiency)[name]
    changes: dict[str, Any] = dict(ranks_per_node=a.ranks_per_node)
    if a.intra_gbps is not None:
        changes["intra_bw"] = a.intra_gbps * 1e9
    if a.inter_gbps is not None:
        changes["inter_bw"] = a.inter_gbps * 1e9
    if a.latency_us is not None:
        changes["intra_latency_s"] = changes["inter_latency_s"] = a.latency_us * 1e-6
    return dataclasses.replace(fabric, **changes)


def _configs(a: argparse.Namespace, device: torch.device) -> list[ScaleConfig]:
    if a.model is None:
        return default_configs(device)
    flags = {"off": [False], "on": [True], "both": [False, True]}
    return [
        ScaleConfig(model=a.model, world_size=a.world_size, rank=a.rank, strategy=s.strip(), forward_prefetch=fp,
                    checkpoint=ac, batch=a.batch, seq=a.seq, fabric=a.fabric)
        for s in a.strategies.split(",") if s.strip()
        for fp in flags[a.forward_prefetch]
        for ac in flags[a.checkpoint]
    ]


def _trace_one_step(cfg: ScaleConfig, fabric: Fabric, device: torch.device, folder: str) -> str:
    """A ``torch.profiler`` trace of one fsdp step with the fabric's time (chrome trace JSON)."""
    import os

    from torch.profiler import ProfilerActivity, profile

    os.makedirs(folder, exist_ok=True)
    with fake_world(cfg.world_size, cfg.rank):
        model = _wrap("fsdp", cfg, device, fabric.ranks_per_node)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        tokens = torch.randint(0, LLAMAS[cfg.model].vocab, (cfg.batch, cfg.seq), device=device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with EmulatedFabric(fabric, device):
            _step(model, opt, tokens)
            _sync(device)
            with profile(activities=activities) as prof:
                _step(model, opt, tokens)
                _sync(device)
    path = os.path.join(folder, cfg.label().replace(" ", "_").replace("=", "") + ".json")
    prof.export_chrome_trace(path)
    return path


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = _parse(argv)
    if a.cpu_dry_run:
        a.device = "cpu"
    device = torch.device(a.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    timed = device.type == "cuda"
    impls = [i.strip() for i in a.impls.split(",") if i.strip()]
    deadline = time.monotonic() + a.time_budget if a.time_budget else math.inf
    report: dict[str, Any] = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        env=dict(torch=torch.__version__, device=torch.cuda.get_device_name(0) if timed else "cpu"),
        not_modelled=NOT_MODELLED,
        timed=timed,
        results=[],
        targets=[],
    )
    print(f"benchmarks.scale: rank r of N on torch's fake process group; {NOT_MODELLED}", file=sys.stderr)
    for cfg in _configs(a, device):
        if time.monotonic() > deadline:
            print(f"[scale] time budget spent: {cfg.label()} not run", file=sys.stderr)
            break
        fabric = _fabric(a, cfg.fabric)
        result = run_config(cfg, fabric, device, impls, a.warmup, a.steps, a.rounds, plan=not a.no_plan)
        result["fabric"] = dataclasses.asdict(fabric)
        if a.trace:
            result["trace"] = _trace_one_step(cfg, fabric, device, a.trace)
        report["results"].append(result)
        report["targets"].extend(targets(result, timed))
        print(_format(result, timed), flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(report, f, indent=1)
    print("targets:")
    for t in report["targets"]:
        value = t.get("ratio", t.get("value"))
        print(f"  {t['target']:<80} {'n/a' if value is None else f'{value:.3f}'}  {t['status']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
