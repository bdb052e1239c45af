"""Multi-process test harness shared by every distributed test in this repository.

Spawning a process and importing ``torch`` costs seconds per rank, so the harness keeps one pool
of long-lived rank processes per world size for the whole pytest session and reuses it for every
check in every test file:

* :class:`RankPool` owns ``world_size`` rank processes. Each joined one ``gloo`` process group
  when it started and then waits for jobs. :meth:`RankPool.run` sends a module-level function to
  every rank, runs it there, and returns the per-rank return values in rank order.
* Ranks are never forked from pytest. By default they are forked from multiprocessing's fork
  server, which imports torch once (a pool then starts in well under a second, even after a
  failure); ``FSDP_TEST_START_METHOD=spawn`` makes every rank a fresh spawned interpreter.
* :func:`get_pool` is a process-wide cache (one pool per world size); :func:`shutdown_all` stops
  every cached pool (it is registered with :mod:`atexit` and is called by ``tests/conftest.py``).
* :func:`rank` and :func:`world_size` are shortcuts for use inside rank functions.

Failure handling (all of it surfaces in the parent as :class:`RankError`, an ``AssertionError``):

* A rank that raises is reported with its rank number and full formatted traceback. Asserts in
  modules under ``tests/`` are rewritten in the workers the way pytest rewrites them in the parent,
  so ``assert a == b`` failures show the compared values.
* A rank that has not answered within the timeout (``timeout_s`` of the pool, or ``_timeout=`` per
  call) is sent ``SIGUSR1``, which makes :mod:`faulthandler` dump the Python stacks of all of its
  threads; the dumps are included in the error. Once one rank has failed, the others get only
  ``failure_grace_s`` more to finish, so a rank blocked in a collective that a failed peer never
  joined does not cost the whole timeout.
* A rank process that dies (segfault, ``os._exit``) is detected at once through its process
  sentinel; the error gives its exit code or signal and its output.
* After a timeout, a death, or (by default) any failure, the pool's processes are killed and the
  next :meth:`RankPool.run` transparently starts fresh ones: a failed or hung collective can leave a
  process group out of step.

Everything a rank prints (stdout and stderr, including C++ output) goes to a per-rank log file;
after each job the part written during that job is echoed to the parent's ``sys.stdout`` with a
``[rank N]`` prefix, so pytest shows it under "Captured stdout" for a failing test.

Only POSIX platforms are supported (``SIGUSR1``, ``os.kill``).
"""

from __future__ import annotations

import ast
import atexit
import contextlib
import dataclasses
import faulthandler
import gc
import hashlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import io
import itertools
import marshal
import multiprocessing
import multiprocessing.connection
import os
import pickle
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import types
from typing import TYPE_CHECKING, Any, Callable, Iterator

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from multiprocessing.process import BaseProcess

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "RankError",
    "RankFailure",
    "RankPool",
    "get_pool",
    "is_worker",
    "pool_backend",
    "rank",
    "shutdown_all",
    "world_size",
]

TESTS_DIR: str = os.path.dirname(os.path.abspath(__file__))
"""Directory holding the test modules (put on ``sys.path`` in every worker)."""

REPO_ROOT: str = os.path.dirname(TESTS_DIR)
"""Repository root (put on ``sys.path`` in every worker so ``fsdp`` and ``tests.*`` import)."""

DEFAULT_TIMEOUT_S: float = float(os.environ.get("FSDP_TEST_TIMEOUT_S", "120"))
"""Default per-job timeout in seconds; the ``FSDP_TEST_TIMEOUT_S`` environment variable overrides it."""

_STARTUP_TIMEOUT_S: float = 180.0
_FAILURE_GRACE_S: float = 5.0
_DUMP_WAIT_S: float = 2.0
_DEATH_GRACE_S: float = 1.0
_OUTPUT_TAIL_CHARS: int = 8000
_WORKER_ENV_FLAG = "FSDP_TEST_HARNESS_RANK"
_PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL

# Make ``import _harness`` and ``import tests._harness`` yield the same module object, so there is
# exactly one pool cache whichever way a test module imports the harness.
if __name__ in ("_harness", "tests._harness"):
    for _alias in ("_harness", "tests._harness"):
        sys.modules.setdefault(_alias, sys.modules[__name__])


# --------------------------------------------------------------------------------------------
# Helpers for rank functions
# --------------------------------------------------------------------------------------------


def rank() -> int:
    """Returns this process's rank in the default process group.

    Returns:
        The rank (``torch.distributed.get_rank()``).
    """
    import torch.distributed as dist

    return dist.get_rank()


def world_size() -> int:
    """Returns the size of the default process group.

    Returns:
        The world size (``torch.distributed.get_world_size()``).
    """
    import torch.distributed as dist

    return dist.get_world_size()


def is_worker() -> bool:
    """Tells whether the caller runs inside a :class:`RankPool` worker process.

    Returns:
        ``True`` in a rank process started by the harness, ``False`` elsewhere (e.g. in pytest).
    """
    return _WORKER_ENV_FLAG in os.environ


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RankFailure:
    """What went wrong on one rank during one :meth:`RankPool.run` call.

    Attributes:
        rank: The failing rank.
        kind: ``"raised"`` (the function raised), ``"died"`` (the process exited),
            ``"timeout"`` (no answer in time) or ``"startup"`` (the rank failed to start).
        exc_type: Qualified name of the exception type for ``"raised"``, else ``None``.
        message: One-line summary (``str(exception)``, exit status, or timeout description).
        traceback: Formatted traceback for ``"raised"``/``"startup"``, else ``""``.
        output: What the rank printed during the job (stdout and stderr merged; for
            ``"timeout"`` it includes the faulthandler stack dump), possibly truncated.
        exit_code: Process exit code for ``"died"`` (negative: killed by that signal).
        exception: The original exception, when it could be pickled across; else ``None``.
    """

    rank: int
    kind: str
    exc_type: str | None = None
    message: str = ""
    traceback: str = ""
    output: str = ""
    exit_code: int | None = None
    exception: BaseException | None = None


