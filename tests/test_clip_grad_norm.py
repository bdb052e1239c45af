"""``FullyShardedDataParallel.clip_grad_norm_``, checked by value.

The same model is trained three ways, all built from the same seed:

* ``ours``: :class:`fsdp.FullyShardedDataParallel` (nested ``Block`` units);
* ``theirs``: torch's own FSDP1 (the reference oracle; ``device_id=cpu``);
* ``plain``: an unwrapped single-process copy that trains on the concatenated global batch and
  clips with ``torch.nn.utils.clip_grad_norm_``.

Each rank trains on its own local batch; the plain copy's mean loss over the global batch equals
the average of the per-rank mean losses, so gradients, total norms, clipped gradients and the
parameters after each optimizer step must agree. Parameter counts (57 in the root unit, 97 per
block) do not divide by the world size, so shards carry padding.

Rank functions are module-level (workers import them by name) and start with ``_``.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fsdp import FullyShardedDataParallel as FSDP
from tests._harness import RankPool
from tests._net import (
    ATOL,
    CPU,
    LR,
    RTOL,
    STRATEGIES,
    Batch,
    Block,
    NetBuilders,
    compare_flat,
    flat_params,
    global_batch,
    local_batch,
)

NORM_TYPES = (1.0, 2.0, math.inf)
STEPS = 2

# ---------------------------------------------------------------------------------------------
# Builders and data (model, builders, batches and comparisons are shared: tests/_net.py)
# ---------------------------------------------------------------------------------------------

_NET = NetBuilders(seed=4321)
_plain, _ours, _theirs = _NET.plain, _NET.ours, _NET.theirs


def _local_batch(step: int) -> Batch:
    # Scaled targets give gradients with norms well above the smaller max_norm.
    return local_batch(7000 + 100 * step, target_scale=3)


def _global_batch(step: int) -> Batch:
    return global_batch(7000 + 100 * step, target_scale=3)


# ---------------------------------------------------------------------------------------------
# Rank functions
# ---------------------------------------------------------------------------------------------


def _check_clip(strategies: tuple[str, ...], max_norms: tuple[float, ...]) -> list[tuple]:
    """Sweeps strategy x norm type x max_norm; returns what was seen for the parent to check."""
    ws = dist.get_world_size()
    seen = []
    for strategy in strategies:
        for norm_type in NORM_TYPES:
            for max_norm in max_norms:
                what = f"{strategy} norm_type={norm_type} max_norm={max_norm}"
                plain, ours, theirs = _plain(), _ours(strategy), _theirs(strategy)
                opts = {id(m): torch.optim.SGD(m.parameters(), lr=LR) for m in (plain, ours, theirs)}
                # Same flat layout and reduction order as torch FSDP1: bit for bit throughout.
                exact = True
                clipped_any = False
                for step in range(STEPS):
                    for m in (plain, ours, theirs):
                        opts[id(m)].zero_grad(set_to_none=True)
                        x, y = _global_batch(step) if m is plain else _local_batch(step)
                        F.mse_loss(m(x), y).backward()
                    grads_before = flat_params(ours, grads=True)
                    compare_flat(grads_before, flat_params(theirs, grads=True), exact, f"{what}: step {step}: grads")

                    ref_norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), max_norm, norm_type)
                    our_norm = ours.clip_grad_norm_(max_norm, norm_type)
                    their_norm = theirs.clip_grad_norm_(max_norm, norm_type)

                    assert isinstance(our_norm, torch.Tensor) and our_norm.dim() == 0, what
                    assert our_norm.dtype == torch.float32, what
                    torch.testing.assert_close(
                        our_norm, ref_norm, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: norm vs plain: {m}"
                    )
                    assert torch.equal(our_norm, their_norm), f"{what}: norm {our_norm} vs torch FSDP1 {their_norm}"
                    clips = bool(ref_norm > max_norm)
                    clipped_any |= clips
                    # Gradients are scaled by max_norm / (norm + 1e-6) when clipping, else unchanged.
                    grads_after = flat_params(ours, grads=True)
                    for before, after in zip(grads_before, grads_after):
                        if clips:
                            coef = max_norm / (our_norm + 1e-6)
                            torch.testing.assert_close(after, before * coef, msg=lambda m: f"{what}: clip coef: {m}")
                        else:
                            assert torch.equal(after, before), f"{what}: gradients changed without clipping"
                    compare_flat(grads_after, flat_params(theirs, grads=True), exact, f"{what}: step {step}: clipped grads")
                    for m in (plain, ours, theirs):
                        opts[id(m)].step()
                    compare_flat(flat_params(ours), flat_params(theirs), exact, f"{what}: step {step}: params")

                # The full parameters match the plain model clipped by torch.nn.utils.clip_grad_norm_.
                with FSDP.summon_full_params(ours, writeback=False):
                    got = {n: p.detach().clone() for n, p in ours.named_parameters()}
                expected = dict(plain.named_parameters())
                assert sorted(got) == sorted(expected)
                for name in expected:
                    torch.testing.assert_close(
                        got[name], expected[name].detach(), rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {name}: {m}"
                    )
                seen.append((strategy, norm_type, max_norm, clipped_any, float(our_norm)))
    return seen


def _no_grads_warning(model: nn.Module) -> tuple[torch.Tensor, list[str]]:
    """``clip_grad_norm_`` on a model without gradients: the norm and the warnings' texts.

    Our warnings must point at the caller's line, this file (torch FSDP1 means to, with
    ``stacklevel=2``, but its ``no_grad`` decorator adds a frame: it points into torch).
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        norm = model.clip_grad_norm_(1.0)
    for w in caught:
        assert w.category is UserWarning, w.category
        assert w.filename == __file__ or not isinstance(model, FSDP), w.filename
    return norm, [str(w.message) for w in caught]


