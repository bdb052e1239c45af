"""A stalled rank: its peers' collectives time out with FSDP's context ([Note: Collective errors]).

Each scenario makes a fresh gloo group and wraps a model on it; rank 1 then stalls (alive, but
it skips the step and waits at a barrier of the default group) while rank 0, its group's timeout
now 0.5 s, runs the step. Rank 0 must get, within seconds, an exception of the type gloo raised (the
original chained as ``__cause__``) that names the collective, the group's global ranks, the
phase, the unit, the rank it waited for (point to point) and how to set the timeout. A timed-out
gloo group is unusable afterwards, so each scenario abandons its group; the default group, which
the pool keeps using, never times out.
"""

from __future__ import annotations

import re
import time
from datetime import timedelta
from typing import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests._harness import RankPool
from tests._models import Block, global_batch, lm_loss, local_rows, make_toy

# Both ranks build and prepare under a timeout no scheduling delay reaches; then rank 0's group
# times out after 0.5 s: what rank 0 then runs waits for rank 1, which is in a barrier of another
# group until rank 0 gave up, so the timeout is certain to trip, and its length only sets how long
# each scenario waits (the phase exchange that follows waits its floor of 1 s regardless).
_PREPARE_TIMEOUT = timedelta(seconds=60)
_GROUP_TIMEOUT = timedelta(seconds=0.5)
# The error must come after the group's timeout, not the default group's 30 minutes; the margin
# is for process scheduling (every collective of one scenario shares the one timeout).
_WITHIN_S = 15.0


def _wrap(group: dist.ProcessGroup, strategy: str) -> nn.Module:
    from fsdp import FullyShardedDataParallel as FSDP
    from fsdp import ShardingStrategy
    from fsdp.wrap import ModuleWrapPolicy

    return FSDP(
        make_toy(n_blocks=2),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        sharding_strategy=ShardingStrategy[strategy],
        process_group=group,
    )


