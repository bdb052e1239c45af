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
from typing import Any, Callable, Dict, List, Optional

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES_DIR = os.path.join(REPO_ROOT, "docs", "examples", "stacks")
RUN_TIMEOUT_S = 240.0
"""Per run (both ranks, start-up included); a run takes 10-40 s on 2 idle cores."""


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
    procs = []
    logs = []
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
        log = tempfile.TemporaryFile(mode="w+")
        logs.append(log)
        cwd = out_dir if os.path.isdir(out_dir) else os.path.dirname(out_dir)
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
    for rank, log in enumerate(logs):
        log.seek(0)
        outputs.append(f"--- rank {rank} (exit {procs[rank].returncode}) ---\n{log.read()[-6000:]}")
        log.close()
    if failed:
        raise AssertionError(f"{script} ({backend}) failed: {' '.join(cmd)}\n" + "\n".join(outputs))
    with open(os.path.join(out_dir, "result.json"), encoding="utf-8") as f:
        return json.load(f)


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
    """
    stem = os.path.splitext(script)[0]
    torch_out = str(tmp_path_factory.mktemp(f"{stem}-torch"))
    fsdp_out = str(tmp_path_factory.mktemp(f"{stem}-fsdp"))
    if out_created_by_script:
        torch_out, fsdp_out = os.path.join(torch_out, "out"), os.path.join(fsdp_out, "out")
    torch_result = run_example(script, torch_args, backend="torch", out_dir=torch_out)
    fsdp_result = run_example(script, fsdp_args(torch_out), backend="fsdp", out_dir=fsdp_out)
    return BackendRuns(torch_result, fsdp_result, torch_out, fsdp_out)


def assert_each_backend_ran(runs: BackendRuns) -> None:
    """The wrapper the script built, by its class's module: torch's, then fsdp's via the redirect."""
    assert runs.torch_result["backend"].startswith("torch.distributed."), runs.torch_result["backend"]
    assert runs.fsdp_result["backend"] == "fsdp.fully_sharded_data_parallel", runs.fsdp_result["backend"]
