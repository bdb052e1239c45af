"""A failed or timed-out collective, re-raised with what FSDP was doing.

[Note: Collective errors]
A rank that stalls (alive but stuck: a slow data loader, a deadlock, a debugger) or dies makes
its peers wait in their next collective for the process group's timeout (30 minutes by default)
and then fail with the backend's bare words, e.g. gloo's "Timed out waiting 1800000ms for recv
operation to complete". Every collective ``fsdp`` issues (``_collectives.py``, and the
works it returns, whose ``wait()`` raises) catches a ``RuntimeError`` (the
base of ``torch.distributed``'s ``DistError`` family and of what gloo raises) and raises one of
the *same type*, chained to the original, saying:

* the collective and the global ranks of its group (in a group of two, the other rank: the
  one it waited for, usually the stalled rank);
* the phase and the FSDP unit, as the layers that know them said them around the collective
  ([Note: Collective phase] in ``_phase.py``: the innermost phase, "within" the enclosing ones,
  and the innermost unit), read only when failing;
* for a timeout or a lost peer, a hint: which timeout elapsed, and how to set it.

Code that catches torch's exception types keeps working; ``__cause__`` holds the original.

[Note: Phases exchanged on failure]
A rank that waits alone cannot tell a stalled peer from one that is somewhere else in the
program. The classic case: only rank 0 calls ``model.state_dict()`` while the others train on;
rank 0 waits in the state dict's gather, the others in their next forward's all-gather, and
both sides time out blaming "a slow data loader". (State dicts now agree on entry before any
collective and fail fast there, [Note: Blocked collectives] in ``_watch.py``; the exchange
below serves every other mismatch, and a peer still blocked when a state dict raised.) So a rank whose collective times out or
loses a peer first writes what it was doing into the default group's store (one key per
group and global rank: a group that failed is abandoned, so a key never outlives its failure)
and reads what the group's other ranks wrote, waiting a moment
for them (a quarter of the group's timeout, between 1 and 10 s): ranks stuck in mismatched
collectives time out together and see each other's phase. Only failures inside an FSDP phase
exchange (cleanup of a dropped model's collectives never waits). The message then lists each rank's
phase, or that it reported no failure (it is busy or blocked elsewhere), and, where a state
dict is involved on some ranks, says that state dicts are collectives. A connection closed by
a peer is said as such: that peer exited or crashed, and nobody waited for a timeout. All of
it runs only while failing; a store that cannot be reached just leaves the exchange out.

[Note: A backward that raised on some ranks]
An exception escaping one rank's backward (a user hook, an out-of-memory, a NaN check) leaves
its peers where that backward's collectives leave them: usually blocked in a reduce-scatter or
backward all-gather this rank will never issue, at best (the failure came after its last
collective) already in the next forward. If the failed rank, caught by the user's ``except``,
reset its units and went on, its next forward's all-gathers would pair with the others' backward
collectives: a hang until the timeout, a gloo size mismatch that aborts the process, or on NCCL
wrong data in silence. What fsdp guarantees:

* Every rank's backward raised at the same point (the same exception in the same place, the
  common case for a bug in the model or the loss): the next forward of each rank warns, drops
  that backward's gradients and trains on, in step (``_recover_if_backward_interrupted``).
* Otherwise (only some ranks raised, or ranks raised at different points): each rank whose
  backward raised raises a ``RuntimeError`` at its next forward, within the exchange's wait
  (a quarter of the group's timeout, 1 to 10 s), before any collective, saying what each rank
  reported; a rank whose backward did not raise is blocked in a collective the failed rank does
  not join and fails at the group's timeout, and its error's phase listing names the failed
  rank's "recovery from an interrupted backward". No rank runs a mismatched collective; the
  group is to be abandoned (restart and resume from a checkpoint).
* Not covered: an exception raised before any FSDP hook of that backward ran (the loss's own
  hooks): fsdp saw nothing to recover and the ranks are still in step unless their peers'
  backward started; the peers then wait at their root's backward all-gather (timeout).

How ranks learn it: the failed rank knows, at its next root forward, that its backward did not
finish; it publishes how far it got (which units were in their backward) in the default store,
the phase exchange's mechanism, and reads the group's other ranks' reports, waiting as the
exchange does. Identical reports: every rank stopped at the same point, so the collectives they
issued match and resetting is safe (reports that differ only because the exception came from
fsdp's execution-order check, which raises on every rank after the same collective, are not
compared). The failed rank publishes its phase before it waits, so a healthy rank's timeout
exchange finds it whichever comes first. Ranks whose backward raised at the same point but that
reach their next forward more than the wait apart are taken as disagreeing: an error, on the
safe side, never a mismatched collective. The healthy ranks get nothing on their normal path: no store
read, no collective per step. A check at every root forward (a store round trip, ~0.1 ms per
step on TCP) would not help them anyway: a healthy rank is in the common case blocked inside its
backward's collectives, never reaching that forward, and one that did reach it would equally
block in its first all-gather; both end in the group's timeout, whose error reads the failed
rank's report through the phase exchange. So the cost lives on the failure path only.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Callable, NoReturn, Optional, Sequence, Union

import torch
import torch.distributed as dist

from fsdp._comm._phase import describe_current, describe_thread

__all__ = [
    "check_interrupted_backward_agreed",
    "describe_blocked_thread",
    "group_key",
    "group_timeout",
    "note_mismatch",
    "publish_phase",
    "raise_collective_error",
]

# Words of a timed-out wait or a lost peer in gloo's and NCCL's messages; a lost peer's name no
# timeout (gloo's own timeout says "Application timeout caused pair closure").
_TIMEOUT_WORDS = ("timed out", "timeout", "pair closure", "connection closed", "connection reset", "broken pipe")
_REPORT_KEY = "fsdp/collective_failure/group{}/rank{}"
# Phases of the state-dict collectives, which users call on one rank by mistake.
_STATE_DICT_PHASES = ("state_dict", "load_state_dict", "optimizer state dict")
_STATE_DICT_HINT = (
    "State dicts are collectives: every rank must call model.state_dict() / load_state_dict() "
    "(and FSDP.optim_state_dict), not only the rank that saves or loads; rank0_only=True only "
    "decides which rank receives the result."
)
_CONTEXT_ATTR = "_fsdp_collective_context"
# [Note: A backward that raised on some ranks]: one key per group, global rank and recovery.
_RECOVERY_KEY = "fsdp/interrupted_backward/group{}/rank{}/{}"
_RECOVERIES: dict[str, int] = {}  # group name -> recoveries this process ran (the keys' last part)


# [Note: A connection closed after a mismatch was said]
# When the ranks of a group issued different collectives, each rank's watcher says so within
# seconds ([Note: Blocked collectives] in ``_watch.py``), and both ranks wait until the group's
# timeout. The rank whose timeout fires first closes its connections; a peer still waiting then
# fails at once with gloo's "Connection closed by peer", not with its own timeout. That peer did
# not exit or crash: it gave up on the same mismatch. So the watcher records what it said per
# group (``note_mismatch``), and a failure on that group that follows takes the record (once): a
# closed connection then repeats the mismatch instead of the crash hint.
_MISMATCH_SAID: dict[str, str] = {}  # group_key -> the watcher's message


def group_key(group: Optional[dist.ProcessGroup]) -> str:
    """The name a group goes by in fsdp's records: collectives given ``None`` (the default
    group) are counted apart from those given the default group itself, on every rank alike."""
    return "<default>" if group is None else group.group_name


def note_mismatch(group: Optional[dist.ProcessGroup], message: str) -> None:
    """Records the watcher's mismatch message for ``group``'s next failure ([Note: A connection
    closed after a mismatch was said])."""
    _MISMATCH_SAID[group_key(group)] = message


def raise_collective_error(
    err: RuntimeError,
    collective: str,
    group: Optional[dist.ProcessGroup],
    peer: Optional[int] = None,
) -> NoReturn:
    """Raises ``err`` again as the same type with FSDP's context, chained from ``err``.

    Call it from the ``except`` clause that caught ``err`` around a collective.

    Args:
        err: What the collective raised.
        collective: Its name for people ("all-gather", "reduce-scatter", ...).
        group: The process group it ran on (None: the default group).
        peer: The global rank this rank waited for, if known (in a group of two ranks it is
            the other one).

    Raises:
        RuntimeError: Of ``err``'s type (``err`` itself, annotated, if that type cannot be
            built from a message), with ``err`` as ``__cause__``.
    """
    if getattr(err, _CONTEXT_ATTR, False):
        raise err  # an inner collective (a work's wait) already said it
    message = _describe(err, collective, group, peer)
    try:
        new = type(err)(message)
    except Exception:  # an exception type that takes other arguments
        new = None
    if new is None or type(new) is not type(err):
        if hasattr(err, "add_note"):
            err.add_note(message)
        setattr(err, _CONTEXT_ATTR, True)
        raise err
    setattr(new, _CONTEXT_ATTR, True)
    raise new from err


def _describe(
    err: RuntimeError,
    collective: str,
    group: Optional[dist.ProcessGroup],
    peer: Optional[int],
) -> str:
    phase, unit = describe_current()
    where = _where(phase, unit)
    ranks = _global_ranks(group)
    if peer is None and isinstance(ranks, list) and len(ranks) == 2 and dist.is_initialized():
        others = [r for r in ranks if r != dist.get_rank()]
        peer = others[0] if len(others) == 1 else None
    waiting = f", waiting for rank {peer}" if peer is not None else ""
    mismatch = _MISMATCH_SAID.pop(group_key(group), None)  # any failure on the group takes it
    original = str(err).strip()
    message = f"fsdp: {collective} over the process group of global ranks {ranks} failed{where}{waiting}: {original}"
    lowered = original.lower()
    if not any(word in lowered for word in _TIMEOUT_WORDS):
        return message
    timeout = _group_timeout(group)
    suspect = f"rank {peer}" if peer is not None else "another rank of the group"
    # Only a failure inside an FSDP phase reaches the user; one outside (completing a dropped
    # model's collectives) must not spend the exchange's wait.
    phases = _phases_of_ranks(group, f"{collective}{where}", timeout) if phase else None
    if mismatch is not None and not any(word in lowered for word in ("timed out", "timeout")):
        message += (
            f"\nfsdp hint: the connection to {suspect} closed after this rank's watcher said that "
            f"the ranks issued different collectives: {suspect} most likely reached the group's "
            f"timeout first and gave up on the same mismatch (it did not crash). What was said: "
            f"{mismatch}"
        )
    elif not any(word in lowered for word in ("timed out", "timeout")):  # gloo: "timeout caused pair closure"
        message += (
            f"\nfsdp hint: the connection to {suspect} closed: that process most likely exited "
            f"or crashed (this rank did not wait for a timeout); look at its output for its own "
            f"error."
        )
    elif phases is None or not phases.differ:
        after = f" ({timeout} for this group)" if timeout is not None else ""
        message += (
            f"\nfsdp hint: {suspect} probably stalled (alive but stuck: a slow data loader, a "
            f"deadlock, uneven work or a debugger) or died, and this rank waited for the process "
            f"group's timeout{after}; look at that rank's output for its own error or stack. "
            f"The timeout is set where the group is made: "
            f"dist.init_process_group(timeout=datetime.timedelta(seconds=...)) for the default "
            f"group, dist.new_group(..., timeout=...) for your own."
        )
    return message + (phases.describe(dist.get_rank()) if phases is not None else "")


@dataclasses.dataclass
class _RankPhases:
    """What the ranks of a failed collective's group said they were doing."""

    mine: str
    theirs: dict[int, Optional[str]]  # global rank -> its phase, None if it did not report
    wait_s: float

    @property
    def differ(self) -> bool:
        """Every rank reported, and not all the same phase."""
        return None not in self.theirs.values() and len({self.mine, *self.theirs.values()}) > 1

    def _state_dict_on_some(self) -> bool:
        phases = [self.mine, *self.theirs.values()]
        in_state_dict = [p for p in phases if p is not None and any(f"during {s}" in p for s in _STATE_DICT_PHASES)]
        return 0 < len(in_state_dict) < len(phases)

    def describe(self, me: int) -> str:
        lines = [f"\nfsdp: what each rank of the group was doing: rank {me} (this one): {self.mine}"]
        for rank, phase in self.theirs.items():
            lines.append(
                f"rank {rank}: {phase}" if phase is not None
                else f"rank {rank}: reported no failed collective within {self.wait_s:.0f} s (busy, or "
                "blocked in something else)"
            )
        if self._state_dict_on_some():
            lead = "The ranks are in different phases." if self.differ else "A rank that reported nothing may have skipped the state dict."
            lines.append(f"{lead} {_STATE_DICT_HINT}")
        elif self.differ:
            lines.append("The ranks are in different phases: every rank must run the same FSDP calls in the same order.")
        return "\n  ".join(lines)


