"""Which FSDP collective each rank is blocked in, and the entry agreement of state dicts.

[Note: Blocked collectives]
A collective whose peers are alive but somewhere else waits for the process group's timeout (30
minutes by default): the rank inside cannot tell a peer that is slow to arrive from one that will
never arrive. The classic case is ``model.state_dict()`` called on rank 0 only: rank 0 waits in
the state dict's gather, rank 1 in its next forward's all-gather, each for the other. What tells
them apart is a *positive* report: the peer says it is blocked in a collective that waits for us.

* Every collective of ``_collectives.py`` counts, per process group, the FSDP collectives this
  process issued on it (``issued``), and marks, per thread, the one it is inside (``begin`` /
  ``end``: a dict write and a pop, a fraction of a microsecond, nothing else on the hot path:
  no store traffic, no clock, no constant tuned to any workload).
* A daemon thread, the watcher, wakes every ``_POLL_S`` while an FSDP collective may need it
  ([Note: The watcher runs only while collectives do]). A thread found inside the *same*
  collective at two wake-ups has been blocked at least that long: the watcher then publishes, in
  the default group's store, under this rank's key, the group's name and global ranks, the
  collective's number on that group, and the phase and unit (what the blocked thread's callers
  said, as collective errors say it, [Note: Collective phase] in ``_phase.py``); the key is
  deleted when it is unblocked. A rank that is not blocked costs the store nothing; a blocked
  rank writes at most once per wake-up. ``_POLL_S`` only bounds how soon a block is reported (a
  wake-up or two).
* Before a state dict's collectives every rank enters an agreement round
  (:func:`entry_agreed`): it adds its entry under a per-group round key and waits for the
  group's other ranks' entries. While it waits it reads the missing ranks' blocked reports: a
  missing rank blocked in collective number ``k`` of a group that includes this rank, which
  has issued fewer than ``k`` collectives on that group, waits for this rank, which waits for it:
  that can never resolve, so this rank raises at once (within a wake-up or two, not the
  timeout), naming what that rank is doing. Where the counts say the peer is merely behind (this
  rank already issued its ``k``-th; NCCL queues work), or the peer reports nothing (busy, or
  blocked outside FSDP), the wait goes on, up to the group's timeout, as the collective's would.
  Ranks that all entered compare the names of what they entered (``state_dict`` vs
  ``optim_state_dict``): a difference raises on every rank before any collective.
* The rank that raised withdraws its entry and publishes its phase for the others' collective
  errors (``_errors.py``): a peer still blocked in its forward all-gather is released as soon as
  this rank runs its own next forward (the group is intact: the agreement ran no collective), or
  fails when this rank's process exits, with this rank's phase in its message.

* Any other mismatch is at least *said* within seconds: a watcher whose rank is blocked reads
  the reports of its group's other ranks, and where one is blocked in its collective of the same
  number on the same group but a different one (an all-reduce against a broadcast, a gather
  against an all-gather), it prints both ranks' collectives and phases to stderr at once; the
  collectives themselves still fail at the group's timeout, with each rank's phase
  ([Note: Phases exchanged on failure]).

Gloo's and NCCL's collectives cannot be interrupted from another thread (gloo has no working
abort), so only code that has not yet entered a collective can fail fast: that is why the
agreement runs before a state dict's collectives rather than a general check inside every
collective, which would need a store round trip per collective.

[Note: The watcher runs only while collectives do]
What needs the watcher is a collective that blocks: its report is what a peer's entry agreement
reads (the agreeing rank itself reads the store from its own thread and needs no watcher of its
own), and what the mismatch diagnosis compares. A process that issues no FSDP collective, or is
between them, needs no thread: none runs there, so no thread of ours touches the process group,
the store or the allocator (nor triggers a garbage collection) while the process does anything
else, torch's own collectives included. So :func:`begin` starts the watcher when none runs (a
module flag read per collective; a thread start only at the change from idle), and the watcher
ends at the first wake-up that finds no FSDP collective in progress, none issued since the
wake-up before, and nothing published (it withdraws its report first): one to two wake-ups after
the last FSDP collective. A training loop keeps one watcher (its collectives follow each other
closer than that), instead of stopping and starting one between them. A block is still reported
after one to two wake-ups: the watcher started with the collective, or was running already. The
flag is cleared and the collectives re-checked under one lock, so a collective that begins
while the watcher ends either is seen by it or starts a new one.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import weakref
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional, Sequence

import torch.distributed as dist

from fsdp._comm._errors import describe_blocked_thread, group_key, group_timeout, note_mismatch, publish_phase

# How often the watcher looks at the collectives in progress ([Note: Blocked collectives]): a
# block is reported after one to two of these; the watcher's own cost is a wake-up each.
_POLL_S = 0.5
# How long the agreement waits on the store between looks at the missing ranks' reports.
_LOOK_S = 0.25

_BLOCKED_KEY = "fsdp/blocked/rank{}"
_ENTRY_KEY = "fsdp/entry/{}/{}/rank{}"  # group name, round, global rank

# Group -> FSDP collectives this process issued on it (None: the default group, passed as None).
# Weak keys: a destroyed group is freed at once (its gloo threads stop), not kept for counting.
_ISSUED: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()
_ISSUED_DEFAULT = [0]  # collectives given None (the default group)
# Thread ident -> (group, number on that group, collective): the collective it is inside.
_ACTIVE: dict[int, tuple[Any, int, str]] = {}
_WATCHING = [False]  # a watcher runs ([Note: The watcher runs only while collectives do])
_WATCHER_LOCK = threading.Lock()
_ROUNDS: dict[str, int] = {}  # group name -> agreement rounds this process entered
DIAGNOSES: list[tuple[float, str]] = []  # (time.monotonic(), what the watcher said about mismatched collectives)
_DEPTH = threading.local()


def issue(group: Optional[dist.ProcessGroup]) -> int:
    """Counts one FSDP collective issued on ``group``; returns its number there (from 1)."""
    if group is None:
        _ISSUED_DEFAULT[0] += 1
        return _ISSUED_DEFAULT[0]
    number = _ISSUED.get(group, 0) + 1
    _ISSUED[group] = number
    return number


def begin(group: Optional[dist.ProcessGroup], number: int, collective: str) -> int:
    """Marks this thread as inside collective ``number`` of ``group``; returns the mark for :func:`end`.

    Starts the watcher where none runs ([Note: The watcher runs only while collectives do]):
    after the mark, so a watcher that is ending sees it or a new one starts."""
    ident = threading.get_ident()
    _ACTIVE[ident] = (group, number, collective)
    if not _WATCHING[0]:
        _start_watcher()
    return ident


def end(mark: int) -> None:
    """This thread left the collective :func:`begin` marked."""
    _ACTIVE.pop(mark, None)


def _start_watcher() -> None:
    try:
        if not dist.is_initialized() or dist.get_world_size() < 2:
            return
        dist.distributed_c10d._get_default_store()
    except Exception:  # no default group (explicit groups only): nothing to publish to
        return
    with _WATCHER_LOCK:
        if _WATCHING[0]:
            return
        _WATCHING[0] = True
        threading.Thread(target=_watch, name="fsdp-collective-watch", daemon=True).start()


def _watch() -> None:
    """The watcher's loop ([Note: Blocked collectives]): until a wake-up finds no FSDP collective
    in progress and nothing published ([Note: The watcher runs only while collectives do]).

    It keeps no reference to a group between wake-ups (records are remembered by ``id``), so a
    destroyed group is freed at once."""
    seen = _Seen()
    while True:
        time.sleep(_POLL_S)
        try:
            if dist.is_initialized():
                _look(seen)
            else:
                seen = _Seen()  # the group went away: nothing published is left to withdraw
        except Exception:  # a store or group going away (shutdown, a destroyed group)
            seen = _Seen()
        issued = _issued_total()
        if 0 <= issued == seen.issued and _done(seen):
            return
        seen.issued = issued


def _issued_total() -> int:
    """The FSDP collectives this process issued so far (-1 where a group was added meanwhile)."""
    try:
        return _ISSUED_DEFAULT[0] + sum(_ISSUED.values())
    except RuntimeError:  # the weak dictionary changed size while read: not quiet
        return -1


def _done(seen: "_Seen") -> bool:
    """Whether the watcher may end: nothing in progress, nothing published. Clears the flag
    first and looks again under the lock, so a collective that begins meanwhile is seen here or
    starts a new watcher (:func:`begin` marks before it reads the flag)."""
    with _WATCHER_LOCK:
        _WATCHING[0] = False
        if _ACTIVE or seen.published is not None:
            _WATCHING[0] = True
            return False
        return True


def _forget_watcher_in_child() -> None:
    """A forked child has no watcher thread (only the forking thread survives a fork)."""
    global _WATCHER_LOCK
    _WATCHER_LOCK = threading.Lock()
    _WATCHING[0] = False
    _ACTIVE.clear()


os.register_at_fork(after_in_child=_forget_watcher_in_child)


class _Seen:
    """What the watcher saw at its last wake-up."""

    def __init__(self) -> None:
        self.active: dict[int, int] = {}  # thread ident -> id of the record it was inside
        self.published: Optional[str] = None  # this rank's report in the store
        self.diagnosed = 0  # id of the record last said to be mismatched
        self.issued = -1  # the FSDP collectives issued by the last wake-up (-1: not counted)


def _look(seen: _Seen) -> None:
    """One wake-up: publish (or withdraw) this rank's blocked collective, say a mismatch."""
    store = dist.distributed_c10d._get_default_store()
    key = _BLOCKED_KEY.format(dist.get_rank())
    current = dict(_ACTIVE)
    blocked = [(ident, rec) for ident, rec in current.items() if seen.active.get(ident) == id(rec)]
    seen.active = {ident: id(rec) for ident, rec in current.items()}
    if not blocked:
        if seen.published is not None:
            store.delete_key(key)
            seen.published = None
        return
    ident, record = blocked[0]
    group, number, collective = record
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    where = describe_blocked_thread(ident)
    report = "|".join([group_key(group), ",".join(map(str, ranks)), str(number), collective, where])
    if report != seen.published:
        store.set(key, report)
        seen.published = report
    if seen.diagnosed != id(record) and _diagnose(store, record, ranks, where):
        seen.diagnosed = id(record)


