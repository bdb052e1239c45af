"""Prefetching (backward_prefetch, forward_prefetch, limit_all_gathers): same results, same
collectives, and the prefetches really happen ([Note: Prefetch]).

Each setting trains through ours and torch FSDP1 with the same setting: losses and parameters
equal bit for bit, and match single-process training. Prefetching only moves collectives in
time, so per step the collectives and their bytes equal those without prefetching.
"""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests._comm_count import count_collectives
from tests._harness import RankPool
from tests._models import Block, global_batch, lm_loss, local_rows, make_toy

STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]
# (backward_prefetch, forward_prefetch)
SETTINGS = [("BACKWARD_PRE", False), ("BACKWARD_POST", False), (None, False), ("BACKWARD_PRE", True), (None, True)]


def _wrap(lib: str, strategy: str, backward: Optional[str], forward: bool, limit: bool = True) -> nn.Module:
    if lib == "ours":
        import fsdp as f
        from fsdp.wrap import ModuleWrapPolicy

        extra: dict[str, Any] = {}
    else:
        import torch.distributed.fsdp as f  # type: ignore[no-redef]
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy  # type: ignore[no-redef]

        extra = {"device_id": torch.device("cpu")}
    return f.FullyShardedDataParallel(
        make_toy(),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        sharding_strategy=f.ShardingStrategy[strategy],
        backward_prefetch=f.BackwardPrefetch[backward] if backward else None,
        forward_prefetch=forward,
        limit_all_gathers=limit,
        **extra,
    )


def _step(model: nn.Module, step: int) -> torch.Tensor:
    rank, ws = dist.get_rank(), dist.get_world_size()
    tokens, targets = global_batch(step, ws)
    loss = lm_loss(model(local_rows(tokens, rank, ws)), local_rows(targets, rank, ws))
    loss.backward()
    return loss.detach()


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    with type(model).summon_full_params(model, writeback=False):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


# Per (strategy, limit_all_gathers, world size): the no-prefetch baseline's per-step losses,
# collective counts and final parameters. They do not depend on the prefetch settings, so each
# rank process computes them once and every setting compares against the same values (the ws2
# sweep runs 5 settings per strategy). Prefetching changes only when collectives run, so the
# results are compared bit for bit; the baseline's parity with one process is test_parity's.
_BASELINES: dict[tuple[str, bool, int], tuple[list[torch.Tensor], list[Any], dict[str, torch.Tensor]]] = {}


def _baseline(strategy: str, limit: bool) -> tuple[list[torch.Tensor], list[Any], dict[str, torch.Tensor]]:
    ws = dist.get_world_size()
    key = (strategy, limit, ws)
    if key not in _BASELINES:
        baseline = _wrap("ours", strategy, None, False, limit)  # no prefetching at all
        opt = torch.optim.AdamW(baseline.parameters(), lr=0.01)
        losses, counts = [], []
        for step in range(4):
            with count_collectives() as c:
                losses.append(_step(baseline, step))
            counts.append(c)
            opt.step()
            opt.zero_grad()
        _BASELINES[key] = (losses, counts, _full(baseline))
    return _BASELINES[key]


def prefetch_parity(strategy: str, backward: Optional[str], forward: bool, limit: bool) -> None:
    baseline_losses, baseline_counts, baseline_params = _baseline(strategy, limit)
    ours, theirs = _wrap("ours", strategy, backward, forward, limit), _wrap("torch", strategy, backward, forward, limit)
    models = [ours, theirs]
    opts = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in models]
    for step in range(4):
        losses = []
        with count_collectives() as mine:
            losses.append(_step(ours, step))
        losses.append(_step(theirs, step))
        assert torch.equal(losses[0], losses[1]), f"step {step}: loss differs from torch FSDP1"
        assert torch.equal(losses[0], baseline_losses[step]), f"step {step}: loss differs without prefetching"
        if step > 0:  # the same collectives and bytes as without prefetching, ...
            plain = baseline_counts[step]
            expected_calls, expected_bytes = dict(plain.calls), dict(plain.bytes)
            kept = ours._fsdp_state.ctx.unit_kept_for_backward
            if backward == "BACKWARD_PRE" and strategy == "FULL_SHARD" and dist.get_world_size() > 1:
                # ... but one all-gather less: the last block, whose backward comes right after
                # the root's, stays gathered from its forward ([Note: The first backward unit
                # stays gathered]); without a backward prefetch it is freed and gathered again.
                assert kept is not None and kept.unit_name == "blocks.2"
                expected_calls["all_gather"] -= 1
                expected_bytes["all_gather"] -= kept.handles[0].shard_layout.padded_unsharded_numel * 4
            else:
                assert kept is None
            assert (dict(mine.calls), dict(mine.bytes)) == (expected_calls, expected_bytes), (mine.calls, plain.calls)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    mine_full, torch_full = _full(ours), _full(theirs)
    assert list(mine_full) == list(torch_full) == list(baseline_params)
    for name, value in mine_full.items():
        assert torch.equal(value, torch_full[name]), f"{name} differs from torch FSDP1"
        assert torch.equal(value, baseline_params[name]), f"{name} differs without prefetching"
    # The prefetches really happened (from the second iteration on; nothing to prefetch when
    # nothing is ever freed).
    ctx = ours._fsdp_state.ctx
    sharded = strategy != "NO_SHARD" and dist.get_world_size() > 1
    # SHARD_GRAD_OP keeps units gathered from forward into backward: nothing to prefetch there.
    expected = sharded and (forward or (backward is not None and strategy == "FULL_SHARD"))
    if not expected:
        assert ctx.prefetches_issued == 0
        return
    assert ctx.prefetches_issued > 0
    assert [s.unit_name for s in ctx.forward_order] == ["<root>", "blocks.0", "blocks.1", "blocks.2"]
    assert [s.unit_name for s in ctx.backward_order] == ["<root>", "blocks.2", "blocks.1", "blocks.0"]


