"""What is alive at the CPU training peak: ``python -m benchmarks.peak_live [benchmark flags]``.

The CPU benchmark's memory phase (:mod:`benchmarks.cpu`) reports one number per implementation,
the largest live-bytes total of its measured steps. This tool runs the same phase (the same
model, wrapping, warm-up and measured steps, measured by the same :class:`MemoryTrace`) with the
profiler's Python stacks kept, and names what that number is made of:

* the moment of the peak: the step, its phase (forward, backward, optimizer) and the unit whose
  forward or backward runs (markers this tool places: a record_function around each block's
  forward and a zero-length one when a block's output gradient arrives, i.e. its backward begins);
  (an FSDP pre-backward hook, on the same output gradient, runs before this tool's marker: what
  block k's pre-backward allocates, its prefetch of block k - 1 included, reads as block k + 1);
* the live set there, rebuilt from the allocator's ``[memory]`` events (address, bytes): every
  block the rank's main thread allocated and had not freed, each named by its size, the op and
  the innermost FSDP / optimizer / autograd Python frame around its allocation, and when
  (which step, phase and unit) it was allocated.

[Note: Reading the live set from main-thread events]
The profiler reports allocations and frees made on the profiled (main) thread only; ``Total
Allocated`` counts every thread ([Note: Frees on other threads] in ``memory.py``). So at each
main-thread event ``k``, ``off_k = (total_k - total_(k-1)) - bytes_k`` is the net change other
threads (gloo's) made since the previous event. A block the main thread allocated and gloo's
thread freed (the last reference dropped by a work object) has no free event: the tool frees it
at the first off-thread decrease of exactly its size after it was allocated (among such blocks
of one size, the oldest first), or, failing that, when its address is handed out again. What
other threads allocated and still hold at the peak (gloo's staging copies) is the remainder:
``peak - sum(live set)``, reported as ``off-thread``. The report says how many blocks were
matched each way, so a reader can judge the reconstruction.

Run as ``python -m benchmarks.peak_live --only fsdp,torch_fsdp1 --no-checkpoint``; ``--json``
writes every rank's live sets. It is an analysis tool: slower than the benchmark (Python stacks
are recorded) and it measures nothing the benchmark does not.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import dataclasses
import gc
import json
import os
import sys
import warnings
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from benchmarks.config import BenchConfig, parse_args
from benchmarks.core import blocks, loss_fn, make_optimizer
from benchmarks.cpu import _batches, _wrapped
from benchmarks.local_ranks import run_local_ranks, write_rank_result
from benchmarks.memory import MemoryTrace

__all__ = ["Block", "LiveSet", "live_set_at_peak", "live_set_of_window", "main"]

_MARK = "peak_live:"
# Python frames worth naming an allocation by (the innermost one wins).
_FRAME_KEYS = ("fsdp/", "distributed/fsdp/", "torch/optim/", "torch/autograd/", "torch/nn/modules/")


@dataclasses.dataclass
class Block:
    """One allocation of the main thread: where and when it was made, and when it died."""

    addr: int
    nbytes: int
    ts: float
    op: str  # the innermost op around the allocation
    frame: str  # the innermost FSDP / optimizer / module Python frames around it (innermost first)
    phase: str  # the step, phase and unit (this tool's markers) when it was allocated
    freed_ts: Optional[float] = None
    freed_by: str = ""  # "main", "off-thread" (matched to an off-thread decrease), "reuse"


@dataclasses.dataclass
class LiveSet:
    """The live set at the peak of a window (see [Note: Reading the live set from main-thread events])."""

    peak: int
    peak_ts: float
    phase: str
    blocks: list[Block]
    off_thread: int
    matched_off_thread: int
    matched_reuse: int
    peak_event: str
    by_phase: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """The live set, grouped by (allocated in, frame, op, size), largest groups first; each
        block of at least 1 MiB also alone, with its times relative to the peak (microseconds)."""
        groups: dict[tuple[str, str, str, int], int] = collections.Counter()
        for b in self.blocks:
            groups[(b.phase, b.frame.split(" < ")[0], b.op, b.nbytes)] += 1
        rows = sorted(groups.items(), key=lambda kv: -kv[0][3] * kv[1])
        return {
            "peak": self.peak,
            "phase": self.phase,
            "main_thread_live": sum(b.nbytes for b in self.blocks),
            "off_thread": self.off_thread,
            "matched_off_thread": self.matched_off_thread,
            "matched_reuse": self.matched_reuse,
            "groups": [
                {"count": n, "bytes": key[3], "allocated_in": key[0], "frame": key[1], "op": key[2]}
                for key, n in rows
            ],
            "large": [
                {
                    "bytes": b.nbytes,
                    "allocated_in": b.phase,
                    "at_us": round(b.ts - self.peak_ts),
                    "freed_us": None if b.freed_ts is None else round(b.freed_ts - self.peak_ts),
                    "freed_by": b.freed_by,
                    "op": b.op,
                    "frames": b.frame,
                }
                for b in sorted(self.blocks, key=lambda b: b.ts)
                if b.nbytes >= 1 << 20 and b.phase.split(" ")[0].split(":")[0] == self.phase.split(":")[0]
            ],
            "peak_event": self.peak_event,
            "by_phase": self.by_phase,
        }


class _Enclosing:
    """The innermost op and Python frame around each of the main thread's timestamps, read in
    time order (one sweep: spans on one thread nest)."""

    def __init__(self, events: list[dict[str, Any]], tid: Any) -> None:
        spans = [e for e in events if e.get("ph") == "X" and e.get("tid") == tid]
        spans.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
        self._spans = spans
        self._next = 0
        self._open: list[dict[str, Any]] = []

    def _close_before(self, ts: float) -> None:
        while self._open and self._open[-1]["ts"] + self._open[-1].get("dur", 0) < ts:
            self._open.pop()

    def around(self, ts: float) -> tuple[str, str]:
        """(innermost op, innermost interesting Python frame) around ``ts``; ``ts`` never decreases."""
        spans = self._spans
        while self._next < len(spans) and spans[self._next]["ts"] <= ts:
            self._close_before(spans[self._next]["ts"])
            self._open.append(spans[self._next])
            self._next += 1
        self._close_before(ts)
        op, frames = "", list[str]()
        for e in reversed(self._open):
            name, cat = e["name"], e.get("cat", "")
            if len(frames) < 3 and cat == "python_function" and any(k in name for k in _FRAME_KEYS):
                frames.append(name.split("/")[-1])
            elif not op and cat in ("cpu_op", "user_annotation") and not name.startswith(_MARK):
                op = name
        return op, " < ".join(frames)


_Marks = list[tuple[float, float, str]]


def _phase_marks(events: list[dict[str, Any]]) -> _Marks:
    """This tool's markers in time order: (start, end, name)."""
    return sorted(
        (e["ts"], e["ts"] + e.get("dur", 0), e["name"][len(_MARK):])
        for e in events
        if e.get("name", "").startswith(_MARK)
    )


