"""Runtime edge cases, each against torch FSDP1 and single-process training.

A unit run twice per forward, outputs unused by the loss, frozen units, eval/no_grad between
steps, structured (dict / namedtuple) inputs, and the wrapper's module plumbing.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests._harness import RankPool
from tests._models import DIM, VOCAB, Block, global_batch, lm_loss, local_rows
from tests.test_parity import FP64_TOL, _full_params


class Inputs(NamedTuple):
    tokens: torch.Tensor
    scale: float


class Twice(nn.Module):
    """Runs ``shared`` twice per forward; ``aux`` produces an output the loss ignores."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.shared = Block()
        self.aux = Block()
        self.frozen = Block()
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        inputs: Inputs = batch["inputs"]
        x = self.embed(inputs.tokens) * inputs.scale
        x = self.shared(self.frozen(self.shared(x)))
        return self.head(x), self.aux(x)


def _make(lib: str, strategy: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    model = Twice().to(dtype)
    if lib == "ref":
        return model
    if lib == "ours":
        from fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
        from fsdp.wrap import ModuleWrapPolicy

        extra: dict[str, Any] = {}
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # type: ignore[no-redef]
        from torch.distributed.fsdp import ShardingStrategy  # type: ignore[no-redef]
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy  # type: ignore[no-redef]

        extra = {"device_id": torch.device("cpu")}
    return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=ShardingStrategy[strategy], **extra)


def edge_cases(strategy: str, steps: int = 3) -> None:
    from fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    rank, ws = dist.get_rank(), dist.get_world_size()
    # The plain module and a second fsdp in float64 (test_parity's FP64_TOL); ours and torch
    # FSDP1 in float32, bit for bit.
    models = [_make("ref", strategy, torch.float64), _make("ours", strategy), _make("torch", strategy)]
    models.append(_make("ours", strategy, torch.float64))
    opts = [torch.optim.SGD((p for p in m.parameters() if p.requires_grad), lr=0.1, momentum=0.9) for m in models]
    for step in range(steps):
        tokens, targets = global_batch(step, ws)
        for i, (model, opt) in enumerate(zip(models, opts)):
            x, y = (tokens, targets) if i == 0 else (local_rows(tokens, rank, ws), local_rows(targets, rank, ws))
            logits, _aux = model({"inputs": Inputs(x, 0.5)})
            lm_loss(logits, y).backward()  # aux is unused: its unit gets no gradient
            opt.step()
            opt.zero_grad(set_to_none=True)
        # Evaluation between steps, under no_grad and eval(): must leave no state behind.
        for model in models[1:]:
            model.eval()
            with torch.no_grad():
                model({"inputs": Inputs(local_rows(tokens, rank, ws), 0.5)})
            model.train()
    ours = [m for m in FSDP.fsdp_modules(models[1])]
    for unit in ours:
        assert unit.training_state.name == "IDLE"
        handle = unit._fsdp_state.handle
        assert handle is None or handle.storage.unsharded_storage_nbytes() == 0 or strategy == "NO_SHARD"
    aux = models[1].aux._fsdp_state.handle.flat_param
    frozen = models[1].frozen._fsdp_state.handle.flat_param
    assert aux.grad is None and frozen.grad is None and not frozen.requires_grad
    mine, theirs = _full_params(models[1], FSDP), _full_params(models[2], TorchFSDP)
    mine64, ref = _full_params(models[3], FSDP), dict(models[0].named_parameters())
    assert list(mine) == list(theirs) == list(ref) == list(mine64)
    for name in mine:
        assert torch.equal(mine[name], theirs[name]), name
        torch.testing.assert_close(mine64[name], ref[name].detach(), **FP64_TOL, msg=name)


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
@pytest.mark.parametrize("dist_pool", [2, 3], indirect=True)
def test_edge_cases(dist_pool: RankPool, strategy: str) -> None:
    dist_pool.run(edge_cases, strategy)


def plumbing() -> None:
    from fsdp import FullyShardedDataParallel as FSDP
    from fsdp.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    inner = nn.Sequential(Block(), Block(), nn.Linear(DIM, 3))
    inner.custom_attribute = "hello"  # type: ignore[assignment]
    model = FSDP(inner, auto_wrap_policy=ModuleWrapPolicy({Block}))
    assert model.module is inner
    assert model.custom_attribute == "hello"  # attribute forwarding
    assert isinstance(model[0], FSDP) and model[0].module.__class__ is Block  # __getitem__ forwarding
    assert model[2] is inner[2]
    assert [type(m.module).__name__ for m in FSDP.fsdp_modules(model)] == ["Sequential", "Block", "Block"]
    assert FSDP.fsdp_modules(model, root_only=True) == [model]
    assert model.check_is_root() and not model[0].check_is_root()
    # Outside summon_full_params names carry the wrapper prefixes (as in torch FSDP1).
    names = [n for n, _ in model.named_parameters()]
    assert names == [
        "_fsdp_wrapped_module._flat_param",
        "_fsdp_wrapped_module.0._fsdp_wrapped_module._flat_param",
        "_fsdp_wrapped_module.1._fsdp_wrapped_module._flat_param",
    ]


def test_plumbing(pool2: RankPool) -> None:
    pool2.run(plumbing)


class _Boom(Exception):
    pass


