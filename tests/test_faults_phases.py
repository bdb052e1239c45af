"""Ranks in different phases: the error says what each rank was doing ([Note: Phases exchanged on
failure] in fsdp/_comm/_errors.py, [Note: Blocked collectives] in fsdp/_comm/_watch.py).

The classic FSDP1 mistake: only rank 0 calls ``model.state_dict()`` (FULL_STATE_DICT,
``rank0_only=True``) while rank 1 trains on. Torch FSDP1 (and fsdp before) waits for the group's
timeout, 30 minutes by default, on both ranks. Now rank 0's entry agreement sees, within a second
or two, that rank 1 is blocked in its forward's all-gather, which waits for rank 0: rank 0 raises
before any collective, naming what rank 1 is doing, and the group stays intact (rank 0's next
forward releases rank 1's, and a state dict on every rank then works). A peer whose connection
closed is said to have exited, not to have been waited for until a timeout.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests._harness import RankPool
from tests._models import Block, global_batch, lm_loss, local_rows, make_toy

_COLLECTIVES_SENTENCE = "State dicts are collectives: every rank must call model.state_dict()"
_RANK0_ONLY_SENTENCE = "rank0_only=True only decides which rank receives the result"
# The group's timeout is long, so an error within _WITHIN_S cannot be the timeout's; detection
# takes one to two of the watcher's 0.5 s wake-ups, the rest is margin for a loaded machine.
_GROUP_TIMEOUT = timedelta(seconds=120)
_WITHIN_S = 10.0


def state_dict_on_one_rank() -> dict[str, object]:
    """Rank 0 saves a full state dict while rank 1 runs its next forward. Returns rank 0's error
    and how long it took, each rank's later full state dict (every rank calls it) and whether
    rank 1's forward raised."""
    from fsdp import FullStateDictConfig, StateDictType
    from fsdp import FullyShardedDataParallel as FSDP
    from fsdp.wrap import ModuleWrapPolicy

    group = dist.new_group(backend="gloo", timeout=_GROUP_TIMEOUT)
    model = FSDP(make_toy(n_blocks=2), auto_wrap_policy=ModuleWrapPolicy({Block}), process_group=group)
    rank, ws = dist.get_rank(), dist.get_world_size()
    tokens, targets = global_batch(0, ws)
    x, y = local_rows(tokens, rank, ws), local_rows(targets, rank, ws)
    lm_loss(model(x), y).backward()
    dist.barrier()
    config = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    out: dict[str, object] = {}
    if rank == 0:
        start = time.monotonic()
        with pytest.raises(RuntimeError) as info:
            with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
                model.state_dict()
        out.update(seconds=time.monotonic() - start, message=str(info.value))
    # Rank 1 waits in this forward's first all-gather until rank 0 runs its own: no error.
    lm_loss(model(x), y).backward()
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
        out["state_dict"] = {k: v.clone() for k, v in model.state_dict().items()}
    with FSDP.summon_full_params(model, writeback=False):
        out["full"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    dist.barrier()
    return out


def test_state_dict_on_one_rank_fails_fast_naming_the_peer(pool2: RankPool) -> None:
    rank0, rank1 = pool2.run(state_dict_on_one_rank, _timeout=120)
    message = str(rank0["message"])
    assert message.startswith(
        "fsdp: state_dict() was called on rank 0 but not on every rank of the process group of "
        "global ranks [0, 1]: rank 1 is blocked in all-gather during forward unshard of FSDP unit "
        "'<root>' (its FSDP collective #"
    ), message
    assert "That collective waits for rank 0, which waits for it here" in message, message
    assert _COLLECTIVES_SENTENCE in message and _RANK0_ONLY_SENTENCE in message, message
    assert "Nothing was communicated: the group is intact." in message, message
    assert float(rank0["seconds"]) < _WITHIN_S, rank0["seconds"]  # type: ignore[arg-type]
    # The group went on: both ranks trained a step more, and the state dict every rank then
    # asked for is rank 0's full model (rank0_only: rank 1 gets nothing).
    saved, full = rank0["state_dict"], rank0["full"]
    assert isinstance(saved, dict) and isinstance(full, dict) and saved and saved.keys() == full.keys()
    for key, value in full.items():
        assert torch.equal(saved[key], value), key
    assert rank1["state_dict"] == {}


def optim_and_model_state_dicts_crossed() -> str:
    """Rank 0 calls FSDP.optim_state_dict while rank 1 calls model.state_dict: both entered a
    state dict, different ones; every rank raises before any collective, and the group works on."""
    from fsdp import FullyShardedDataParallel as FSDP
    from fsdp.wrap import ModuleWrapPolicy

    group = dist.new_group(backend="gloo", timeout=_GROUP_TIMEOUT)
    model = FSDP(make_toy(n_blocks=2), auto_wrap_policy=ModuleWrapPolicy({Block}), process_group=group)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    rank, ws = dist.get_rank(), dist.get_world_size()
    tokens, targets = global_batch(0, ws)
    lm_loss(model(local_rows(tokens, rank, ws)), local_rows(targets, rank, ws)).backward()
    optim.step()
    with pytest.raises(RuntimeError) as info:
        if rank == 0:
            FSDP.optim_state_dict(model, optim)
        else:
            model.state_dict()
    osd = FSDP.optim_state_dict(model, optim)  # in step again
    assert osd["state"] == {} and osd["param_groups"]
    return str(info.value)


def test_different_state_dicts_on_ranks_raise_on_every_rank(pool2: RankPool) -> None:
    for message in pool2.run(optim_and_model_state_dicts_crossed, _timeout=120):
        assert message.startswith(
            "fsdp: the ranks of the process group of global ranks [0, 1] called different "
            "state-dict functions at the same point: rank 0: optim_state_dict(); rank 1: state_dict()."
        ), message


def mismatched_collectives() -> list[tuple[float, str]]:
    """Rank 0 all-reduces while rank 1 broadcasts, on a group with a 6 s timeout: both wait
    until it. Returns what this rank's watcher said meanwhile, with when (seconds after the
    collective began)."""
    from fsdp._comm import _collectives as comm
    from fsdp._comm import _watch

    # 6 s: above the test's bound of 5 s for what the watcher says, which is what decides pass or
    # fail (a report later than 5 s fails it whatever the timeout): a longer one only waits longer.
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=6))
    said_before = len(_watch.DIAGNOSES)
    dist.barrier()
    start = time.monotonic()
    # Each rank fails at its own timeout, or at once when the other rank's timeout fired first
    # and closed the connection ([Note: A connection closed after a mismatch was said]).
    with pytest.raises(RuntimeError) as info:
        if dist.get_rank() == 0:
            comm.all_reduce_sum(torch.ones(4), group)
        else:
            comm.broadcast_from_rank0(torch.ones(4), group)
    failure = str(info.value)
    if "Timed out" not in failure:
        assert "gave up on the same mismatch (it did not crash). What was said: fsdp: rank" in failure, failure
        assert "most likely exited" not in failure, failure
    dist.barrier()  # the default group still works; the scenario's group is abandoned
    return [(when - start, message) for when, message in _watch.DIAGNOSES[said_before:]]