def _check_errors_and_no_grads() -> bool:
    rank = dist.get_rank()
    # No gradients yet, sharded: a zero fp32 norm and torch FSDP1's warning, word for word.
    ours_norm, ours_warnings = _no_grads_warning(_ours("FULL_SHARD"))
    their_norm, their_warnings = _no_grads_warning(_theirs("FULL_SHARD"))
    assert torch.equal(ours_norm, their_norm) and ours_norm.dtype == torch.float32
    assert ours_warnings == their_warnings == [
        f"Called FSDP.clip_grad_norm_() on rank {rank} with no gradients -- returning the total norm "
        f"in the default dtype torch.float32"
    ]
    with pytest.warns(UserWarning, match=rf"on rank {rank} with no gradients -- returning the total norm"):
        _ours("FULL_SHARD").clip_grad_norm_(1.0)
    # NO_SHARD everywhere: torch.nn.utils.clip_grad_norm_'s zero and no warning, as in torch.
    ours_norm, ours_warnings = _no_grads_warning(_ours("NO_SHARD"))
    their_norm, their_warnings = _no_grads_warning(_theirs("NO_SHARD"))
    assert torch.equal(ours_norm, their_norm) and ours_warnings == their_warnings == []
    model = _ours("FULL_SHARD")
    x, y = _local_batch(0)
    F.mse_loss(model(x), y).backward()
    with pytest.raises(RuntimeError, match="root"):
        model.module.blocks[0].clip_grad_norm_(1.0)
    # An int max_norm / norm_type is accepted.
    norm_int = model.clip_grad_norm_(10**6, 2)
    assert norm_int > 0
    return True



# ---------------------------------------------------------------------------------------------
# Bit-for-bit parity with torch FSDP1 ([Note: Clip-norm arithmetic] in fsdp/runtime/_clip_grad.py)
# ---------------------------------------------------------------------------------------------

