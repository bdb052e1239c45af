"""What FSDP is doing while it communicates: the phase and the unit, said by whoever knows them.

[Note: Collective phase]
A failed or timed-out collective's message ([Note: Collective errors] in ``_errors.py``) and a
blocked collective's report ([Note: Blocked collectives] in ``_watch.py``) name the FSDP phase
("forward unshard", "backward reduce", "state_dict", ...) and the unit
("of FSDP unit 'blocks.1'"). This layer cannot know either: its callers do. So each caller says
it, explicitly, around the code that communicates:

* a layer that knows the phase (the runtime's hooks, prefetch, summon, clipping, the order
  check, the state-dict paths, the scaler) wraps it in ``with collective_phase("...")``, passing
  the unit where the phase belongs to one (``collective_phase("clip_grad_norm_", state)``);
* the object that owns a unit's communication (a ``FlatParamHandle`` gathering, a
  ``GradReduction`` reducing) names itself with ``collective_phase(None, self)``.

Only code that runs a collective (a launch in ``_collectives.py``, or the ``wait()`` of the work
an asynchronous one returned) is read: a wait on a stream's event (completing a reduction in
flight or a prefetched gather, at the end of backward, in the recovery from an interrupted
backward, when a dropped model is released) runs none, and says no phase.

Each thread keeps one stack. The phase said is the innermost one, followed by the enclosing
ones that differ ("backward prefetch (within backward unshard)"); the unit is the innermost one
given. Units are kept as the objects that name them (anything with a ``unit_name``), read only
while describing, because a unit's name is refined at lazy init. Nothing here looks at Python
frames or function names: renaming a hook or a local cannot weaken a message.

Cost on the hot path: two list appends on entry and two pops on exit (a phase and a unit slot
per entry, ``None`` where not given), no allocation: :func:`collective_phase` pushes at once
and returns one shared exit object, so ``with collective_phase(...)`` builds nothing. It must
always be used as a ``with`` statement's expression (nothing can run between the call and the
``with``'s entry). Stacks live per thread (autograd runs CUDA backward hooks on its own
threads); another thread (the watcher) reads a thread's stack by its ident.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Callable, Optional, ParamSpec, Protocol, TypeVar

__all__ = ["HasUnitName", "collective_phase", "describe_current", "describe_thread", "during"]


class HasUnitName(Protocol):
    """An object that names the FSDP unit it belongs to (a handle, a unit state, a reduction)."""

    @property
    def unit_name(self) -> str: ...


class _Stack:
    """One thread's phases and units, innermost last (parallel lists; ``None``: not given)."""

    __slots__ = ("phases", "units", "__weakref__")

    def __init__(self) -> None:
        self.phases: list[Optional[str]] = []
        self.units: list[Optional[HasUnitName]] = []


# Thread ident -> its stack, for the watcher; an entry goes when its thread's locals are freed.
_STACKS: "weakref.WeakValueDictionary[int, _Stack]" = weakref.WeakValueDictionary()


class _Local(threading.local):
    def __init__(self) -> None:
        self.stack = _Stack()
        _STACKS[threading.get_ident()] = self.stack


_LOCAL = _Local()


class _Exit:
    """What :func:`collective_phase` returns: its ``__exit__`` pops the entry the call pushed."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        stack = _LOCAL.stack
        stack.phases.pop()
        stack.units.pop()


_EXIT = _Exit()


def collective_phase(phase: Optional[str], unit: Optional[HasUnitName] = None) -> _Exit:
    """``with collective_phase(phase, unit):`` collectives inside say they ran during ``phase``
    (``None``: no phase of its own) of ``unit``'s FSDP unit ([Note: Collective phase]).

    Pushes at the call and pops at the ``with``'s exit: use it only as a ``with`` expression.
    """
    stack = _LOCAL.stack
    stack.phases.append(phase)
    stack.units.append(unit)
    return _EXIT


def _describe(stack: Optional[_Stack]) -> tuple[Optional[str], Optional[str]]:
    """(the phase, innermost first with the enclosing ones "within", the innermost unit's name)."""
    if stack is None:
        return None, None
    phases: list[str] = []
    for phase in reversed(list(stack.phases)):  # list(): another thread may push meanwhile
        if phase is not None and phase not in phases:
            phases.append(phase)
    unit = next((u for u in reversed(list(stack.units)) if u is not None), None)
    name = getattr(unit, "unit_name", None)
    unit_name = name if isinstance(name, str) else None
    if not phases:
        return None, unit_name
    within = f" (within {', '.join(phases[1:])})" if len(phases) > 1 else ""
    return phases[0] + within, unit_name


def describe_current() -> tuple[Optional[str], Optional[str]]:
    """The calling thread's phase and unit name (see :func:`_describe`)."""
    return _describe(_LOCAL.stack)


def describe_thread(ident: int) -> tuple[Optional[str], Optional[str]]:
    """Thread ``ident``'s phase and unit name, read from another thread."""
    return _describe(_STACKS.get(ident))


_P = ParamSpec("_P")
_R = TypeVar("_R")


def during(phase: str) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """Decorator: the whole function runs in ``with collective_phase(phase)``."""

    def decorate(fn: Callable[_P, _R]) -> Callable[_P, _R]:
        @functools.wraps(fn)
        def in_phase(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            with collective_phase(phase):
                return fn(*args, **kwargs)

        return in_phase

    return decorate
