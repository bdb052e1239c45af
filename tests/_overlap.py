"""Overlap on one GPU: fsdp as rank 0 of N on torch's fake process group, with slept compute and
slept collectives (issue 30, part 2; run by tests/test_cuda_lane.py on a GPU and by
tests/test_streams.py on CPU).

One process plays rank 0 of 8 (``benchmarks.scale.fake_world``); every collective fsdp issues
queues a ``torch.cuda._sleep`` on the stream it was issued on, of its bytes at a bus bandwidth
chosen so that one unit's collective takes ``COMM_S`` (``benchmarks.scale.EmulatedFabric``), and
each block's forward and backward queue a sleep of ``COMPUTE_S`` on the compute stream. So the
GPU spends known times on known streams, and CUDA events on the compute stream measure whether
they overlap: a schedule that serializes them takes the sum, one that overlaps them about the
max. Values are garbage (the fake group moves no data); only time and memory are measured.

Scenarios (``python -m tests._overlap --device cuda|cpu``, JSON on stdout):

- ``forward``: FULL_SHARD, no forward prefetch: each unit's all-gather against the previous
  unit's forward compute ([Note: Stream edges] in fsdp/flat_param/_streams.py, edge 1); also the
  memory of the run-ahead: max allocated and reserved above the step's start, with
  ``limit_all_gathers`` on and off ([Note: Prefetch] in fsdp/runtime/_prefetch.py).
- ``backward``: SHARD_GRAD_OP (no backward gathers): each unit's reduce-scatter against the next
  unit's backward compute (edge 5).
- ``hybrid``: _HYBRID_SHARD_ZERO2 over 2 nodes of 4, short compute: each unit's all-reduce across
  nodes against the next unit's reduce-scatter ([Note: The all-reduce across replicas runs on its
  own stream] in fsdp/flat_param/_reduction.py).

Each scenario overlaps collectives only with compute or with collectives of another process
group: NCCL runs one group's collectives one after another on its own stream, which a sleep on
the issuing stream does not model (``benchmarks/scale.py``'s list of what it does not model).

On CPU nothing sleeps and nothing is timed: the same scenarios run on the fake group and report
the collectives fsdp issued (kind, group size, bytes, modelled seconds, in order), which the CPU
test checks against the schedule.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Optional, Sequence

import torch
from torch import nn

from benchmarks.scale import EmulatedFabric, Fabric, calibrate_sleep, fake_world

WORLD_SIZE = 8
RANKS_PER_NODE = 4  # hybrid: 2 nodes of 4 (the shard group a node, the replicate group 2 ranks)
BLOCKS = 6
# One block: DIM x DIM fp32 = 16 MiB unsharded, above the caching allocator's 10 MiB, so each
# gathered buffer is a segment of its own (rounded to 2 MiB: exactly 16 MiB) and reserved
# memory counts gathered buffers one by one.
DIM = 2048
CPU_DIM = 64  # the CPU run checks the schedule only: small blocks keep it quick
BATCH = 8
COMPUTE_S = 0.02
COMM_S = 0.02
SHORT_COMPUTE_S = 0.002


class _SleepInBackward(torch.autograd.Function):
    """Identity whose backward queues a sleep on the stream backward runs on (the compute one)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cycles: int) -> torch.Tensor:
        ctx.cycles = cycles
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if ctx.cycles:
            torch.cuda._sleep(ctx.cycles)
        return grad, None


class SleepBlock(nn.Module):
    """A linear layer whose forward and backward each queue a sleep of known length."""

    def __init__(self, dim: int, forward_cycles: int, backward_cycles: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim, bias=False)
        self.forward_cycles, self.backward_cycles = forward_cycles, backward_cycles

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.forward_cycles:
            torch.cuda._sleep(self.forward_cycles)
        return self.linear(_SleepInBackward.apply(x, self.backward_cycles))