def test_mismatched_collectives_are_said_within_seconds(pool2: RankPool) -> None:
    """No thread can interrupt a gloo collective, so the ranks still fail at the group's
    timeout; but each rank's watcher says, within a second or two, which collective each rank
    waits in ([Note: Blocked collectives])."""
    for rank, said in enumerate(pool2.run(mismatched_collectives, _timeout=120)):
        assert len(said) == 1, said
        when, message = said[0]
        assert when < 5.0, said  # before the group's 6 s timeout
        mine, theirs = ("all-reduce", "broadcast") if rank == 0 else ("broadcast", "all-reduce")
        assert message.startswith(
            f"fsdp: rank {rank} waits in {mine} (FSDP collective #1 on the process group of global "
            f"ranks [0, 1]) while rank {1 - rank} waits in {theirs} (its #1 there): the ranks "
            f"issued different collectives at the same point and will wait for each other until "
            f"the group's timeout (0:00:06), then fail."
        ), message


@pytest.mark.parametrize(
    "words",
    ["Connection closed by peer [127.0.0.1]:41234", "Connection reset by peer", "Broken pipe"],
)
def test_lost_peer_is_not_called_a_timeout(words: str) -> None:
    """gloo fails at once when a peer's process exits: the hint says the peer's connection closed
    and that nothing waited for the timeout (the timeout sentence would be false)."""
    from fsdp._comm._errors import raise_collective_error

    with pytest.raises(RuntimeError) as info:
        try:
            raise RuntimeError(words)
        except RuntimeError as err:
            raise_collective_error(err, "all-gather", None, peer=1)
    message = str(info.value)
    assert "the connection to rank 1 closed: that process most likely exited or crashed" in message, message
    assert "did not wait for a timeout" in message, message
    assert "waited for the process group's timeout" not in message, message


def test_closed_connection_after_a_said_mismatch_is_not_called_a_crash() -> None:
    """A peer that gave up on a mismatch the watcher said closes its connection: the hint repeats
    the mismatch (once), not the crash hint."""
    from fsdp._comm._errors import note_mismatch, raise_collective_error

    said = "fsdp: rank 0 waits in all-reduce (FSDP collective #1 ...) while rank 1 waits in broadcast"
    messages = []
    for _ in range(2):
        if not messages:
            note_mismatch(None, said)
        with pytest.raises(RuntimeError) as info:
            try:
                raise RuntimeError("Connection closed by peer [127.0.0.1]:41234")
            except RuntimeError as err:
                raise_collective_error(err, "all-reduce", None, peer=1)
        messages.append(str(info.value))
    assert "rank 1 most likely reached the group's timeout first and gave up on the same mismatch" in messages[0]
    assert messages[0].endswith("What was said: " + said), messages[0]
    assert "most likely exited" not in messages[0], messages[0]
    assert "the connection to rank 1 closed: that process most likely exited or crashed" in messages[1]


def test_timeout_hint_kept_for_timeouts() -> None:
    from fsdp._comm._errors import raise_collective_error

    with pytest.raises(RuntimeError) as info:
        try:
            raise RuntimeError("Timed out waiting 1800000ms for recv operation to complete")
        except RuntimeError as err:
            raise_collective_error(err, "all-gather", None, peer=1)
    message = str(info.value)
    assert "rank 1 probably stalled" in message and "waited for the process group's timeout" in message, message
    assert "connection to rank 1 closed" not in message, message