def _phase_at(ts: float, marks: _Marks) -> str:
    """The step and phase around ``ts`` and the unit: the block whose forward holds it, or in
    backward the block whose output gradient arrived last (its backward runs)."""
    i = bisect.bisect_right(marks, (ts, float("inf"), "")) - 1
    step: Optional[tuple[float, float, str]] = None
    unit = ""
    for start, end, name in reversed(marks[: i + 1]):
        if name.startswith("step"):
            if end >= ts:
                step = (start, end, name)
            break
        if not unit and name.endswith(":forward") and end >= ts:
            unit = name.split(":")[0]
        elif not unit and name.endswith(":backward"):
            unit = name.split(":")[0]
    if step is None:
        return "setup"
    if step[2].endswith(":backward") and not unit:
        unit = "before the first block (loss, root)"
    return f"{step[2]} {unit}".strip()


def _replay(
    memory: list[dict[str, Any]], enclosing: _Enclosing, marks: _Marks
) -> tuple[list[Block], list[tuple[float, int]], list[int]]:
    """Main-thread blocks (freed where the main thread freed them), the off-thread net changes,
    and the live total after each event."""
    live: dict[int, Block] = {}
    every: list[Block] = []
    off: list[tuple[float, int]] = []
    totals: list[int] = []
    previous = memory[0]["args"]["Total Allocated"] - memory[0]["args"]["Bytes"] if memory else 0
    for e in memory:
        args, ts = e["args"], e["ts"]
        addr, nbytes, total = int(args["Addr"]), int(args["Bytes"]), int(args["Total Allocated"])
        if total - previous != nbytes:
            off.append((ts, total - previous - nbytes))
        previous = total
        totals.append(total)
        if nbytes > 0:
            old = live.pop(addr, None)
            if old is not None:
                old.freed_ts, old.freed_by = ts, "reuse"
            op, frame = enclosing.around(ts)
            block = Block(addr, nbytes, ts, op, frame, _phase_at(ts, marks))
            live[addr] = block
            every.append(block)
        elif nbytes < 0:
            block_or_none = live.pop(addr, None)
            if block_or_none is not None:
                block_or_none.freed_ts, block_or_none.freed_by = ts, "main"
    return every, off, totals