class SleepModel(nn.Module):
    def __init__(self, dim: int, forward_cycles: int, backward_cycles: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(WORLD_SIZE))  # the root's own (tiny) unit
        self.blocks = nn.ModuleList(SleepBlock(dim, forward_cycles, backward_cycles) for _ in range(BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * self.scale.sum()
        for block in self.blocks:
            x = block(x)
        return x


def _fabric(hybrid: bool, dim: int) -> Fabric:
    """A fabric on which one block's all-gather, reduce-scatter and (hybrid) all-reduce each take
    ``COMM_S`` (latency 0: the root's tiny unit costs next to nothing)."""
    unsharded = dim * dim * 4
    if not hybrid:
        # An all-gather or reduce-scatter over N ranks moves (N-1)/N of the unsharded bytes.
        bw = (WORLD_SIZE - 1) / WORLD_SIZE * unsharded / COMM_S
        return Fabric("lane", bw, bw, 0.0, 0.0, ranks_per_node=WORLD_SIZE)
    # The reduce-scatter inside a node of 4; the all-reduce of the shard (1/4) across 2 nodes,
    # 2(n-1)/n = 1 times its bytes.
    intra = (RANKS_PER_NODE - 1) / RANKS_PER_NODE * unsharded / COMM_S
    inter = (unsharded / RANKS_PER_NODE) / COMM_S
    return Fabric("lane", intra, inter, 0.0, 0.0, ranks_per_node=RANKS_PER_NODE)


def _wrap(model: nn.Module, strategy: str, device: torch.device, limit: bool) -> nn.Module:
    import fsdp
    from fsdp.wrap import ModuleWrapPolicy

    mesh = None
    if "HYBRID" in strategy:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (WORLD_SIZE // RANKS_PER_NODE, RANKS_PER_NODE))
    return fsdp.FullyShardedDataParallel(
        model,
        auto_wrap_policy=ModuleWrapPolicy({SleepBlock}),
        sharding_strategy=fsdp.ShardingStrategy[strategy],
        forward_prefetch=False,
        limit_all_gathers=limit,
        device_id=device if device.type == "cuda" else None,
        device_mesh=mesh,
    )


def _event(device: torch.device) -> Optional[Any]:
    if device.type != "cuda":
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _seconds(start: Optional[Any], end: Optional[Any]) -> Optional[float]:
    if start is None or end is None:
        return None
    end.synchronize()
    return float(start.elapsed_time(end)) / 1e3


SCENARIOS = {
    # name: (strategy, forward compute s, backward compute s)
    "forward": ("FULL_SHARD", COMPUTE_S, 0.0),
    "backward": ("SHARD_GRAD_OP", SHORT_COMPUTE_S, COMPUTE_S),
    "hybrid": ("_HYBRID_SHARD_ZERO2", SHORT_COMPUTE_S, SHORT_COMPUTE_S),
}


def run_scenario(name: str, device: torch.device, cycles_per_s: float, limit: bool = True) -> dict[str, Any]:
    """Two steps (the first records the order); the second is measured: forward and backward
    seconds (CUDA events on the compute stream), memory above its start, its collectives."""
    strategy, forward_s, backward_s = SCENARIOS[name]
    dim = DIM if device.type == "cuda" else CPU_DIM
    model = SleepModel(dim, int(forward_s * cycles_per_s), int(backward_s * cycles_per_s)).to(device)
    wrapped = _wrap(model, strategy, device, limit)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.0)
    x = torch.zeros(BATCH, dim, device=device)
    result: dict[str, Any] = dict(scenario=name, strategy=strategy, limit_all_gathers=limit)
    with EmulatedFabric(_fabric("HYBRID" in strategy, dim), device) as fabric:
        calls: list[tuple[str, int]] = []
        for step in range(2):
            if step == 1:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                    result["allocated_at_start"] = torch.cuda.memory_allocated()
                    result["reserved_at_start"] = torch.cuda.memory_reserved()
                fabric.reset()
                calls = _trace_collectives(fabric)
            start = _event(device)
            loss = wrapped(x).float().sum()
            middle = _event(device)
            if step == 1 and device.type == "cuda":
                # Every allocation of the forward has been made once the host returns from it.
                result["forward_max_allocated"] = torch.cuda.max_memory_allocated()
                result["forward_max_reserved"] = torch.cuda.max_memory_reserved()
            loss.backward()
            end = _event(device)
            if step == 1:
                result["forward_s"] = _seconds(start, middle)
                result["backward_s"] = _seconds(middle, end)
                if device.type == "cuda":
                    result["max_allocated"] = torch.cuda.max_memory_allocated()
                    result["max_reserved"] = torch.cuda.max_memory_reserved()
            opt.step()
            opt.zero_grad()
        result["modelled_s"] = fabric.modelled_s
        result["collectives"] = calls
    result["unit_bytes"] = dim * dim * 4
    result["compute_s"] = dict(forward=forward_s, backward=backward_s)
    result["comm_s"] = COMM_S
    result["blocks"] = BLOCKS
    return result


def _trace_collectives(fabric: EmulatedFabric) -> list[tuple[str, int]]:
    """Records (kind, group size) of each collective the fabric prices, in issue order."""
    calls: list[tuple[str, int]] = []
    original = fabric.fabric.collective_seconds

    def traced(kind: str, nbytes: int, group_ranks: Sequence[int]) -> float:
        calls.append((kind, len(group_ranks)))
        return original(kind, nbytes, group_ranks)

    fabric.fabric = _Traced(fabric.fabric, traced)  # type: ignore[assignment]
    return calls


class _Traced:
    """The fabric, with its pricing function traced."""

    def __init__(self, fabric: Fabric, traced: Any) -> None:
        self._fabric, self.collective_seconds = fabric, traced

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fabric, name)


def run_in_subprocess(device: str) -> dict[str, Any]:
    """Every scenario in a fresh interpreter (it becomes rank 0 of 8 on torch's fake group, which
    needs the default process group to itself); the JSON :func:`main` prints."""
    import os
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-m", "tests._overlap", "--device", device],
        cwd=root, env={**os.environ, "PYTHONPATH": root}, capture_output=True, text=True, timeout=600, check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc: dict[str, Any] = json.loads(proc.stdout)
    return doc


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    args = parser.parse_args(argv)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cycles_per_s = calibrate_sleep() if device.type == "cuda" else 0.0
    results = []
    with fake_world(WORLD_SIZE, 0):
        for name in args.scenarios.split(","):
            results.append(run_scenario(name, device, cycles_per_s))
            if name == "forward":  # the run-ahead without the limiter, for the memory bound
                results.append(run_scenario(name, device, cycles_per_s, limit=False))
    json.dump(dict(device=args.device, cycles_per_s=cycles_per_s, results=results), sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
