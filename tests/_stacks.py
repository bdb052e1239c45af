"""Launching the stack example scripts (docs/examples/stacks/) on local CPU ranks for the tests.

The stacks (accelerate, Lightning, torchrun scripts) initialize the process group themselves
and the redirect must run before they are imported, so these runs cannot use the shared rank
pools (whose processes have torch's package loaded): each run is fresh processes, launched the
way ``torchrun`` launches them (the same environment variables, ``TORCHELASTIC_RUN_ID``
included, which Lightning reads to know it was launched), without torchrun's agent process.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from tests._preloaded import run_python

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES_DIR = os.path.join(REPO_ROOT, "docs", "examples", "stacks")
RUN_TIMEOUT_S = 240.0
"""Per run (both ranks, start-up included); a run takes 10-40 s on 2 idle cores."""

# [Note: Stack ranks forked from a preloaded interpreter]
# With ``preload``, one interpreter (the redirect installed first for the fsdp backend, as
# ``python -m fsdp.torch_alias`` installs it before the script runs) imports the stack's package
# once and forks every rank, instead of each rank importing it (Lightning: ~5 s of CPU a
# process). A forked rank then runs the script as ``python SCRIPT`` (or ``python -m
# fsdp.torch_alias SCRIPT``) would: its environment, working folder, ``sys.argv``, the
# script's folder first on the import path, ``runpy.run_path`` as ``__main__``. What the
# preloaded packages read from the environment at import, they read without the rank's
# variables (as rank 0); Lightning's strategies set their ranks again when they start.
# The interpreter kills the other ranks when one fails (a peer blocks in a collective) and
# prints every rank's exit status. It is itself a fork of the session's interpreter that imported
# torch alone ([Note: Test commands forked from a preloaded interpreter] in tests/_preloaded.py),
# which the redirect and every stack import first anyway.
_PRELOADED = r"""
import json, os, runpy, sys, traceback
request = json.loads(sys.argv[1])
if request["redirect"]:
    from fsdp.torch_alias import redirect_torch_fsdp
    redirect_torch_fsdp()
for name in request["preload"]:
    __import__(name)
pids = []
for env, log_path in request["ranks"]:
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.environ.clear()
            os.environ.update(env)
            os.chdir(request["cwd"])
            sys.argv = list(request["argv"])
            sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
            try:
                runpy.run_path(sys.argv[0], run_name="__main__")
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            import atexit
            atexit._run_exitfuncs()
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    pids.append(pid)
codes = {}
while len(codes) < len(pids):
    pid, status = os.wait()
    codes[pid] = os.waitstatus_to_exitcode(status)
    if codes[pid] != 0:
        for other in pids:
            if other not in codes:
                try:
                    os.kill(other, 9)
                except ProcessLookupError:
                    pass