def _match_off_thread_frees(every: list[Block], off: list[tuple[float, int]]) -> None:
    """Frees each block the main thread never freed at the first off-thread decrease of its size
    after its allocation (oldest block first; a decrease matches one block)."""
    candidates: dict[int, list[Block]] = collections.defaultdict(list)
    for b in every:
        if b.freed_by in ("reuse", ""):
            candidates[b.nbytes].append(b)
    for ts, change in off:
        pool = candidates.get(-change)
        if not pool:
            continue
        for i, b in enumerate(pool):
            if b.ts < ts and (b.freed_ts is None or b.freed_ts >= ts):
                b.freed_ts, b.freed_by = ts, "off-thread"
                del pool[i]
                break


def live_set_at_peak(events: list[dict[str, Any]], window: tuple[float, float], base: int) -> LiveSet:
    """The live set at the largest live total inside ``window`` (profiler timestamps); ``base``
    is the process-wide total just before the trace's first event."""
    memory = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    tid = collections.Counter(e.get("tid") for e in memory).most_common(1)[0][0]
    marks = _phase_marks(events)
    every, off, totals = _replay(memory, _Enclosing(events, tid), marks)
    _match_off_thread_frees(every, off)
    inside = [i for i, e in enumerate(memory) if window[0] <= e["ts"] <= window[1]]
    peak_i = max(inside, key=lambda i: totals[i])
    peak_ts = memory[peak_i]["ts"]
    alive = [b for b in every if b.ts <= peak_ts and (b.freed_ts is None or b.freed_ts > peak_ts)]
    peak = totals[peak_i] - base
    return LiveSet(
        peak=peak,
        peak_ts=peak_ts,
        phase=_phase_at(peak_ts, marks),
        blocks=alive,
        off_thread=peak - sum(b.nbytes for b in alive),
        matched_off_thread=sum(b.freed_by == "off-thread" for b in every),
        matched_reuse=sum(b.freed_by == "reuse" for b in every),
        peak_event=_describe_event(memory[peak_i], every),
        by_phase=_phase_maxima([memory[i]["ts"] for i in inside], [totals[i] - base for i in inside], marks, every),
    )


def _phase_maxima(times: list[float], lives: list[int], marks: _Marks, every: list[Block]) -> list[dict[str, Any]]:
    """The largest live total of each phase (step, phase, unit) in time order, with the bytes
    then alive that another thread frees later (a collective's buffers its work still holds)."""
    best: dict[str, tuple[int, float]] = {}
    for ts, live in zip(times, lives):
        phase = _phase_at(ts, marks)
        if phase not in best or live > best[phase][0]:
            best[phase] = (live, ts)
    rows = []
    for phase, (live, ts) in sorted(best.items(), key=lambda kv: kv[1][1]):
        held = sum(
            b.nbytes
            for b in every
            if b.freed_by in ("off-thread", "reuse") and b.ts <= ts and b.freed_ts is not None and b.freed_ts > ts
        )
        rows.append({"phase": phase, "peak": live, "freed_off_thread_later": held})
    return rows


def _describe_event(event: dict[str, Any], every: list[Block]) -> str:
    """The peak's own event: an allocation (its block) or a free."""
    ts, nbytes = event["ts"], int(event["args"]["Bytes"])
    block = next((b for b in every if b.ts == ts and b.nbytes == nbytes), None)
    where = f"{block.op} {block.frame}" if block is not None else ""
    return f"{nbytes:+,} bytes {where}".strip()


def live_set_of_window(trace: MemoryTrace, window: str) -> LiveSet:
    """The live set at the peak of ``trace``'s window ``window`` (a ``MemoryTrace(keep_trace=True)``
    that measured every thread; its peak is the one :attr:`MemoryTrace.peaks` reports)."""
    events = trace.trace_events
    mark = next(e for e in events if e.get("name") == "fsdp_bench_window:" + window)
    memory = [e for e in events if e.get("name") == "[memory]"]
    first = min(memory, key=lambda e: e["ts"])["args"]
    base = first["Total Allocated"] - first["Bytes"]
    return live_set_at_peak(events, (mark["ts"], mark["ts"] + mark.get("dur", 0)), base)


