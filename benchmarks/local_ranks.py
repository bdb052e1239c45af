"""Running a tool's ranks as local spawned processes and collecting each rank's JSON result.

The CPU benchmark (``python -m benchmarks``) and the planner's validation run
(``python -m benchmarks.validate_plan``) both start ``world_size`` processes on this machine,
wait for them under a deadline, and read back what each rank wrote. This module is that runner.

[Note: Local rank protocol]
The runner calls ``target(rank, payload, workdir)`` in each spawned process, ``rank`` from 0 to
``world_size - 1``. ``workdir`` is a fresh temporary folder shared by all ranks: they may
rendezvous through a file in it (``init_method=f"file://{workdir}/rendezvous"``), and each
rank's result is the JSON file ``rank{rank}.json`` in it (:func:`write_rank_result` writes it
atomically). The first rank to exit with a non-zero code, or the deadline, ends the run: the
ranks still alive are terminated, because they would block in a collective waiting for the
failed one.

[Note: Rank exit without interpreter finalization]
Each rank process runs ``target`` inside :func:`_rank_process`, which ends the process with
``os._exit`` once ``target`` returns (code 0) or raises (code 1, after printing the traceback),
with its output flushed. A rank's work is over by then (its result written, its process group
destroyed); what ``os._exit`` skips is the interpreter's finalization. That is where a process
can abort (``terminate called without an active exception``) when a backend thread still
alive drops the last reference to a Python-owned tensor: CPython ends a foreign thread that
asks for the GIL of a finalizing interpreter, inside a C++ destructor. Gloo's threads stay alive
while anything holds the process group, and models of other libraries (torch's FSDP1) hold it
through reference cycles; fsdp's own models release it at once ([Note: Releasing the root
context] in ``fsdp/runtime/_lazy_init.py``). :mod:`faulthandler` is enabled for every thread,
so an abort that still happens prints each thread's Python stack.

It imports nothing from ``fsdp``.
"""

from __future__ import annotations

import faulthandler
import json
import multiprocessing
import os
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Optional

__all__ = ["run_local_ranks", "write_rank_result"]

# How often the parent looks at its ranks, and how long it waits for a terminated one to exit.
_POLL_S = 0.2
_JOIN_S = 30.0


def _result_path(workdir: str, rank: int) -> str:
    return os.path.join(workdir, f"rank{rank}.json")


def write_rank_result(workdir: str, rank: int, result: Any) -> None:
    """Writes one rank's result where :func:`run_local_ranks` reads it, atomically.

    Args:
        workdir: The folder the runner passed to the rank.
        rank: This rank.
        result: Anything ``json.dump`` takes.
    """
    path = _result_path(workdir, rank)
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)


def _rank_process(target: Callable[[int, Any, str], None], rank: int, payload: Any, workdir: str) -> None:
    """A rank process's entry: runs ``target``, then leaves with ``os._exit``.

    The exit code is 0 when ``target`` returns, the code of a ``sys.exit`` in it, and 1 when it
    raises anything else (the traceback is printed first). See
    [Note: Rank exit without interpreter finalization]. Never returns.
    """
    faulthandler.enable(all_threads=True)
    code = 1
    try:
        target(rank, payload, workdir)
        code = 0
    except SystemExit as exit_:  # sys.exit(n) in the target keeps its code, as in a plain process
        code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # a closed or broken stream must not keep the rank from exiting
                pass
        os._exit(code)


def _first_failure(procs: list[Any]) -> Optional[str]:
    """The first rank (in rank order) that exited with a non-zero code, described, else None."""
    for rank, proc in enumerate(procs):
        if proc.exitcode not in (0, None):
            return f"rank {rank} exited with code {proc.exitcode}"
    return None


def _wait(procs: list[Any], timeout_s: float) -> Optional[str]:
    """Waits for every rank to exit; returns why the run failed, or None when all exited with 0.

    Postcondition: no rank is alive (the ones left when a rank failed or the deadline passed
    are terminated).
    """
    deadline = time.monotonic() + timeout_s
    failed: Optional[str] = None
    try:
        while any(p.is_alive() for p in procs):
            failed = _first_failure(procs)
            if failed is not None:
                break
            if time.monotonic() > deadline:
                failed = f"timed out after {timeout_s:.0f} s"
                break
            time.sleep(_POLL_S)
        if failed is None:
            failed = _first_failure(procs)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(_JOIN_S)
    return failed


def run_local_ranks(
    target: Callable[[int, Any, str], None],
    payload: Any,
    world_size: int,
    timeout_s: float,
    *,
    prog: str,
) -> list[Any]:
    """Runs ``target`` on ``world_size`` spawned processes; returns each rank's result in rank order.

    See [Note: Local rank protocol]. Environment variables the ranks need must be set in
    ``os.environ`` before the call: spawned interpreters inherit them at start.

    Args:
        target: ``target(rank, payload, workdir)``; a picklable module-level function that
            writes its result with :func:`write_rank_result`.
        payload: Passed to every rank unchanged (picklable; the tools pass a config as a dict).
        world_size: Number of ranks.
        timeout_s: Seconds the whole run may take.
        prog: The tool's name, the first word of its errors and of the processes' names.

    Returns:
        What each rank wrote, decoded from JSON, rank 0 first.

    Raises:
        RuntimeError: A rank exited with a non-zero code, the run exceeded ``timeout_s``, or a
            rank exited without writing its result.
    """
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix=prog.replace(".", "_") + "_") as workdir:
        procs = [
            ctx.Process(
                target=_rank_process, args=(target, rank, payload, workdir), name=f"{prog}-rank{rank}"
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        failed = _wait(procs, timeout_s)
        if failed:
            raise RuntimeError(f"{prog}: {failed}")
        results = []
        for rank in range(world_size):
            path = _result_path(workdir, rank)
            if not os.path.exists(path):
                raise RuntimeError(f"{prog}: rank {rank} exited with code 0 without writing {path}")
            with open(path) as f:
                results.append(json.load(f))
        return results
