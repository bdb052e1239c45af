"""Small helpers shared across the package: the internal-invariant error tier and tensor tree maps.

Two error tiers (see docs/design.md, [Note: Error tiers]):

- *Internal invariants* use :func:`p_assert`. It prints the message before raising, because an
  exception raised inside an autograd hook can lose its message on the way out of the engine.
  A failing ``p_assert`` is a bug in ``fsdp``, never the user's fault.
- *User mistakes* raise ``ValueError`` / ``TypeError`` / ``RuntimeError`` /
  ``NotImplementedError`` with the offending module, parameter or argument and the remedy.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import traceback
import types
from typing import Callable, NoReturn, Optional, Sequence, TypeVar, cast

import torch
import torch.distributed as dist

FSDP_WRAPPED_MODULE = "_fsdp_wrapped_module"
FSDP_PREFIX = FSDP_WRAPPED_MODULE + "."
FLAT_PARAM = "_flat_param"
# torch's checkpoint_wrapper nests the module under this name; like FSDP's own wrapper name it
# is not part of the model's parameter names (torch strips both too).
CHECKPOINT_WRAPPED_MODULE = "_checkpoint_wrapped_module"
_WRAPPER_SEGMENTS = frozenset({FSDP_WRAPPED_MODULE, CHECKPOINT_WRAPPED_MODULE})


class FSDPInternalError(AssertionError):
    """Raised when an internal invariant of ``fsdp`` does not hold (a bug in fsdp)."""


class FSDPStateAssertionError(RuntimeError, AssertionError):
    """A user call FSDP cannot serve in the current state, where torch FSDP1 raises AssertionError.

    Torch FSDP1 reports a few user mistakes (``summon_full_params`` inside forward or backward,
    ``register_comm_hook`` on a nested unit, twice, or with a hybrid strategy) as
    ``AssertionError``. This type is both an ``AssertionError`` (code written against torch
    keeps catching it) and a ``RuntimeError`` (not mistaken for :class:`FSDPInternalError`, the
    internal-invariant tier).
    """


def p_assert(cond: object, msg: str) -> None:
    """Checks an internal invariant; prints the message and stack before raising.

    Args:
        cond: Condition that must hold.
        msg: What was expected, with the actual values.

    Raises:
        FSDPInternalError: If ``cond`` is false.
    """
    if not cond:
        _fail(msg)


def _fail(msg: str) -> NoReturn:
    full = f"fsdp internal error (please report): {msg}"
    print(full, file=sys.stderr)
    traceback.print_stack(file=sys.stderr)
    raise FSDPInternalError(full)


_T = TypeVar("_T")
_F = TypeVar("_F", bound=Callable[..., object])


def apply_to_tensors(fn: Callable[[torch.Tensor], object], container: _T) -> _T:
    """Applies ``fn`` to every tensor in a nested structure and rebuilds the structure.

    Handles tensors, lists, tuples (including namedtuples), dicts (keeping their type) and
    leaves anything else unchanged. The result has the container's type where ``fn`` maps
    tensors to tensors (the callers that map to anything else discard the result).
    """
    return cast(_T, _rebuild(fn, container))


def _rebuild(fn: Callable[[torch.Tensor], object], container: object) -> object:
    if isinstance(container, torch.Tensor):
        return fn(container)
    if isinstance(container, dict):
        return type(container)((k, _rebuild(fn, v)) for k, v in container.items())
    if isinstance(container, tuple) and hasattr(container, "_fields"):  # namedtuple
        make_namedtuple: Callable[..., object] = type(container)  # takes its fields positionally
        return make_namedtuple(*(_rebuild(fn, v) for v in container))
    if isinstance(container, (list, tuple)):
        return type(container)(_rebuild(fn, v) for v in container)
    return container


# [Note: torch.compile]
# Under ``torch.compile``, Dynamo must not trace FSDP's runtime (collectives, autograd hooks,
# the training-state machine), but must trace and compile the wrapped modules' own forward,
# with each unit's parameters passed in as graph inputs, fresh every step (the unsharded views
# change every step). Torch FSDP1 gets this from Dynamo's rules for its own files plus two
# attributes on every module a unit manages (``_is_fsdp_managed_module``,
# ``_fsdp_use_orig_params``; see ``fsdp/init/_steps.py``). fsdp marks its code instead:
#
# - ``compile_boundary``: the unit's forward. Dynamo neither inlines it (a traced caller
#   breaks its graph once there) nor traces its frame, but it does compile the frames it calls:
#   the wrapped module. ``torch.compiler.disable(fn, recursive=False)``.
# - ``eager_only``: the FSDP steps the forward runs before and after the wrapped module; they
#   and everything they call run eagerly. ``torch.compiler.disable(fn)``.
#
# Applying either marker imports all of Dynamo (a second of start-up, tens of MB), so neither
# is applied when fsdp is imported: a marked function stays plain until the process has built
# its first unit ([Note: What fsdp changes in torch]) and ``torch._dynamo`` is imported
# (``torch.compile`` imports it before it traces anything), then the name that holds
# it, in its module or class, is rebound to the marked function. Callers must call these by
# that name (a module global or a method), not through a reference taken earlier, and a
# marker applied outside a ``def`` must be assigned back to that name.

_MARKED: list[tuple[Callable[..., object], bool]] = []  # (function, recursive), not yet applied
_DYNAMO = "torch._dynamo"


def eager_only(fn: _F) -> _F:
    """Marks an FSDP runtime step that ``torch.compile`` runs eagerly, with all it calls.

    See [Note: torch.compile]. Returns ``fn`` itself, or its marked form if Dynamo is already
    imported; the name that defines ``fn`` holds ``torch.compiler.disable(fn)`` once it is.
    """
    return _mark(fn, recursive=True)


def compile_boundary(fn: _F) -> _F:
    """Marks a unit's forward: never traced by Dynamo, while the modules it calls compile.

    See [Note: torch.compile]. Returns ``fn`` itself, or its marked form if Dynamo is already
    imported; the name that defines ``fn`` holds ``torch.compiler.disable(fn,
    recursive=False)`` once it is.
    """
    return _mark(fn, recursive=False)


def _mark(fn: _F, recursive: bool) -> _F:
    if _DYNAMO in sys.modules:  # already imported: mark at once
        return torch.compiler.disable(fn, recursive=recursive)
    if not _MARKED:
        on_first_wrap(lambda: call_after_import(_DYNAMO, _apply_marks))
    _MARKED.append((fn, recursive))
    return fn


def _apply_marks(dynamo: types.ModuleType) -> None:
    """Rebinds each marked function's defining name to its Dynamo-disabled form. A name that
    holds another function right now (a test's wrapper, say) is left alone and tried again at
    the next wrap (:func:`run_first_wrap_callbacks`)."""
    remaining: list[tuple[Callable[..., object], bool]] = []
    while _MARKED:
        fn, recursive = _MARKED.pop(0)
        owner: object = sys.modules[fn.__module__]
        *path, name = fn.__qualname__.split(".")
        for part in path:  # a method: its class (marked functions are never local ones)
            owner = getattr(owner, part)
        p_assert("<locals>" not in fn.__qualname__, f"{fn.__qualname__} is not defined under its name")
        if vars(owner).get(name) is fn:
            setattr(owner, name, torch.compiler.disable(fn, recursive=recursive))
        else:
            remaining.append((fn, recursive))
    _MARKED.extend(remaining)


# [Note: What fsdp changes in torch]
# ``import fsdp`` changes nothing in torch. The first ``FullyShardedDataParallel`` built in a
# process runs the callbacks registered with :func:`on_first_wrap`, and only those touch torch;
# each is listed, with why and the torch versions it was checked on, in docs/stacks.md ("What
# fsdp changes in torch"). A process that never wraps a model (one that only plans memory, say)
# pays for none of them.

_ON_FIRST_WRAP: list[Callable[[], None]] = []
_WRAPPED = False


def on_first_wrap(callback: Callable[[], None]) -> None:
    """Runs ``callback`` when the process builds its first FSDP unit (now, if it has)."""
    if _WRAPPED:
        callback()
    else:
        _ON_FIRST_WRAP.append(callback)


def run_first_wrap_callbacks() -> None:
    """Called by every FSDP construction; runs the :func:`on_first_wrap` callbacks once (and
    later marks for Dynamo a function whose name was rebound at the last attempt)."""
    global _WRAPPED
    if _WRAPPED:
        if _MARKED and _DYNAMO in sys.modules:
            _apply_marks(sys.modules[_DYNAMO])
        return
    _WRAPPED = True
    while _ON_FIRST_WRAP:
        _ON_FIRST_WRAP.pop(0)()


# [Note: After-import callbacks]
# Some of fsdp's integration with torch must change a torch module that fsdp does not import
# itself, because importing it is costly (Dynamo) or would be circular: the change is made
# right after the module's first import, by a finder at the head of ``sys.meta_path`` that
# finds the module as the finders after it would and wraps its loader. It finds nothing itself
# and leaves the module's ``__loader__`` and ``__spec__.loader`` as they would be.

_AFTER_IMPORT: dict[str, list[Callable[[types.ModuleType], None]]] = {}


def call_after_import(name: str, callback: Callable[[types.ModuleType], None]) -> None:
    """Calls ``callback(module)`` now if module ``name`` is imported, else right after its import.

    See [Note: After-import callbacks].
    """
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    _AFTER_IMPORT.setdefault(name, []).append(callback)
    if not any(isinstance(finder, _AfterImportFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImportFinder())


class _AfterImportFinder(importlib.abc.MetaPathFinder):
    """Wraps the loader of each module that has after-import callbacks (finds nothing itself)."""

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]] = None, target: Optional[types.ModuleType] = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname not in _AFTER_IMPORT:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _CallbacksAfterExec(spec.loader)
        return spec


class _CallbacksAfterExec(importlib.abc.Loader):
    """The module's own loader, then the module's after-import callbacks."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[types.ModuleType]:
        return self._inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__loader__ = self._inner
        if module.__spec__ is not None:
            module.__spec__.loader = self._inner
        self._inner.exec_module(module)
        for callback in _AFTER_IMPORT.pop(module.__name__, []):
            callback(module)
        if not _AFTER_IMPORT:  # nothing left to wait for: the finder leaves sys.meta_path
            sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _AfterImportFinder)]

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)


