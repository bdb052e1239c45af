"""Shared pytest fixtures: multi-process rank pools reused across the whole session.

Rank processes are expensive to start (spawn + ``import torch``), so every world size gets one
:class:`~tests._harness.RankPool` per pytest session, shared by all test files (see
``tests/_harness.py``). Pools start lazily on their first job and are shut down when the session
ends.

Fixtures:
    pool1, pool2, pool3, pool4: The shared pool with that many ranks.
    cuda_pool1, cuda_pool2: The CUDA lane's pools (every rank on GPU 0; NCCL for one rank, gloo
        with CUDA tensors for two), used by ``tests/test_cuda_lane.py`` only.
    dist_pool: The shared pool whose world size is given by indirect parametrization, e.g.
        ``@pytest.mark.parametrize("dist_pool", [1, 2, 4], indirect=True)``; world size 2 when
        not parametrized.

Example::

    import torch
    import torch.distributed as dist
    from tests._harness import RankPool

    def _sum_ranks() -> float:  # module level: workers import it by name
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t)
        return t.item()

    def test_sum(pool2: RankPool) -> None:
        assert pool2.run(_sum_ranks) == [1.0, 1.0]
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

from tests import _preloaded
from tests._harness import RankPool, get_pool, shutdown_all


#: The switch for the CUDA lane: ``FSDP_TEST_DEVICE=cuda python -m pytest tests`` runs
#: ``tests/test_cuda_lane.py`` on the GPU as well; the default ``cpu`` skips it.
TEST_DEVICES = ("cpu", "cuda")


def test_device() -> str:
    """The value of ``FSDP_TEST_DEVICE`` (default ``cpu``)."""
    return os.environ.get("FSDP_TEST_DEVICE", "cpu").strip().lower() or "cpu"


test_device.__test__ = False  # type: ignore[attr-defined]  # not a test despite the name


def pytest_collection_finish(session: pytest.Session) -> None:
    """Moves what collection imported (torch, fsdp, every test module) out of the collector's
    reach, as each rank process does at start-up: Python's full collections during the run then
    scan only what the tests make."""
    gc.collect()
    gc.freeze()


#: What every process a test starts inherits unless the environment says otherwise: one
#: OpenMP/MKL thread, as the pools' ranks run (tests/_harness.py). The tests' tools, examples and
#: fresh interpreters train tiny models, whose ops gain nothing from a second thread; with two,
#: OpenMP's waiting thread spins for its next region, which on a 2-core machine doubles their
#: CPU time (benchmarks.scale's CPU run: 21 s of CPU with two threads, 5 s with one) and takes
#: the core from the ranks they run beside. This process keeps torch's default: torch reads these
#: variables when first asked for its thread count, which :func:`pytest_configure` asks first.
SUBPROCESS_THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def pytest_configure(config: pytest.Config) -> None:
    torch.get_num_threads()  # fixed now, before the variables below are set
    for name, value in SUBPROCESS_THREADS.items():
        os.environ.setdefault(name, value)
    if test_device() not in TEST_DEVICES:
        raise pytest.UsageError(
            f"FSDP_TEST_DEVICE={os.environ['FSDP_TEST_DEVICE']!r} is not one of {list(TEST_DEVICES)} "
            "(cuda adds the CUDA lane, tests/test_cuda_lane.py, to the CPU suite)"
        )


def pytest_report_header(config: pytest.Config) -> str:
    if test_device() == "cuda":
        return "fsdp: FSDP_TEST_DEVICE=cuda: CPU suite plus the CUDA lane (tests/test_cuda_lane.py)"
    return "fsdp: CPU suite (FSDP_TEST_DEVICE=cuda adds the CUDA lane on an NVIDIA GPU)"


@pytest.fixture(scope="session")
def cuda_pool1() -> RankPool:
    """The CUDA lane's one-rank pool (NCCL, GPU 0)."""
    return get_pool(1, device="cuda")


@pytest.fixture(scope="session")
def cuda_pool2() -> RankPool:
    """The CUDA lane's two-rank pool (gloo with CUDA tensors, both ranks on GPU 0)."""
    return get_pool(2, device="cuda")


@pytest.fixture(scope="session")
def pool1() -> RankPool:
    """The session-wide pool with 1 rank."""
    return get_pool(1)


@pytest.fixture(scope="session")
def pool2() -> RankPool:
    """The session-wide pool with 2 ranks."""
    return get_pool(2)


@pytest.fixture(scope="session")
def pool3() -> RankPool:
    """The session-wide pool with 3 ranks."""
    return get_pool(3)


@pytest.fixture(scope="session")
def pool4() -> RankPool:
    """The session-wide pool with 4 ranks."""
    return get_pool(4)


@pytest.fixture(scope="session")
def dist_pool(request: pytest.FixtureRequest) -> RankPool:
    """The session-wide pool whose world size is ``request.param`` (indirect parametrization).

    Defaults to 2 ranks when the test does not parametrize ``dist_pool``.
    """
    return get_pool(int(getattr(request, "param", 2)))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Stops every rank pool at the end of the session (``atexit`` is only the backstop), and
    the tests' preloaded interpreter (tests/_preloaded.py)."""
    shutdown_all()
    _preloaded.close()