@pytest.mark.parametrize("backward,forward", SETTINGS)
def test_prefetch_parity_ws2(pool2: RankPool, backward: Optional[str], forward: bool) -> None:
    for strategy in STRATEGIES:
        pool2.run(prefetch_parity, strategy, backward, forward, True)


@pytest.mark.parametrize("dist_pool", [1, 4], indirect=True)
def test_prefetch_parity_ws1_ws4(dist_pool: RankPool) -> None:
    for backward, forward in [("BACKWARD_PRE", True), ("BACKWARD_POST", False)]:
        for strategy in STRATEGIES:
            dist_pool.run(prefetch_parity, strategy, backward, forward, False)


def prefetch_completes_at_launch() -> None:
    """On CPU a prefetched all-gather is launched at the moment its setting names and completes
    there ([Note: On CPU a collective completes where it is launched]): nothing is ever left in flight
    for the unit to wait on, and the gathered parameters are the full ones at once."""
    from fsdp import FullyShardedDataParallel as FSDP
    from fsdp.flat_param._storage import FlatParamStorage
    from fsdp.flat_param.flat_param import FlatParamHandle

    model = _wrap("ours", "FULL_SHARD", "BACKWARD_PRE", True)
    _step(model, 0)  # the first iteration records the order
    full = {n.replace("_fsdp_wrapped_module.", ""): p for n, p in _full(model).items()}
    events: list[tuple[str, str]] = []
    original_unshard, original_wait = FlatParamHandle.unshard, FlatParamStorage.wait_unshard

    units = FSDP.fsdp_modules(model)
    unit_of_storage = {id(h.storage): h.unit_name for u in units for h in u._fsdp_state.handles}
    most_in_flight = [0]

    def unshard(self: FlatParamHandle, full_precision: bool = False, async_op: bool = False, stream_ordered: bool = False) -> None:
        original_unshard(self, full_precision, async_op, stream_ordered)
        if async_op:
            events.append(("launch", self.unit_name))
            expected = torch.cat([full[f"{self.unit_name}.{info.fqn}"].reshape(-1) for info in self.views.param_infos])
            assert torch.equal(self.flat_param.detach()[: expected.numel()], expected), self.unit_name
        in_flight = sum(h.unshard_pending for u in units for h in u._fsdp_state.handles)
        most_in_flight[0] = max(most_in_flight[0], in_flight)

    def wait_unshard(self: FlatParamStorage) -> None:
        if self.pending_unshard is not None:
            events.append(("wait", unit_of_storage[id(self)]))
        original_wait(self)

    FlatParamHandle.unshard, FlatParamStorage.wait_unshard = unshard, wait_unshard  # type: ignore[method-assign]
    try:
        _step(model, 1)
    finally:
        FlatParamHandle.unshard, FlatParamStorage.wait_unshard = original_unshard, original_wait  # type: ignore[method-assign]
    forward = [("launch", "blocks.0"), ("launch", "blocks.1"), ("launch", "blocks.2")]
    backward = [("launch", "blocks.1"), ("launch", "blocks.0")]
    # Backward: the root and blocks.2 stay gathered from their forward ([Note: The first
    # backward unit stays gathered]), so the root's pre-backward has nothing to launch.
    assert events == forward + backward, events
    assert most_in_flight[0] == 0


def test_prefetch_completes_at_launch_on_cpu(pool2: RankPool) -> None:
    pool2.run(prefetch_completes_at_launch)