print(json.dumps([codes.get(pid) for pid in pids]), flush=True)
"""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_example(
    script: str,
    args: List[str],
    *,
    backend: str,
    world_size: int = 2,
    out_dir: Optional[str] = None,
    extra_env: Optional[Dict[str, str]] = None,
    preload: Sequence[str] = (),
) -> Dict[str, Any]:
    """Runs ``docs/examples/stacks/<script>`` on ``world_size`` CPU ranks and returns its result.

    Args:
        script: The example's file name.
        args: Its arguments (``--out`` is added).
        backend: ``"torch"`` runs the script as is (torch's FSDP1); ``"fsdp"`` runs it through
            ``python -m fsdp.torch_alias`` (the redirect, the script unchanged).
        world_size: The number of ranks.
        out_dir: The folder for checkpoints and ``result.json`` (a new temporary one if None); one
            that does not exist yet is the script's to create (the ranks run in its parent).
        extra_env: More environment variables for the ranks.
        preload: Modules to import once and fork every rank from, instead of starting each
            rank fresh ([Note: Stack ranks forked from a preloaded interpreter]); empty: fresh.

    Returns:
        The ``result.json`` that rank 0 wrote.

    Raises:
        AssertionError: If a rank fails or the run times out (with every rank's output).
    """
    if backend not in ("torch", "fsdp"):
        raise ValueError(f"backend must be 'torch' or 'fsdp', got {backend!r}")
    out_dir = out_dir or tempfile.mkdtemp(prefix=f"stacks-{backend}-")
    port = _free_port()
    path = os.path.join(EXAMPLES_DIR, script)
    cmd = [sys.executable] + (["-m", "fsdp.torch_alias"] if backend == "fsdp" else []) + [path]
    cmd += list(args) + ["--out", out_dir]
    envs = []
    for rank in range(world_size):
        env = dict(os.environ)
        env.update(
            {
                "PYTHONPATH": os.pathsep.join([REPO_ROOT] + [p for p in [env.get("PYTHONPATH")] if p]),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "GROUP_RANK": "0",
                "ROLE_RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_WORLD_SIZE": str(world_size),
                "ROLE_WORLD_SIZE": str(world_size),
                "TORCHELASTIC_RUN_ID": f"stacks-{port}",
                "OMP_NUM_THREADS": "1",
                "CUDA_VISIBLE_DEVICES": "",
                "PYTHONWARNINGS": "ignore::FutureWarning",
            }
        )
        env.update(extra_env or {})
        envs.append(env)
    cwd = out_dir if os.path.isdir(out_dir) else os.path.dirname(out_dir)
    launch = _launch_preloaded if preload else _launch_fresh
    codes, outputs = launch(cmd, envs, cwd, backend == "fsdp", preload)
    if any(code != 0 for code in codes):
        raise AssertionError(
            f"{script} ({backend}) failed: {' '.join(cmd)}\n"
            + "\n".join(f"--- rank {rank} (exit {code}) ---\n{out}" for rank, (code, out) in enumerate(zip(codes, outputs)))
        )
    with open(os.path.join(out_dir, "result.json"), encoding="utf-8") as f:
        return json.load(f)


def _launch_fresh(
    cmd: List[str], envs: List[Dict[str, str]], cwd: str, redirect: bool, preload: Sequence[str]
) -> Tuple[List[Optional[int]], List[str]]:
    """Runs ``cmd`` once per rank environment, each a fresh interpreter; returns the exit codes
    (None: killed) and the tails of their outputs."""
    procs = []
    logs = []
    for env in envs:
        log = tempfile.TemporaryFile(mode="w+")
        logs.append(log)
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=cwd))
    deadline = time.monotonic() + RUN_TIMEOUT_S
    failed = False
    for proc in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            failed = True
        failed = failed or proc.returncode != 0
        if failed:
            break
    if failed:  # a peer of a failed rank blocks in a collective: stop them all
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read()[-6000:])
        log.close()
    return [proc.returncode for proc in procs], outputs


def _launch_preloaded(
    cmd: List[str], envs: List[Dict[str, str]], cwd: str, redirect: bool, preload: Sequence[str]
) -> Tuple[List[Optional[int]], List[str]]:
    """:func:`_launch_fresh`'s twin: every rank forked from one interpreter that imported
    ``preload`` ([Note: Stack ranks forked from a preloaded interpreter])."""
    argv = cmd[cmd.index("fsdp.torch_alias") + 1:] if redirect else cmd[1:]
    common = {k: v for k, v in envs[0].items() if k not in ("RANK", "LOCAL_RANK", "ROLE_RANK")}
    with tempfile.TemporaryDirectory(prefix="stacks-logs-") as logs:
        paths = [os.path.join(logs, f"rank{rank}.log") for rank in range(len(envs))]
        request = {"redirect": redirect, "preload": list(preload), "cwd": cwd, "argv": argv,
                   "ranks": [[env, path] for env, path in zip(envs, paths)]}
        returncode: Optional[int] = None
        codes: List[Optional[int]] = [None] * len(envs)
        try:  # killed with its ranks (its process group) after the timeout
            done = run_python(["-c", _PRELOADED, json.dumps(request)], env=common, cwd=cwd, timeout=RUN_TIMEOUT_S)
            returncode, err = done.returncode, done.stderr
            if returncode == 0:
                codes = json.loads(done.stdout.strip().splitlines()[-1])
        except subprocess.TimeoutExpired as timed_out:
            err = str(timed_out.stderr or "")
        outputs = []
        for path in paths:
            text = open(path, encoding="utf-8", errors="replace").read() if os.path.exists(path) else ""
            outputs.append(text[-6000:])
    if returncode != 0:
        outputs[0] += f"\n--- the preloaded interpreter (exit {returncode}) ---\n{err[-6000:]}"
    return codes, outputs


@dataclass
class BackendRuns:
    """One example run on torch's FSDP1 and one through the redirect on fsdp.

    Attributes:
        torch_result, fsdp_result: The ``result.json`` of each run.
        torch_out, fsdp_out: Each run's output folder (checkpoints).
    """

    torch_result: Dict[str, Any]
    fsdp_result: Dict[str, Any]
    torch_out: str
    fsdp_out: str


def run_on_both_backends(
    script: str,
    tmp_path_factory: Any,
    torch_args: List[str],
    fsdp_args: Callable[[str], List[str]],
    out_created_by_script: bool = False,
    preload: Sequence[str] = (),
) -> BackendRuns:
    """Runs ``script`` on torch's FSDP1, then (the script unchanged) on fsdp.

    Args:
        script: The example's file name.
        tmp_path_factory: pytest's, for the two output folders.
        torch_args: The torch run's arguments.
        fsdp_args: The fsdp run's arguments, given the torch run's output folder (to resume
            from its checkpoints).
        out_created_by_script: Pass each run an ``--out`` folder that does not exist yet (the
            script must create it).
        preload: :func:`run_example`'s, for both runs.
    """
    stem = os.path.splitext(script)[0]
    torch_out = str(tmp_path_factory.mktemp(f"{stem}-torch"))
    fsdp_out = str(tmp_path_factory.mktemp(f"{stem}-fsdp"))
    if out_created_by_script:
        torch_out, fsdp_out = os.path.join(torch_out, "out"), os.path.join(fsdp_out, "out")
    torch_result = run_example(script, torch_args, backend="torch", out_dir=torch_out, preload=preload)
    fsdp_result = run_example(script, fsdp_args(torch_out), backend="fsdp", out_dir=fsdp_out, preload=preload)
    return BackendRuns(torch_result, fsdp_result, torch_out, fsdp_out)


def assert_each_backend_ran(runs: BackendRuns) -> None:
    """The wrapper the script built, by its class's module: torch's, then fsdp's via the redirect."""
    assert runs.torch_result["backend"].startswith("torch.distributed."), runs.torch_result["backend"]
    assert runs.fsdp_result["backend"] == "fsdp.fully_sharded_data_parallel", runs.fsdp_result["backend"]