def _phases_of_ranks(
    group: Optional[dist.ProcessGroup], mine: str, timeout: Optional[timedelta]
) -> Optional[_RankPhases]:
    """Publishes this rank's phase and reads the group's other ranks' ([Note: Phases exchanged
    on failure]); None where the default store cannot be reached."""
    try:
        store = dist.distributed_c10d._get_default_store()
        me = dist.get_rank()
        all_ranks = _global_ranks(group)
        resolved = _resolved(group)
        if isinstance(all_ranks, str) or resolved is None:  # ranks unknown, or no default group
            return None
        ranks = [r for r in all_ranks if r != me]
        name = resolved.group_name
    except Exception:  # no default group (explicit groups only)
        return None
    wait_s = _exchange_wait_s(timeout)
    try:
        theirs = _exchange(store, lambda r: _REPORT_KEY.format(name, r), me, ranks, mine, wait_s)
    except Exception:  # describing must never hide the original error
        return None
    return _RankPhases(mine, theirs, wait_s)


def _exchange(
    store: dist.Store, key: Callable[[int], str], me: int, ranks: list[int], mine: str, wait_s: float
) -> dict[int, Optional[str]]:
    """Publishes ``mine`` under this rank's ``key`` and reads the other ``ranks``' values, waiting
    up to ``wait_s`` for them (None: a rank that reported nothing by then)."""
    store.set(key(me), mine)
    try:
        store.wait([key(r) for r in ranks], timedelta(seconds=wait_s))
    except Exception:  # some ranks did not report: the caller says so
        pass
    return {r: store.get(key(r)).decode() if store.check([key(r)]) else None for r in ranks}


