"""Tensor parallel + FSDP on a 2-D (dp, tp) mesh, 4 ranks: torch's 2-D recipe, through both.

``parallelize_module(model, mesh["tp"], plan)`` makes the blocks' ``fc1`` column-parallel and
``fc2`` row-parallel (DTensor parameters, sharded over the tp pairs {0, 1} and {2, 3}); then
``FSDP(model, device_mesh=mesh["dp"], use_orig_params=True)`` shards every parameter's local
tensor over the dp pairs {0, 2} and {1, 3}. Each dp rank trains on its own rows of the batch;
the two tp ranks of a dp rank see the same rows.

Results are compared with torch FSDP1 given the same model, seeds and data, bit for bit (the
same arithmetic: the same TP ops, the same flat layout, the same gloo collectives in the same
order), and with one process training the unsharded model on the whole batch within float
rounding (the sharded runs sum gradients in another order and TP splits matmuls).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests._harness import RankPool
from tests._models import Block, global_batch, lm_loss, local_rows, make_toy

_MESH: dict[str, Any] = {}

# One process's float32 training on the whole batch vs the 2-D sharded runs: gradients are
# summed in another order (dp reduce-scatter, tp all-reduce of fc2's output, split matmuls), so
# each step differs by a few float32 roundings of values of order 1; AdamW divides by the
# square root of the second moment, which can magnify a relative difference of ~1e-7 in a
# small gradient entry to ~lr * 1e-3 in the update. Over 3 steps at lr 1e-2 that bounds the
# parameter difference well under 1e-5 (the same bound tests/test_hybrid_shard.py uses).
_REF_TOL = dict(rtol=5e-5, atol=5e-6)


def _mesh() -> Any:
    """The (dp, tp) mesh, made once per rank process (every rank creates it in order)."""
    if not _MESH:
        from torch.distributed.device_mesh import init_device_mesh

        _MESH["mesh"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return _MESH["mesh"]


_N_BLOCKS = 2


def _make_model() -> nn.Module:
    """The toy LM with blocks of hidden size 12 (TP splits it evenly), the same seed everywhere."""
    model = make_toy(n_blocks=_N_BLOCKS)
    torch.manual_seed(1)
    model.blocks = nn.ModuleList(Block(hidden=12) for _ in range(_N_BLOCKS))
    return model


def _tp_model(n_blocks: int = _N_BLOCKS) -> nn.Module:
    """:func:`_make_model` with each block's MLP tensor-parallel over ``tp``."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = _make_model()
    plan: dict[str, Any] = {}
    for i in range(n_blocks):
        plan[f"blocks.{i}.fc1"] = ColwiseParallel()
        plan[f"blocks.{i}.fc2"] = RowwiseParallel()
    return parallelize_module(model, _mesh()["tp"], plan)


def _wrap(lib: str, model: nn.Module, strategy: str, nested: bool, use_orig_params: bool = True) -> nn.Module:
    if lib == "ours":
        from fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
        from fsdp.wrap import ModuleWrapPolicy

        extra: dict[str, Any] = {}
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy  # type: ignore[assignment]
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy  # type: ignore[assignment]

        extra = {"device_id": torch.device("cpu")}
    policy = ModuleWrapPolicy({Block}) if nested else None
    return FSDP(
        model,
        device_mesh=_mesh()["dp"],
        sharding_strategy=ShardingStrategy[strategy],
        auto_wrap_policy=policy,
        use_orig_params=use_orig_params,
        **extra,
    )


def _full(model: nn.Module, fsdp_cls: Any) -> dict[str, torch.Tensor]:
    """Every parameter in full (a DTensor's ``full_tensor()``), read inside summon_full_params."""
    from torch.distributed.tensor import DTensor

    with fsdp_cls.summon_full_params(model, writeback=False):
        return {
            n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters()
        }


def _dp_rows(t: torch.Tensor) -> torch.Tensor:
    """This rank's dp rows of the global batch (tp ranks of one dp rank get the same rows)."""
    mesh = _mesh()
    return local_rows(t, mesh.get_local_rank("dp"), mesh.size(0))


def _make_optim(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01)


