"""Fresh-interpreter commands for the tests, forked from one interpreter that imported torch.

[Note: Test commands forked from a preloaded interpreter]
Some tests run ``python -c CODE`` or ``python -m MODULE`` in a fresh interpreter because what
they check depends on what the process imported (the redirect changes ``sys.modules``; a check of
import order; a process group of its own). Each such interpreter spends 1.5 s of CPU importing
torch. Here they are forks of one interpreter per test session that imported torch alone
(``benchmarks/gpu_run.py``'s ``_Preloaded``: the same argv, environment, working folder, import
path and exit status as ``python`` gives). Every one of those commands imports torch first,
itself or through fsdp, and ``import torch`` imports none of what they look at (torch's FSDP1
package, DCP's state-dict module, Dynamo). A command whose environment sets a variable that torch
or the interpreter reads at start-up differently from the preloaded one (``TORCH_*``,
``PYTORCH_*``, ``PYTHON*`` but ``PYTHONPATH`` and ``PYTHONWARNINGS``, which a fork applies) runs
in a fresh interpreter instead, as does any other command line (a script's path).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from typing import IO, Dict, List, Optional

from benchmarks.gpu_run import _Preloaded

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SERVER: Optional[_Preloaded] = None
_SERVER_ENV: Dict[str, str] = {}


def _read_at_start(name: str) -> bool:
    """Whether python or torch reads ``name`` at start-up, where a fork cannot apply it (the
    preloaded interpreter applies ``PYTHONPATH``, and ``PYTHONWARNINGS`` where it had none)."""
    applied = ("PYTHONPATH",) if _SERVER_ENV.get("PYTHONWARNINGS") else ("PYTHONPATH", "PYTHONWARNINGS")
    return name.startswith(("TORCH_", "PYTORCH_")) or (name.startswith("PYTHON") and name not in applied)


def _server_for(args: List[str], env: Dict[str, str]) -> Optional[_Preloaded]:
    """The session's preloaded interpreter where it can run ``python *args`` in ``env``."""
    global _SERVER, _SERVER_ENV
    if not args or args[0] not in ("-c", "-m"):
        return None
    if _SERVER is None:
        _SERVER_ENV = {**os.environ, "PYTHONPATH": REPO_ROOT}
        _SERVER = _Preloaded(_SERVER_ENV, preload=("torch",))
    names = {n for n in (*env, *_SERVER_ENV) if _read_at_start(n)}
    if any(env.get(n) != _SERVER_ENV.get(n) for n in names):
        return None
    return _SERVER


class Started:
    """A started ``python`` command; :meth:`wait` gives its :class:`subprocess.CompletedProcess`."""

    def __init__(self, args: List[str], env: Dict[str, str], cwd: str) -> None:
        self.args = [sys.executable, *args]
        self._out: IO[str] = tempfile.NamedTemporaryFile("w+", prefix="cmd-out-", delete=False)
        self._err: IO[str] = tempfile.NamedTemporaryFile("w+", prefix="cmd-err-", delete=False)
        self._server = _server_for(args, env)
        self._pid: Optional[int] = None
        self._proc: Optional[subprocess.Popen] = None
        if self._server is not None:
            self._pid = self._server.start(self.args, env, self._out.name, self._err.name, cwd=cwd)
        if self._pid is None:  # not forkable, or the preloaded interpreter failed: fresh
            self._server = None
            self._proc = subprocess.Popen(self.args, env=env, cwd=cwd, stdout=self._out, stderr=self._err)

    def wait(self, timeout: float) -> subprocess.CompletedProcess:
        """Waits for the command; kills it after ``timeout`` s and raises ``TimeoutExpired``."""
        if self._server is not None and self._pid is not None:
            code = self._server.wait(self._pid, timeout)
        else:
            assert self._proc is not None
            try:
                code = self._proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
                code = None
        outputs = []
        for f in (self._out, self._err):
            f.seek(0)
            outputs.append(f.read())
            f.close()
            os.unlink(f.name)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout, outputs[0], outputs[1])
        return subprocess.CompletedProcess(self.args, code, outputs[0], outputs[1])


def start_python(args: List[str], *, env: Dict[str, str], cwd: str = REPO_ROOT) -> Started:
    """Starts ``python *args`` ([Note: Test commands forked from a preloaded interpreter]);
    several may run side by side (a test's ranks)."""
    return Started(args, env, cwd)


def run_python(args: List[str], *, env: Dict[str, str], timeout: float, cwd: str = REPO_ROOT) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *args], env=env, cwd=cwd, capture_output=True,
    text=True, timeout=timeout)``, as a fork of the preloaded interpreter where it can be."""
    return start_python(args, env=env, cwd=cwd).wait(timeout)


def close() -> None:
    """Ends the preloaded interpreter (the session's end: ``tests/conftest.py``)."""
    global _SERVER
    if _SERVER is not None:
        _SERVER.close()
        _SERVER = None