def _exchange_wait_s(timeout: Optional[timedelta]) -> float:
    """How long a failing rank waits for the others' reports: a quarter of the group's timeout,
    between 1 and 10 s."""
    timeout_s = timeout.total_seconds() if timeout is not None else 1800.0
    return min(10.0, max(1.0, timeout_s / 4))


def check_interrupted_backward_agreed(groups: Sequence[dist.ProcessGroup], progress: str) -> None:
    """Before a rank resets from a backward that raised: checks that every rank of ``groups``
    is resetting from the same point ([Note: A backward that raised on some ranks]).

    ``progress`` says how far this rank's backward got (which units it reached); it is published
    in the default store and compared with the other ranks' reports, read for a moment (as the
    phase exchange waits). Runs only on this recovery path; a store that cannot be reached
    leaves the check out (the reset goes on, as without it).

    Raises:
        RuntimeError: On this rank, without any collective, where another rank did not report
            the same progress in time (its backward finished or still waits in a collective this
            rank will not join, or it raised at another point). What this rank did is also
            published as its phase, so the other ranks' collective errors name it.
    """
    try:
        store = dist.distributed_c10d._get_default_store()
        me = dist.get_rank()
    except Exception:  # no default group: nothing to compare with
        return
    for group in groups:
        all_ranks = _global_ranks(group)
        if isinstance(all_ranks, str) or len(all_ranks) < 2:
            continue
        name = group.group_name
        attempt = _RECOVERIES[name] = _RECOVERIES.get(name, 0) + 1
        ranks = [r for r in all_ranks if r != me]
        wait_s = _exchange_wait_s(_group_timeout(group))
        report = _REPORT_KEY.format(name, me)
        try:
            # First this rank's phase, for the other ranks' collective errors (the phase
            # exchange) should they time out meanwhile; removed again where the ranks agree.
            store.set(
                report,
                f"recovery from an interrupted backward: its backward raised after reaching "
                f"{progress}, and it will run no more collectives of this group",
            )
            theirs = _exchange(
                store, lambda r: _RECOVERY_KEY.format(name, r, attempt), me, ranks, progress, wait_s
            )
            if all(p == progress for p in theirs.values()):
                store.delete_key(report)  # no failure: a later exchange must not read it
                continue
        except Exception:  # a store that cannot be reached: the check is left out
            continue
        listing = "; ".join(
            f"rank {r}: "
            + (f"its backward raised too, after reaching {p}" if p is not None
               else f"reported no failed backward within {wait_s:.0f} s (its backward finished, or "
               f"it waits in a collective of that backward)")
            for r, p in theirs.items()
        )
        raise RuntimeError(
            f"fsdp: the previous backward raised on this rank (rank {me}) after reaching "
            f"{progress}, but the other ranks of the process group of global ranks {all_ranks} "
            f"did not stop at the same point: {listing}. The ranks' collectives no longer match "
            f"(the next forward's all-gathers would pair with another rank's backward "
            f"collectives: a hang, or mixed data on NCCL), so FSDP does not resume here and runs "
            f"no collective. Fix the exception the backward raised on this rank (printed where "
            f"it was raised), restart every rank, and resume from a checkpoint."
        )