class RankError(AssertionError):
    """Raised by :meth:`RankPool.run` when one or more ranks failed, died or timed out.

    The message names each failing rank and carries its formatted traceback (or its stack dump
    or exit status), so a pytest failure report is readable without further digging.

    Attributes:
        world_size: World size of the pool that ran the job.
        failures: Per-rank failure details, keyed by rank (only failing ranks appear).
    """

    def __init__(self, message: str, *, world_size: int, failures: dict[int, RankFailure]) -> None:
        super().__init__(message)
        self.world_size = world_size
        self.failures = failures


# --------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------


class _AssertRewritingFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Import hook that rewrites ``assert`` statements of modules under ``tests/`` like pytest.

    pytest rewrites asserts of test modules only in its own process; without this hook an
    ``assert x == y`` failing in a rank would report a bare ``AssertionError``.
    """

    def __init__(self, root: str) -> None:
        self._root = os.path.realpath(root)
        self._prefix = self._root + os.sep

    def _in_root(self, path: str) -> bool:
        return os.path.realpath(path).startswith(self._prefix)

    def find_spec(
        self,
        fullname: str,
        path: Any = None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        tail = fullname.rpartition(".")[2]
        if tail in ("_harness", "__init__"):
            return None
        if path is None:  # top-level module: only ``tests`` itself or files directly in tests/
            if not os.path.exists(os.path.join(self._root, tail + ".py")):
                return None
        elif not any(isinstance(p, str) and (p == self._root or self._in_root(p)) for p in path):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if (
            spec is None
            or spec.origin is None
            or not isinstance(spec.loader, importlib.machinery.SourceFileLoader)
            or spec.submodule_search_locations is not None  # packages: leave alone
            or not self._in_root(spec.origin)
        ):
            return None
        return importlib.util.spec_from_file_location(fullname, spec.origin, loader=self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        assert module.__spec__ is not None and module.__spec__.origin is not None
        path = module.__spec__.origin
        with open(path, "rb") as f:
            source = f.read()
        exec(_rewritten(path, source), module.__dict__)  # noqa: S102 - this is what an import does


def _rewritten(path: str, source: bytes) -> types.CodeType:
    """``source`` compiled with its asserts rewritten, through the session's cache: every rank of
    every pool imports the same test modules, and rewriting them costs ~1.5 s of CPU for all of
    tests/ (a cached module loads in well under a millisecond). The key is the path and the
    source, so an edited file is a new entry; a rank writes its entry whole (rename)."""
    from _pytest.assertion.rewrite import rewrite_asserts

    cache_dir = os.environ.get(_REWRITE_CACHE_ENV)
    entry = os.path.join(cache_dir, hashlib.sha1(path.encode() + b"\0" + source).hexdigest()) if cache_dir else None
    if entry is not None:
        with contextlib.suppress(OSError, EOFError, ValueError, TypeError):
            with open(entry, "rb") as f:
                return marshal.loads(f.read())
    tree = ast.parse(source, filename=path)
    rewrite_asserts(tree, source, path, None)
    code = compile(tree, path, "exec", dont_inherit=True)
    if entry is not None:
        with contextlib.suppress(OSError):
            with open(f"{entry}.{os.getpid()}", "wb") as f:
                f.write(marshal.dumps(code))
            os.replace(f"{entry}.{os.getpid()}", entry)
    return code


class _StubPytestConfig:
    """Just enough of ``pytest.Config`` for ``_pytest.assertion.util.assertrepr_compare``."""

    def get_verbosity(self, *_: Any) -> int:
        return 0

    def get_terminal_writer(self) -> Any:
        from _pytest._io import TerminalWriter

        return TerminalWriter(io.StringIO())


def _install_assert_support() -> None:
    """Installs assert rewriting for ``tests/`` and pytest's detailed comparison explanations."""
    try:
        from _pytest.assertion import util
        from _pytest.assertion.rewrite import rewrite_asserts  # noqa: F401 - availability check
    except ImportError:  # pragma: no cover - pytest is always there when tests run
        return
    sys.meta_path.insert(0, _AssertRewritingFinder(TESTS_DIR))
    config = _StubPytestConfig()

    def reprcompare(op: str, left: Any, right: Any) -> str | None:
        try:
            lines = util.assertrepr_compare(config, op, left, right)
        except Exception:
            return None
        if not lines:
            return None
        if len(lines) > 40:
            lines = [*lines[:40], f"...({len(lines) - 40} more lines)"]
        return "\n~".join(line.replace("\n", "\\n") for line in lines).replace("%", "%%")

    util._reprcompare = reprcompare


def pool_backend(world_size: int, device: str) -> str:
    """The process-group backend of a pool: gloo on the CPU; on CUDA, NCCL for one rank and
    gloo (with CUDA tensors) for more, since NCCL refuses two ranks on one GPU ("Duplicate GPU
    detected") and the CUDA lane has one GPU."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    return "nccl" if device == "cuda" and world_size == 1 else "gloo"


def _child_env_overrides() -> dict[str, str]:
    """Environment every rank runs with: one OpenMP/MKL thread, gloo on the loopback device,
    and cuBLAS's deterministic workspace setting (read when CUDA starts; harmless on the CPU)."""
    env = {
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8"),
    }
    if (
        "GLOO_SOCKET_IFNAME" not in os.environ
        and sys.platform.startswith("linux")
        and os.path.exists("/sys/class/net/lo")
    ):
        env["GLOO_SOCKET_IFNAME"] = "lo"
    return env