def _diagnose(store: dist.Store, record: tuple[Any, int, str], ranks: list[int], where: str) -> bool:
    """Says at once (stderr, and ``DIAGNOSES``) where another rank of the group is blocked in
    *its* collective of the same number on the same group, a different one: the ranks issued
    different collectives and wait for each other until the group's timeout, which no thread
    can interrupt ([Note: Blocked collectives]). Returns whether it said so."""
    group, number, collective = record
    me, name = dist.get_rank(), group_key(group)
    for rank in ranks:
        report = _blocked_report(store, rank) if rank != me else None
        if report is None or report[0] != name or report[2] != number or report[3] == collective:
            continue
        timeout = group_timeout(group) or timedelta(minutes=30)
        message = (
            f"fsdp: rank {me} waits in {collective}{where} (FSDP collective #{number} on the "
            f"process group of global ranks {ranks}) while rank {rank} waits in "
            f"{report[3]}{report[4]} (its #{number} there): the ranks issued different "
            f"collectives at the same point and will wait for each other until the group's "
            f"timeout ({timeout}), then fail. Every rank must run the same FSDP calls in the same "
            f"order (not a state dict, summon_full_params or clip_grad_norm_ on some ranks only, "
            f"nor a forward or backward skipped on some)."
        )
        DIAGNOSES.append((time.monotonic(), message))
        note_mismatch(group, message)
        print(message, file=sys.stderr, flush=True)
        return True
    return False


