"""What a failed collective says it was doing comes from its callers, not from Python frames
([Note: Collective phase] in fsdp/_comm/_phase.py); the watcher thread that reports blocked
collectives runs only while FSDP collectives do ([Note: The watcher runs only while collectives
do] in fsdp/_comm/_watch.py).

The messages themselves are pinned where they arise (tests/test_faults_timeouts.py,
tests/test_faults_phases.py); here: renaming every function (and the local ``moment``) the old
frame walk matched leaves them whole, and the watcher is gone when no collective runs.
"""

from __future__ import annotations

import pathlib
import re
import threading
import time
import types
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.distributed as dist

from tests._harness import RankPool
from tests._models import Block, global_batch, lm_loss, local_rows, make_toy

_ROOT = pathlib.Path(__file__).resolve().parent.parent
_WATCHER_NAME = "fsdp-collective-watch"


class _Unit:
    """Anything with a ``unit_name`` names a unit."""

    def __init__(self, name: str) -> None:
        self.unit_name = name


def test_no_frame_is_inspected() -> None:
    for name in ("_errors.py", "_watch.py", "_phase.py"):
        source = (_ROOT / "fsdp" / "_comm" / name).read_text()
        for pattern in (r"_getframe", r"_current_frames", r"\.f_(back|locals|globals|code)\b", r"\.co_name\b", r"\bFrameType\b", r"\binspect\b"):
            assert not re.search(pattern, source), (name, pattern)
    from fsdp._comm import _errors

    assert not hasattr(_errors, "_PHASE_OF_FUNCTION") and not hasattr(_errors, "_PHASE_OF_MODULE")


def test_innermost_phase_within_the_others_and_the_innermost_unit() -> None:
    from fsdp._comm._phase import collective_phase, describe_current

    outer, inner = _Unit("blocks.1"), _Unit("blocks.0")
    assert describe_current() == (None, None)
    with collective_phase("backward unshard", outer):
        assert describe_current() == ("backward unshard", "blocks.1")
        with collective_phase("backward prefetch"), collective_phase(None, inner):
            assert describe_current() == ("backward prefetch (within backward unshard)", "blocks.0")
        with collective_phase("backward reduce"), collective_phase("backward unshard"):
            # A phase said again further in is listed once, at its innermost place.
            assert describe_current() == ("backward unshard (within backward reduce)", "blocks.1")
    inner.unit_name = "refined"  # names are read when describing (lazy init refines them)
    with collective_phase(None, inner):
        assert describe_current() == (None, "refined")
    with pytest.raises(ValueError):
        with collective_phase("state_dict", outer):
            raise ValueError("popped on the way out")
    assert describe_current() == (None, None)


def test_another_thread_reads_a_threads_phase() -> None:
    """The watcher describes the thread blocked in a collective, from its own thread."""
    from fsdp._comm._phase import collective_phase, describe_current, describe_thread

    inside, release = threading.Event(), threading.Event()
    idents: list[int] = []

    def blocked() -> None:
        idents.append(threading.get_ident())
        with collective_phase("forward unshard", _Unit("<root>")):
            inside.set()
            release.wait(10)

    thread = threading.Thread(target=blocked)
    thread.start()
    try:
        assert inside.wait(10)
        assert describe_thread(idents[0]) == ("forward unshard", "<root>")
        assert describe_current() == (None, None)  # this thread's own stack is apart
    finally:
        release.set()
        thread.join()
    assert describe_thread(idents[0]) == (None, None)


def test_error_message_from_the_callers_context() -> None:
    """A function no table knows, with no local named like a unit holder: the message is whole."""
    from fsdp._comm._errors import raise_collective_error
    from fsdp._comm._phase import collective_phase

    def some_new_hook_name(whatever: object) -> None:
        with collective_phase("forward unshard", _Unit("blocks.0")):
            try:
                raise RuntimeError("gloo: injected failure")
            except RuntimeError as err:
                raise_collective_error(err, "all-gather", None, peer=1)

    with pytest.raises(RuntimeError) as info:
        some_new_hook_name(None)
    assert str(info.value) == (
        "fsdp: all-gather over the process group of global ranks ? failed during forward unshard of "
        "FSDP unit 'blocks.0', waiting for rank 1: gloo: injected failure"
    )


