"""use_orig_params: original parameters that have no elements on a rank's shard, against torch FSDP1.

torch FSDP1 gives such a parameter ``.grad = None`` on that rank (not an empty gradient), so its
optimizer makes no state for it there, and its optimizer state dicts (full, rank0_only,
sharded) and loads reflect that. One root unit over a small model whose flat layout (torch's,
16-byte aligned) puts whole parameters on single ranks at world sizes 2 and 4 (see
``_LAYOUT``); both libraries train it alike and every value is compared bit for bit.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests._harness import RankPool
from tests.test_optim_state_dict import _assert_osd_equal, _torch_full

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)


class _Scaled(nn.Module):
    """A 3-element parameter between two linears: it lands wholly on one rank."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale.sum()


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)  # weight 64, bias 8
        self.mid = _Scaled()  # 3 (+ 1 alignment padding)
        self.out = nn.Linear(8, 2)  # weight 16, bias 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.mid(torch.relu(self.fc(x))))


# The flat layout (fp32: 4-element alignment): fc.weight [0, 64), fc.bias [64, 72), mid.scale
# [72, 75), padding [75, 76), out.weight [76, 92), out.bias [92, 94), then padding to a multiple
# of the world size. Which parameters each rank holds any part of:
_LAYOUT = {
    # 94 elements, shards of 47: rank 0 only fc.weight[0:47].
    2: [
        ["fc.weight"],
        ["fc.weight", "fc.bias", "mid.scale", "out.weight", "out.bias"],
    ],
    # 96 elements, shards of 24.
    4: [
        ["fc.weight"],
        ["fc.weight"],
        ["fc.weight", "fc.bias"],
        ["mid.scale", "out.weight", "out.bias"],
    ],
}


def _wrap(lib: str, strategy: str) -> nn.Module:
    torch.manual_seed(0)
    model = _Net()
    if lib == "ours":
        from fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy

        return FSDP(model, sharding_strategy=ShardingStrategy[strategy], use_orig_params=True)
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP, ShardingStrategy as TS

    return TorchFSDP(model, sharding_strategy=TS[strategy], use_orig_params=True, device_id=torch.device("cpu"))


def _backward(model: nn.Module, step: int) -> None:
    gen = torch.Generator().manual_seed(100 * step + dist.get_rank())
    x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 2, generator=gen)
    F.mse_loss(model(x), y).backward()


def _clean(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "")


def _check_grads(ours: nn.Module, theirs: nn.Module, where: str) -> None:
    """Same ``.grad is None`` pattern (None exactly off this rank's shard), same values."""
    held = _LAYOUT[dist.get_world_size()][dist.get_rank()]
    pairs = list(zip(ours.named_parameters(), theirs.named_parameters()))
    assert [_clean(n) for (n, _), _ in pairs] == ["fc.weight", "fc.bias", "mid.scale", "out.weight", "out.bias"]
    for (name, mine), (torch_name, ref) in pairs:
        name = _clean(name)
        assert name == _clean(torch_name), where
        assert (ref.grad is None) == (name not in held), f"{where}: torch FSDP1 {name}: the layout moved"
        assert (mine.grad is None) == (ref.grad is None), f"{where}: {name}: .grad is None {mine.grad is None}"
        if mine.grad is not None:
            assert mine.grad.numel() > 0, where
            assert torch.equal(mine.grad, ref.grad), f"{where}: {name}: gradient differs"


def _user_inf_norm(model: nn.Module) -> torch.Tensor:
    """Inf-norm clipping as user code writes it: the max over every ``.grad`` it finds.

    An empty gradient would make ``amax`` raise; the all-reduce makes it global.
    """
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    local = torch.stack([g.detach().abs().amax() for g in grads]).amax() if grads else torch.zeros(())
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    return local


