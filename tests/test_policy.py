"""The unit schedule policy ([Note: One schedule] in fsdp/flat_param/_policy.py): each rule once,
for every strategy, world size and offload setting the runtime and the planner meet."""

from __future__ import annotations

import itertools

import pytest

from fsdp.api import BackwardPrefetch, CPUOffload, ShardingStrategy as S
from fsdp.flat_param._policy import HYBRID_STRATEGIES, UnitPolicy, effective_strategy


def test_effective_strategy() -> None:
    assert effective_strategy(None, 4) is S.FULL_SHARD
    for strategy in (S.FULL_SHARD, S.SHARD_GRAD_OP, S.NO_SHARD):
        assert effective_strategy(strategy, 1) is S.NO_SHARD  # nothing to shard on one rank
        assert effective_strategy(strategy, 2) is strategy
    for strategy in HYBRID_STRATEGIES:
        assert effective_strategy(strategy, 1) is strategy  # the replicas still all-reduce


@pytest.mark.parametrize("strategy", list(S))
@pytest.mark.parametrize("world_size", [1, 2, 8])
def test_rules(strategy: S, world_size: int) -> None:
    for offload, root, buffer, sync, stream, hook in itertools.product([False, True], repeat=6):
        policy = UnitPolicy.resolve(strategy, world_size, 2 if strategy in HYBRID_STRATEGIES else 1,
                                    CPUOffload(offload_params=offload), BackwardPrefetch.BACKWARD_POST)
        effective = policy.strategy
        assert policy.backward_prefetch is BackwardPrefetch.BACKWARD_POST and policy.offload_params is offload
        # A handle shards when its strategy shards over several ranks, or offloads on one.
        assert policy.uses_sharding is ((effective is not S.NO_SHARD and world_size > 1) or (offload and world_size == 1))
        frees = policy.frees_after_forward(root, buffer)
        if effective in (S.FULL_SHARD, S.HYBRID_SHARD):
            assert frees is not root
        elif effective is S.NO_SHARD:
            assert frees is buffer  # only a separate compute copy (low precision, offload)
        else:
            assert frees is False  # SHARD_GRAD_OP, _HYBRID_SHARD_ZERO2 keep it for backward
        assert policy.keeps_unsharded_for_backward is (effective in (S.SHARD_GRAD_OP, S._HYBRID_SHARD_ZERO2))
        assert policy.reshards_after_backward(sync) is (sync or effective in (S.FULL_SHARD, S.HYBRID_SHARD))
        # Every reduction on a stream stays in flight; without one, none ([Note: On CPU a
        # collective completes where it is launched]); a communication hook changes nothing.
        assert policy.reduction_stays_in_flight(stream) is stream
