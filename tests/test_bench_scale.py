"""``benchmarks/scale.py``, rank r of N on torch's fake process group: the fabric's arithmetic
and the models' shapes. The CPU run (the tooling CI can run: memory and modelled communication,
no timing) is asserted in tests/test_gpu_run.py, on the GPU run's dry ``scale`` step."""

from __future__ import annotations

import pytest

from benchmarks.scale import LLAMAS, PRESETS, Fabric


def test_collective_seconds_follow_the_bus_bandwidth_convention() -> None:
    fabric = Fabric("f", intra_bw=400e9, inter_bw=50e9, intra_latency_s=1e-5, inter_latency_s=2e-5, ranks_per_node=8)
    gib = 2**30
    # An all-gather of 1 GiB over one node's 8 ranks: 7/8 of it at the intra-node bus bandwidth.
    assert fabric.collective_seconds("all_gather", gib, list(range(8))) == pytest.approx(7 / 8 * gib / 400e9 + 1e-5)
    # The same over 16 ranks spans two nodes: the inter-node bandwidth, 15/16 of the bytes.
    assert fabric.collective_seconds("reduce_scatter", gib, list(range(16))) == pytest.approx(15 / 16 * gib / 50e9 + 2e-5)
    # HYBRID's replicate group (one rank per node) crosses nodes; an all-reduce moves 2(n-1)/n.
    assert fabric.collective_seconds("all_reduce", gib, [0, 8, 16, 24]) == pytest.approx(2 * 3 / 4 * gib / 50e9 + 2e-5)
    assert fabric.collective_seconds("all_gather", gib, [3]) == 0.0  # one rank moves nothing
    presets = PRESETS(efficiency=0.5)
    assert presets["nvlink"].intra_bw == 225e9 and presets["ib"].inter_bw == 25e9


def test_llama_shapes() -> None:
    # Llama 3 8B's shapes: 8.03e9 parameters; the 1B's (head untied): 1.50e9.
    assert LLAMAS["llama-8b"].params() == 8_030_261_248
    assert round(LLAMAS["llama-1b"].params() / 1e9, 2) == 1.50


# The CPU run (rank 3 of 16, FULL_SHARD and HYBRID_SHARD) is the prepared GPU run's dry
# ``scale`` step: tests/test_gpu_run.py asserts it (one run of the command, not two).
