"""Contract: a forward order that differs across ranks or across iterations, as torch FSDP1.

Torch FSDP1 checks the forward order only under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``: in the
first iteration, ranks that gather different units raise ``Forward order differs across
ranks: ...`` on every rank; in a later iteration, a rank whose forward order differs from its
first iteration's warns (``UserWarning``, ``Forward order differs from that of the first
iteration on rank R. ...``) at each difference of the first iteration that differs, and never
again. Ours raises the first error always (without DETAIL torch hangs there), with torch's
sentence first, and warns exactly where torch warns, with torch's sentence first
([Note: Execution order check], [Note: Forward order after the first iteration]). The same
scenarios run through both libraries on two ranks; ours must contain torch's message, word for
word, in every place torch gives one, and give nothing where torch gives nothing.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from tests._harness import RankPool
from tests.test_contract_errors import Lib, _lib


class _TwoUnits(nn.Module):
    """Two units, ``a`` and ``b``, run in an order the caller picks (``order``: unit names)."""

    def __init__(self, lib: Lib) -> None:
        super().__init__()
        F, extra = lib["F"], lib["extra"]
        self.a = F(nn.Linear(4, 4), **extra)
        self.b = F(nn.Linear(4, 4), **extra)

    def forward(self, x: torch.Tensor, order: str = "ab") -> torch.Tensor:
        for name in order:
            x = getattr(self, name)(x)
        return x


def _model(lib: Lib) -> nn.Module:
    torch.manual_seed(0)
    return lib["F"](_TwoUnits(lib), **lib["extra"])


def _first_iteration_differs(lib: Lib) -> Optional[str]:
    """Rank 1 runs ``b`` first in the first iteration: the message raised, or None."""
    model = _model(lib)
    try:
        model(torch.randn(2, 4), order="ba" if dist.get_rank() == 1 else "ab").sum().backward()
    except RuntimeError as exc:
        return str(exc)
    return None


def _later_iterations(lib: Lib, orders: list[tuple[str, bool]]) -> list[list[tuple[str, str]]]:
    """Runs one iteration per ``(order, training)`` (training: forward and backward; else an
    eval forward only); returns each iteration's warnings (category, message)."""
    model = _model(lib)
    per_iteration = []
    for order, training in orders:
        model.train(training)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = model(torch.randn(2, 4), order=order)
            if training:
                out.sum().backward()
        per_iteration.append([(w.category.__name__, str(w.message)) for w in caught])
    return per_iteration


# Every rank runs the same orders (so nothing hangs): iteration 0 is the reference; an eval
# forward in another order is not checked; iteration 3 swaps the units (two differences),
# iteration 4 runs ``a`` twice (a difference, then one forward more than the first iteration
# had), both of which only iteration 3 reports; iteration 5 is clean.
_ORDERS = [("ab", True), ("ab", True), ("ba", False), ("ba", True), ("aab", True), ("ab", True)]


def _run(detail: bool) -> dict[str, Any]:
    previous = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL if detail else dist.DebugLevel.OFF)
    try:
        out: dict[str, Any] = {}
        for name in ("torch", "ours"):
            lib = _lib(name)
            # Without DETAIL torch FSDP1 does not check the first iteration and would hang.
            out[name] = {
                "first": _first_iteration_differs(lib) if detail or name == "ours" else None,
                "later": _later_iterations(lib, _ORDERS),
            }
            dist.barrier()
        return out
    finally:
        dist.set_debug_level(previous)


def test_forward_order_checks_match_torch_fsdp1(pool2: RankPool) -> None:
    detail, plain = pool2.run(_run, True), pool2.run(_run, False)
    for rank, (r, p) in enumerate(zip(detail, plain)):
        theirs, ours = r["torch"], r["ours"]
        # First iteration: every rank raises, torch's sentence first (same on both ranks).
        assert theirs["first"] == (
            "Forward order differs across ranks: rank 0 is all-gathering parameters for "
            "[['a.weight', 'a.bias']] while rank 1 is all-gathering parameters for "
            "[['b.weight', 'b.bias']]"
        ), theirs["first"]
        for ours_first in (ours["first"], p["ours"]["first"]):  # with and without DETAIL
            assert ours_first is not None and ours_first.startswith(theirs["first"] + ". (fsdp: "), ours_first
            assert "rank 0: forward of unit 'a'; rank 1: forward of unit 'b'" in ours_first, ours_first

        # Later iterations: the same warnings in the same iterations, ours = torch's + culprit.
        their_later, our_later = theirs["later"], ours["later"]
        assert [len(w) for w in their_later] == [0, 0, 0, 2, 0, 0], their_later
        assert [len(w) for w in our_later] == [len(w) for w in their_later], our_later
        head = (
            f"Forward order differs from that of the first iteration on rank {rank}. Collectives "
            f"are unchecked and may give incorrect results or hang.\n"
        )
        assert [m for _, m in their_later[3]] == [
            head + "Expected to all-gather for [['a.weight', 'a.bias']] but trying to all-gather "
            "parameters for [['b.weight', 'b.bias']]",
            head + "Expected to all-gather for [['b.weight', 'b.bias']] but trying to all-gather "
            "parameters for [['a.weight', 'a.bias']]",
        ], their_later[3]
        for (t_cat, t_msg), (o_cat, o_msg) in zip(their_later[3], our_later[3]):
            assert o_cat == t_cat == "UserWarning"
            assert o_msg.startswith(t_msg + " (fsdp: "), (o_msg, t_msg)
        assert "forward #1 of this iteration is unit 'b'; the first iteration ran unit 'a' here" in our_later[3][0][1]

        # Without DETAIL neither library checks later iterations.
        assert p["torch"]["later"] == p["ours"]["later"] == [[]] * len(_ORDERS), p


def _extra_forward() -> list[list[tuple[str, str]]]:
    previous = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        runs = [_later_iterations(_lib(name), [("ab", True), ("aab", True), ("ba", True)]) for name in ("torch", "ours")]
        dist.barrier()
        return runs
    finally:
        dist.set_debug_level(previous)


def test_extra_forward_after_the_first_iteration(pool2: RankPool) -> None:
    """A later iteration that runs a unit once more: torch's two sentences (a different unit,
    then one forward more than the first iteration had), and silence in the next iteration."""
    for rank, (theirs, ours) in enumerate(pool2.run(_extra_forward)):
        head = (
            f"Forward order differs from that of the first iteration on rank {rank}. Collectives "
            f"are unchecked and may give incorrect results or hang.\n"
        )
        assert [m for _, m in theirs[1]] == [
            head + "Expected to all-gather for [['b.weight', 'b.bias']] but trying to all-gather "
            "parameters for [['a.weight', 'a.bias']]",
            head + "Expected to not all-gather any more parameters in the forward but trying to "
            "all-gather parameters for [['b.weight', 'b.bias']]",
        ], theirs
        assert theirs[0] == theirs[2] == ours[0] == ours[2] == [], (theirs, ours)
        assert len(ours[1]) == 2, ours
        for (_, t_msg), (_, o_msg) in zip(theirs[1], ours[1]):
            assert o_msg.startswith(t_msg + " (fsdp: "), (o_msg, t_msg)