# ----------------------------------------------------------------------------- the real runtime
# Every module whose functions the old frame walk matched by name, and the local it read.
_RENAMED_MODULES = (
    "fsdp.runtime._hooks",
    "fsdp.runtime._prefetch",
    "fsdp.runtime._summon",
    "fsdp.runtime._clip_grad",
    "fsdp.runtime._exec_order",
    "fsdp.state_dict._model_state_dict",
    "fsdp.state_dict._optim_state_dict",
    "fsdp.state_dict._optim_save",
    "fsdp.state_dict._optim_load",
    "fsdp.init._sync",
    "fsdp.flat_param.flat_param",
    "fsdp.flat_param._reduction",
)


def _renamed_code(code: types.CodeType) -> types.CodeType:
    """``code`` under another name, its unit-holding locals renamed (not those closures share)."""
    held = ("moment", "handle", "state", "self")
    varnames = tuple(
        "renamed_" + v if v in held and v not in code.co_cellvars else v for v in code.co_varnames
    )
    return code.replace(co_name="renamed_" + code.co_name, co_qualname="renamed_" + code.co_qualname, co_varnames=varnames)


def _functions(module: types.ModuleType) -> Iterator[types.FunctionType]:
    for value in list(vars(module).values()):
        candidates = list(vars(value).values()) if isinstance(value, type) else [value]
        for fn in candidates:
            fn = getattr(fn, "__wrapped__", fn)
            fn = fn.fget if isinstance(fn, property) else fn
            if isinstance(fn, types.FunctionType) and fn.__module__ == module.__name__:
                yield fn


def _renamed_everywhere() -> Callable[[], None]:
    """Renames the functions (and the locals ``moment``, ``handle``, ``state``, ``self``) of
    ``_RENAMED_MODULES`` in place; returns the undo."""
    import importlib

    saved: dict[types.FunctionType, types.CodeType] = {}
    for name in _RENAMED_MODULES:
        for fn in _functions(importlib.import_module(name)):
            if fn not in saved:
                saved[fn] = fn.__code__
                fn.__code__ = _renamed_code(fn.__code__)

    def undo() -> None:
        for fn, code in saved.items():
            fn.__code__ = code

    return undo