def describe_blocked_thread(ident: int) -> str:
    """" during <phase> of FSDP unit '<unit>'" for the thread ``ident`` (blocked in a
    collective), as collective errors say it; "" where no phase or unit is known."""
    return _where(*describe_thread(ident))


def _where(phase: Optional[str], unit: Optional[str]) -> str:
    where = f" during {phase}" if phase else ""
    return where + (f" of FSDP unit '{unit}'" if unit is not None else "")


def publish_phase(group: Optional[dist.ProcessGroup], phase: str) -> None:
    """Publishes ``phase`` as this rank's report for ``group``'s collective errors ([Note: Phases
    exchanged on failure]), for a rank that raised without entering the collective the others
    wait in; a store that cannot be reached leaves it out."""
    try:
        store = dist.distributed_c10d._get_default_store()
        name = _resolved(group).group_name  # type: ignore[union-attr]
        store.set(_REPORT_KEY.format(name, dist.get_rank()), phase)
    except Exception:  # describing must never hide the error being raised
        return


def group_timeout(group: Optional[dist.ProcessGroup]) -> Optional[timedelta]:
    """The timeout the group's backend waits for (None where it cannot be read)."""
    return _group_timeout(group)


def _resolved(group: Optional[dist.ProcessGroup]) -> Optional[dist.ProcessGroup]:
    return group if group is not None else dist.group.WORLD


def _global_ranks(group: Optional[dist.ProcessGroup]) -> Union[list[int], str]:
    """The group's global ranks, or "?" where they cannot be read (for messages)."""
    try:
        return dist.get_process_group_ranks(_resolved(group))
    except Exception:  # describing must never hide the original error
        return "?"


def _group_timeout(group: Optional[dist.ProcessGroup]) -> Optional[timedelta]:
    """The timeout the group's backend waits for (None where it cannot be read)."""
    resolved = _resolved(group)
    if resolved is None:  # no default group
        return None
    for device_type in ("cpu", "cuda"):
        try:
            return resolved._get_backend(torch.device(device_type)).options._timeout
        except Exception:
            continue
    return None