def _blocked_report(store: dist.Store, rank: int) -> Optional[tuple[str, list[int], int, str, str]]:
    """What ``rank`` published as its blocked collective: (group name, its ranks, number,
    collective, " during <phase> of FSDP unit '<unit>'")."""
    key = _BLOCKED_KEY.format(rank)
    if not store.check([key]):
        return None
    name, ranks, number, collective, where = store.get(key).decode().split("|", 4)
    return name, [int(r) for r in ranks.split(",")], int(number), collective, where


def _issued_by_name() -> dict[str, int]:
    counts = {group_key(group): count for group, count in list(_ISSUED.items())}
    counts[group_key(None)] = _ISSUED_DEFAULT[0]
    return counts


@contextlib.contextmanager
def entry_agreed(what: str, groups: Callable[[], Sequence[dist.ProcessGroup]]) -> Iterator[None]:
    """Every rank of the ``groups()`` enters ``what`` (a state-dict call) before it runs
    collectives ([Note: Blocked collectives]); nested entries (units inside the root's call)
    agree once (``groups`` is not even called for them).

    Raises:
        RuntimeError: At once, where a rank that has not entered is blocked in an FSDP
            collective that waits for this rank; where the ranks entered different calls; or
            after the group's timeout, where a rank neither entered nor reported a block.
    """
    depth = getattr(_DEPTH, "value", 0)
    if depth == 0:
        for group in groups():
            _agree(what, group)
    _DEPTH.value = depth + 1
    try:
        yield
    finally:
        _DEPTH.value = depth