def _scenario(strategy: str) -> int:
    from fsdp import FullyShardedDataParallel as FSDP, FullOptimStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullOptimStateDictConfig as TFOC
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP, StateDictType as TSDT

    ours, theirs = _wrap("ours", strategy), _wrap("torch", strategy)
    opts = [torch.optim.Adam(m.parameters(), lr=0.01) for m in (ours, theirs)]
    checked = 0
    for step, norm_type in enumerate((math.inf, 2.0)):
        where = f"{strategy} ws={dist.get_world_size()} step {step}"
        for model in (ours, theirs):
            _backward(model, step)
        _check_grads(ours, theirs, where + " after backward")
        assert torch.equal(_user_inf_norm(ours), _user_inf_norm(theirs)), where
        our_norm = ours.clip_grad_norm_(0.01, norm_type)
        their_norm = theirs.clip_grad_norm_(0.01, norm_type)
        assert torch.equal(our_norm, their_norm), f"{where}: norm {our_norm} vs torch FSDP1 {their_norm}"
        _check_grads(ours, theirs, where + f" after clip_grad_norm_({norm_type})")
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        # The optimizer holds state exactly where torch's does: not for parameters off the shard.
        _assert_osd_equal(opts[0].state_dict(), opts[1].state_dict(), where + " optimizer")
        checked += 1
    where = f"{strategy} ws={dist.get_world_size()}"
    full = FSDP.optim_state_dict(ours, opts[0])
    _assert_osd_equal(full, _torch_full(theirs, opts[1], True), "full " + where)
    with FSDP.state_dict_type(ours, StateDictType.FULL_STATE_DICT, None, FullOptimStateDictConfig(rank0_only=True)):
        rank0 = FSDP.optim_state_dict(ours, opts[0])
    _assert_osd_equal(rank0, _torch_full(theirs, opts[1], True, rank0_only=True), "rank0_only " + where)
    with FSDP.state_dict_type(ours, StateDictType.SHARDED_STATE_DICT), TorchFSDP.state_dict_type(
        theirs, TSDT.SHARDED_STATE_DICT
    ):
        sharded = FSDP.optim_state_dict(ours, opts[0])
        torch_sharded = TorchFSDP.optim_state_dict(theirs, opts[1])
        _assert_osd_equal(sharded, torch_sharded, "sharded " + where)
        _assert_osd_equal(
            FSDP.optim_state_dict_to_load(ours, opts[0], sharded),
            TorchFSDP.optim_state_dict_to_load(theirs, opts[1], torch_sharded),
            "sharded to_load " + where,
            ordered=False,
        )
    with TorchFSDP.state_dict_type(theirs, TSDT.FULL_STATE_DICT, None, TFOC(offload_to_cpu=False)):
        torch_loaded = TorchFSDP.optim_state_dict_to_load(theirs, opts[1], full)
    loaded = FSDP.optim_state_dict_to_load(ours, opts[0], full)
    _assert_osd_equal(loaded, torch_loaded, "full to_load " + where, ordered=False)
    _assert_osd_equal(loaded, opts[0].state_dict(), "full to_load is the optimizer's own " + where, ordered=False)
    # Resuming from the full state dict trains on exactly as training straight on does.
    resumed = _wrap("ours", strategy)
    with torch.no_grad():
        for p, q in zip(resumed.parameters(), ours.parameters()):
            p.copy_(q)
    resumed_opt = torch.optim.Adam(resumed.parameters(), lr=0.01)
    resumed_opt.load_state_dict(FSDP.optim_state_dict_to_load(resumed, resumed_opt, full))
    for model, opt in ((ours, opts[0]), (resumed, resumed_opt), (theirs, opts[1])):
        _backward(model, 2)
        opt.step()
    for (name, a), (_, b), (_, c) in zip(ours.named_parameters(), resumed.named_parameters(), theirs.named_parameters()):
        assert torch.equal(a, b), f"resumed {where}: {name}"
        assert torch.equal(a, c), f"vs torch FSDP1 after resuming {where}: {name}"
    return checked


def _all_strategies() -> list[int]:
    return [_scenario(strategy) for strategy in ("FULL_SHARD", "SHARD_GRAD_OP")]


@pytest.mark.parametrize("dist_pool", [2, 4], indirect=True)
def test_params_off_the_shard_match_torch(dist_pool: RankPool) -> None:
    assert dist_pool.run(_all_strategies, _timeout=300) == [[2, 2]] * dist_pool.world_size