EXACT_NORM_TYPES = (0.0, 1.0, 2.0, 3.5, math.inf)
EXACT_STEPS = 3
EXACT_MAX_NORM = 0.05  # below every norm seen here: every step clips
EXACT_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
_BF16 = torch.bfloat16
MIXED_PRECISION: dict[str, dict[str, Any] | None] = {
    "fp32": None,
    "bf16": dict(param_dtype=_BF16, reduce_dtype=_BF16, buffer_dtype=_BF16),
    "bf16_keep_low_precision_grads": dict(param_dtype=_BF16, reduce_dtype=_BF16, keep_low_precision_grads=True),
}

_HYBRID_GROUPS: dict[int, tuple[Any, Any]] = {}


def _hybrid_groups() -> tuple[Any, Any]:
    """(shard group, replicate group): shard in pairs of consecutive ranks, replicate across them.

    Made once per rank process (every rank must create every group, in the same order).
    """
    ws = dist.get_world_size()
    if ws not in _HYBRID_GROUPS:
        pairs = [[r, r + 1] for r in range(0, ws, 2)]
        across = [[r + i for r in range(0, ws, 2)] for i in range(2)]
        shard, _ = dist.new_subgroups_by_enumeration(pairs)
        replicate, _ = dist.new_subgroups_by_enumeration(across)
        _HYBRID_GROUPS[ws] = (shard, replicate)
    return _HYBRID_GROUPS[ws]


