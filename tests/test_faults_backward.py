"""A backward that raised on some ranks only ([Note: A backward that raised on some ranks] in
fsdp/_comm/_errors.py): the error reaches every rank, and no rank's "recovered" next forward runs
collectives against another rank's backward collectives.

Each scenario runs on its own gloo group with a 3 s timeout (the group is abandoned afterwards;
the default group resynchronizes the pool). The case where every rank's backward raised at the
same point, which recovers and trains on in step, is tests/test_runtime.py's
``test_recovers_from_interrupted_backward`` (its parity with a single-process model).
"""

from __future__ import annotations

import time
import warnings
from datetime import timedelta
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests._harness import RankPool
from tests._models import Block, global_batch, lm_loss, local_rows, make_toy

_GROUP_TIMEOUT_S = 3.0
_WAIT_S = 1.0  # the exchange's wait for this group: a quarter of 3 s, at least 1 s


class _Boom(Exception):
    pass


def _model(group: dist.ProcessGroup, backward_prefetch: Optional[str] = "BACKWARD_PRE") -> nn.Module:
    from fsdp import BackwardPrefetch
    from fsdp import FullyShardedDataParallel as FSDP
    from fsdp.wrap import ModuleWrapPolicy

    return FSDP(
        make_toy(n_blocks=3),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        process_group=group,
        backward_prefetch=BackwardPrefetch[backward_prefetch] if backward_prefetch else None,
    )


def _arm(model: nn.Module, block: int, inside: bool = False) -> None:
    """The next forward's ``blocks[block]`` output raises when its gradient arrives (after the
    root's backward and that of the blocks after it ran, before its own). ``inside``: the
    block's ``fc2`` output instead, after the block's pre-backward hook, within its backward."""
    inner = model.module.blocks[block].module
    if inside:
        inner = inner.fc2

    def explode(grad: torch.Tensor) -> torch.Tensor:
        raise _Boom(f"user hook failed at blocks.{block}")

    def hook(module: nn.Module, inputs: Any, out: torch.Tensor) -> None:
        handle.remove()
        out.register_hook(explode)

    handle = inner.register_forward_hook(hook)


def backward_raised_on(
    fail_at: dict[int, int], inside: tuple[int, ...] = (), backward_prefetch: Optional[str] = "BACKWARD_PRE"
) -> dict[str, Any]:
    """Ranks in ``fail_at`` have their backward raise at ``blocks[fail_at[rank]]`` (within its
    backward for ranks in ``inside``); the others' backward runs on. Each rank then catches what
    it got and (a failed rank) runs the next forward. Returns each rank's messages and how long
    each took."""
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=_GROUP_TIMEOUT_S))
    rank, ws = dist.get_rank(), dist.get_world_size()
    model = _model(group, backward_prefetch)
    tokens, targets = global_batch(0, ws)
    x, y = local_rows(tokens, rank, ws), local_rows(targets, rank, ws)
    dist.barrier()  # in step before the group's first collective: its timeout is only 3 s
    lm_loss(model(x), y).backward()  # one clean step: the first-iteration checks are done
    dist.barrier()
    if rank in fail_at:
        _arm(model, fail_at[rank], rank in inside)
    loss = lm_loss(model(x), y)
    result: dict[str, Any] = {}
    start = time.monotonic()
    if rank in fail_at:
        with pytest.raises(_Boom):
            loss.backward()
        if len(fail_at) == ws:
            # Every rank failed: they reach the next forward together (on a loaded machine the
            # skew could otherwise exceed the exchange's 1 s wait, which reads as disagreeing).
            dist.barrier()
        start = time.monotonic()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "resetting" warning: nothing is reset
            with pytest.raises(RuntimeError) as info:
                model(x)
        result["seconds"] = time.monotonic() - start
        result["next_forward"] = str(info.value)
        # Raised again at a later forward: the rank stays stopped, still without collectives.
        with pytest.raises(RuntimeError, match="the previous backward raised on this rank"):
            model(x)
    else:
        with pytest.raises(RuntimeError) as info:
            loss.backward()
        result["seconds"] = time.monotonic() - start
        result["backward"] = str(info.value)
    dist.barrier()  # the default group still works; the scenario's group is abandoned
    return result