def strip_fsdp_segments(name: str) -> str:
    """Removes only FSDP's wrapper segments (what torch FSDP1's ``named_parameters`` strips)."""
    if FSDP_WRAPPED_MODULE not in name:
        return name
    return ".".join(part for part in name.split(".") if part != FSDP_WRAPPED_MODULE)


def clean_fqn(name: str) -> str:
    """Removes wrapper segments (FSDP's, activation checkpointing's) from a qualified name.

    ``"blocks.0._fsdp_wrapped_module.fc1.weight"`` becomes ``"blocks.0.fc1.weight"`` and
    ``"embed._fsdp_wrapped_module"`` becomes ``"embed"``.
    """
    if FSDP_WRAPPED_MODULE not in name and CHECKPOINT_WRAPPED_MODULE not in name:
        return name
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_SEGMENTS)


# [Note: Only the unit's group]
# As in torch FSDP1, a unit talks only to the process group it was given: construction,
# training and state dicts work with ``process_group=pg`` even when the default group was never
# initialized (a ProcessGroup built directly from a store). ``dist.get_rank(group)``,
# ``dist.get_backend(group)`` and ``dist.get_global_rank`` need the default group or c10d's
# registry, so fsdp asks the group object itself and addresses peers by group rank.


def group_rank(group: Optional["dist.ProcessGroup"]) -> int:
    """This process's rank in ``group`` (None: the default group), without needing the default group."""
    return group.rank() if group is not None else dist.get_rank()


def group_size(group: Optional["dist.ProcessGroup"]) -> int:
    """The number of ranks in ``group`` (None: the default group)."""
    return group.size() if group is not None else dist.get_world_size()


def group_backend(group: Optional["dist.ProcessGroup"]) -> str:
    """The backend name of ``group`` (``"gloo"``, ``"nccl"``, ...; None: the default group).

    What ``dist.get_backend`` says for groups c10d registered; for a group built directly from
    a store (unknown to c10d), the group's own backend name.
    """
    if group is None:
        return str(dist.get_backend())
    try:
        return str(dist.get_backend(group))
    except (ValueError, RuntimeError, KeyError):
        name = getattr(group, "name", None)  # a stand-in group object may have no name()
        return str(name()) if callable(name) else type(group).__name__


def describe_group_rank(group: Optional["dist.ProcessGroup"], rank_in_group: int) -> str:
    """``"rank N"`` with the global rank when c10d knows the group, else ``"group rank N"`` (messages)."""
    if group is None:
        return f"rank {rank_in_group}"
    try:
        return f"rank {dist.get_global_rank(group, rank_in_group)}"
    except (ValueError, RuntimeError, KeyError):
        return f"group rank {rank_in_group}"