def _agree(what: str, group: dist.ProcessGroup) -> None:
    """One agreement round of ``group`` for ``what`` (see :func:`entry_agreed`)."""
    try:
        ranks = dist.get_process_group_ranks(group)
        if len(ranks) < 2:
            return
        store = dist.distributed_c10d._get_default_store()
        me, name = dist.get_rank(), group.group_name
    except Exception:  # no default group or store: the collectives go on unchecked, as before
        return
    number = _ROUNDS[name] = _ROUNDS.get(name, 0) + 1
    peers = [r for r in ranks if r != me]
    store.set(_ENTRY_KEY.format(name, number, me), what)
    if number > 2:  # every rank finished round number - 2 before any entered number - 1
        with contextlib.suppress(Exception):
            store.delete_key(_ENTRY_KEY.format(name, number - 2, me))
    timeout = group_timeout(group) or timedelta(minutes=30)
    deadline = time.monotonic() + timeout.total_seconds()
    missing = peers
    while True:
        with contextlib.suppress(Exception):  # some still missing: looked at below
            store.wait([_ENTRY_KEY.format(name, number, r) for r in missing], timedelta(seconds=_LOOK_S))
        missing = [r for r in missing if not store.check([_ENTRY_KEY.format(name, number, r)])]
        if not missing:
            break
        stuck = _stuck_on_me(store, missing, me)
        if stuck or time.monotonic() > deadline:
            _withdraw(store, name, number, me, group, what)
            raise RuntimeError(_not_entered(what, me, ranks, missing, stuck, timeout))
    entered = {r: store.get(_ENTRY_KEY.format(name, number, r)).decode() for r in peers}
    if any(other != what for other in entered.values()):
        listing = "; ".join(f"rank {r}: {entered.get(r, what)}()" for r in ranks)
        raise RuntimeError(
            f"fsdp: the ranks of the process group of global ranks {ranks} called different "
            f"state-dict functions at the same point: {listing}. They are collectives: every rank "
            f"must call the same ones in the same order. Nothing was communicated."
        )


def _stuck_on_me(store: dist.Store, missing: list[int], me: int) -> dict[int, str]:
    """The missing ranks blocked in an FSDP collective that waits for this rank: rank -> what."""
    issued = _issued_by_name()
    stuck = {}
    for rank in missing:
        try:
            report = _blocked_report(store, rank)
        except Exception:  # unreadable: as if it reported nothing
            continue
        if report is None:
            continue
        name, group_ranks, number, collective, where = report
        if me in group_ranks and issued.get(name, 0) < number:
            stuck[rank] = (
                f"blocked in {collective}{where} (its FSDP collective #{number} on the process group of "
                f"global ranks {group_ranks}; rank {me} has issued {issued.get(name, 0)} there)"
            )
    return stuck


def _withdraw(store: dist.Store, name: str, number: int, me: int, group: dist.ProcessGroup, what: str) -> None:
    """Undoes this rank's entry (a later round must pair with the peers' next one) and publishes
    its phase for the peers' collective errors."""
    _ROUNDS[name] = number - 1
    with contextlib.suppress(Exception):
        store.delete_key(_ENTRY_KEY.format(name, number, me))
    publish_phase(group, f"{what}() (it found the other ranks elsewhere and raised before any collective)")


def _not_entered(
    what: str, me: int, ranks: list[int], missing: list[int], stuck: dict[int, str], timeout: timedelta
) -> str:
    if stuck:
        doing = "; ".join(f"rank {r} is {d}" for r, d in stuck.items())
        cause = (
            f"{doing}. That collective waits for rank {me}, which waits for "
            f"{'it' if len(stuck) == 1 else 'them'} here: neither could ever go on (without this "
            f"check both would wait for the group's timeout, {timeout})"
        )
    else:
        who = ", ".join(f"rank {r}" for r in missing)
        cause = (
            f"{who} did not enter it within the group's timeout ({timeout}) and reported no "
            f"blocked FSDP collective (busy, stalled, or blocked outside FSDP)"
        )
    return (
        f"fsdp: {what}() was called on rank {me} but not on every rank of the process group of "
        f"global ranks {ranks}: {cause}. State dicts are collectives: every rank must call "
        f"model.state_dict() / load_state_dict() (and FSDP.optim_state_dict), not only the rank "
        f"that saves or loads; rank0_only=True only decides which rank receives the result. "
        f"Nothing was communicated: the group is intact."
    )