def run_tp_training(configs: list[tuple[str, bool, str]], steps: int = 3) -> None:
    """For each (strategy, nested, optimizer): train ours, torch FSDP1's and the reference."""
    from fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    dp_size = _mesh().size(0)
    for strategy, nested, optim in configs:
        ref = _make_model()
        ours = _wrap("ours", _tp_model(), strategy, nested)
        theirs = _wrap("torch", _tp_model(), strategy, nested)
        # The same units, the same plain 1-D shards of the local tensors as the optimizer sees.
        ours_params, theirs_params = dict(ours.named_parameters()), dict(theirs.named_parameters())
        assert list(ours_params) == list(theirs_params)
        for name, p in ours_params.items():
            assert type(p) is nn.Parameter and torch.equal(p, theirs_params[name]), name
        models = (ref, ours, theirs)
        opts = [_make_optim(optim, m.parameters()) for m in models]
        for step in range(steps):
            tokens, targets = global_batch(step, dp_size)
            losses = []
            for i, (model, opt) in enumerate(zip(models, opts)):
                x, y = (tokens, targets) if i == 0 else (_dp_rows(tokens), _dp_rows(targets))
                loss = lm_loss(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.detach())
            assert torch.equal(losses[1], losses[2]), (strategy, nested, optim, step, losses)
        for name, p in dict(ours.named_parameters()).items():
            assert torch.equal(p, dict(theirs.named_parameters())[name]), (strategy, nested, optim, name)
        mine, torch_full = _full(ours, FSDP), _full(theirs, TorchFSDP)
        ref_full = dict(ref.named_parameters())
        assert list(mine) == list(torch_full) == list(ref_full)
        for name in mine:
            assert torch.equal(mine[name], torch_full[name]), (strategy, nested, optim, name)
            torch.testing.assert_close(mine[name], ref_full[name].detach(), **_REF_TOL, msg=name)


def test_tp_training(pool4: RankPool) -> None:
    pool4.run(
        run_tp_training,
        [
            ("FULL_SHARD", False, "adamw"),
            ("FULL_SHARD", True, "sgd"),
            ("SHARD_GRAD_OP", True, "adamw"),
            ("SHARD_GRAD_OP", False, "sgd"),
        ],
    )


def _step(model: nn.Module, step: int) -> None:
    tokens, targets = global_batch(step, _mesh().size(0))
    lm_loss(model(_dp_rows(tokens)), _dp_rows(targets)).backward()


def run_tp_summon_and_clip(configs: list[tuple[str, bool]]) -> list[float]:
    """summon_full_params shows torch FSDP1's DTensors, its writeback of in-place changes and
    clip_grad_norm_ (2 and inf) equal torch FSDP1's, bit for bit."""
    from fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.tensor import DTensor

    norms = []
    for strategy, nested in configs:
        ours = _wrap("ours", _tp_model(), strategy, nested)
        theirs = _wrap("torch", _tp_model(), strategy, nested)
        for model, cls in ((ours, FSDP), (theirs, TorchFSDP)):
            _step(model, 0)
            with cls.summon_full_params(model):  # writeback of an in-place change
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(0.5)
        with FSDP.summon_full_params(ours, writeback=False), TorchFSDP.summon_full_params(theirs, writeback=False):
            mine, other = list(ours.named_parameters()), list(theirs.named_parameters())
            assert [n for n, _ in mine] == [n for n, _ in other]
            for (name, p), (_, q) in zip(mine, other):
                assert type(p) is type(q) and p.shape == q.shape and p.requires_grad == q.requires_grad, name
                if isinstance(q, DTensor):
                    assert isinstance(p, DTensor), name
                    assert p.placements == q.placements and p.device_mesh == q.device_mesh, name
                    assert p.stride() == q.stride(), name
                    p, q = p.to_local(), q.to_local()
                assert torch.equal(p, q), name
        for max_norm, norm_type in ((0.1, 2.0), (0.05, float("inf"))):
            for model in (ours, theirs):
                _step(model, 1)
            norm = ours.clip_grad_norm_(max_norm, norm_type)
            torch_norm = theirs.clip_grad_norm_(max_norm, norm_type)
            assert torch.equal(norm, torch_norm), (strategy, nested, norm_type, norm, torch_norm)
            assert norm > max_norm  # the gradients were clipped
            norms.append(norm.item())
            for (name, p), (_, q) in zip(ours.named_parameters(), theirs.named_parameters()):
                assert (p.grad is None) == (q.grad is None), name
                if p.grad is not None:
                    assert torch.equal(p.grad, q.grad), (strategy, nested, norm_type, name)
            for model in (ours, theirs):
                model.zero_grad()
    return norms


