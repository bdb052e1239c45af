"""The CUDA stream schedule, checked on CPU ranks ([Note: Stream edges] in fsdp/flat_param/_streams.py).

The stream layer is the one place fsdp touches streams and events, so recording streams can stand
in for CUDA's: every ``wait_stream``, ``wait_event``, event, ``record_stream`` and event
synchronization is logged, with every collective and every cast of a gradient to ``reduce_dtype``
and the stream current when it was issued. The CUDA code paths (the gather on the unshard stream,
reductions in flight, the all-reduce stream) then run on gloo, where every collective completes
where it is issued: the values must equal the plain CPU run bit for bit, and the log must show
exactly the edges the note lists. The timing these edges buy is measured on a GPU by
tests/test_cuda_lane.py's overlap tests.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from tests._harness import RankPool
from tests._models import Block, global_batch, lm_loss, local_rows, make_toy

Entry = tuple[Any, ...]


class _Event:
    def __init__(self, log: list[Entry], stream: str, number: int) -> None:
        self.log, self.stream, self.number = log, stream, number

    def synchronize(self) -> None:
        self.log.append(("host_waits", self.stream, self.number))


class _Stream:
    def __init__(self, log: list[Entry], name: str) -> None:
        self.log, self.name = log, name

    def wait_stream(self, other: "_Stream") -> None:
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: _Event) -> None:
        self.log.append(("wait_event", self.name, event.stream, event.number))

    def synchronize(self) -> None:
        self.log.append(("host_waits_stream", self.name))


class _CastLog(TorchDispatchMode):
    """Logs each cast of a gradient from ``param_dtype`` to ``reduce_dtype`` with its stream."""

    def __init__(self, recorder: "_Recorder", low: torch.dtype, high: torch.dtype) -> None:
        super().__init__()
        self.recorder, self.low, self.high = recorder, low, high

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and args[0].dtype == self.low and kwargs.get("dtype") == self.high:
            if args[0].dim() == 1:  # a flat gradient (the unsharded one), not an activation
                self.recorder.log.append(("cast", self.recorder.current.name))
        return func(*args, **kwargs)


class _Recorder:
    """Recording streams in place of CUDA's (see the module docstring)."""

    NAMES = ("unshard", "post_backward", "all_reduce")

    def __init__(self) -> None:
        self.log: list[Entry] = []
        self.compute = _Stream(self.log, "compute")
        self.current = self.compute
        self.made = 0
        self.events = itertools.count()

    def new_stream(self, device: torch.device) -> _Stream:
        stream = _Stream(self.log, self.NAMES[self.made % 3])
        self.made += 1
        return stream

    def current_stream(self, device: torch.device) -> _Stream:
        return self.current

    @contextlib.contextmanager
    def use_stream(self, stream: Optional[_Stream]) -> Iterator[None]:
        before = self.current
        self.current = stream if stream is not None else before
        try:
            yield
        finally:
            self.current = before

    def record_event(self, stream: _Stream) -> _Event:
        event = _Event(self.log, stream.name, next(self.events))
        self.log.append(("event", stream.name, event.number))
        return event

    def record_stream(self, tensor: torch.Tensor, stream: _Stream) -> None:
        self.log.append(("record_stream", stream.name))

    def collective(self, kind: str, original: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            self.log.append((kind, self.current.name))
            return original(*args, **kwargs)

        return run


@contextlib.contextmanager
def recording_streams(recorder: _Recorder) -> Iterator[None]:
    """Installs the recorder as fsdp's stream layer and wraps fsdp's collectives."""
    from fsdp._comm import _collectives as comm
    from fsdp.flat_param import _streams

    saved = {name: getattr(_streams, name) for name in ("new_stream", "current_stream", "use_stream", "record_event", "record_stream")}
    collectives = {"all_gather_flat": "all_gather", "reduce_scatter_flat": "reduce_scatter", "all_reduce_sum": "all_reduce"}
    saved_comm = {name: getattr(comm, name) for name in collectives}
    try:
        for name in saved:
            setattr(_streams, name, getattr(recorder, name))
        for name, kind in collectives.items():
            setattr(comm, name, recorder.collective(kind, saved_comm[name]))
        yield
    finally:
        for name, fn in saved.items():
            setattr(_streams, name, fn)
        for name, fn in saved_comm.items():
            setattr(comm, name, fn)


def _wrap(cfg: dict[str, Any]) -> torch.nn.Module:
    from fsdp import BackwardPrefetch, FullyShardedDataParallel as FSDP, MixedPrecision, ShardingStrategy
    from fsdp.wrap import ModuleWrapPolicy

    kwargs: dict[str, Any] = dict(
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        sharding_strategy=ShardingStrategy[cfg["strategy"]],
        backward_prefetch=BackwardPrefetch[cfg["bwd"]] if cfg.get("bwd") else None,
        forward_prefetch=cfg.get("fwd", False),
    )
    if cfg.get("mp"):
        kwargs["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if cfg.get("optim_in_backward"):
        kwargs["use_orig_params"] = True
    if "HYBRID" in cfg["strategy"]:
        from torch.distributed.device_mesh import init_device_mesh

        kwargs["device_mesh"] = init_device_mesh("cpu", (dist.get_world_size(), 1))  # replicate over the ranks
    return FSDP(make_toy(), **kwargs)


def _train(cfg: dict[str, Any], steps: int, recorder: Optional[_Recorder]) -> tuple[list[torch.Tensor], torch.nn.Module]:
    model = _wrap(cfg)
    opt: Optional[torch.optim.Optimizer] = None
    if cfg.get("optim_in_backward"):
        from torch.distributed.optim import _apply_optimizer_in_backward

        _apply_optimizer_in_backward(torch.optim.SGD, list(model.parameters()), {"lr": 0.1})
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rank, ws = dist.get_rank(), dist.get_world_size()
    streams = recording_streams(recorder) if recorder is not None else contextlib.nullcontext()
    casts = _CastLog(recorder, torch.bfloat16, torch.float32) if recorder is not None and cfg.get("mp") else contextlib.nullcontext()
    with streams:
        for step in range(steps):
            tokens, targets = global_batch(step, ws)
            if recorder is not None:
                recorder.log.append(("step", step))
            loss = lm_loss(model(local_rows(tokens, rank, ws)).float(), local_rows(targets, rank, ws))
            if recorder is not None:
                recorder.log.append(("backward",))
            with casts:
                loss.backward()
            if recorder is not None:
                recorder.log.append(("end",))
            if opt is not None:
                opt.step()
                opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], model


def _steady_step(log: list[Entry], step: int) -> tuple[list[Entry], list[Entry]]:
    """The forward's and the backward's entries of ``step``."""
    start = log.index(("step", step))
    middle = log.index(("backward",), start)
    end = log.index(("end",), middle)
    return log[start + 1 : middle], log[middle + 1 : end]


def _check_gathers(forward: list[Entry], backward: list[Entry]) -> int:
    """Edges 1 and 2: the unshard stream waits for the compute stream once in each phase, before
    its first gather; every gather runs on the unshard stream and the compute stream waits on
    its event."""
    for phase in (forward, backward):
        waits = [i for i, e in enumerate(phase) if e == ("wait_stream", "unshard", "compute")]
        gathers = [i for i, e in enumerate(phase) if e[0] == "all_gather"]
        assert gathers and len(waits) == 1 and waits[0] < gathers[0], phase
        assert all(phase[i] == ("all_gather", "unshard") for i in gathers), phase
        events = {e[2] for e in phase if e[:2] == ("event", "unshard")}
        waited = {e[3] for e in phase if e[:3] == ("wait_event", "compute", "unshard")}
        assert len(events) == len(gathers) and events <= waited, phase
    return sum(1 for e in forward + backward if e[0] == "all_gather")


def _reduction_blocks(backward: list[Entry], hybrid: bool, cast: bool) -> list[tuple[int, int, int, int]]:
    """Each reduction's entries, which run back to back in its post-backward hook, checked
    against edges 3 and 4: the post-backward stream waits for the compute stream, then casts
    (where the dtypes differ) and reduces on it (hybrid, here one rank per shard group: nothing
    to reduce-scatter); a hybrid unit all-reduces on the all-reduce stream after the
    post-backward stream's event. Returns per reduction (first entry, last entry, the event
    after the last read of its input, its completion event)."""
    blocks = []
    for at in [i for i, e in enumerate(backward) if e == ("wait_stream", "post_backward", "compute")]:
        # The expected kinds, in order; events are ("event", stream, number).
        expected: list[tuple[str, str]] = [("wait_stream", "post_backward")]
        if cast:
            expected += [("cast", "post_backward"), ("event", "post_backward")]  # the input is read
        if not hybrid:
            expected += [("reduce_scatter", "post_backward")]
        expected += [("event", "post_backward")]  # the collective is done
        if hybrid:
            expected += [("wait_event", "all_reduce"), ("all_reduce", "all_reduce"), ("event", "all_reduce")]
        else:
            expected += [("event", "post_backward")]  # the kept form is made
        got = backward[at : at + len(expected)]
        assert [e[:2] for e in got] == expected, got
        reduced = got[-4 if hybrid else -2]
        if hybrid:
            assert got[-3] == ("wait_event", "all_reduce", "post_backward", reduced[2]), got
        read = got[2] if cast else reduced
        blocks.append((at, at + len(expected) - 1, read[2], got[-1][2]))
    return blocks


def _check_reductions(backward: list[Entry], hybrid: bool, cast: bool) -> int:
    """Edge 5: before a reduction is issued, the compute stream has waited for the previous one's
    input to be read (one input alive at a time), and for no reduction's result: those it waits
    for after the last one is issued (the end of backward), each once."""
    blocks = _reduction_blocks(backward, hybrid, cast)
    assert blocks, backward
    done_stream = "all_reduce" if hybrid else "post_backward"
    for previous, block in zip(blocks, blocks[1:]):
        between = backward[previous[1] + 1 : block[0]]
        assert ("wait_event", "compute", "post_backward", previous[2]) in between, (previous, between)
        assert not any(e[:3] == ("wait_event", "compute", done_stream) and e[3] in {b[3] for b in blocks} for e in between), between
    after = backward[blocks[-1][1] + 1 :]
    completions = [e[3] for e in after if e[:3] == ("wait_event", "compute", done_stream)]
    assert sorted(completions) == sorted(b[3] for b in blocks), after
    assert not any(e[0] in ("reduce_scatter", "all_reduce") for e in after), after
    return len(blocks)


CONFIGS = [
    dict(strategy="FULL_SHARD", bwd="BACKWARD_PRE"),
    dict(strategy="FULL_SHARD", bwd="BACKWARD_POST", fwd=True),
    dict(strategy="FULL_SHARD", bwd=None, mp=True),
    dict(strategy="HYBRID_SHARD", bwd="BACKWARD_PRE", mp=True),
    dict(strategy="FULL_SHARD", bwd="BACKWARD_PRE", optim_in_backward=True),
]


def stream_schedule(configs: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """Each config: two steps with recording streams and two plain CPU steps; the parameters
    equal bit for bit, and the second (steady) step's log shows the edges. Returns per config
    the gathers and reductions of that step."""
    counts = []
    for cfg in configs:
        recorder = _Recorder()
        plain, _ = _train(cfg, 2, None)
        recorded, model = _train(cfg, 2, recorder)
        assert recorder.made == 3, "one unshard, post-backward and all-reduce stream per tree"
        for a, b in zip(plain, recorded):
            assert torch.equal(a, b), f"{cfg}: the stream path changed a value"
        forward, backward = _steady_step(recorder.log, 1)
        hybrid = "HYBRID" in cfg["strategy"]
        gathers = _check_gathers(forward, backward) if not hybrid else 0
        if cfg.get("optim_in_backward"):
            # Optimizers in backward step on each unit's gradient where its input is released:
            # every reduction but the last is completed before the next one is issued.
            blocks = _reduction_blocks(backward, hybrid, False)
            for previous, block in zip(blocks, blocks[1:]):
                assert ("wait_event", "compute", "post_backward", previous[3]) in backward[previous[1] + 1 : block[0]]
            reductions = len(blocks)
        else:
            reductions = _check_reductions(backward, hybrid, bool(cfg.get("mp")))
        # Edge 6: the host waits only on the compute stream's free events (limit_all_gathers).
        assert all(e[1] == "compute" for e in forward + backward if e[0] == "host_waits"), cfg
        counts.append((gathers, reductions))
        if cfg is configs[0]:
            _check_summon(model, recorder)
    return counts


def _check_summon(model: torch.nn.Module, recorder: _Recorder) -> None:
    """Gathers outside an iteration (summon_full_params) each wait for the compute stream first,
    and a writeback of the local shard orders the unshard stream after it (edge 1)."""
    from fsdp import FullyShardedDataParallel as FSDP

    recorder.log.clear()
    with recording_streams(recorder):
        with FSDP.summon_full_params(model, writeback=True):
            with torch.no_grad():
                next(model.parameters()).add_(1.0)
    log = recorder.log
    gathers = [i for i, e in enumerate(log) if e[0] == "all_gather"]
    assert gathers, log
    for previous, at in zip([-1] + gathers, gathers):
        assert ("wait_stream", "unshard", "compute") in log[previous + 1 : at], log
    assert ("wait_stream", "unshard", "compute") in log[gathers[-1] + 1 :], log  # after the writeback


def test_stream_schedule(pool2: RankPool) -> None:
    counts = pool2.run(stream_schedule, CONFIGS)
    assert counts[0] == counts[1]
    units = 4  # the root and three blocks
    # FULL_SHARD: every unit gathered in forward; in backward all but the root and the unit kept
    # from forward ([Note: The first backward unit stays gathered], BACKWARD_PRE only).
    assert counts[0][0] == (2 * units - 2, units)
    assert counts[0][1] == (2 * units - 1, units)
    assert counts[0][2] == (2 * units - 1, units) and counts[0][3] == (0, units)
    assert counts[0][4] == counts[0][0]


def test_recording_streams_restores_the_stream_layer() -> None:
    from fsdp._comm import _collectives as comm
    from fsdp.flat_param import _streams

    before = (_streams.current_stream, comm.all_gather_flat)
    with recording_streams(_Recorder()):
        assert _streams.current_stream is not before[0]
    assert (_streams.current_stream, comm.all_gather_flat) == before


def test_overlap_harness_on_cpu() -> None:
    """The GPU overlap lane's harness (tests/_overlap.py) on CPU: fsdp trains as rank 0 of 8 on the
    fake group in every scenario, and the collectives it issues in the measured step are the
    schedule's, in order, priced at COMM_S per block by the emulated fabric (nothing sleeps)."""
    from tests import _overlap as o

    doc = o.run_in_subprocess("cpu")
    runs = {(r["scenario"], r["limit_all_gathers"]): r for r in doc["results"]}
    assert sorted(runs) == [("backward", True), ("forward", False), ("forward", True), ("hybrid", True)]
    units, blocks, n, node = o.BLOCKS + 1, o.BLOCKS, o.WORLD_SIZE, o.RANKS_PER_NODE
    for (name, _), run in runs.items():
        calls = [tuple(c) for c in run["collectives"]]
        assert run["forward_s"] is None and run["backward_s"] is None  # CPU: nothing timed
        if name == "forward":
            # FULL_SHARD: every unit gathered in forward, then in backward all but the root and
            # the block kept from forward ([Note: The first backward unit stays gathered]); one
            # reduce-scatter per unit, the root's last.
            assert calls[:units] == [("all_gather", n)] * units, calls
            assert calls.count(("all_gather", n)) == 2 * units - 2 and calls.count(("reduce_scatter", n)) == units
            assert calls[-1] == ("reduce_scatter", n)
            gathered = 2 * blocks - 1
        elif name == "backward":
            # SHARD_GRAD_OP: one gather per unit (forward), then one reduce-scatter per unit.
            assert calls == [("all_gather", n)] * units + [("reduce_scatter", n)] * units, calls
            gathered = blocks
        else:
            # Hybrid over 2 nodes of 4: gathers in the node, then per unit its reduce-scatter in
            # the node followed by its all-reduce across the 2 nodes.
            assert calls == [("all_gather", node)] * units + [("reduce_scatter", node), ("all_reduce", n // node)] * units, calls
            gathered = blocks
        reductions = blocks * (2 if name == "hybrid" else 1)
        # Each block's collective costs COMM_S; the root's tiny unit next to nothing.
        assert abs(run["modelled_s"] - (gathered + reductions) * o.COMM_S) < 1e-3, run["modelled_s"]