def test_one_rank_raises_mid_backward_error_reaches_both(pool2: RankPool) -> None:
    failed, healthy = pool2.run(backward_raised_on, {1: 1}, _timeout=120)[::-1]
    message = failed["next_forward"]
    assert message.startswith(
        "fsdp: the previous backward raised on this rank (rank 1) after reaching FSDP units '<root>' "
    ), message
    assert "'blocks.2'" in message and "'blocks.1'" not in message, message  # how far it got
    assert f"rank 0: reported no failed backward within {_WAIT_S:.0f} s" in message, message
    assert "so FSDP does not resume here and runs no collective" in message, message
    # The exchange's wait, not the group's timeout (the store's wait overshoots its 1 s: 2 s
    # measured with the harness's store).
    assert failed["seconds"] < _GROUP_TIMEOUT_S, failed
    # The healthy rank waited in its backward's collective for the group's timeout; its error
    # names what the failed rank did.
    report = healthy["backward"]
    assert "during backward" in report, report
    assert "rank 1: recovery from an interrupted backward: its backward raised after reaching FSDP units '<root>'" in report, report
    assert "it will run no more collectives of this group" in report, report
    assert healthy["seconds"] < _GROUP_TIMEOUT_S + _WAIT_S + 2, healthy  # no hang


def test_ranks_raising_at_different_points_both_stop(pool2: RankPool) -> None:
    """Rank 0 raises before ``blocks.1``'s backward, rank 1 within it: both stop at once, each
    naming how far the other got. No collective may lie between the two points on rank 1, or
    rank 1 waits in it for the group's timeout (the test above): with ``BACKWARD_PRE``,
    ``blocks.1``'s pre-backward gathers ``blocks.0`` ahead, a collective rank 0 never joins (a
    CPU prefetch completes where it is launched), so the scenario prefetches after backward."""
    rank0, rank1 = pool2.run(backward_raised_on, {0: 1, 1: 1}, (1,), "BACKWARD_POST", _timeout=120)
    for me, other, result in ((0, 1, rank0), (1, 0, rank1)):
        message = result["next_forward"]
        assert f"the previous backward raised on this rank (rank {me})" in message, message
        assert f"rank {other}: its backward raised too, after reaching FSDP units '<root>'" in message, message
        assert result["seconds"] < _WAIT_S, result  # both reported at once: no wait
    # Each names how far the other got: rank 1 reached blocks.1's backward, rank 0 did not.
    assert "'blocks.1'" in rank0["next_forward"].split("rank 1: ")[1], rank0
    assert "'blocks.1'" not in rank1["next_forward"].split("rank 0: ")[1], rank1


def same_point_on_every_rank() -> bool:
    """Every rank's backward raises at ``blocks.1``: the next forward warns, resets and the step
    runs; the gradients then equal a clean model's exactly (the interrupted backward's are
    dropped), and no phase report is left in the store for a later failure to misread."""
    from fsdp._comm._errors import _REPORT_KEY

    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=_GROUP_TIMEOUT_S))
    rank, ws = dist.get_rank(), dist.get_world_size()
    model, clean = _model(group), _model(group)
    tokens, targets = global_batch(0, ws)
    x, y = local_rows(tokens, rank, ws), local_rows(targets, rank, ws)
    _arm(model, 1)
    dist.barrier()  # in step before the group's first collective: its timeout is only 3 s
    with pytest.raises(_Boom):
        lm_loss(model(x), y).backward()
    dist.barrier()  # the exchange's premise: the ranks reach the next forward within its wait
    with pytest.warns(UserWarning, match="previous backward did not finish"):
        loss = lm_loss(model(x), y)
    loss.backward()
    lm_loss(clean(x), y).backward()
    for mine, theirs in zip(model.parameters(), clean.parameters()):
        assert torch.equal(mine.grad, theirs.grad)
    store = dist.distributed_c10d._get_default_store()
    left = store.check([_REPORT_KEY.format(group.group_name, rank)])
    dist.barrier()
    return left


def test_same_point_on_every_rank_recovers(pool2: RankPool) -> None:
    assert pool2.run(same_point_on_every_rank, _timeout=60) == [False, False]
