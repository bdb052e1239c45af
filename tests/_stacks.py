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
from typing import Any, Dict, List, Optional

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
        out_dir: The folder for checkpoints and ``result.json`` (a new temporary one if None).
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
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=out_dir))
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
