"""The unit schedule policy ([Note: One schedule] in fsdp/flat_param/_policy.py): each rule once,
for every strategy, world size and offload setting the runtime and the planner meet."""

from __future__ import annotations

import itertools

import pytest

from fsdp.api import BackwardPrefetch, CPUOffload, ShardingStrategy as S
from fsdp.flat_param._policy import HYBRID_STRATEGIES, UnitPolicy, effective_strategy
from tests._harness import RankPool


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


def test_from_kwargs_omitted_take_the_constructors_defaults() -> None:
    """The planner's one call: kwargs a user omitted take resolve's defaults, which are the
    constructor's (nothing restates them); given ones are passed under the same names."""
    import inspect

    from fsdp import FullyShardedDataParallel

    assert UnitPolicy.from_kwargs({}, 4) == UnitPolicy.resolve(None, 4)
    constructor = inspect.signature(FullyShardedDataParallel.__init__).parameters
    resolve = inspect.signature(UnitPolicy.resolve).parameters
    for name in ("cpu_offload", "backward_prefetch", "forward_prefetch", "limit_all_gathers"):
        assert resolve[name].default == constructor[name].default, name
    offload = CPUOffload(offload_params=True)
    kwargs = {"sharding_strategy": S._HYBRID_SHARD_ZERO2, "cpu_offload": offload, "backward_prefetch": None,
              "forward_prefetch": True, "limit_all_gathers": False, "use_orig_params": True}
    assert UnitPolicy.from_kwargs(kwargs, 4, 2) == UnitPolicy.resolve(S._HYBRID_SHARD_ZERO2, 4, 2, offload, None, True, False)


def _count_resolutions() -> tuple[int, int, int]:
    """(units, UnitPolicy.resolve calls, effective_strategy calls) while a 3-unit model is built."""
    import sys

    import torch
    from torch import nn

    from fsdp import FullyShardedDataParallel as FSDP
    from fsdp.flat_param import _policy
    from fsdp.wrap import ModuleWrapPolicy

    codes = {_policy.UnitPolicy.resolve.__func__.__code__: 0, _policy.effective_strategy.__code__: 0}

    def count(frame: object, event: str, arg: object) -> None:
        code = getattr(frame, "f_code", None)
        if event == "call" and code in codes:
            codes[code] += 1

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    sys.setprofile(count)
    try:
        wrapped = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), device_id=torch.device("cpu"))
    finally:
        sys.setprofile(None)
    resolves, effective = codes.values()
    return len(FSDP.fsdp_modules(wrapped)), resolves, effective


def test_each_unit_resolves_its_policy_once(pool1: RankPool) -> None:
    """Construction resolves each unit's UnitPolicy once (the strategy in effect included), and
    every later step reads that record."""
    units, resolves, effective = pool1.run(_count_resolutions)[0]
    assert units == 3 and resolves == units and effective == units, (units, resolves, effective)