def _inputs(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    rank, ws = dist.get_rank(), dist.get_world_size()
    tokens, targets = global_batch(step, ws)
    return local_rows(tokens, rank, ws), local_rows(targets, rank, ws)


def _train_step(model: nn.Module, step: int = 0) -> None:
    x, y = _inputs(step)
    lm_loss(model(x), y).backward()


def _forward(model: nn.Module) -> torch.Tensor:
    x, y = _inputs(1)
    return lm_loss(model(x), y)


def _stall(
    strategy: str,
    prepare: Callable[[nn.Module], object],
    act: Callable[[nn.Module, object], object],
) -> dict[str, object]:
    """Both ranks build and ``prepare``; rank 0 then runs ``act`` while rank 1 stalls.

    Returns on rank 0 what it caught: type names, message, cause, seconds waited.
    """
    group = dist.new_group(backend="gloo", timeout=_PREPARE_TIMEOUT)
    model = _wrap(group, strategy)
    prepared = prepare(model)
    caught: dict[str, object] = {}
    if dist.get_rank() == 0:
        dist.distributed_c10d._set_pg_timeout(_GROUP_TIMEOUT, group)
        start = time.monotonic()
        with pytest.raises(RuntimeError) as info:
            act(model, prepared)
        err = info.value
        caught = {
            "seconds": time.monotonic() - start,
            "type": type(err),
            "cause_type": type(err.__cause__),
            "cause": str(err.__cause__),
            "message": str(err),
        }
    dist.barrier()  # rank 1 "stalls" here, in the default group, until rank 0 gave up
    return caught


def stalled_peer() -> dict[str, dict[str, object]]:
    """Every scenario, on both ranks; rank 0 returns what it caught per scenario."""
    from fsdp import FullyShardedDataParallel as FSDP

    def nothing(model: nn.Module) -> None:
        return None

    def forward_only(model: nn.Module) -> torch.Tensor:
        _train_step(model)
        return _forward(model)

    def clip(model: nn.Module, _: object) -> None:
        FSDP.clip_grad_norm_(model, 1.0)  # type: ignore[arg-type]

    def summon(model: nn.Module, _: object) -> None:
        with FSDP.summon_full_params(model):
            pass

    scenarios: dict[str, tuple[str, Callable[[nn.Module], object], Callable[[nn.Module, object], object]]] = {
        # The very first forward: ranks first agree on the unit layout.
        "lazy_init": ("FULL_SHARD", nothing, lambda model, _: _forward(model)),
        # After a good step: the root unit's all-gather at the next forward.
        "forward": ("FULL_SHARD", _train_step, lambda model, _: _forward(model)),
        # Both ran forward; SHARD_GRAD_OP gathers nothing in backward, so the first collective
        # that waits is a gradient reduce-scatter.
        "backward_reduce": ("SHARD_GRAD_OP", forward_only, lambda model, loss: loss.backward()),  # type: ignore[union-attr]
        # FULL_SHARD gathers the blocks again in backward.
        "backward_unshard": ("FULL_SHARD", forward_only, lambda model, loss: loss.backward()),  # type: ignore[union-attr]
        "summon_full_params": ("FULL_SHARD", _train_step, summon),
        "state_dict": ("FULL_SHARD", _train_step, lambda model, _: model.state_dict()),
        "clip_grad_norm": ("FULL_SHARD", _train_step, clip),
    }
    results = {}
    for name, (strategy, prepare, act) in scenarios.items():
        results[name] = _stall(strategy, prepare, act)
    # The default group (the pool's) still works, and so does a fresh FSDP model on it.
    _train_step(_wrap(dist.group.WORLD, "FULL_SHARD"))  # type: ignore[arg-type]
    total = torch.ones(1)
    dist.all_reduce(total)
    assert total.item() == dist.get_world_size()
    return results


_HINT = (
    r"fsdp hint: (rank 1|another rank of the group) probably stalled .* or died, and this rank "
    r"waited for the process group's timeout \(" + re.escape(str(_GROUP_TIMEOUT)) + r" for this group\).*"
    r"dist\.init_process_group\(timeout=datetime\.timedelta\(seconds=\.\.\.\)\)"
)

# scenario -> what rank 0's message must say (after "fsdp: ").
_EXPECTED = {
    "lazy_init": r"all-gather over the process group of global ranks \[0, 1\] failed during lazy-init "
    r"layout check \(within first-iteration execution-order check, forward unshard\) of FSDP unit '<root>'",
    "forward": r"all-gather over the process group of global ranks \[0, 1\] failed during forward unshard "
    r"of FSDP unit '<root>', waiting for rank 1",
    # On CPU the reduction in flight is completed in the next unit's pre-backward hook (before
    # its prefetch allocates) or when that unit's first gradient arrives, whichever comes first.
    "backward_reduce": r"reduce-scatter over the process group of global ranks \[0, 1\] failed during "
    r"backward reduce( \(within backward unshard\))? of FSDP unit 'blocks\.1', waiting for rank 1",
    # blocks.1, the last block, stays gathered from its forward into its backward ([Note: The
    # first backward unit stays gathered]): the first gather of the backward is blocks.0's,
    # prefetched in blocks.1's pre-backward, where a CPU gather completes ([Note: A CPU gather
    # completes where it is launched]).
    "backward_unshard": r"all-gather over the process group of global ranks \[0, 1\] failed during "
    r"backward prefetch \(within backward unshard\) of FSDP unit 'blocks\.0', waiting for rank 1",
    "summon_full_params": r"all-gather over the process group of global ranks \[0, 1\] failed during "
    r"summon_full_params of FSDP unit '<root>', waiting for rank 1",
    "clip_grad_norm": r"all-reduce over the process group of global ranks \[0, 1\] failed during "
    r"clip_grad_norm_ of FSDP unit '<root>'",
}


# A state dict runs no collective before every rank entered it ([Note: Blocked collectives] in
# fsdp/_comm/_watch.py): a peer that is neither in it nor blocked in an FSDP collective (here:
# in a barrier of another group) is waited for up to the group's timeout, then named.
_STATE_DICT_NOT_ENTERED = (
    "fsdp: state_dict() was called on rank 0 but not on every rank of the process group of global "
    "ranks [0, 1]: rank 1 did not enter it within the group's timeout (0:00:00.500000) and reported no "
    "blocked FSDP collective (busy, stalled, or blocked outside FSDP). State dicts are collectives"
)


def test_stalled_rank_times_out_with_context(pool2: RankPool) -> None:
    caught = pool2.run(stalled_peer, _timeout=120)[0]
    assert sorted(caught) == sorted([*_EXPECTED, "state_dict"])
    state_dict = caught["state_dict"]
    assert str(state_dict["message"]).startswith(_STATE_DICT_NOT_ENTERED), state_dict
    assert state_dict["type"] is RuntimeError and _GROUP_TIMEOUT.total_seconds() <= float(state_dict["seconds"]) < _WITHIN_S, state_dict  # type: ignore[arg-type]
    for scenario, pattern in _EXPECTED.items():
        seen = caught[scenario]
        message = str(seen["message"])
        assert re.match("fsdp: " + pattern, message), (scenario, message)
        assert re.search(_HINT, message, re.S), (scenario, message)
        # The type gloo raised (RuntimeError), the original chained, its words kept.
        assert seen["type"] is seen["cause_type"] and issubclass(seen["type"], RuntimeError), (scenario, seen)  # type: ignore[arg-type]
        assert str(seen["cause"]).strip() in message, (scenario, seen)
        assert float(seen["seconds"]) < _WITHIN_S, (scenario, seen["seconds"])  # type: ignore[arg-type]
        # Rank 1 reported no failure ([Note: Phases exchanged on failure]); in a state dict the
        # likeliest cause is said as well.
        assert "rank 1: reported no failed collective" in message, (scenario, message)
        assert "State dicts are collectives" not in message, (scenario, message)


class _TwoArgError(RuntimeError):
    """An error type that cannot be built from a message alone."""

    def __init__(self, code: int, text: str) -> None:
        super().__init__(f"{code}: {text}")


@pytest.mark.parametrize(
    "error",
    [
        dist.DistBackendError("Timed out waiting 5ms for recv operation to complete"),
        dist.DistNetworkError("Connection closed by peer"),
        RuntimeError("Timed out waiting 5ms for send operation to complete"),
        _TwoArgError(7, "Timed out"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_collective_error_keeps_torch_type(error: RuntimeError) -> None:
    """Whatever RuntimeError a collective raises comes back as its own type, with the context:
    a new exception chained to it, or (a type not built from a message) itself with a note."""
    from fsdp._comm._errors import raise_collective_error

    with pytest.raises(type(error)) as info:
        try:
            raise error
        except RuntimeError as err:
            raise_collective_error(err, "all-gather", None, peer=3)
    caught = info.value
    assert type(caught) is type(error)
    context = "fsdp: all-gather over the process group of global ranks"
    if caught is error:  # _TwoArgError: the original, annotated
        assert any(note.startswith(context) for note in getattr(caught, "__notes__", []))
    else:
        assert caught.__cause__ is error and str(caught).startswith(context)
        assert str(error) in str(caught) and "waiting for rank 3" in str(caught)
        if "closed" in str(error):  # the peer's process is gone: no timeout was waited for
            assert "fsdp hint: the connection to rank 3 closed: that process most likely exited" in str(caught)
        else:
            assert "fsdp hint: rank 3 probably stalled" in str(caught)
    # Raised again through an outer collective (a work waited inside one): said only once.
    with pytest.raises(type(error)) as again:
        try:
            raise caught
        except RuntimeError as err:
            raise_collective_error(err, "reduce-scatter", None)
    assert again.value is caught
