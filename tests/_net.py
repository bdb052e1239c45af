"""The small nested test model shared by the by-value tests of ``clip_grad_norm_``, ``no_sync``
and ``summon_full_params`` (``tests/test_clip_grad_norm.py``, ``tests/test_no_sync.py``,
``tests/test_summon_full_params.py``).

Those tests run the same model three ways, all built from the same seed:

* ``ours``: :class:`fsdp.FullyShardedDataParallel` (by default with nested ``Block`` units);
* ``theirs``: torch's own FSDP1 (the reference oracle; ``device_id=cpu``);
* ``plain``: an unwrapped single-process copy that sees the concatenated global batch.

This module holds what they share: the sizes, :class:`Block` and :class:`Net`, the three
builders (:class:`NetBuilders`, one per seed), the deterministic per-rank batches, and the helpers
that compare flat parameters and named tensors. Each test file keeps its own seeds and its rank
functions (workers import those by module and name).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import ShardingStrategy as TorchShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchModuleWrapPolicy

from fsdp import FullyShardedDataParallel as FSDP
from fsdp.api import ShardingStrategy
from fsdp.wrap import ModuleWrapPolicy

__all__ = [
    "ATOL",
    "BATCH",
    "CPU",
    "D_HID",
    "D_IN",
    "D_OUT",
    "LR",
    "RTOL",
    "SHARDED",
    "STRATEGIES",
    "Batch",
    "Block",
    "D",
    "Net",
    "NetBuilders",
    "assert_same",
    "compare_flat",
    "flat_params",
    "global_batch",
    "local_batch",
]

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
"""Every sharding strategy the tests sweep (names of :class:`fsdp.api.ShardingStrategy`)."""

SHARDED = ("FULL_SHARD", "SHARD_GRAD_OP")
"""The strategies that actually shard parameters when the world size is above 1."""

D_IN, D, D_HID, D_OUT = 5, 6, 7, 3
"""Input, residual, hidden and output widths of :class:`Net`."""

BATCH = 4
"""Rows of one rank's local batch."""

LR = 0.1
"""SGD learning rate."""

CPU = torch.device("cpu")
"""``device_id`` for torch FSDP1 (the tests run on CPU with gloo)."""

# Tolerance against the plain single-process model: the global batch is reduced in a different
# order than the per-rank batches plus the gradient all-reduce, so results differ in the last bits.
RTOL, ATOL = 1e-4, 1e-5

# Tolerance between the two FSDP implementations' flat parameters when not compared bit for bit.
_FLAT_RTOL, _FLAT_ATOL = 1e-5, 1e-6

Batch = tuple[torch.Tensor, torch.Tensor]
"""An ``(inputs, targets)`` pair."""


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------


class Block(nn.Module):
    """Residual MLP block: 97 parameters (prime, so never divisible by the world size)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, D_HID)
        self.fc2 = nn.Linear(D_HID, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Net(nn.Module):
    """Root unit holds ``inp`` and ``out`` (36 + 21 = 57 parameters); two nested Block units."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, D)
        self.blocks = nn.Sequential(Block(), Block())
        self.out = nn.Linear(D, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(torch.relu(self.inp(x))))


