"""The prepared GPU run: everything that has not run on a GPU, in order, in one
command, within a time budget.

On the GPU machine, from the repository root (torch preinstalled, no network)::

    python3 benchmarks/gpu_run.py --out /tmp/g --budget-s 530; tar czf $OUT/gpu_run.tgz -C /tmp/g .

(the device tool brings back at most 8 files, and the run writes about 15: they travel as one
archive; 530 s of budget leave the 10-minute command time for the archive and a slow start).

The script installs fsdp itself (``pip install --no-deps --no-build-isolation -e .``, which
touches no other package; ``--no-install`` skips it) and every step also runs with the
repository root on ``PYTHONPATH``, so a failed install does not stop the run. Steps, in order,
each a subprocess with its own time limit (its log in ``$OUT/NN_<step>.log``, JSON or JUnit XML
beside it):

1. ``cuda_lane``: ``FSDP_TEST_DEVICE=cuda python -m pytest tests/test_cuda_lane.py
   tests/test_cuda_lane_offload.py tests/test_cuda_lane_async_checkpoint.py`` (the overlap test
   on the fake group adds a fresh interpreter and about 10 s of slept steps: 180 s);
2. ``lane_sanitizer``: the lane's training parity under ``TORCH_CUDA_SANITIZER=1`` (about 90 s on
   an H100: the sanitizer traces every kernel launch);
3. ``scale``: rank 0 of N = 8 and 64 on torch's fake process group with emulated NVLink and
   InfiniBand collectives (``benchmarks/scale.py``): fsdp, torch FSDP1 and FSDP2, step time,
   exposed communication, per-rank memory, the planner beside (at most 180 s);
4. ``plan_gpu``: the memory planner against ``torch.cuda.max_memory_allocated`` (10M, 100M, 1B);
5. ``ws2_memory``: world size 2 on the one GPU, per-rank max allocated, fsdp against torch FSDP1;
6. ``bench_eager`` and ``bench_compile``: the GPU benchmark at world size 1, then ``--compile``
   runs of fsdp, torch FSDP1 and the unwrapped model;
7. ``offload``: CPU offload, fsdp against torch FSDP1, walking 1B, 2B, 4B (one size compared,
   and the largest each trains);
8. ``offload_walk``: fsdp's fractional offload at 0/25/50/75/100% of a 1B GPT (step time, max
   allocated, each point against its floor), the copy and host AdamW rates beside
   (``benchmarks/offload_walk.py``);
9. ``export``: issue 34's weight export at world size 1 on NCCL, 1.007B parameters in 15 units
   (``benchmarks/export.py --device cuda``): fsdp's stream beside torch FSDP1's summon walk and
   FULL_STATE_DICT and torch FSDP2's ``full_tensor()`` loop, seconds per GB and peak extra
   ``max_memory_allocated``, the delta after one AdamW step (about 40-60 s: spawn, three 1B
   models, about 50 exports, two SHA-1'd host copies for the delta; at most 120 s);
10. ``cpu_suite``: whatever time is left, the CPU suite on the GPU machine's torch.

A step starts only while at least its minimum time is left; its limit is the smaller of its cap
and the time left, and a step over its limit is killed with its whole process group. After each
step ``$OUT/summary.json`` is rewritten (step, command, exit code, seconds, status), so a run
cut short still says what it did. ``--steps a,b`` runs a subset (to split the run over two device
calls: one command may run at most 10 minutes, hence the default budget of 540 s). The steps no
longer fit one call; the split (step seconds from the H200 run of 2026-11-28)::

    --steps install,env,cuda_lane,lane_sanitizer,scale,plan_gpu,export      # about 4+11+40+100+180+75+60
    --steps ws2_memory,bench_eager,bench_compile,offload,offload_walk,cpu_suite   # about 42+109+136+73+150

``export`` goes in the first call, last (``--budget-s 530``): the second is already full, and in
the first, with the other steps as long as on 2026-11-28 and ``scale`` (not yet run on a GPU) at
its 180 s cap, about 120 s are left for it. Where the first call's ``summary.json`` says
``export`` was skipped, add it to the second.

``--dry-run`` runs the same orchestration on CPU: every step's modules are imported in one fresh
interpreter, and each step runs a quick CPU equivalent of its command (the benchmarks'
``--cpu-dry-run`` or ``--dry-run`` on a tiny GPT, the planner's ``--list``, the lane collected
without a GPU, the suite collected); the exact GPU command is written beside it. The install is
never run in a dry run. Its commands are forks of one interpreter that imported torch once
([Note: The dry run's preloaded interpreter]). ``tests/test_gpu_run.py`` runs it.

This file uses only the standard library: it runs before fsdp is installed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
#: A tiny GPT for the dry run's benchmark steps.
TINY = ["--layers", "2", "--d-model", "32", "--n-head", "4", "--vocab", "64", "--seq", "16", "--batch", "2"]

#: ``(limit in seconds) -> argv`` of a step.
Command = Callable[[float], list[str]]
#: ``(argv, env, limit, log path) -> (exit code or None on timeout, seconds)``: how a command runs.
Runner = Callable[[list[str], dict[str, str], float, str], tuple[Optional[int], float]]


@dataclasses.dataclass(frozen=True)
class Step:
    """One step of the run.

    Attributes:
        name: Its name (the log is ``NN_<name>.log``).
        cap_s: The most seconds it may run.
        min_s: It starts only with at least this many seconds of the budget left.
        gpu: The command on the GPU machine.
        dry: The CPU equivalent for ``--dry-run``.
        modules: What the commands import (checked in the dry run; a test module is checked by
            pytest collecting it, since the lane skips itself at import without a GPU).
        env: Extra environment of the command (the dry run's too).
        dry_codes: Exit codes that pass in the dry run: the lane, run without a GPU, skips itself
            at collection, which pytest reports as exit code 5 (nothing ran).
    """

    name: str
    cap_s: float
    min_s: float
    gpu: Command
    dry: Command
    modules: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    dry_codes: tuple[int, ...] = (0,)


def _bench(out: str, name: str, *flags: str) -> Command:
    """The GPU benchmark with ``flags``; its own time budget and hang timeout inside the limit."""

    def cmd(limit: float) -> list[str]:
        budget, hang = max(20.0, limit - 60.0), max(30.0, limit - 10.0)
        return [PY, "-m", "benchmarks", "--device", "cuda", *flags, "--json", os.path.join(out, f"{name}.json"),
                "--time-budget", f"{budget:.0f}", "--hang-timeout", f"{hang:.0f}"]

    return cmd


def _pytest(out: str, name: str, *args: str) -> Command:
    return lambda limit: [PY, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider",
                          f"--junitxml={os.path.join(out, name + '.xml')}", *args]


def steps(out: str) -> list[Step]:
    """Every step, in run order (see the module docstring)."""
    lane, lane_offload = "tests/test_cuda_lane.py", "tests/test_cuda_lane_offload.py"
    lane_async = "tests/test_cuda_lane_async_checkpoint.py"
    return [
        Step("install", 90, 10,
             lambda limit: [PY, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-e", "."],
             lambda limit: [PY, "-c", "print('dry run: the install is not run')"], ()),
        Step("env", 30, 5,
             lambda limit: [PY, "-c", "import torch, fsdp; print(torch.__version__, torch.version.cuda, "
                            "torch.cuda.get_device_name(0), torch.cuda.mem_get_info(0))"],
             lambda limit: [PY, "-c", "import torch, fsdp; print(torch.__version__, torch.cuda.is_available())"],
             ("torch", "fsdp")),
        Step("cuda_lane", 180, 60, _pytest(out, "cuda_lane", lane, lane_offload, lane_async),
             _pytest(out, "cuda_lane", lane, lane_offload, lane_async),
             ("pytest", "tests.conftest", "tests._models", "tests._object_device"), (("FSDP_TEST_DEVICE", "cuda"),), (0, 5)),
        Step("lane_sanitizer", 120, 60, _pytest(out, "lane_sanitizer", lane, "-k", "test_training_parity"),
             _pytest(out, "lane_sanitizer", lane, "-k", "test_training_parity"),
             ("pytest", "tests.conftest", "tests._models"), (("FSDP_TEST_DEVICE", "cuda"), ("TORCH_CUDA_SANITIZER", "1")),
             (0, 5)),
        Step("scale", 180, 90,
             lambda limit: [PY, "-m", "benchmarks.scale", "--device", "cuda", "--json", os.path.join(out, "scale.json"),
                            "--time-budget", f"{max(30.0, limit - 75):.0f}"],
             # Rank 3 of 16 over two nodes, FULL_SHARD and HYBRID_SHARD: tests/test_gpu_run.py
             # asserts the CPU run's collectives and modelled seconds on this step's JSON and log.
             lambda limit: [PY, "-m", "benchmarks.scale", "--cpu-dry-run", "--model", "tiny", "--rank", "3",
                            "--world-size", "16", "--fabric", "ib", "--strategies", "FULL_SHARD,HYBRID_SHARD",
                            "--batch", "2", "--seq", "16", "--warmup", "1", "--steps", "1", "--rounds", "1",
                            "--no-plan", "--json", os.path.join(out, "scale.json")],
             ("benchmarks.scale",)),
        Step("plan_gpu", 75, 40,
             lambda limit: [PY, "-m", "benchmarks.validate_plan", "--device", "cuda", "--max-total", "60GiB",
                            "--timeout", f"{max(10.0, limit - 10):.0f}", "10M", "100M", "1B"],
             lambda limit: [PY, "-m", "benchmarks.validate_plan", "--device", "cuda", "--list", "10M", "100M", "1B"],
             ("benchmarks.validate_plan",)),
        Step("ws2_memory", 90, 40,
             lambda limit: [PY, "-m", "benchmarks.ws2_memory", "--timeout", f"{max(10.0, limit / 2 - 5):.0f}",
                            "--json", os.path.join(out, "ws2_memory.json")],
             lambda limit: [PY, "-m", "benchmarks.ws2_memory", "--dry-run", *TINY, "--steps", "2",
                            "--json", os.path.join(out, "ws2_memory.json")],
             ("benchmarks.ws2_memory",)),
        Step("bench_eager", 150, 60, _bench(out, "bench_eager", "--rounds", "3"),
             # Two rounds of two steps and the profile: tests/test_gpu_run.py asserts the
             # benchmark's CPU run end to end on this step's JSON and log (one run, not two).
             _bench(out, "bench_eager", "--cpu-dry-run", *TINY, "--rounds", "2", "--warmup-steps", "1", "--steps", "2",
                    "--profile"),
             ("benchmarks.__main__", "benchmarks.cuda")),
        Step("bench_compile", 180, 90,
             _bench(out, "bench_compile", "--compile", "--only", "fsdp,torch_fsdp1,local", "--rounds", "1",
                    "--warmup-steps", "3", "--steps", "5"),
             _bench(out, "bench_compile", "--cpu-dry-run", *TINY, "--compile", "--compile-backend", "aot_eager",
                    "--only", "fsdp,torch_fsdp1",
                    "--rounds", "1", "--warmup-steps", "1", "--steps", "1"),
             ("benchmarks.__main__", "benchmarks.cuda")),
        Step("offload", 120, 60, _bench(out, "offload", "--offload", "--offload-sizes", "1,2,4"),
             _bench(out, "offload", "--cpu-dry-run", *TINY, "--offload-sizes", "3e-5,1e-5"),
             ("benchmarks.__main__", "benchmarks.cuda")),
        Step("offload_walk", 150, 60,
             lambda limit: [PY, "-m", "benchmarks.offload_walk", "--device", "cuda",
                            "--json", os.path.join(out, "offload_walk.json")],
             lambda limit: [PY, "-m", "benchmarks.offload_walk", "--cpu-dry-run", *TINY, "--warmup-steps", "0",
                            "--steps", "1", "--json", os.path.join(out, "offload_walk.json")],
             ("benchmarks.offload_walk",)),
        Step("export", 120, 60,
             lambda limit: [PY, "-m", "benchmarks.export", "--device", "cuda", "--timeout", f"{max(20.0, limit - 10):.0f}",
                            "--json", os.path.join(out, "export.json")],
             lambda limit: [PY, "-m", "benchmarks.export", "--device", "cpu", "--world-sizes", "1", "--layers", "2", "--d", "64",
                            "--reps", "1", "--ratio-reps", "1", "--bucket-mib", "1", "--json", os.path.join(out, "export.json")],
             ("benchmarks.export",)),
        Step("cpu_suite", 10_000, 60, _pytest(out, "cpu_suite", "tests"),
             _pytest(out, "cpu_suite", "--collect-only", "tests"), ("tests",)),
    ]


def _run(argv: list[str], env: dict[str, str], limit: float, log_path: str) -> tuple[Optional[int], float]:
    """Runs ``argv`` from the repository root with its output in ``log_path``; kills its whole
    process group after ``limit`` seconds. Returns (exit code or None on timeout, seconds)."""
    start = time.monotonic()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(argv) + "\n")
        log.flush()
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code: Optional[int] = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            code = None
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            log.write(f"\n[gpu_run] killed after its limit of {limit:.0f} s\n")
    return code, time.monotonic() - start


# [Note: The dry run's preloaded interpreter]
# Every dry-run step but the install imports torch, which costs seconds of CPU per interpreter
# (1-3 s each on 2 cores). So a dry run starts one interpreter that imports torch once
# (:data:`PRELOAD`), and each command is a fork of it, run the way ``python -c`` or ``python -m``
# runs it (same argv, environment, working directory, the import path python builds from the
# command's PYTHONPATH, and its PYTHONWARNINGS; its own process group, killed as a group after its
# limit, its exit status reported as it exits, so commands may also run side by side). Not its own session: with the kernel's autogroup
# scheduling (on by default) every session gets an equal share of the CPUs, so on a busy machine
# a fork in a session of its own would run at a speed set by how many other sessions run, not
# at its caller's (tests/test_example_train.py forks the trainer this way too). A step whose environment names a ``TORCH_`` variable
# (read when torch is imported, e.g. TORCH_CUDA_SANITIZER) runs in a fresh interpreter. The
# harness's rank pools fork their ranks from a torch-loaded server the same way
# (tests/_harness.py), and the tests' fresh-interpreter commands are forks of one such
# interpreter (tests/_preloaded.py). On the GPU every command is a fresh process (:func:`_run`).

#: What the preloaded interpreter imports: torch and the torch packages most steps load (the
#: benchmarks run torch's FSDP1 beside fsdp; the test collection imports DCP); not fsdp, which the
#: ``env`` step imports from the repository as the install left it.
PRELOAD = ("torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.checkpoint")
_PRELOADED = r"""
import atexit, importlib, json, os, runpy, select, sys, traceback
for name in sys.argv[1:]:  # once, for every command forked below
    importlib.import_module(name)
def pythonpath(value):  # its entries as python puts them on sys.path at start-up
    return [os.path.abspath(p) for p in value.split(os.pathsep)] if value else []
site_path = sys.path[1 + len(pythonpath(os.environ.get("PYTHONPATH", ""))):]  # after '' and those
base_warnings = os.environ.get("PYTHONWARNINGS", "")
pending, running, eof = b"", set(), False
while not eof or running:
    # Requests come on stdin, one JSON line each; every fork runs while the next is read, and
    # each exit is reported as it happens ("exit PID STATUS"): commands may run side by side.
    if select.select([] if eof else [0], [], [], 0.05 if running else None)[0]:
        chunk = os.read(0, 65536)
        eof = not chunk
        pending += chunk
    while running:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            break
        running.discard(pid)
        print("exit", pid, os.waitstatus_to_exitcode(status), flush=True)
    while b"\n" in pending:
        line, pending = pending.split(b"\n", 1)
        argv, env, log, err_log, cwd = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os.setpgid(0, 0)  # its own process group, not session: see the Note
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            out = os.open(log, os.O_WRONLY | os.O_APPEND)
            err = os.open(err_log, os.O_WRONLY | os.O_APPEND) if err_log else out
            os.dup2(out, 1)
            os.dup2(err, 2)
            os.close(out)
            if err != out:
                os.close(err)
            os.environ.clear()
            os.environ.update(env)
            os.chdir(cwd)
            code = 0
            try:
                # The import path python would start with: the command's first entry, then
                # its environment's PYTHONPATH, then the installation's.
                first = "" if argv[1] == "-c" else os.getcwd()
                sys.path[:] = [first, *pythonpath(env.get("PYTHONPATH", "")), *site_path]
                if not base_warnings and env.get("PYTHONWARNINGS"):  # as python applies it at start
                    import warnings
                    sys.warnoptions[:] = env["PYTHONWARNINGS"].split(",")
                    warnings._processoptions(sys.warnoptions)
                if argv[1] == "-c":
                    sys.argv = ["-c", *argv[3:]]
                    exec(compile(argv[2], "<string>", "exec"), {"__name__": "__main__"})
                else:
                    sys.argv = [argv[2], *argv[3:]]
                    runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
                if not isinstance(exc.code, (int, type(None))):
                    print(exc.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
                code = 1
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        running.add(pid)
        print("started", pid, flush=True)
"""


class _Preloaded:
    """The dry run's preloaded interpreter ([Note: The dry run's preloaded interpreter]); its
    :meth:`run` is :func:`_run`'s twin. Commands may also run side by side: :meth:`start` each,
    then :meth:`wait` for each (a test's ranks)."""

    def __init__(self, env: dict[str, str], preload: Sequence[str] = PRELOAD) -> None:
        self._env = env
        self._preload = list(preload)
        self._proc: Optional[subprocess.Popen] = None
        self._lock = threading.Lock()  # one request at a time: its "started" line is the next
        self._changed = threading.Condition()
        self._started: list[int] = []
        self._exits: dict[int, int] = {}
        self._dead = False

    def _read_replies(self, proc: subprocess.Popen) -> None:
        """Turns the interpreter's reply lines into :attr:`_started` and :attr:`_exits` (a thread)."""
        for line in proc.stdout:  # type: ignore[union-attr]
            kind, *numbers = line.split()
            with self._changed:
                if kind == "started":
                    self._started.append(int(numbers[0]))
                elif kind == "exit":
                    self._exits[int(numbers[0])] = int(numbers[1])
                self._changed.notify_all()
        with self._changed:
            if self._proc in (proc, None):  # not a later interpreter's
                self._dead = True
            self._changed.notify_all()

    def start(self, argv: list[str], env: dict[str, str], log_path: str, err_path: Optional[str] = None,
              cwd: str = ROOT) -> Optional[int]:
        """Starts ``argv`` (``PY -c ...`` or ``PY -m ...``) as a fork in ``cwd``, its stdout
        appended to ``log_path`` and its stderr to ``err_path`` (else to ``log_path`` too); returns
        its pid, or None where the preloaded interpreter failed (:meth:`wait` it)."""
        with self._lock:
            if self._proc is None:
                self._proc = subprocess.Popen([PY, "-c", _PRELOADED, *self._preload], cwd=ROOT, env=self._env,
                                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                self._dead, self._started, self._exits = False, [], {}
                threading.Thread(target=self._read_replies, args=(self._proc,), daemon=True).start()
            assert self._proc.stdin is not None
            try:
                self._proc.stdin.write(json.dumps([argv, env, log_path, err_path, cwd]) + "\n")
                self._proc.stdin.flush()
            except (OSError, ValueError):
                self.close()
                return None
            with self._changed:
                self._changed.wait_for(lambda: self._started or self._dead)
                return self._started.pop(0) if self._started else None

    def wait(self, pid: int, limit: float) -> Optional[int]:
        """The exit status of the fork ``pid``; None where it ran past ``limit`` seconds (it is
        then killed, with its process group); 1 where the preloaded interpreter died."""
        with self._changed:
            if not self._changed.wait_for(lambda: pid in self._exits or self._dead, timeout=limit):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
                self._changed.wait_for(lambda: pid in self._exits or self._dead)
                self._exits.pop(pid, None)
                return None
            return self._exits.pop(pid) if pid in self._exits else 1

    def run(
        self, argv: list[str], env: dict[str, str], limit: float, log_path: str, err_path: Optional[str] = None
    ) -> tuple[Optional[int], float]:
        """Runs ``argv`` (``PY -c ...`` or ``PY -m ...``) as a fork of the preloaded interpreter;
        its stderr goes to ``err_path`` when given (created empty), else (and in the fresh
        interpreter a ``TORCH_`` variable or a failed fork falls back to) to ``log_path`` too."""
        if any(k.startswith("TORCH_") for k in env) or argv[1] not in ("-c", "-m"):
            return _run(argv, env, limit, log_path)
        start = time.monotonic()
        with open(log_path, "w") as log:
            log.write("$ " + " ".join(argv) + "\n")
        if err_path:
            open(err_path, "w").close()
        pid = self.start(argv, env, log_path, err_path)
        if pid is None:  # a fresh interpreter then says what fails
            return _run(argv, env, limit, log_path)
        code = self.wait(pid, limit)
        if code is None:
            with open(log_path, "a") as log:
                log.write(f"\n[gpu_run] killed after its limit of {limit:.0f} s\n")
        elif self._dead and code == 1:  # the preloaded interpreter itself died
            self.close()
            with open(log_path, "a") as log:
                log.write("\n[gpu_run] the preloaded interpreter died (see gpu_run's stderr)\n")
        return code, time.monotonic() - start

    def close(self) -> None:
        """Ends the preloaded interpreter (its input closed, it exits once its forks have)."""
        proc, self._proc = self._proc, None
        if proc is not None:
            with contextlib.suppress(OSError, ValueError):
                proc.stdin.close()  # type: ignore[union-attr]
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _import_check(modules: Sequence[str], env: dict[str, str], log_path: str, run: Runner = _run) -> set[str]:
    """The modules that do not import, each tried in one fresh interpreter (the dry run's first
    check, once for every step: one interpreter start, not one per step)."""
    if not modules:
        return set()
    code = (
        "import importlib, json\nfailed = []\n"
        f"for name in {sorted(set(modules))!r}:\n"
        "    try:\n        importlib.import_module(name)\n"
        "    except Exception as exc:\n        print(name, repr(exc))\n        failed.append(name)\n"
        "print('FAILED ' + json.dumps(failed))\n"
    )
    rc, _ = run([PY, "-c", code], env, 120, log_path)
    with open(log_path) as log:
        lines = [line for line in log.read().splitlines() if line.startswith("FAILED ")]
    if rc != 0 or not lines:
        return set(modules)
    return set(json.loads(lines[-1][len("FAILED "):]))


def _checked(not_importing: Optional[set[str]], plan: Sequence[Step], wanted: Sequence[str],
             env: dict[str, str], out: str, run: Runner) -> set[str]:
    """``not_importing``, or, the first time (None: a dry run before its first step starts), the
    modules of every wanted step that do not import (:func:`_import_check`, ``00_imports.log``)."""
    if not_importing is not None:
        return not_importing
    modules = [m for step in plan if step.name in wanted for m in step.modules]
    return _import_check(modules, env, os.path.join(out, "00_imports.log"), run)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the steps; returns 0 when every step that ran passed, else 1."""
    p = argparse.ArgumentParser(prog="python benchmarks/gpu_run.py", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="folder for logs and JSON ($OUT on the device)")
    p.add_argument("--budget-s", type=float, default=540.0, help="total seconds; no step starts after")
    p.add_argument("--steps", default=None, help="comma-separated subset of the step names (default: all)")
    p.add_argument("--no-install", action="store_true", help="skip the pip install step")
    p.add_argument("--dry-run", action="store_true", help="the same orchestration on CPU, quick equivalents")
    a = p.parse_args(argv)
    deadline = time.monotonic() + a.budget_s
    os.makedirs(a.out, exist_ok=True)
    plan = steps(os.path.abspath(a.out))
    names = [s.name for s in plan]
    wanted = names if a.steps is None else [n.strip() for n in a.steps.split(",") if n.strip()]
    unknown = sorted(set(wanted) - set(names))
    if unknown:
        p.error(f"--steps: unknown {unknown}; choose from {names}")
    if a.no_install:
        wanted = [n for n in wanted if n != "install"]
    base_env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    summary: dict[str, object] = {"dry_run": a.dry_run, "budget_s": a.budget_s, "steps": []}
    records: list[dict[str, object]] = summary["steps"]  # type: ignore[assignment]
    # The dry run's import check runs once, just before the first step that starts (none may:
    # a budget too small for every step wanted skips them all, and then it checks nothing).
    not_importing: Optional[set[str]] = None if a.dry_run else set()
    preloaded = _Preloaded(base_env) if a.dry_run else None
    run = preloaded.run if preloaded else _run
    for index, step in enumerate(plan, 1):
        if step.name not in wanted:
            continue
        left = deadline - time.monotonic()
        limit = min(step.cap_s, left)
        env = dict(base_env, **dict(step.env))
        gpu_cmd = step.gpu(limit)
        rec: dict[str, object] = {"step": step.name, "gpu_command": " ".join(gpu_cmd), "env": dict(step.env)}
        log = os.path.join(a.out, f"{index:02d}_{step.name}.log")
        if left < step.min_s:
            rec.update(status="skipped", reason=f"{left:.0f} s left, needs {step.min_s:.0f}")
        elif (not_importing := _checked(not_importing, plan, wanted, base_env, a.out, run)) & set(step.modules):
            rec.update(status="failed", reason="a module it references does not import (see 00_imports.log)")
        else:
            cmd = step.dry(limit) if a.dry_run else gpu_cmd
            code, seconds = run(cmd, env, limit, log)
            passing = step.dry_codes if a.dry_run else (0,)
            status = "timeout" if code is None else ("ok" if code in passing else "failed")
            rec.update(command=" ".join(cmd), exit_code=code, seconds=round(seconds, 1), limit_s=round(limit), status=status)
        records.append(rec)
        print(f"[gpu_run] {step.name}: {rec['status']} {rec.get('seconds', '')}", flush=True)
        with open(os.path.join(a.out, "summary.json.tmp"), "w") as f:
            json.dump(summary, f, indent=1)
        os.replace(os.path.join(a.out, "summary.json.tmp"), os.path.join(a.out, "summary.json"))
    if preloaded:
        preloaded.close()
    return 0 if all(r["status"] in ("ok", "skipped") for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