def _failing(names: tuple[str, ...]) -> Callable[[], None]:
    """Makes ``torch.distributed``'s ``names`` raise at once on this rank (nothing is sent, so the
    group stays usable); returns the undo."""
    saved = {name: getattr(dist, name) for name in names if hasattr(dist, name)}

    def fail(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("gloo: injected failure")

    for name in saved:
        setattr(dist, name, fail)

    def undo() -> None:
        for name, fn in saved.items():
            setattr(dist, name, fn)

    return undo


_GATHERS = ("all_gather_single", "all_gather_into_tensor")


def renamed_functions_keep_messages() -> dict[str, str]:
    """Each scenario on a fresh model, with every function the frame walk matched renamed: the
    first collective fails on both ranks (injected); returns each scenario's message."""
    from fsdp import FullyShardedDataParallel as FSDP
    from fsdp.wrap import ModuleWrapPolicy

    rank, ws = dist.get_rank(), dist.get_world_size()
    tokens, targets = global_batch(0, ws)
    x, y = local_rows(tokens, rank, ws), local_rows(targets, rank, ws)

    def model() -> torch.nn.Module:
        return FSDP(make_toy(n_blocks=2), auto_wrap_policy=ModuleWrapPolicy({Block}))

    def trained() -> torch.nn.Module:
        m = model()
        lm_loss(m(x), y).backward()
        return m

    def first_forward() -> Callable[[], object]:
        m = model()
        return lambda: m(x)

    def forward() -> Callable[[], object]:
        m = trained()
        return lambda: m(x)

    def backward() -> Callable[[], object]:
        return lm_loss(trained()(x), y).backward

    def clip() -> Callable[[], object]:
        m = trained()
        return lambda: FSDP.clip_grad_norm_(m, 1.0)  # type: ignore[arg-type]

    # scenario -> (what prepares it and returns the step that fails, the collectives that fail)
    scenarios: dict[str, tuple[Callable[[], Callable[[], object]], tuple[str, ...]]] = {
        "lazy_init": (first_forward, ("all_gather",)),
        "forward": (forward, _GATHERS),
        "backward": (backward, _GATHERS),
        "clip_grad_norm": (clip, ("all_reduce",)),
    }
    undo_names = _renamed_everywhere()
    messages = {}
    try:
        for name, (prepare, collectives) in scenarios.items():
            act = prepare()
            undo_failing = _failing(collectives)
            try:
                with pytest.raises(RuntimeError) as info:
                    act()
            finally:
                undo_failing()
            messages[name] = str(info.value)
            dist.barrier()
    finally:
        undo_names()
    return messages


def test_renamed_hooks_keep_their_messages(pool2: RankPool) -> None:
    for rank, messages in enumerate(pool2.run(renamed_functions_keep_messages, _timeout=120)):
        head = "fsdp: {} over the process group of global ranks [0, 1] failed during {} of FSDP unit '{}'"
        tail = f", waiting for rank {1 - rank}: gloo: injected failure"
        assert messages == {
            "lazy_init": head.format(
                "all-gather", "lazy-init layout check (within first-iteration execution-order check, forward unshard)", "<root>"
            ) + tail,
            "forward": head.format("all-gather", "forward unshard", "<root>") + tail,
            # blocks.1 stays gathered into its backward; blocks.0 is prefetched in its pre-backward.
            "backward": head.format("all-gather", "backward prefetch (within backward unshard)", "blocks.0") + tail,
            "clip_grad_norm": head.format("all-reduce", "clip_grad_norm_", "<root>") + tail,
        }, messages


# ----------------------------------------------------------------------------- the watcher
def _watchers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == _WATCHER_NAME]


def _until(condition: Callable[[], bool], limit_s: float) -> float:
    """Seconds until ``condition`` held (polled), or ``inf`` after ``limit_s``."""
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        if condition():
            return time.monotonic() - start
        time.sleep(0.05)
    return float("inf")


def watcher_only_while_blocked() -> dict[str, object]:
    """Rank 1 joins an FSDP all-reduce 2.5 s after rank 0: rank 0's watcher reports the block
    meanwhile; once the collective is done, every watcher withdraws and ends."""
    from fsdp._comm import _collectives as comm
    from fsdp._comm import _watch

    rank = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    key = f"fsdp/blocked/rank{rank}"
    out: dict[str, object] = {"idle_gone_s": _until(lambda: not _watchers(), 4.0)}
    dist.barrier()
    if rank == 0:
        probe: dict[str, float] = {}

        def look() -> None:
            probe["reported_s"] = _until(lambda: store.check([key]), 2.3)

        thread = threading.Thread(target=look)
        thread.start()
        comm.all_reduce_sum(torch.ones(1), None)
        thread.join()
        out.update(probe)
    else:
        time.sleep(2.5)
        comm.all_reduce_sum(torch.ones(1), None)
    out["gone_after_s"] = _until(lambda: not _watchers() and not _watch._WATCHING[0], 4.0)
    out["withdrawn"] = not store.check([key])
    dist.barrier()
    return out


def test_watcher_runs_only_while_a_collective_does(pool2: RankPool) -> None:
    rank0, rank1 = pool2.run(watcher_only_while_blocked, _timeout=120)
    for seen in (rank0, rank1):
        # Nothing in progress: no watcher thread, gone one to two 0.5 s wake-ups after the last
        # FSDP collective (the rest is margin for a loaded machine).
        assert float(seen["idle_gone_s"]) < 2.5, seen  # type: ignore[arg-type]
        assert float(seen["gone_after_s"]) < 2.5 and seen["withdrawn"], seen  # type: ignore[arg-type]
    # Blocked: the watcher started with the collective and reported it within two wake-ups.
    assert float(rank0["reported_s"]) < 2.3, rank0  # type: ignore[arg-type]