def interrupted_backward(strategy: str) -> None:
    """An exception escaping backward: the next step warns, resets and trains correctly."""
    from fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
    from fsdp.wrap import ModuleWrapPolicy

    from tests._models import make_toy

    rank, ws = dist.get_rank(), dist.get_world_size()
    ref = make_toy()
    ours = FSDP(make_toy(), auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=ShardingStrategy[strategy])
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, ours)]
    tokens, targets = global_batch(0, ws)
    logits = ours(local_rows(tokens, rank, ws))

    def explode(grad: torch.Tensor) -> torch.Tensor:
        raise _Boom("user hook failed")

    logits.register_hook(explode)  # fails before any unit's backward ran
    with pytest.raises(_Boom):
        lm_loss(logits, local_rows(targets, rank, ws)).backward()
    # Mid-backward failure: a hook deep inside (after the root's pre-backward and some units).
    inner = ours.module.blocks[1].module
    def arm(module: nn.Module, inputs: Any, out: torch.Tensor) -> None:
        out.register_hook(explode)  # returns None: the output is unchanged

    handle = inner.register_forward_hook(arm)
    logits = ours(local_rows(tokens, rank, ws))
    handle.remove()
    with pytest.raises(_Boom):  # after the root's and blocks[2]'s backward already ran
        lm_loss(logits, local_rows(targets, rank, ws)).backward()
    for step in range(1, 3):
        tokens, targets = global_batch(step, ws)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = lm_loss(ours(local_rows(tokens, rank, ws)), local_rows(targets, rank, ws))
        if step == 1:
            assert any("previous backward did not finish" in str(w.message) for w in caught)
        loss.backward()
        lm_loss(ref(tokens), targets).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    mine = _full_params(ours, FSDP)
    for name, value in ref.named_parameters():
        torch.testing.assert_close(mine[name], value.detach(), rtol=5e-5, atol=5e-6, msg=name)


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_recovers_from_interrupted_backward(pool2: RankPool, strategy: str) -> None:
    pool2.run(interrupted_backward, strategy)


class Branchy(nn.Module):
    """Blocks run in order; ``skip`` leaves one out (a data-dependent branch)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.aux = Block()
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor, skip: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embed(tokens)
        for i in range(3):
            if i != skip:
                x = self.blocks[i](x)
        return self.head(x), self.aux(x)


def diverging_ranks() -> None:
    """A rank that takes another path raises on every rank within seconds; nothing hangs."""
    import time

    from fsdp import FullyShardedDataParallel as FSDP
    from fsdp.wrap import ModuleWrapPolicy

    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = FSDP(Branchy(), auto_wrap_policy=ModuleWrapPolicy({Block}))
    tokens, targets = global_batch(0, ws)
    x, y = local_rows(tokens, rank, ws), local_rows(targets, rank, ws)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"ranks took different paths through the model in the first iteration \(step 3 of the execution order\): rank 0: forward of unit 'blocks.1'; rank 1: forward of unit 'blocks.2'"):
        model(x, skip=1 if rank == 1 else -1)
    # Backward divergence: rank 1's loss ignores the aux unit's output.
    logits, aux = model(x)
    loss = lm_loss(logits, y) + (aux.sum() * 0.0 if rank == 0 else 0.0)
    with pytest.raises(RuntimeError, match=r"ranks took different paths.*rank 0: backward of unit 'aux'; rank 1: backward of unit '[^']+'"):
        loss.backward()
    assert time.monotonic() - start < 20
    # The group is still in step: a consistent step works, and the check runs until a backward completes.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the interrupted backward is reset with a warning
        logits, aux = model(x)
    lm_loss(logits, y).backward()
    assert model._fsdp_state.ctx.order_checked
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == ws


def test_diverging_ranks_raise_instead_of_hanging(pool2: RankPool) -> None:
    pool2.run(diverging_ranks, _timeout=60)


def reductions_complete_where_launched() -> list[tuple[str, list[str], bool]]:
    """[Note: On CPU a collective completes where it is launched]: each unit's gradient
    reduction is complete when its post-backward hook returns (nothing in flight, the reduced
    sharded gradient pending for the end of backward), and no reduction is in flight when any
    unit's unsharded gradient is assembled."""
    from fsdp import FullyShardedDataParallel as FSDP
    from fsdp.wrap import ModuleWrapPolicy
    from tests._models import make_toy

    rank, ws = dist.get_rank(), dist.get_world_size()
    model = FSDP(make_toy(), auto_wrap_policy=ModuleWrapPolicy({Block}))
    seen: list[tuple[str, list[str], bool]] = []
    handles = [h for unit in FSDP.fsdp_modules(model) for h in unit._fsdp_state.handles]

    def assembled(name: str, grad: torch.Tensor) -> None:
        # Runs when the FlatParameter's gradient has just been assembled, before accumulation.
        seen.append((name, [h.unit_name for h in model._fsdp_state.ctx.inflight_reductions], False))

    def reduced(handle: Any, param: torch.Tensor) -> None:
        # Registered after fsdp's post-accumulate hook: runs once it has launched the reduction.
        done = handle.grads.inflight is None and handle.grads.pending_sharded_grad is not None
        seen.append((handle.unit_name, [h.unit_name for h in model._fsdp_state.ctx.inflight_reductions], done))

    for step in range(2):
        removable = []
        if step == 1:
            for h in handles:
                removable.append(h.flat_param.register_hook(lambda g, n=h.unit_name: assembled(n, g)))
                removable.append(h.flat_param.register_post_accumulate_grad_hook(lambda p, h=h: reduced(h, p)))
        tokens, targets = global_batch(step, ws)
        lm_loss(model(local_rows(tokens, rank, ws)), local_rows(targets, rank, ws)).backward()
        for r in removable:
            r.remove()
    return seen


def test_reductions_complete_where_launched_on_cpu(pool2: RankPool) -> None:
    for seen in pool2.run(reductions_complete_where_launched):
        order = ["blocks.2", "blocks.1", "blocks.0", "<root>"]
        assert [(name, done) for name, _, done in seen] == [(n, d) for n in order for d in (False, True)], seen
        assert all(inflight == [] for _, inflight, _ in seen), seen