def _wrap_both(strategy: str, use_orig_params: bool, precision: str) -> tuple[FSDP, nn.Module]:
    """:class:`Net` wrapped by us and by torch FSDP1 the same way (nested ``Block`` units)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision
    from torch.distributed.fsdp import ShardingStrategy as TorchShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchModuleWrapPolicy

    from fsdp import MixedPrecision
    from fsdp.api import ShardingStrategy
    from fsdp.wrap import ModuleWrapPolicy

    config = MIXED_PRECISION[precision]
    groups = {"process_group": _hybrid_groups()} if strategy == "HYBRID_SHARD" else {}
    ours = FSDP(
        _plain(),
        sharding_strategy=ShardingStrategy[strategy],
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        use_orig_params=use_orig_params,
        mixed_precision=None if config is None else MixedPrecision(**config),
        **groups,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # world size 1 -> NO_SHARD warning
        theirs = TorchFSDP(
            _plain(),
            sharding_strategy=TorchShardingStrategy[strategy],
            auto_wrap_policy=TorchModuleWrapPolicy({Block}),
            use_orig_params=use_orig_params,
            mixed_precision=None if config is None else TorchMixedPrecision(**config),
            device_id=CPU,
            **groups,
        )
    return ours, theirs


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    with type(model).summon_full_params(model, writeback=False):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _compare(ours: FSDP, theirs: nn.Module, use_orig_params: bool, grads: bool, what: str) -> None:
    """Each unit's local flat parameter (or gradient) equals torch FSDP1's bit for bit.

    Both lay out flat parameters alike (with use_orig_params, torch FSDP1's 16-byte alignment
    padding), so the shards are the same elements. With use_orig_params each original
    parameter (its local part) and its ``.grad`` must also match, ``None`` where torch's is.
    """
    compare_flat(flat_params(ours, grads=grads), flat_params(theirs, grads=grads), True, what)
    if not use_orig_params:
        return
    pairs = list(zip(ours.named_parameters(), theirs.named_parameters()))
    assert len(pairs) == len(list(theirs.parameters())), what
    for (name, mine), (torch_name, ref) in pairs:
        assert name == torch_name, what
        a, b = (mine.grad, ref.grad) if grads else (mine, ref)
        assert (a is None) == (b is None), f"{what}: {name}: {a is None} vs torch FSDP1 {b is None}"
        if a is not None:
            assert torch.equal(a, b), f"{what}: {name} differs from torch FSDP1"


def _upcast_grads(model: nn.Module) -> None:
    """keep_low_precision_grads leaves bf16 gradients on fp32 parameters; AdamW needs fp32."""
    for p in model.parameters():
        if p.grad is not None and p.grad.dtype != p.dtype:
            p.grad = p.grad.to(p.dtype)


_ADAMW_LR = 0.01


def _saved_grads(model: nn.Module) -> list[Optional[torch.Tensor]]:
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def _restore_grads(model: nn.Module, saved: list[Optional[torch.Tensor]]) -> None:
    """Writes the saved values back into the same gradient tensors (clipping scales in place;
    with use_orig_params the original parameters' gradients are views of the flat one)."""
    for p, grad in zip(model.parameters(), saved):
        if grad is not None:
            p.grad.copy_(grad)
    restored = _saved_grads(model)
    assert all(a is None and b is None or torch.equal(a, b) for a, b in zip(restored, saved)), "grads not restored"


def _check_exact(strategies: tuple[str, ...], orig_params: tuple[bool, ...], precisions: tuple[str, ...]) -> int:
    """Every config: at every step, for every norm type, the returned norm (value and dtype)
    and the clipped gradients equal torch FSDP1's bit for bit, with use_orig_params too (the
    same flat layout, alignment padding included); each step's AdamW update uses one norm type's
    clipping, in turn (the others' are undone first), and the parameters after it equal torch's.
    Returns how many (config, step) pairs compared."""
    ws = dist.get_world_size()
    compared = 0
    for strategy in strategies:
        if strategy == "HYBRID_SHARD" and ws == 1:
            continue  # nothing to shard nor replicate
        sharded = ws > 1 and strategy != "NO_SHARD"
        # The 0-"norm" is not defined over sharded gradients: torch FSDP1 fails with a bare
        # ZeroDivisionError; ours says why. It never drives an update there.
        drivers = [n for n in EXACT_NORM_TYPES if not (n == 0 and sharded)]
        for use_orig_params in orig_params:
            for precision in precisions:
                what = f"{strategy} use_orig_params={use_orig_params} {precision}"
                ours, theirs = _wrap_both(strategy, use_orig_params, precision)
                opts = [torch.optim.AdamW(m.parameters(), lr=_ADAMW_LR) for m in (ours, theirs)]
                for step in range(EXACT_STEPS):
                    for model in (ours, theirs):
                        x, y = _local_batch(step)
                        out = model(x)  # bf16 with mixed precision; torch 2.11's
                        # mse_loss backward rejects mixed dtypes, so the target follows it
                        F.mse_loss(out, y.to(out.dtype)).backward()
                    _compare(ours, theirs, use_orig_params, True, f"{what}: step {step}: grads")
                    saved = (_saved_grads(ours), _saved_grads(theirs))
                    driver = drivers[step % len(drivers)]
                    for norm_type in [n for n in EXACT_NORM_TYPES if n != driver] + [driver]:
                        label = f"{what} norm_type={norm_type}: step {step}"
                        if norm_type == 0 and sharded:
                            with pytest.raises(ZeroDivisionError):
                                theirs.clip_grad_norm_(EXACT_MAX_NORM, norm_type)
                            with pytest.raises(ZeroDivisionError, match="not defined when gradients are sharded"):
                                ours.clip_grad_norm_(EXACT_MAX_NORM, norm_type)
                            _restore_grads(theirs, saved[1])  # whatever torch did before failing
                            _compare(ours, theirs, use_orig_params, True, f"{label}: grads kept")
                            continue
                        our_norm = ours.clip_grad_norm_(EXACT_MAX_NORM, norm_type)
                        their_norm = theirs.clip_grad_norm_(EXACT_MAX_NORM, norm_type)
                        assert our_norm.dtype == their_norm.dtype, f"{label}: {our_norm.dtype} vs {their_norm.dtype}"
                        norm_msg = f"{label}: norm {our_norm.item()!r} vs torch FSDP1 {their_norm.item()!r}"
                        assert torch.equal(our_norm, their_norm), norm_msg
                        assert float(our_norm) > EXACT_MAX_NORM, f"{label}: did not clip"
                        _compare(ours, theirs, use_orig_params, True, f"{label}: clipped grads")
                        if norm_type != driver:
                            _restore_grads(ours, saved[0])
                            _restore_grads(theirs, saved[1])
                    for model, opt in zip((ours, theirs), opts):
                        _upcast_grads(model)
                        opt.step()
                        # (torch FSDP1 cannot summon use_orig_params with low-precision
                        # gradients, so they go before the parameters are compared.)
                        opt.zero_grad(set_to_none=True)
                    _compare(ours, theirs, use_orig_params, False, f"{what}: step {step} (norm_type={driver}): params")
                    compared += 1
    return compared


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------

SMALL_MAX_NORM = 0.05  # always clips
LARGE_MAX_NORM = 1e6  # never clips


@pytest.mark.parametrize("dist_pool", [1, 2, 4], indirect=True)
def test_clip_grad_norm_matches_reference(dist_pool: RankPool) -> None:
    results = dist_pool.run(_check_clip, STRATEGIES, (SMALL_MAX_NORM, LARGE_MAX_NORM))
    expected_configs = len(STRATEGIES) * len(NORM_TYPES) * 2
    for per_rank in results:
        assert len(per_rank) == expected_configs
        for strategy, norm_type, max_norm, clipped_any, _ in per_rank:
            # Both regimes were really exercised.
            assert clipped_any == (max_norm == SMALL_MAX_NORM), (strategy, norm_type, max_norm)
    # Every rank returns the same total norm.
    for configs in zip(*results):
        assert len({c[-1] for c in configs}) == 1, configs


def test_clip_grad_norm_edge_cases(pool2: RankPool) -> None:
    assert pool2.run(_check_errors_and_no_grads) == [True, True]


@pytest.mark.parametrize("dist_pool", [1, 2, 4], indirect=True)
def test_clip_grad_norm_bit_identical_to_torch(dist_pool: RankPool) -> None:
    compared = dist_pool.run(_check_exact, EXACT_STRATEGIES, (False, True), tuple(MIXED_PRECISION), _timeout=600)
    assert len(set(compared)) == 1 and compared[0] > 0


def _float64_model_clips() -> None:
    """A float64 model: the norm is taken in float64 and equals the one-process
    ``torch.nn.utils.clip_grad_norm_``'s (the same arithmetic in another summation order: a
    relative difference of at most about n u, n < 1e4 terms, u = 2**-53, so 1e-10 leaves a
    margin of 100), and the gradients are clipped to ``max_norm``. Torch FSDP1 fails here (it
    narrows every gradient's norm to fp32)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    from fsdp.wrap import ModuleWrapPolicy
    from tests._models import Block, global_batch, lm_loss, local_rows, make_toy

    rank, ws = dist.get_rank(), dist.get_world_size()
    tokens, targets = global_batch(0, ws)
    x, y = local_rows(tokens, rank, ws), local_rows(targets, rank, ws)
    for norm_type in (2.0, math.inf):
        ours = FSDP(make_toy().double(), auto_wrap_policy=ModuleWrapPolicy({Block}))
        ref = make_toy().double()
        lm_loss(ours(x), y).backward()
        lm_loss(ref(tokens), targets).backward()
        norm = ours.clip_grad_norm_(0.1, norm_type)
        expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1, norm_type)
        assert norm.dtype == torch.float64 and expected.item() > 0.1, (norm, expected)
        torch.testing.assert_close(norm, expected, rtol=1e-10, atol=0)
        clipped = ours.clip_grad_norm_(math.inf, norm_type)  # the norm of what was left
        torch.testing.assert_close(clipped, 0.1 * norm / (norm + 1e-6), rtol=1e-10, atol=0)  # (torch's eps)
    theirs = TorchFSDP(make_toy().double(), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"))
    lm_loss(theirs(x), y).backward()
    with pytest.raises(RuntimeError, match="without narrowing"):
        theirs.clip_grad_norm_(0.1)


def test_clip_grad_norm_float64_model(pool2: RankPool) -> None:
    pool2.run(_float64_model_clips)
