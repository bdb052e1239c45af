"""use_orig_params=True: what the original parameters and their ``.grad`` show at every point of
training, between a forward and its backward included, and when the FlatParameter's gradient is
freed, against torch FSDP1 (the same scenario through both, compared exactly).

torch FSDP1 shows after a forward what it shows between steps, per strategy ([Note: Original
parameters between forward and backward] in ``fsdp/runtime/_hooks.py``): FULL_SHARD the sharded
1-D parameters with their sharded gradients, NO_SHARD the parameters in their shapes with their
gradients, SHARD_GRAD_OP the unsharded views (plain tensors without ``.grad``); inside
``no_sync`` the gradient is the accumulated unsharded one. Code that reads, scales or clips
gradients during accumulation sees them.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests._harness import RankPool
from tests._models import global_batch, lm_loss, local_rows, make_toy
from tests.test_orig_params_torch_attrs import _units, _wrap
from tests.test_parity import _full_params

STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]


def _tensor(t: Optional[torch.Tensor]) -> Any:
    return None if t is None else (tuple(t.shape), t.dtype, t.detach().clone())


def snapshot(model: nn.Module) -> dict[str, Any]:
    """Everything a user reads off the parameters, and what each unit's FlatParameter keeps.

    A parameter: its type, its values and its ``.grad`` (a non-leaf view has none: its
    ``.grad`` reads None). A unit: its FlatParameter's ``.grad`` (memory is behaviour: a
    gradient torch FSDP1 frees must not stay alive, zeros or not).
    """
    seen: dict[str, Any] = {}
    for name, p in model.named_parameters():
        seen[name] = (type(p).__name__, p.is_leaf, _tensor(p), _tensor(p.grad if p.is_leaf else None))
    for index, unit in enumerate(_units(model)):
        flat = unit._flat_param
        seen[f"unit {index} flat grad"] = None if flat is None else _tensor(flat.grad)
    return seen


def _check_tensor(a: Any, b: Any, where: str) -> None:
    """Two ``_tensor`` records: both None, or the same shape, dtype and values."""
    assert (a is None) == (b is None), (where, "fsdp: None" if a is None else "torch FSDP1: None")
    if a is not None:
        assert a[:2] == b[:2], (where, a[:2], b[:2])
        assert torch.equal(a[2], b[2]), where


def assert_same(mine: dict[str, Any], theirs: dict[str, Any], where: str) -> None:
    """Two snapshots: the same names, types, values and gradients, and each unit's
    FlatParameter gradient None where torch FSDP1's is (inside ``no_sync`` too: both keep the
    accumulated unsharded gradient there, [Note: The gradient no_sync accumulates])."""
    assert list(mine) == list(theirs), where
    for name, ours in mine.items():
        ref = theirs[name]
        if name.endswith("flat grad"):
            _check_tensor(ours, ref, f"{where}: {name}")
            continue
        assert ours[:2] == ref[:2], (where, name, "(type, is_leaf)", ours[:2], ref[:2])
        _check_tensor(ours[2], ref[2], f"{where}: {name}")
        _check_tensor(ours[3], ref[3], f"{where}: {name}.grad")


def _scale_visible_grads(model: nn.Module) -> None:
    """What gradient clipping during accumulation does: scale every visible gradient in place."""
    with torch.no_grad():
        for p in model.parameters():
            if p.is_leaf and p.grad is not None:
                p.grad.mul_(0.5)


def _build(lib: str, strategy: str) -> nn.Module:
    """The toy model wrapped by ``lib`` with use_orig_params; hybrid strategies over 2 x 2
    groups (``tests/test_hybrid_shard.py``'s)."""
    if "HYBRID" not in strategy:
        return _wrap(lib, make_toy(), strategy, True)
    from tests.test_hybrid_shard import _layouts
    from tests.test_optim_in_backward import _wrap as _wrap_with

    return _wrap_with(lib, make_toy(), strategy, use_orig_params=True, **_layouts()["tuple"])


def grads_at_every_point(strategies: list[str]) -> int:
    """Two micro-batches (inside ``no_sync`` or not) with the gradients read and scaled after
    the second forward, a synchronized backward, the optimizer step, ``zero_grad`` both ways
    and the forwards after them: the parameters, their gradients and the flat gradients are
    torch FSDP1's at each point, bit for bit (each element's gradient is reduced over the same
    ranks in the same order by both)."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    compared = 0
    for strategy in strategies:
        for accumulate_in_no_sync in (False, True):
            log: dict[str, list[tuple[str, dict[str, Any]]]] = {}
            for lib in ("ours", "torch"):
                model = _build(lib, strategy)
                opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
                points: list[tuple[str, dict[str, Any]]] = []
                log[lib] = points

                def forward(step: int) -> torch.Tensor:
                    tokens, targets = global_batch(step, ws)
                    return lm_loss(model(local_rows(tokens, rank, ws)), local_rows(targets, rank, ws))

                for step in range(2):
                    sync = model.no_sync() if accumulate_in_no_sync else contextlib.nullcontext()  # type: ignore[operator]
                    with sync:
                        forward(10 * step).backward()
                        points.append((f"{step}: first backward", snapshot(model)))
                        loss = forward(10 * step + 1)
                        points.append((f"{step}: forward between backwards", snapshot(model)))
                        _scale_visible_grads(model)
                        loss.backward()
                        points.append((f"{step}: second backward", snapshot(model)))
                    loss = forward(10 * step + 2)
                    points.append((f"{step}: forward before the synchronized backward", snapshot(model)))
                    loss.backward()
                    points.append((f"{step}: synchronized backward", snapshot(model)))
                    opt.step()
                    points.append((f"{step}: optimizer step", snapshot(model)))
                    opt.zero_grad(set_to_none=step == 1)
                    points.append((f"{step}: zero_grad(set_to_none={step == 1})", snapshot(model)))
                    loss = forward(10 * step + 3)
                    points.append((f"{step}: forward after zero_grad", snapshot(model)))
                    loss.backward()
                    points.append((f"{step}: backward after zero_grad", snapshot(model)))
                    opt.step()
                    opt.zero_grad(set_to_none=step == 0)
                points.append(("full parameters", _full_params(model, type(model))))
            for (where, mine), (_, theirs) in zip(log["ours"], log["torch"], strict=True):
                if where == "full parameters":
                    assert list(mine) == list(theirs)
                    assert all(torch.equal(mine[n], theirs[n]) for n in mine), (strategy, where)
                else:
                    assert_same(mine, theirs, f"{strategy}, no_sync={accumulate_in_no_sync}, {where}")
                compared += 1
    return compared


@pytest.mark.parametrize("dist_pool", [1, 2, 4], indirect=True)
def test_grads_at_every_point(dist_pool: RankPool) -> None:
    assert dist_pool.run(grads_at_every_point, STRATEGIES) == [3 * 2 * 19] * dist_pool.world_size


def test_grads_at_every_point_hybrid(pool4: RankPool) -> None:
    assert pool4.run(grads_at_every_point, ["HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"]) == [2 * 2 * 19] * 4
