"""torch FSDP1's FlatParameter / handle metadata that client stacks read (accelerate, Lightning),
and use_orig_params gradients of parameters with no element on a rank — against torch FSDP1.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests._harness import RankPool
from tests._models import Block, global_batch, lm_loss, local_rows, make_toy


def _wrap(lib: str, model: nn.Module, strategy: str, use_orig_params: bool, policy: bool = True) -> nn.Module:
    if lib == "ours":
        from fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
        from fsdp.wrap import ModuleWrapPolicy

        return FSDP(
            model,
            auto_wrap_policy=ModuleWrapPolicy({Block}) if policy else None,
            sharding_strategy=ShardingStrategy[strategy],
            use_orig_params=use_orig_params,
        )
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP, ShardingStrategy as TS
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TP

    return TorchFSDP(
        model,
        auto_wrap_policy=TP({Block}) if policy else None,
        sharding_strategy=TS[strategy],
        use_orig_params=use_orig_params,
        device_id=torch.device("cpu"),
    )


def _units(model: nn.Module) -> list[nn.Module]:
    from fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    return [m for m in model.modules() if isinstance(m, (FSDP, TorchFSDP))]


def metadata() -> None:
    for strategy in ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]:
        for use_orig in [False, True]:
            ours, theirs = _wrap("ours", make_toy(), strategy, use_orig), _wrap("torch", make_toy(), strategy, use_orig)
            # After a step: torch sets some sizes (``_padded_unsharded_size``) at lazy init.
            tokens, targets = global_batch(0, dist.get_world_size())
            for model in (ours, theirs):
                lm_loss(model(local_rows(tokens, dist.get_rank(), dist.get_world_size())), local_rows(targets, dist.get_rank(), dist.get_world_size())).backward()
            pairs = list(zip(_units(ours), _units(theirs)))
            assert len(pairs) == len(_units(theirs)) == 4
            for mine, ref in pairs:
                where = (strategy, use_orig, type(mine.module).__name__)
                # accelerate: fsdp_module._flat_param, ._fqns, _handle._orig_param_dtype
                flat, tflat = mine._flat_param, ref._flat_param
                assert flat is mine._handle.flat_param, where
                assert tflat is ref._handle.flat_param
                assert mine._handle._orig_param_dtype == ref._handle._orig_param_dtype == torch.float32
                assert mine._handle._use_orig_params == ref._handle._use_orig_params == use_orig
                assert mine._handle._fully_sharded_module is mine.module
                for attr in ["_fqns", "_shapes", "_strides", "_numels", "_num_params", "_fsdp_flattened"]:
                    assert getattr(flat, attr) == getattr(tflat, attr), (where, attr)
                    assert type(getattr(flat, attr)) is type(getattr(tflat, attr)), (where, attr)
                assert [(p.param_name, p.module_name) for p in flat._param_infos] == [
                    (p.param_name, p.module_name) for p in tflat._param_infos
                ], where
                assert {type(m) for m in flat._modules} == {type(m) for m in tflat._modules}, where
                # torch aligns each parameter to 16 bytes with use_orig_params: other padding.
                sizes = ["_unpadded_unsharded_size", "_sharded_size", "_padded_unsharded_size"]
                if not use_orig:
                    for attr in sizes + ["_shard_numel_padded"]:
                        assert hasattr(flat, attr) == hasattr(tflat, attr), (where, attr)
                        if hasattr(tflat, attr):
                            assert getattr(flat, attr) == getattr(tflat, attr), (where, attr)
                            assert type(getattr(flat, attr)) is type(getattr(tflat, attr)), (where, attr)
                else:
                    assert flat._unpadded_unsharded_size == torch.Size([sum(flat._numels)])
                    assert flat._sharded_size == flat.shape
                # Lightning: param._fsdp_flattened; original params with use_orig_params.
                if use_orig:
                    assert tflat._params is not None
                    assert [id(p) for p in flat._params] == [
                        id(getattr(info.module, info.param_name)) for info in flat._param_infos
                    ], where
                    assert all(getattr(p, "_fsdp_flattened", False) for p in flat._params)
                    assert all(getattr(p, "_fsdp_flattened", False) for p in tflat._params)
                else:
                    assert flat._params is None and tflat._params is None
            for (name, p), (tname, tp) in zip(ours.named_parameters(), theirs.named_parameters()):
                assert name == tname
                assert getattr(p, "_fsdp_flattened", False) == getattr(tp, "_fsdp_flattened", False) is True


@pytest.mark.parametrize("dist_pool", [1, 2, 4], indirect=True)
def test_torch_named_metadata(dist_pool: RankPool) -> None:
    dist_pool.run(metadata)


class _Small(nn.Module):
    """Numels 16, 4, 4, 1: every parameter but the last is a multiple of torch's 4-element
    alignment, so torch's use_orig_params layout (which pads each parameter to 16 bytes) is the
    same as ours and both put the same elements on each rank. With 2 ranks (13 elements each)
    rank 0 holds only fc1.weight; with 4 ranks (7 each) ranks 0 and 1 hold only fc1.weight."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def empty_shard_grads(strategy: str) -> None:
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1)
    x = torch.randn(4 * ws, 4)
    ours, theirs = _wrap("ours", _Small(), strategy, True, False), _wrap("torch", _Small(), strategy, True, False)
    ref = _Small()
    for model in (ours, theirs):
        model(local_rows(x, rank, ws)).square().sum().backward()
    ref(x).square().sum().div(ws).backward()  # FSDP averages over ranks
    # Which parameters have a gradient here: exactly torch's (None where no element is local).
    got = {n: p.grad for n, p in ours.named_parameters()}
    want = {n: p.grad for n, p in theirs.named_parameters()}
    assert list(got) == list(want)
    for name in got:
        assert (got[name] is None) == (want[name] is None), (name, rank)
        if got[name] is not None:
            assert got[name].numel() > 0, name
            # Same reduction of the same numbers in the same order: exact.
            assert torch.equal(got[name], want[name]), name
    if strategy != "NO_SHARD" and ws > 1:  # the layout of _Small's docstring
        prefix = "_fsdp_wrapped_module."
        if rank < ws - 1:
            assert got[prefix + "fc2.bias"] is None
        if rank == 0:
            assert got[prefix + "fc1.bias"] is None and got[prefix + "fc1.weight"] is not None
    # Inf-norm clipping over model.parameters(): the local max, as torch gives.
    norm = torch.nn.utils.clip_grad_norm_(ours.parameters(), 0.01, norm_type=float("inf"))
    tnorm = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.01, norm_type=float("inf"))
    assert torch.equal(norm, tnorm)
    for name, p in ours.named_parameters():
        tp = dict(theirs.named_parameters())[name]
        if p.grad is not None:
            assert torch.equal(p.grad, tp.grad), name
    # FSDP's own clip (all ranks): the global inf-norm of the single-process gradients. The
    # gradients are the same numbers as the reference's up to the averaging's rounding, and a
    # max picks one of them: compare with the reference's max to float32 rounding of a sum of
    # ws terms (rtol 1e-6 covers ws<=4 roundings of a value of this size).
    ours.zero_grad()
    ours(local_rows(x, rank, ws)).square().sum().backward()
    total = ours.clip_grad_norm_(1e9, norm_type=float("inf"))
    ref_max = max(p.grad.abs().max() for p in ref.parameters())
    torch.testing.assert_close(total, ref_max, rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
@pytest.mark.parametrize("dist_pool", [1, 2, 4], indirect=True)
def test_empty_shard_grad_is_none(dist_pool: RankPool, strategy: str) -> None:
    dist_pool.run(empty_shard_grads, strategy)