@contextlib.contextmanager
def _marked_blocks(model: nn.Module) -> Iterator[None]:
    """A marker around each block's forward and one when its output gradient arrives."""
    handles = []
    open_marks: dict[int, Any] = {}

    def instant(name: str) -> None:
        with record_function(_MARK + name):
            pass

    for index, block in enumerate(blocks(model)):

        def pre(module: nn.Module, args: Any, index: int = index) -> None:
            open_marks[index] = record_function(_MARK + f"block{index}:forward")
            open_marks[index].__enter__()

        def post(module: nn.Module, args: Any, output: Any, index: int = index) -> None:
            open_marks.pop(index).__exit__(None, None, None)
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(lambda grad, index=index: instant(f"block{index}:backward"))

        handles += [block.register_forward_pre_hook(pre), block.register_forward_hook(post)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _marked_step(model: nn.Module, opt: torch.optim.Optimizer, batch: Any, index: int) -> None:
    """:func:`benchmarks.core.train_step` (fp32), its phases marked."""
    with record_function(_MARK + f"step{index}:forward"):
        loss = loss_fn(model, batch)
    with record_function(_MARK + f"step{index}:backward"):
        loss.backward()
    with record_function(_MARK + f"step{index}:optimizer"):
        opt.step()
    with record_function(_MARK + f"step{index}:zero_grad"):
        opt.zero_grad(set_to_none=True)


def _analyse_impl(cfg: BenchConfig, name: str) -> dict[str, Any]:
    """The benchmark's memory phase for ``name`` (:func:`benchmarks.cpu._memory_phase`), traced."""
    gc.collect()
    dist.barrier()
    with MemoryTrace(keep_trace=True) as trace:
        model = _wrapped(name, cfg)
        gc.collect()
        opt = make_optimizer(model)
        batches = _batches(cfg)
        with _marked_blocks(model):
            for i in range(cfg.warmup_steps):
                _marked_step(model, opt, batches[i % len(batches)], i)
            with trace.window("step"):
                for i in range(cfg.memory_steps):
                    _marked_step(model, opt, batches[i % len(batches)], cfg.warmup_steps + i)
        del model, opt, batches
        gc.collect()
        dist.barrier()
    result = live_set_of_window(trace, "step").summary()
    result["benchmark_peak"] = trace.peaks["step"]
    return result


def rank_entry(rank: int, cfg_dict: dict[str, Any], workdir: str) -> None:
    warnings.filterwarnings("ignore", module=r"torch\.distributed\..*")
    cfg = BenchConfig(**{**cfg_dict, "only": tuple(cfg_dict["only"])})
    torch.set_num_threads(cfg.threads)
    dist.init_process_group(
        "gloo", init_method=f"file://{os.path.join(workdir, 'rendezvous')}", rank=rank, world_size=cfg.world_size
    )
    try:
        result = {name: _analyse_impl(cfg, name) for name in cfg.only}
        write_rank_result(workdir, rank, result)
        dist.barrier()
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def format_live(name: str, rank: int, s: dict[str, Any], top: int = 25) -> str:
    """One implementation's live set at one rank's peak, largest groups first."""
    lines = [
        f"{name}, rank {rank}: peak {s['peak']:,} bytes (benchmark: {s['benchmark_peak']:,}) at {s['phase']}",
        f"  main-thread blocks alive {s['main_thread_live']:,}; off-thread {s['off_thread']:,}"
        f" (blocks freed off-thread: {s['matched_off_thread']} by size, {s['matched_reuse']} by address reuse)",
    ]
    for g in s["groups"][:top]:
        lines.append(
            f"  {g['count']:3d} x {g['bytes']:>11,}  {g['allocated_in']:<28} {g['op'][:34]:<34} {g['frame'][:70]}"
        )
    lines.append(f"  the peak's event: {s['peak_event']}; this step's blocks of 1 MiB or more, in allocation order:")
    for b in s["large"]:
        freed = "" if b["freed_us"] is None else f", freed at {b['freed_us']:+,} us ({b['freed_by']})"
        lines.append(
            f"    {b['bytes']:>11,}  at {b['at_us']:+,} us{freed}  {b['allocated_in']}: {b['op'][:30]} {b['frames'][:110]}"
        )
    rest = s["groups"][top:]
    if rest:
        lines.append(f"  ... {len(rest)} more groups, {sum(g['count'] * g['bytes'] for g in rest):,} bytes")
    lines.append("  the largest live total of each phase (bytes; of it, blocks another thread frees later):")
    for row in s["by_phase"]:
        lines.append(f"    {row['phase']:<36} {row['peak']:>13,}  {row['freed_off_thread_later']:>12,}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    cfg = parse_args(argv)
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    results = run_local_ranks(rank_entry, dataclasses.asdict(cfg), cfg.world_size, cfg.timeout_s, prog="benchmarks.peak_live")
    for name in cfg.only:
        for rank, result in enumerate(results):
            print(format_live(name, rank, result[name]))
            print()
    if cfg.json_out:
        with open(cfg.json_out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
