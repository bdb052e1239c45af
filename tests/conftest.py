"""Shared pytest fixtures: multi-process rank pools reused across the whole session.

Rank processes are expensive to start (spawn + ``import torch``), so every world size gets one
:class:`~tests._harness.RankPool` per pytest session, shared by all test files (see
``tests/_harness.py``). Pools start lazily on their first job and are shut down when the session
ends.

Fixtures:
    pool1, pool2, pool3, pool4: The shared pool with that many ranks.
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

import pytest

from tests._harness import RankPool, get_pool, shutdown_all


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
    """Stops every rank pool at the end of the session (``atexit`` is only the backstop)."""
    shutdown_all()