@contextlib.contextmanager
def _child_environment() -> Iterator[None]:
    """Temporarily prepares ``os.environ`` and ``sys.path`` for starting rank processes.

    Spawned processes (and the fork server, which imports torch once for all ranks) inherit
    the environment at exec time, so :func:`_child_env_overrides` holds before torch is
    imported. Children also get the parent's ``sys.path``, and they must import this module to
    find their entry point before any of its code runs; so the repository root and the tests
    directory are appended for the duration (needed e.g. with ``--import-mode=importlib``).
    """
    overrides = {**_child_env_overrides(), _REWRITE_CACHE_ENV: _rewrite_cache_dir()}
    saved = {k: os.environ.get(k) for k in overrides}
    added = [p for p in (REPO_ROOT, TESTS_DIR) if p not in sys.path]
    os.environ.update(overrides)
    sys.path.extend(added)
    try:
        yield
    finally:
        for p in added:
            with contextlib.suppress(ValueError):
                sys.path.remove(p)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


_REWRITE_CACHE_ENV = "FSDP_TEST_REWRITE_CACHE"
_REWRITE_CACHE_DIR: str | None = None


def _rewrite_cache_dir() -> str:
    """This session's folder of rewritten test modules (:func:`_rewritten`), removed at exit."""
    global _REWRITE_CACHE_DIR
    if _REWRITE_CACHE_DIR is None:
        _REWRITE_CACHE_DIR = tempfile.mkdtemp(prefix="rankpool-rewritten-")
        atexit.register(shutil.rmtree, _REWRITE_CACHE_DIR, True)
    return _REWRITE_CACHE_DIR


def _default_start_method() -> str:
    """``FSDP_TEST_START_METHOD`` if set, else ``forkserver`` where available, else ``spawn``."""
    method = os.environ.get("FSDP_TEST_START_METHOD")
    if method:
        return method
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


# Imported once in the fork server, so every rank (and every restart after a failed job) starts
# with them loaded: torch, fsdp, and the heavy torch packages the tests use (torch's FSDP1 as the
# oracle pulls in DTensor; DCP for checkpoints). Importing them in each fresh rank instead costs
# seconds of CPU per rank. None of them starts threads or touches a device at import. Dynamo
# comes last, after fsdp, as a rank met it before: torch's optimizers import it when the first
# one is built (the first call of a torch._disable_dynamo function), 0.5 s of CPU in every rank
# that ever builds one.
_FORKSERVER_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "fsdp",
    "torch._dynamo",
]