# ---------------------------------------------------------------------------------------------
# Builders
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NetBuilders:
    """Builds the plain model and both FSDP wrappings of it, all from ``seed``.

    Every builder reseeds torch's global RNG with ``seed`` and constructs a fresh :class:`Net`,
    so all three start from identical parameters. A test file binds its own seed once::

        _NET = NetBuilders(seed=1234)
        _plain, _ours, _theirs = _NET.plain, _NET.ours, _NET.theirs
    """

    seed: int

    def plain(self) -> Net:
        """The unwrapped model, freshly initialized from ``seed``."""
        torch.manual_seed(self.seed)
        return Net()

    def ours(self, strategy: str, nested: bool = True) -> FSDP:
        """:meth:`plain` wrapped in :class:`fsdp.FullyShardedDataParallel`.

        ``strategy`` names a :class:`fsdp.api.ShardingStrategy`; with ``nested`` each ``Block``
        becomes its own unit (three units in all), otherwise the root is the only unit.
        """
        return FSDP(
            self.plain(),
            sharding_strategy=ShardingStrategy[strategy],
            auto_wrap_policy=ModuleWrapPolicy({Block}) if nested else None,
        )

    def theirs(self, strategy: str, nested: bool = True, use_orig_params: bool = False) -> TorchFSDP:
        """:meth:`plain` wrapped in torch's FSDP1 on CPU, the same way as :meth:`ours`."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # world size 1 -> NO_SHARD warning
            return TorchFSDP(
                self.plain(),
                sharding_strategy=TorchShardingStrategy[strategy],
                auto_wrap_policy=TorchModuleWrapPolicy({Block}) if nested else None,
                device_id=CPU,
                use_orig_params=use_orig_params,
            )


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


def local_batch(seed_base: int, rank: int | None = None, target_scale: float = 1) -> Batch:
    """One rank's ``(x, y)`` batch of :data:`BATCH` rows, drawn from a generator seeded with
    ``seed_base + rank`` (``rank`` defaults to this process's rank).

    ``y`` is standard normal, multiplied by ``target_scale`` when that is not 1.
    """
    rank = dist.get_rank() if rank is None else rank
    g = torch.Generator().manual_seed(seed_base + rank)
    x = torch.randn(BATCH, D_IN, generator=g)
    y = torch.randn(BATCH, D_OUT, generator=g)
    return x, (y if target_scale == 1 else target_scale * y)


def global_batch(seed_base: int, target_scale: float = 1) -> Batch:
    """Every rank's :func:`local_batch`, concatenated in rank order (what the plain model sees).

    The plain model's mean loss over it equals the average of the per-rank mean losses.
    """
    parts = [local_batch(seed_base, r, target_scale) for r in range(dist.get_world_size())]
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


# ---------------------------------------------------------------------------------------------
# Comparisons
# ---------------------------------------------------------------------------------------------


def flat_params(model: nn.Module, grads: bool = False) -> list[torch.Tensor | None]:
    """Each unit's local (sharded) FlatParameter, or its ``.grad``, cloned, in pre-order.

    Works on both FSDP implementations; a missing gradient is ``None``. Both order units and
    lay out / pad / shard flat parameters the same way, so the lists are directly comparable.
    """
    out: list[torch.Tensor | None] = []
    for unit in type(model).fsdp_modules(model):
        flat = unit._fsdp_state.handle.flat_param if isinstance(unit, FSDP) else unit._handle.flat_param
        t = flat.grad if grads else flat
        out.append(None if t is None else t.detach().clone())
    return out


def compare_flat(
    actual: list[torch.Tensor | None],
    expected: list[torch.Tensor | None],
    exact: bool,
    what: str,
    n_units: int | None = None,
) -> None:
    """Asserts that two :func:`flat_params` lists (ours, torch FSDP1's) agree unit by unit.

    Bit for bit when ``exact``, else up to rounding in the last bits. ``n_units``, when given,
    is the number of units both lists must have.
    """
    assert len(actual) == len(expected), what
    if n_units is not None:
        assert len(actual) == n_units, what
    for i, (a, b) in enumerate(zip(actual, expected)):
        assert a is not None and b is not None, f"{what}: unit {i}: missing tensor"
        assert a.shape == b.shape, f"{what}: unit {i}: {tuple(a.shape)} vs torch {tuple(b.shape)}"
        if exact:
            assert torch.equal(a, b), f"{what}: unit {i} differs from torch FSDP1"
        else:
            torch.testing.assert_close(
                a, b, rtol=_FLAT_RTOL, atol=_FLAT_ATOL, msg=_prefixed(f"{what}: unit {i}")
            )


def assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], exact: bool, what: str) -> None:
    """Asserts that two name -> tensor dicts have the same names, shapes and values.

    Values must be equal bit for bit when ``exact``, else close within :data:`RTOL` /
    :data:`ATOL` (the tolerance against the plain model).
    """
    assert sorted(actual) == sorted(expected), what
    for name in expected:
        assert actual[name].shape == expected[name].shape, f"{what}: {name}"
        if exact:
            assert torch.equal(actual[name], expected[name]), f"{what}: {name} differs"
        else:
            torch.testing.assert_close(
                actual[name], expected[name], rtol=RTOL, atol=ATOL, msg=_prefixed(f"{what}: {name}")
            )


def _prefixed(prefix: str) -> Callable[[str], str]:
    """An ``assert_close`` ``msg`` callable that puts ``prefix`` before torch's own message."""
    return lambda m: f"{prefix}: {m}"
