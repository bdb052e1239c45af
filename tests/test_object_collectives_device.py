"""Object collectives and optimizer-state values use the unit's compute device (``device_id``).

The GPU case (NCCL, ``device_id`` given, the current device never set to it) is the CUDA lane's
``test_object_collectives_on_device_id``; here the same rank function runs on CPU with gloo: the
device passes through every object collective of the optimizer state-dict APIs (full,
rank0_only, sharded), and each round trip restores the optimizer state exactly.
"""

from __future__ import annotations

import pytest

from tests._harness import RankPool
from tests._object_device import check_object_collectives_on


@pytest.mark.parametrize("dist_pool", [1, 2], indirect=True)
def test_object_collectives_on_compute_device(dist_pool: RankPool) -> None:
    counts = dist_pool.run(check_object_collectives_on, "cpu")
    assert counts[0] > 0 and counts == [counts[0]] * dist_pool.world_size