def _watch_parent(parent_pid: int) -> None:
    """Exits this worker when the parent process has gone away (runs in a daemon thread)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(1)


def _die_with_parent() -> None:
    """Makes this worker exit when its parent process dies, even mid-collective.

    The parent is pytest (``spawn``) or multiprocessing's fork server (``forkserver``), which
    itself exits when pytest goes away. On Linux this uses ``prctl(PR_SET_PDEATHSIG, SIGKILL)``
    (no extra thread, so stack dumps stay clean); elsewhere a daemon thread polls ``os.getppid()``.
    """
    # Under ``forkserver`` every child holds the write end of the fork server's "alive" pipe,
    # which keeps the server (our parent) running as long as any rank lives. Drop it, so that
    # the server exits with pytest and PR_SET_PDEATHSIG then takes the ranks down with it.
    forkserver = sys.modules.get("multiprocessing.forkserver")
    server = getattr(forkserver, "_forkserver", None)
    alive_fd = getattr(server, "_forkserver_alive_fd", None)
    if isinstance(alive_fd, int):
        with contextlib.suppress(OSError):
            os.close(alive_fd)
        server._forkserver_alive_fd = None  # type: ignore[union-attr]
    parent_pid = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(1, signal.SIGKILL, 0, 0, 0) == 0:  # 1 == PR_SET_PDEATHSIG
                if os.getppid() != parent_pid:  # the parent died before prctl took effect
                    os._exit(1)
                return
        except (OSError, AttributeError):
            pass
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="parent-watch", daemon=True).start()


def _redirect_output(log_path: str) -> None:
    """Points fds 1 and 2 (and ``sys.stdout``/``sys.stderr``) at the rank's log file."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for name, target_fd in (("stdout", 1), ("stderr", 2)):
        stream = os.fdopen(
            target_fd, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _flush_output() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def _load_module_from_file(module_name: str, file: str) -> types.ModuleType:
    """Imports ``file`` under ``module_name`` (fallback for ``--import-mode=importlib``)."""
    parent = module_name.rpartition(".")[0]
    if parent:
        try:
            importlib.import_module(parent)
        except ImportError:
            pass
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {module_name!r} from {file!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        if file.endswith(".py") and os.path.realpath(file).startswith(os.path.realpath(TESTS_DIR) + os.sep):
            _AssertRewritingFinder(TESTS_DIR).exec_module(module)
        else:
            spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    return module


_FUNCTION_CACHE: dict[tuple[str, str], Callable[..., Any]] = {}


def _resolve_function(module_name: str, qualname: str, file: str | None) -> Callable[..., Any]:
    """Finds the rank function in the worker by module name and qualified name."""
    key = (module_name, qualname)
    cached = _FUNCTION_CACHE.get(key)
    if cached is not None:
        return cached
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if file is None or not (module_name == missing or module_name.startswith(missing + ".")):
            raise
        module = _load_module_from_file(module_name, file)
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    _FUNCTION_CACHE[key] = obj
    return obj


def _reset_rank_state() -> None:
    """Per-job reset: deterministic seeds and default global torch state. No collectives."""
    import torch

    torch.manual_seed(0)
    random.seed(0)
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)
    torch.set_grad_enabled(True)
    torch.set_default_dtype(torch.float32)
    if torch.is_anomaly_enabled():
        torch.autograd.set_detect_anomaly(False)


def _is_pytest_skip(exc: BaseException) -> bool:
    """Tells whether ``exc`` is pytest's ``Skipped`` outcome (``pytest.skip()``)."""
    outcomes = sys.modules.get("_pytest.outcomes")
    skipped = getattr(outcomes, "Skipped", None)
    return isinstance(skipped, type) and isinstance(exc, skipped)


def _describe_exception(exc: BaseException) -> dict[str, Any]:
    """Turns an exception raised in a rank into picklable failure data."""
    exc_type = type(exc)
    tb = exc.__traceback__
    if tb is not None and tb.tb_next is not None:
        tb = tb.tb_next  # drop the harness frame that called the rank function
    try:
        formatted = "".join(traceback.format_exception(exc_type, exc, tb))
    except Exception:  # pragma: no cover - a broken __str__ etc.
        formatted = f"{exc_type.__qualname__}: <traceback formatting failed>\n"
    try:
        message = str(exc)
    except Exception:  # pragma: no cover
        message = "<str() failed>"
    try:
        blob: bytes | None = pickle.dumps(exc, protocol=_PICKLE_PROTOCOL)
    except Exception:
        blob = None
    return {
        "exc_type": f"{exc_type.__module__}.{exc_type.__qualname__}",
        "message": message,
        "traceback": formatted,
        "exception": blob,
        "skipped": _is_pytest_skip(exc),
    }


def _worker_main(
    rank_: int,
    world_size_: int,
    conn: Connection,
    init_method: str,
    log_path: str,
    device: str = "cpu",
) -> None:
    """Entry point of a rank process: set up, join the process group, then serve jobs forever.

    Args:
        rank_: This process's rank.
        world_size_: Number of ranks in the pool.
        conn: This rank's end of the duplex pipe to the parent.
        init_method: ``file://`` URL of the rendezvous store.
        log_path: File that receives this rank's stdout and stderr.
        device: ``"cpu"`` (gloo) or ``"cuda"`` (see :func:`pool_backend`).
    """
    _redirect_output(log_path)
    os.environ[_WORKER_ENV_FLAG] = str(rank_)
    os.environ.update(_child_env_overrides())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
    faulthandler.enable(file=sys.stderr, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True, chain=False)
    _die_with_parent()
    for path in (REPO_ROOT, TESTS_DIR):
        if path not in sys.path:
            sys.path.insert(0, path)

    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        torch.set_num_interop_threads(1)
        _install_assert_support()
        backend = pool_backend(world_size_, device)
        if device == "cuda":
            # Every rank of a CUDA pool uses the first GPU (the CUDA lane runs on one GPU).
            torch.cuda.set_device(0)
            # Deterministic kernels (embedding backward, cuBLAS workspaces): the lane compares
            # fsdp with torch FSDP1 bit for bit, which needs the same kernel to give the same bits.
            torch.use_deterministic_algorithms(True)
        dist.init_process_group(backend, init_method=init_method, rank=rank_, world_size=world_size_)
        # The preloaded modules' objects (a few hundred thousand) live as long as the rank: move
        # them out of the collector's reach, so each full collection (tests call gc.collect() to
        # free models; Python runs them too) scans only what the jobs made: ~0.2 s less each.
        gc.collect()
        gc.freeze()
    except BaseException as exc:
        _flush_output()
        conn.send_bytes(pickle.dumps(("startup_error", _describe_exception(exc))))
        os._exit(1)
    conn.send_bytes(pickle.dumps(("ready", os.getpid())))

    while True:
        try:
            msg = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            os._exit(0)
        if msg[0] == "stop":
            _flush_output()
            os._exit(0)
        _, job_id, (module_name, qualname, file), payload = msg
        try:
            _reset_rank_state()
            fn = _resolve_function(module_name, qualname, file)
            args, kwargs = pickle.loads(payload)
            value = fn(*args, **kwargs)
            try:
                reply: tuple[Any, ...] = (job_id, "ok", pickle.dumps(value, protocol=_PICKLE_PROTOCOL))
            except Exception as exc:
                raise TypeError(
                    f"the return value of {qualname} on rank {rank_} cannot be pickled "
                    f"({type(value).__qualname__}): {exc}"
                ) from exc
        except BaseException as exc:  # includes pytest outcomes (fail/skip) and SystemExit
            reply = (job_id, "error", _describe_exception(exc))
        del msg, payload
        _flush_output()
        healthy = dist.is_initialized()
        conn.send_bytes(pickle.dumps((*reply, healthy), protocol=_PICKLE_PROTOCOL))


# --------------------------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------------------------


def _function_ref(fn: Callable[..., Any]) -> tuple[str, str, str | None]:
    """Returns ``(module, qualname, file)`` naming ``fn`` so that a worker can import it.

    Raises:
        TypeError: ``fn`` is not a module-level (or class-level) function of an importable module.
    """
    module_name = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    hint = (
        "RankPool.run needs a function defined at module level in an importable module "
        "(e.g. a tests/test_*.py file); pass data as arguments instead of closures/lambdas/partials"
    )
    if not callable(fn) or not isinstance(module_name, str) or not isinstance(qualname, str):
        raise TypeError(f"{fn!r} has no __module__/__qualname__; {hint}")
    if "<" in qualname or module_name == "__main__":
        raise TypeError(f"{module_name}.{qualname} cannot be imported by name; {hint}")
    module = sys.modules.get(module_name)
    if module is None:
        raise TypeError(f"module {module_name!r} of {qualname} is not imported; {hint}")
    obj: Any = module
    try:
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise TypeError(f"{module_name}.{qualname} is not reachable by name; {hint}") from None
    return module_name, qualname, getattr(module, "__file__", None)


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _exit_description(code: int | None) -> str:
    if code is None:
        return "exited (exit code unknown)"
    if code < 0:
        return f"was killed by {_signal_name(code)} (exit code {code})"
    return f"exited with exit code {code}"


def _indent(text: str, prefix: str = "    ") -> str:
    return "".join(prefix + line for line in text.splitlines(keepends=True))


def _tail(text: str, limit: int = _OUTPUT_TAIL_CHARS) -> str:
    if len(text) <= limit:
        return text
    return f"[... {len(text) - limit} earlier characters omitted ...]\n" + text[-limit:]


class RankPool:
    """A pool of ``world_size`` long-lived rank processes sharing one ``gloo`` process group.

    Processes are spawned lazily by the first :meth:`run` (or :meth:`start`) and reused for
    every later call. Each rank runs with ``torch.set_num_threads(1)`` and ``OMP_NUM_THREADS=1``,
    writes its stdout/stderr to a per-rank log file in a private temporary directory, dumps its
    Python stacks on ``SIGUSR1``, and exits by itself if the parent process dies.

    Args:
        world_size: Number of ranks (processes).
        timeout_s: Default seconds one :meth:`run` may take before the ranks' stacks are dumped
            and the pool is killed; override per call with ``_timeout=``.
        startup_timeout_s: Seconds allowed for spawning the ranks, importing torch and joining
            the process group.
        failure_grace_s: Once a rank has failed, seconds the other ranks get to finish before
            they are treated as hung (they are often blocked in a collective the failed rank
            never joined).
        restart_on_failure: Restart the ranks after any failed job, not only after timeouts and
            deaths. Safer (a half-run collective sequence can leave the group out of step); with
            the ``forkserver`` start method a restart costs well under a second.
        start_method: ``"forkserver"`` (default where available: torch is imported once in the
            fork server and each rank is forked from it, so starting a pool costs ~0.1 s instead
            of seconds per rank) or ``"spawn"`` (each rank imports torch itself). The
            ``FSDP_TEST_START_METHOD`` environment variable sets the default. Either way the
            ranks are never forked from the pytest process itself.
        device: ``"cpu"`` (default: a gloo group, CPU tensors) or ``"cuda"`` (every rank on GPU 0,
            deterministic algorithms on; the backend is :func:`pool_backend`'s).
    """

    def __init__(
        self,
        world_size: int,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        *,
        startup_timeout_s: float = _STARTUP_TIMEOUT_S,
        failure_grace_s: float = _FAILURE_GRACE_S,
        restart_on_failure: bool = True,
        start_method: str | None = None,
        device: str = "cpu",
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.backend = pool_backend(world_size, device)
        self.device = device
        self._world_size = world_size
        self.timeout_s = float(timeout_s)
        self.startup_timeout_s = float(startup_timeout_s)
        self.failure_grace_s = float(failure_grace_s)
        self.restart_on_failure = restart_on_failure
        self.start_method = start_method or _default_start_method()
        if self.start_method not in ("spawn", "forkserver"):
            raise ValueError(f"start_method must be 'spawn' or 'forkserver', got {self.start_method!r}")
        self._lock = threading.RLock()
        self._job_ids = itertools.count(1)
        self._procs: list[BaseProcess] = []
        self._conns: list[Connection] = []
        self._log_paths: list[str] = []
        self._tmpdir: str | None = None
        self._ready = False
        self.starts = 0
        """How many times processes were (re)started; handy for tests of the harness."""
        self.jobs = 0
        """How many jobs were dispatched."""

    # -- properties -----------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """Number of ranks in the pool."""
        return self._world_size

    @property
    def pids(self) -> list[int]:
        """PIDs of the current rank processes (empty if not started)."""
        return [p.pid for p in self._procs if p.pid is not None]

    @property
    def running(self) -> bool:
        """Whether rank processes currently exist (started and not discarded)."""
        return bool(self._procs)

    def __repr__(self) -> str:
        state = "ready" if self._ready else ("starting" if self._procs else "stopped")
        device = "" if self.device == "cpu" else f", device={self.device}"
        return f"RankPool(world_size={self._world_size}{device}, {state}, starts={self.starts}, jobs={self.jobs})"

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Spawns the rank processes if they are not running. Does not wait for them."""
        with self._lock:
            if self._procs:
                return
            ctx = multiprocessing.get_context(self.start_method)
            if self.start_method == "forkserver":
                # Takes effect if the fork server is not running yet: it imports torch once and
                # every rank is forked from it, which makes (re)starting a pool nearly free.
                ctx.set_forkserver_preload(_FORKSERVER_PRELOAD)
            self._tmpdir = tempfile.mkdtemp(prefix=f"rankpool-ws{self._world_size}-")
            init_method = "file://" + os.path.join(self._tmpdir, "rendezvous")
            try:
                for r in range(self._world_size):
                    log_path = os.path.join(self._tmpdir, f"rank{r}.log")
                    open(log_path, "wb").close()
                    parent_conn, child_conn = ctx.Pipe(duplex=True)
                    proc = ctx.Process(
                        target=_worker_main,
                        args=(r, self._world_size, child_conn, init_method, log_path, self.device),
                        name=f"rankpool-ws{self._world_size}-rank{r}",
                        daemon=False,
                    )
                    with _child_environment():
                        proc.start()
                    child_conn.close()
                    self._procs.append(proc)
                    self._conns.append(parent_conn)
                    self._log_paths.append(log_path)
            except BaseException:
                self._discard()
                raise
            self.starts += 1
            self._ready = False

    def close(self) -> None:
        """Stops the rank processes (politely, then by force). A later :meth:`run` restarts them."""
        with self._lock:
            if not self._procs:
                return
            if self._ready:
                stop = pickle.dumps(("stop",))
                for conn in self._conns:
                    try:
                        conn.send_bytes(stop)
                    except OSError:
                        pass
                deadline = time.monotonic() + 3.0
                for proc in self._procs:
                    proc.join(max(0.0, deadline - time.monotonic()))
            self._discard()

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _discard(self) -> None:
        """Kills all rank processes and forgets them; the next run starts fresh ones."""
        for proc in self._procs:
            if proc.is_alive():
                try:
                    proc.kill()
                except OSError:
                    pass
        for proc in self._procs:
            proc.join(5.0)
            try:
                proc.close()
            except ValueError:
                pass
        for conn in self._conns:
            conn.close()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
        self._procs, self._conns, self._log_paths = [], [], []
        self._tmpdir = None
        self._ready = False

    def _ensure_ready(self) -> None:
        """Starts the ranks if needed and waits until each has joined the process group."""
        __tracebackhide__ = True
        self.start()
        if self._ready:
            return
        deadline = time.monotonic() + self.startup_timeout_s
        pending = set(range(self._world_size))
        failures: dict[int, RankFailure] = {}
        closed: set[int] = set()
        while pending and not failures:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            by_conn = {self._conns[r]: r for r in pending if r not in closed}
            by_sentinel = {self._procs[r].sentinel: r for r in pending}
            ready = multiprocessing.connection.wait([*by_conn, *by_sentinel], timeout=remaining)
            for obj in ready:
                r = by_conn.get(obj)  # type: ignore[call-overload]
                if r is None or r not in pending:
                    continue
                try:
                    msg = pickle.loads(self._conns[r].recv_bytes())
                except (EOFError, OSError):
                    closed.add(r)  # the rank is exiting; its sentinel reports the death
                    continue
                pending.discard(r)
                if msg[0] == "startup_error":
                    info = msg[1]
                    failures[r] = RankFailure(
                        rank=r,
                        kind="startup",
                        exc_type=info["exc_type"],
                        message=info["message"],
                        traceback=info["traceback"],
                        output=self._read_log(r, 0),
                    )
            for obj in ready:
                r = by_sentinel.get(obj)  # type: ignore[call-overload]
                if r is not None and r in pending:
                    self._procs[r].join(1.0)  # reap it so that exitcode is known
                    code = self._procs[r].exitcode
                    pending.discard(r)
                    output = self._read_log(r, 0)
                    if not output:
                        output = (
                            "(no output: the rank died before its log was set up, typically because "
                            f"{_worker_main.__module__!r} could not be imported in the child; see the "
                            "stderr of the pytest process)"
                        )
                    failures[r] = RankFailure(
                        rank=r,
                        kind="died",
                        message=f"rank {r} {_exit_description(code)} during startup",
                        output=output,
                        exit_code=code,
                    )
        if not pending and not failures:
            self._ready = True
            return
        if not failures:
            for r in sorted(pending):
                failures[r] = RankFailure(
                    rank=r,
                    kind="timeout",
                    message=f"rank {r} did not join the process group within {self.startup_timeout_s:g} s",
                    output=self._read_log(r, 0),
                )
        self._discard()
        lines = [f"RankPool(world_size={self._world_size}) failed to start:"]
        for r in sorted(failures):
            f = failures[r]
            lines.append(f"===== rank {r}: {f.message or f.kind} =====")
            if f.traceback:
                lines.append(f.traceback.rstrip())
            if f.output.strip():
                lines.append(f"--- rank {r} output ---")
                lines.append(_tail(f.output).rstrip())
        raise RankError("\n".join(lines), world_size=self._world_size, failures=failures)

    # -- logs -------------------------------------------------------------------------------

    def _log_size(self, r: int) -> int:
        try:
            return os.path.getsize(self._log_paths[r])
        except OSError:
            return 0

    def _read_log(self, r: int, offset: int) -> str:
        try:
            with open(self._log_paths[r], "rb") as f:
                f.seek(offset)
                data = f.read()
        except (OSError, IndexError):
            return ""
        return data.decode("utf-8", errors="replace")

    def _dump_stacks(self, ranks: list[int]) -> None:
        """Sends SIGUSR1 to ``ranks`` and waits (at most ~2 s) until their dumps are written."""
        before = {r: self._log_size(r) for r in ranks}
        targets = []
        for r in ranks:
            proc = self._procs[r]
            if proc.pid is not None and proc.is_alive():
                try:
                    os.kill(proc.pid, signal.SIGUSR1)
                    targets.append(r)
                except OSError:
                    pass
        deadline = time.monotonic() + _DUMP_WAIT_S
        last = dict(before)
        stable_since = time.monotonic()
        while targets and time.monotonic() < deadline:
            time.sleep(0.05)
            sizes = {r: self._log_size(r) for r in targets}
            if sizes != last:
                last, stable_since = sizes, time.monotonic()
            elif all(sizes[r] > before[r] for r in targets) and time.monotonic() - stable_since > 0.2:
                break

    def _forward_output(self, offsets: list[int], skip: frozenset[int] = frozenset()) -> dict[int, str]:
        """Echoes what each rank printed since ``offsets`` to ``sys.stdout``; returns the texts.

        Args:
            offsets: Per-rank log offsets taken when the job was sent.
            skip: Ranks whose output is not echoed (it goes into the error message instead).
        """
        outputs = {r: self._read_log(r, offsets[r]) for r in range(self._world_size)}
        chunks = []
        for r, text in outputs.items():
            if text and r not in skip:
                chunks.append(_indent(text if text.endswith("\n") else text + "\n", f"[rank {r}] "))
        if chunks:
            try:
                sys.stdout.write("".join(chunks))
                sys.stdout.flush()
            except Exception:  # pragma: no cover - closed/odd stdout
                pass
        return outputs

    # -- running jobs -------------------------------------------------------------------------

    def run(self, fn: Callable[..., Any], *args: Any, _timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """Runs ``fn(*args, **kwargs)`` on every rank and returns the results in rank order.

        Before the call each rank does ``torch.manual_seed(0)``, ``random.seed(0)`` and resets
        grad mode and the default dtype; no collective is issued by the harness.

        Args:
            fn: A function defined at module level in an importable module (typically the test
                module itself). Workers import it by ``__module__`` and ``__qualname__``.
            *args: Positional arguments for ``fn``; must be picklable.
            _timeout: Seconds to wait for all ranks; defaults to the pool's ``timeout_s``.
            **kwargs: Keyword arguments for ``fn``; must be picklable.

        Returns:
            ``[result_of_rank_0, result_of_rank_1, ...]``; results must be picklable.

        Raises:
            TypeError: ``fn`` cannot be imported by name or the arguments cannot be pickled.
            RankError: A rank raised, died or did not answer in time (the message carries the
                tracebacks / exit codes / stack dumps).
            pytest.skip.Exception: Every rank that did not succeed called ``pytest.skip``.
        """
        __tracebackhide__ = True
        ref = _function_ref(fn)
        try:
            payload = pickle.dumps((args, kwargs), protocol=_PICKLE_PROTOCOL)
        except Exception as exc:
            raise TypeError(f"arguments for {ref[1]} cannot be pickled: {exc}") from exc
        timeout = self.timeout_s if _timeout is None else float(_timeout)
        with self._lock:
            self._ensure_ready()
            job_id = next(self._job_ids)
            self.jobs += 1
            try:
                return self._run_job(job_id, ref, payload, timeout)
            except BaseException as exc:
                if not isinstance(exc, RankError) and not _is_pytest_skip(exc):
                    self._discard()  # interrupted or harness bug: ranks are in an unknown state
                raise

    def _run_job(self, job_id: int, ref: tuple[str, str, str | None], payload: bytes, timeout: float) -> list[Any]:
        __tracebackhide__ = True
        ws = self._world_size
        name = f"{ref[0]}.{ref[1]}"
        offsets = [self._log_size(r) for r in range(ws)]
        msg = pickle.dumps(("job", job_id, ref, payload), protocol=_PICKLE_PROTOCOL)
        start = time.monotonic()
        deadline = start + timeout
        pending = set(range(ws))
        values: dict[int, bytes] = {}
        errors: dict[int, dict[str, Any]] = {}
        dead: dict[int, int | None] = {}
        unhealthy: list[int] = []
        closed: set[int] = set()
        first_error_at: float | None = None

        for r, conn in enumerate(self._conns):
            try:
                conn.send_bytes(msg)
            except OSError:
                pass  # the rank is dead; its sentinel is reported below

        first_death_at: float | None = None

        while pending:
            limit = deadline
            if first_error_at is not None:
                limit = min(limit, first_error_at + self.failure_grace_s)
            if first_death_at is not None:  # peers of a dead rank usually error out at once
                limit = min(limit, first_death_at + _DEATH_GRACE_S)
            remaining = limit - time.monotonic()
            if remaining <= 0:
                break
            by_conn = {self._conns[r]: r for r in pending if r not in closed}
            by_sentinel = {p.sentinel: r for r, p in enumerate(self._procs) if r not in dead}
            ready = multiprocessing.connection.wait([*by_conn, *by_sentinel], timeout=remaining)
            for obj in ready:
                r = by_conn.get(obj)  # type: ignore[call-overload]
                if r is None:
                    continue
                try:
                    reply = pickle.loads(self._conns[r].recv_bytes())
                except (EOFError, OSError):
                    closed.add(r)  # the rank is exiting; its sentinel reports the death
                    continue
                reply_id, status, data, healthy = reply
                if reply_id != job_id:  # pragma: no cover - protocol invariant
                    raise RuntimeError(f"rank {r} answered job {reply_id} while job {job_id} was running")
                pending.discard(r)
                if not healthy:
                    unhealthy.append(r)
                if status == "ok":
                    values[r] = data
                else:
                    errors[r] = data
                    if first_error_at is None and not data["skipped"]:
                        first_error_at = time.monotonic()
            for obj in ready:
                r = by_sentinel.get(obj)  # type: ignore[call-overload]
                if r is not None:
                    self._procs[r].join(1.0)  # reap it so that exitcode is known
                    dead[r] = self._procs[r].exitcode
                    pending.discard(r)
                    if first_death_at is None:
                        first_death_at = time.monotonic()
        elapsed = time.monotonic() - start

        if not pending and not dead and not errors:
            self._forward_output(offsets)
            results = [pickle.loads(values[r]) for r in range(ws)]
            if unhealthy:
                self._discard()  # somebody destroyed the default process group
            return results

        hung = sorted(pending)
        if hung:
            self._dump_stacks(hung)
        outputs = self._forward_output(offsets, skip=frozenset(hung) | frozenset(dead))
        real_errors = {r: e for r, e in errors.items() if not e["skipped"]}
        if not hung and not dead and not real_errors:
            # Only skips (and successes): propagate the skip, the group is still in step.
            import pytest

            reason = errors[min(errors)]["message"]
            pytest.skip(f"rank {min(errors)}: {reason}")

        failures: dict[int, RankFailure] = {}
        for r, info in real_errors.items():
            exception = None
            if info["exception"] is not None:
                try:
                    exception = pickle.loads(info["exception"])
                except Exception:
                    exception = None
            failures[r] = RankFailure(
                rank=r,
                kind="raised",
                exc_type=info["exc_type"],
                message=info["message"],
                traceback=info["traceback"],
                output=_tail(outputs[r]),
                exception=exception,
            )
        for r, code in dead.items():
            failures[r] = RankFailure(
                rank=r,
                kind="died",
                message=f"rank {r} {_exit_description(code)}",
                output=_tail(outputs[r]),
                exit_code=code,
            )
        for r in hung:
            if dead and elapsed < timeout:
                why = f"still running {_DEATH_GRACE_S:g} s after rank {min(dead)} died"
            elif first_error_at is not None and elapsed < timeout:
                why = f"still running {self.failure_grace_s:g} s after another rank failed"
            else:
                why = f"timed out: no answer after {timeout:g} s"
            failures[r] = RankFailure(rank=r, kind="timeout", message=f"rank {r} {why}", output=_tail(outputs[r]))

        if self.restart_on_failure or hung or dead:
            self._discard()

        def _short(f: RankFailure) -> str:
            if f.kind == "raised":
                return f"rank {f.rank} raised {(f.exc_type or 'exception').rpartition('.')[2]}"
            if f.kind == "died":
                return f"rank {f.rank} died (exit code {f.exit_code})"
            return f"rank {f.rank} hung"

        summary = ", ".join(_short(failures[r]) for r in sorted(failures))
        lines = [f"{name} failed on {len(failures)} of {ws} ranks (world_size={ws}, {elapsed:.1f} s): {summary}"]
        kind_order = {"died": 0, "raised": 1, "timeout": 2}  # likely root causes first
        for r in sorted(failures, key=lambda r: (kind_order[failures[r].kind], r)):
            f = failures[r]
            if f.kind == "raised":
                short = f.exc_type.rpartition(".")[2] if f.exc_type else "exception"
                lines.append(f"===== rank {r} raised {short}: {f.message.splitlines()[0] if f.message else ''}")
                lines.append(f.traceback.rstrip())
            elif f.kind == "died":
                lines.append(f"===== {f.message} =====")
                lines.append(f"--- rank {r} output during the job ---")
                lines.append(f.output.rstrip() or "(none)")
            else:
                lines.append(f"===== {f.message}; Python stacks (faulthandler, SIGUSR1) follow =====")
                lines.append(f"--- rank {r} output during the job ---")
                lines.append(f.output.rstrip() or "(none)")
        raise RankError("\n".join(lines), world_size=ws, failures=failures)


# --------------------------------------------------------------------------------------------
# Process-wide cache
# --------------------------------------------------------------------------------------------

_POOLS: dict[tuple[int, str], RankPool] = {}
_POOLS_LOCK = threading.Lock()


def get_pool(world_size: int, device: str = "cpu") -> RankPool:
    """Returns the process-wide :class:`RankPool` for ``world_size`` ranks on ``device``
    (``"cpu"`` or ``"cuda"``), creating it on first use.

    The pool's processes start lazily on its first :meth:`RankPool.run`, so asking for a pool
    (e.g. through a fixture during collection) costs nothing until a job runs.

    Args:
        world_size: Number of ranks.

    Returns:
        The shared pool; the same object for every caller in this process.
    """
    with _POOLS_LOCK:
        pool = _POOLS.get((world_size, device))
        if pool is None:
            pool = _POOLS[(world_size, device)] = RankPool(world_size, device=device)
        return pool


def shutdown_all() -> None:
    """Stops the processes of every cached pool. Safe to call repeatedly."""
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
    for pool in pools:
        try:
            pool.close()
        except Exception:  # pragma: no cover - best effort at exit
            pass


atexit.register(shutdown_all)


# ---------------------------------------------------------------------------------- script children
_SCRIPT_ENDING = '''
import gc as _gc, sys as _sys
_namespace = {"__name__": "__main__"}
exec(compile(%r, "<child>", "exec"), _namespace)
_sys.stdout.flush()
_namespace.clear()
_gc.collect()
import torch.distributed as _dist
if _dist.is_available() and _dist.is_initialized():
    _dist.destroy_process_group()
'''


def ends_cleanly(code: str) -> str:
    """``code`` (a script run with ``python -c``), ended the way a script must end with gloo.

    The script's objects are released and collected before the interpreter shuts down, and the
    default group is destroyed if the script left it. A module holds its process group, and a gloo
    group's worker threads live as long as the group: one that is still releasing a finished
    collective's tensors when the interpreter finalizes needs the GIL and aborts the process
    (torch issue #190489, "terminate called without an active exception"). ``examples/train.py``
    ends the same way.
    """
    return _SCRIPT_ENDING % code