def test_tp_summon_and_clip(pool4: RankPool) -> None:
    norms = pool4.run(run_tp_summon_and_clip, [("FULL_SHARD", True), ("SHARD_GRAD_OP", False)])
    # As torch FSDP1 computes it, the norm is reduced over the dp group only: the two dp ranks
    # of one tp index agree ({0, 2} and {1, 3}); each tp index counts its own tp pieces of the
    # tensor-parallel gradients (the values equal torch's, checked on every rank above).
    assert norms[0] == norms[2] and norms[1] == norms[3]


def _assert_same_values(mine: dict[str, Any], theirs: dict[str, Any], what: str) -> None:
    """Same keys, types, DTensor meshes, placements, shapes and local values, bit for bit."""
    from torch.distributed.tensor import DTensor

    assert list(mine) == list(theirs), what
    for key, value in mine.items():
        other = theirs[key]
        assert type(value) is type(other), (what, key, type(value), type(other))
        if isinstance(other, DTensor):
            assert value.device_mesh == other.device_mesh and value.placements == other.placements, (what, key)
            assert value.shape == other.shape and value.stride() == other.stride(), (what, key)
            value, other = value.to_local(), other.to_local()
        if isinstance(other, torch.Tensor):
            assert torch.equal(value, other), (what, key)
        else:
            assert value == other, (what, key)


def run_tp_model_state_dicts(configs: list[tuple[str, bool]]) -> None:
    """FULL and SHARDED model state dicts equal torch FSDP1's (2-D DTensors when SHARDED, tp
    DTensors when FULL); each loads back into a fresh model (SHARDED through DCP)."""
    import tempfile

    import torch.distributed.checkpoint as dcp
    from fsdp import FullyShardedDataParallel as FSDP, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP, StateDictType as TorchType

    for strategy, nested in configs:
        ours = _wrap("ours", _tp_model(), strategy, nested)
        theirs = _wrap("torch", _tp_model(), strategy, nested)
        for model in (ours, theirs):
            opt = torch.optim.AdamW(model.parameters(), lr=0.01)
            _step(model, 0)
            opt.step()
        for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
            with FSDP.state_dict_type(ours, StateDictType[kind]):
                mine = ours.state_dict()
            with TorchFSDP.state_dict_type(theirs, TorchType[kind]):
                other = theirs.state_dict()
            _assert_same_values(mine, other, f"{strategy} {nested} {kind}")
            fresh = _wrap("ours", _tp_model(), strategy, nested)
            with FSDP.state_dict_type(fresh, StateDictType[kind]):
                if kind == "SHARDED_STATE_DICT":
                    path = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
                    dist.broadcast_object_list(path)
                    dcp.save(mine, checkpoint_id=path[0])
                    template = fresh.state_dict()
                    dcp.load(template, checkpoint_id=path[0])
                    fresh.load_state_dict(template)
                else:
                    fresh.load_state_dict(mine)
            _assert_same_values(dict(fresh.named_parameters()), dict(ours.named_parameters()), f"load {kind}")


def test_tp_model_state_dicts(pool4: RankPool) -> None:
    pool4.run(run_tp_model_state_dicts, [("FULL_SHARD", True), ("SHARD_GRAD_OP", False)])



def run_tp_unsupported() -> None:
    """Optimizer state dicts of DTensor parameters (torch FSDP1 gives DTensor state; not done
    yet) raise a clear NotImplementedError before anything moves; use_orig_params=False trains
    as torch FSDP1 does."""
    from fsdp import FullyShardedDataParallel as FSDP, StateDictType

    ours = _wrap("ours", _tp_model(), "FULL_SHARD", True)
    opt = torch.optim.AdamW(ours.parameters(), lr=0.01)
    _step(ours, 0)
    opt.step()
    before = {k: {n: v.clone() for n, v in s.items()} for k, s in opt.state_dict()["state"].items()}
    for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
        with FSDP.state_dict_type(ours, StateDictType[kind]):
            with pytest.raises(NotImplementedError, match=r"tensor-parallel \(DTensor\) parameters yet: parameter 'fc1.weight'"):
                FSDP.optim_state_dict(ours, opt)
            with pytest.raises(NotImplementedError, match="loading an optimizer state dict does not support tensor-parallel"):
                FSDP.optim_state_dict_to_load(ours, opt, {"state": {}, "param_groups": []})
    after = opt.state_dict()["state"]
    assert list(after) == list(before) and all(torch.equal(before[k][n], after[k][n]) for k in before for n in before[k])


def test_tp_unsupported(pool4: RankPool) -> None:
    pool4.run(run_tp_unsupported)
