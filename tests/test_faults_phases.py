"""Ranks in different phases: the error says what each rank was doing ([Note: Phases exchanged on
failure] in fsdp/_comm/_errors.py).

The classic FSDP1 mistake: only rank 0 calls ``model.state_dict()`` (FULL_STATE_DICT,
``rank0_only=True``) while rank 1 trains on. Each rank waits in a collective the other never
joins and both time out (here after the scenario group's 3 s, not the default 30 minutes). Each
rank's error must then list both ranks' phases and say that state dicts are collectives to call
on every rank. A peer whose connection closed is said to have exited, not to have been waited
for until a timeout.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from tests._harness import RankPool
from tests._models import Block, global_batch, lm_loss, local_rows, make_toy

_COLLECTIVES_SENTENCE = "State dicts are collectives: every rank must call model.state_dict()"
_RANK0_ONLY_SENTENCE = "rank0_only=True only decides which rank receives the result"


def state_dict_on_one_rank() -> str:
    """Rank 0 saves a full state dict while rank 1 runs its next forward; returns the message of
    the error each rank got."""
    from fsdp import FullStateDictConfig, StateDictType
    from fsdp import FullyShardedDataParallel as FSDP
    from fsdp.wrap import ModuleWrapPolicy

    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=3))
    model = FSDP(make_toy(n_blocks=2), auto_wrap_policy=ModuleWrapPolicy({Block}), process_group=group)
    rank, ws = dist.get_rank(), dist.get_world_size()
    tokens, targets = global_batch(0, ws)
    x, y = local_rows(tokens, rank, ws), local_rows(targets, rank, ws)
    lm_loss(model(x), y).backward()
    dist.barrier()
    with pytest.raises(RuntimeError) as info:
        if rank == 0:
            config = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
            with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
                model.state_dict()
        else:
            model(x)
    dist.barrier()  # the default group still works; the scenario's group is abandoned
    print(info.value)
    return str(info.value)


def test_state_dict_on_one_rank_names_both_phases(pool2: RankPool) -> None:
    rank0, rank1 = pool2.run(state_dict_on_one_rank, _timeout=120)
    for rank, message in ((0, rank0), (1, rank1)):
        assert "what each rank of the group was doing" in message, (rank, message)
        assert "rank 0" in message and "during state_dict of FSDP unit '<root>'" in message, (rank, message)
        assert "during forward unshard of FSDP unit '<root>'" in message, (rank, message)
        assert "The ranks are in different phases." in message, (rank, message)
        assert _COLLECTIVES_SENTENCE in message and _RANK0_ONLY_SENTENCE in message, (rank, message)
        # The mismatch is known: no guess that the peer stalled or died.
        assert "probably stalled" not in message, (rank, message)
    assert "rank 0 (this one): " in rank0 and "during state_dict" in rank0.split("rank 0 (this one): ")[1].split("\n")[0]
    assert "rank 1 (this one): " in rank1 and "during forward unshard" in rank1.split("rank 1 (this one): ")[1].split("\n")[0]


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
