"""Tensor parallel + FSDP on a 2-D (dp, tp) mesh, 4 ranks: torch's 2-D recipe, through both.

``parallelize_module(model, mesh["tp"], plan)`` makes the blocks' ``fc1`` column-parallel and
``fc2`` row-parallel (DTensor parameters, sharded over the tp pairs {0, 1} and {2, 3}); then
``FSDP(model, device_mesh=mesh["dp"], use_orig_params=True)`` shards every parameter's local
tensor over the dp pairs {0, 2} and {1, 3}. Each dp rank trains on its own rows of the batch;
the two tp ranks of a dp rank see the same rows.

Results are compared with torch FSDP1 given the same model, seeds and data, bit for bit (the
same arithmetic: the same TP ops, the same flat layout, the same gloo collectives in the same
order), and with one process training the unsharded model on the whole batch within a
tolerance derived from float32 rounding ([Note: Tolerance against the one-process model]: the
sharded runs sum gradients in another order and TP splits matmuls).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests._harness import RankPool
from tests._models import Block, global_batch, lm_loss, local_rows, make_toy

_MESH: dict[tuple[int, int], Any] = {}

# [Note: Tolerance against the one-process model] One process's float32 training on the whole
# batch vs the 2-D sharded runs: the same operations, but sums in another order (the dp
# reduce-scatter adds two halves of the batch, TP splits fc1's and fc2's inner products and
# all-reduces fc2's output), so each gradient entry differs by at most the rounding of a sum of
# K terms, K * u relative to the sum of the terms' magnitudes (u = 2**-24, float32's unit
# roundoff; K = the longest sum: the 40 tokens of the global batch plus the 13-wide inner
# products). Gradients of a token-mean cross-entropy over O(1) activations are O(1), so
# rho = K * u bounds each gradient entry's difference. An optimizer step moves it into the
# parameters, first order in rho:
# - SGD (momentum m): step s applies lr * sum_{j <= s} m^(s-j) * g_j, so after S steps
#   |dp| <= lr * rho * sum_{s=1..S} sum_{j<=s} m^(s-j).
# - AdamW: m_hat / sqrt(v_hat) has magnitude <= ~1 for S = 3 (Cauchy-Schwarz on the bias-corrected
#   weights) and relative error <= 2 * rho (numerator and denominator each rho), so
#   |dp| <= lr * S * 2 * rho. (An entry whose gradient is itself a cancellation, far smaller than
#   its terms, could break this; the bound would then fail loudly rather than hide it.)
# Each run also rounds every parameter once per step: S * u * |p| (rtol).
# Measured on this model: 6e-8 (AdamW) and 3e-8 (SGD), the bound ~1e-6.
_STEPS = 3
_U = torch.finfo(torch.float32).eps / 2
_RHO = (40 + 13) * _U


def _ref_tol(optim: str) -> dict[str, float]:
    """``assert_close`` tolerances against the one-process model after ``_STEPS`` steps
    ([Note: Tolerance against the one-process model])."""
    if optim == "sgd":
        lr, m = 0.05, 0.9
        amplification = sum(sum(m ** (s - j) for j in range(1, s + 1)) for s in range(1, _STEPS + 1))
        atol = lr * amplification * _RHO
    else:
        atol = 0.01 * _STEPS * 2 * _RHO
    return dict(rtol=_STEPS * _U, atol=atol)


def _mesh(shape: tuple[int, int] = (2, 2)) -> Any:
    """The (dp, tp) mesh of ``shape``, made once per rank process (every rank creates it in order)."""
    if shape not in _MESH:
        from torch.distributed.device_mesh import init_device_mesh

        _MESH[shape] = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
    return _MESH[shape]


_N_BLOCKS = 2


def _make_model(hidden: int = 12) -> nn.Module:
    """The toy LM with blocks of hidden size 12 (TP splits it evenly), the same seed everywhere."""
    model = make_toy(n_blocks=_N_BLOCKS)
    torch.manual_seed(1)
    model.blocks = nn.ModuleList(Block(hidden=hidden) for _ in range(_N_BLOCKS))
    return model


def _tp_model(n_blocks: int = _N_BLOCKS, shape: tuple[int, int] = (2, 2), hidden: int = 12) -> nn.Module:
    """:func:`_make_model` with each block's MLP tensor-parallel over ``tp`` of the ``shape`` mesh
    (``hidden`` 11: tp splits it unevenly)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = _make_model(hidden)
    plan: dict[str, Any] = {}
    for i in range(n_blocks):
        plan[f"blocks.{i}.fc1"] = ColwiseParallel()
        plan[f"blocks.{i}.fc2"] = RowwiseParallel()
    return parallelize_module(model, _mesh(shape)["tp"], plan)


def _wrap(
    lib: str, model: nn.Module, strategy: str, nested: bool, use_orig_params: bool = True, shape: tuple[int, int] = (2, 2)
) -> nn.Module:
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
        device_mesh=_mesh(shape)["dp"],
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


def run_tp_training(configs: list[tuple[str, bool, str, bool]], steps: int = _STEPS) -> None:
    """For each (strategy, nested, optimizer, use_orig_params): train ours, torch FSDP1's and the
    reference."""
    from fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    dp_size = _mesh().size(0)
    for strategy, nested, optim, use_orig_params in configs:
        ref = _make_model()
        ours = _wrap("ours", _tp_model(), strategy, nested, use_orig_params)
        theirs = _wrap("torch", _tp_model(), strategy, nested, use_orig_params)
        # The same units, the same plain 1-D shards of the local tensors as the optimizer sees.
        ours_params, theirs_params = dict(ours.named_parameters()), dict(theirs.named_parameters())
        assert list(ours_params) == list(theirs_params)
        for name, p in ours_params.items():
            assert type(p).__name__ == type(theirs_params[name]).__name__, name  # Parameter / FlatParameter
            assert torch.equal(p, theirs_params[name]), name
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
            torch.testing.assert_close(mine[name], ref_full[name].detach(), **_ref_tol(optim), msg=name)


def test_tp_training(pool4: RankPool) -> None:
    pool4.run(
        run_tp_training,
        [
            ("FULL_SHARD", False, "adamw", True),
            ("FULL_SHARD", True, "sgd", True),
            ("SHARD_GRAD_OP", True, "adamw", False),
            ("SHARD_GRAD_OP", False, "sgd", True),
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


def _assert_same_values(mine: dict[str, Any], theirs: dict[str, Any], what: str, values: bool = True) -> None:
    """Same keys, types, DTensor meshes, placements, shapes and (``values``) local values, bit
    for bit."""
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
            assert not values or torch.equal(value, other), (what, key)
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


def _assert_same_optim(mine: dict[str, Any], theirs: dict[str, Any], what: str, values: bool = True) -> None:
    """Two optimizer state dicts keyed by names: the same entries, values as in
    :func:`_assert_same_values`, the same parameter groups."""
    assert list(mine["state"]) == list(theirs["state"]), what
    for key in mine["state"]:
        _assert_same_values(mine["state"][key], theirs["state"][key], f"{what} {key}", values)
    assert mine["param_groups"] == theirs["param_groups"], what


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[torch.Tensor]:
    losses = []
    for step in steps:
        tokens, targets = global_batch(step, _mesh().size(0))
        loss = lm_loss(model(_dp_rows(tokens)), _dp_rows(targets))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _shared_dir() -> str:
    import tempfile

    path = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path)
    return path[0]  # type: ignore[return-value]


def _sorted_names(osd: dict[str, Any]) -> dict[str, Any]:
    """``osd`` with each parameter's states in name order (an optimizer loads them in any)."""
    return {**osd, "state": {key: dict(sorted(entry.items())) for key, entry in osd["state"].items()}}


def _full_values(osd: dict[str, Any]) -> dict[tuple[str, str], torch.Tensor]:
    """Every state's full tensor (a DTensor's ``full_tensor()``): a collective."""
    from torch.distributed.tensor import DTensor

    return {
        (key, name): value.full_tensor() if isinstance(value, DTensor) else value
        for key, entry in osd["state"].items()
        for name, value in entry.items()
    }


def run_tp_optim_state_dicts(configs: list[tuple[str, bool, bool]]) -> None:
    """FULL and SHARDED optimizer state dicts as torch FSDP1 gives them (tp DTensors when FULL,
    2-D DTensors when SHARDED, plain ``step``), ``optim_state_dict_to_load`` gives back exactly
    what the optimizer holds, and a checkpoint (SHARDED through dcp.save / dcp.load) loaded into a fresh model and
    optimizer resumes exactly as the continuous run goes on.

    Torch FSDP1's FULL values are wrong here (torch 2.13, CPU/gloo, a dp slice of a 2-D mesh:
    every ``exp_avg`` holds ``exp_avg_sq``'s values, tensor-parallel or not), so a FULL state
    dict is compared with torch's in keys, types, meshes, placements and shapes, and in values
    with torch's SHARDED state dict made full (whose values are right: resuming from ours, which
    equals it, equals the continuous run). Torch FSDP1's ``optim_state_dict_to_load`` is wrong
    here too (it gives the ranks of tp index 1 the other tp piece's state, and with
    use_orig_params=False raises ``Tensor optimizer state does not have same shape as its
    parameter``), so ours is checked against what the optimizer holds and by resuming."""
    import torch.distributed.checkpoint as dcp
    from fsdp import FullyShardedDataParallel as FSDP, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP, StateDictType as TorchType

    for strategy, nested, use_orig_params in configs:
        ours = _wrap("ours", _tp_model(), strategy, nested, use_orig_params)
        theirs = _wrap("torch", _tp_model(), strategy, nested, use_orig_params)
        opts = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in (ours, theirs)]
        for model, opt in zip((ours, theirs), opts):
            _train(model, opt, range(2))
        with TorchFSDP.state_dict_type(theirs, TorchType.SHARDED_STATE_DICT):
            torch_sharded = TorchFSDP.optim_state_dict(theirs, opts[1])
        with TorchFSDP.state_dict_type(theirs, TorchType.FULL_STATE_DICT):
            torch_full = TorchFSDP.optim_state_dict(theirs, opts[1])
        torch_values = _full_values(torch_sharded)
        for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
            what = f"{strategy} {nested} {use_orig_params} {kind}"
            with FSDP.state_dict_type(ours, StateDictType[kind]):
                mine, msd = FSDP.optim_state_dict(ours, opts[0]), ours.state_dict()
                mine_flat = FSDP.optim_state_dict_to_load(ours, opts[0], mine)
            if kind == "SHARDED_STATE_DICT":
                _assert_same_optim(mine, torch_sharded, what)
            else:
                _assert_same_optim(mine, torch_full, what, values=False)
                mine_values = _full_values(mine)
                assert list(mine_values) == list(torch_values), what
                for key, value in mine_values.items():
                    assert torch.equal(value, torch_values[key]), (what, key)
            # Loading our own state dict back gives exactly what the optimizer holds.
            held = opts[0].state_dict()
            _assert_same_optim(_sorted_names(mine_flat), _sorted_names(held), f"to_load {what}")
            fresh = _wrap("ours", _tp_model(), strategy, nested, use_orig_params)
            fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.01)
            with FSDP.state_dict_type(fresh, StateDictType[kind]):
                if kind == "SHARDED_STATE_DICT":  # through DCP, into the fresh model's templates
                    path = _shared_dir()
                    dcp.save({"model": msd, "optim": mine}, checkpoint_id=path)
                    _train(fresh, fresh_opt, range(1))  # the optimizer has state to template
                    template = {"model": fresh.state_dict(), "optim": FSDP.optim_state_dict(fresh, fresh_opt)}
                    dcp.load(template, checkpoint_id=path)
                    msd, mine = template["model"], template["optim"]
                fresh.load_state_dict(msd)
                fresh_opt.load_state_dict(FSDP.optim_state_dict_to_load(fresh, fresh_opt, mine))
            resumed, continued = _train(fresh, fresh_opt, range(2, 4)), _train(ours, opts[0], range(2, 4))
            assert all(torch.equal(a, b) for a, b in zip(resumed, continued)), (what, resumed, continued)
            _assert_same_values(dict(fresh.named_parameters()), dict(ours.named_parameters()), f"resumed {what}")
            _train(theirs, opts[1], range(2, 4))  # the next checkpoint from the same point
            with TorchFSDP.state_dict_type(theirs, TorchType.SHARDED_STATE_DICT):
                torch_sharded = TorchFSDP.optim_state_dict(theirs, opts[1])
            torch_values = _full_values(torch_sharded)


def test_tp_optim_state_dicts(pool4: RankPool) -> None:
    pool4.run(run_tp_optim_state_dicts, [("FULL_SHARD", True, True), ("SHARD_GRAD_OP", False, False)])


def run_tp_unsupported() -> None:
    """rank0_only optimizer state dicts of DTensor parameters (torch FSDP1 hangs: one rank cannot
    hold every tp piece) and hybrid sharding of them raise a clear NotImplementedError before
    anything changes."""
    from fsdp import FullyShardedDataParallel as FSDP, StateDictType
    from fsdp.api import FullOptimStateDictConfig

    ours = _wrap("ours", _tp_model(), "FULL_SHARD", True)
    opt = torch.optim.AdamW(ours.parameters(), lr=0.01)
    _step(ours, 0)
    opt.step()
    before = {k: {n: v.clone() for n, v in s.items()} for k, s in opt.state_dict()["state"].items()}
    config = FullOptimStateDictConfig(rank0_only=True)
    with FSDP.state_dict_type(ours, StateDictType.FULL_STATE_DICT, optim_state_dict_config=config):
        with pytest.raises(NotImplementedError, match=r"rank0_only=True does not support tensor-parallel \(DTensor\) parameters: parameter 'blocks.0.fc1.weight'"):
            FSDP.optim_state_dict(ours, opt)
        with pytest.raises(NotImplementedError, match="loading an optimizer state dict with rank0_only=True"):
            FSDP.optim_state_dict_to_load(ours, opt, {"state": {}, "param_groups": []})
    after = opt.state_dict()["state"]
    assert list(after) == list(before) and all(torch.equal(before[k][n], after[k][n]) for k in before for n in before[k])
    # Hybrid sharding + TP (a 3-D mesh): torch FSDP1 constructs it and fails at the first
    # forward; fsdp refuses it in the constructor, before the model changes.
    from fsdp import ShardingStrategy
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh3 = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("replicate", "shard", "tp"))
    model = parallelize_module(_make_model(), mesh3["tp"], {"blocks.0.fc1": ColwiseParallel(), "blocks.0.fc2": RowwiseParallel()})
    params = dict(model.named_parameters())
    for strategy in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"):
        with pytest.raises(NotImplementedError, match=rf"{strategy} with tensor-parallel \(DTensor\) parameters is not supported: parameter 'blocks.0.fc1.weight'"):
            FSDP(model, device_mesh=mesh3["replicate", "shard"], sharding_strategy=ShardingStrategy[strategy], use_orig_params=True)
    assert dict(model.named_parameters()) == params and isinstance(params["blocks.0.fc1.weight"], DTensor)


def test_tp_unsupported(pool4: RankPool) -> None:
    pool4.run(run_tp_unsupported)


def _plain_fsdp(lib: str, hidden: int = 12) -> nn.Module:
    """The same model without tensor parallelism, FSDP over all 4 ranks (another layout)."""
    if lib == "ours":
        from fsdp import FullyShardedDataParallel as FSDP
        from fsdp.wrap import ModuleWrapPolicy

        return FSDP(_make_model(hidden), auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True)
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy

    return TorchFSDP(_make_model(), auto_wrap_policy=TorchPolicy({Block}), use_orig_params=True, device_id=torch.device("cpu"))


def _full_state(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[tuple[str, str], torch.Tensor]]:
    """Every parameter's and every optimizer state's full tensor, read through torch's DCP
    state-dict API (full_state_dict=True; a tp DTensor's ``full_tensor()``)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.tensor import DTensor

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    params = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in msd.items()}
    return params, _full_values(osd)


def run_tp_dcp_state_dict_api() -> None:
    """torch.distributed.checkpoint.state_dict on the 2-D model: get_state_dict gives torch
    FSDP1's keys, types and (sharded) values; a dcp.save of it loads through set_state_dict into
    a fresh 2-D model (resuming exactly as the continuous run) and into other layouts: the same
    model without tensor parallelism, FSDP over all 4 ranks, and TP on (4, 1) and (1, 4) meshes
    (the same full parameters and optimizer states), as torch FSDP1's checkpoint loads into
    torch FSDP1's (where torch can); and back, the plain model's FULL optimizer state dict into
    a 2-D model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    ours = _wrap("ours", _tp_model(), "FULL_SHARD", True)
    theirs = _wrap("torch", _tp_model(), "FULL_SHARD", True)
    opts = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in (ours, theirs)]
    for model, opt in zip((ours, theirs), opts):
        _train(model, opt, range(2))
    for full in (False, True):
        options = StateDictOptions(full_state_dict=full)
        (msd, osd), (tmsd, tosd) = get_state_dict(ours, opts[0], options=options), get_state_dict(theirs, opts[1], options=options)
        _assert_same_values(msd, tmsd, f"model full={full}")
        # torch FSDP1's FULL optimizer values are wrong here (see run_tp_optim_state_dicts)
        _assert_same_optim(osd, tosd, f"optim full={full}", values=not full)
    original = _full_state(ours, opts[0])
    torch_values = _full_values(get_state_dict(theirs, opts[1])[1])  # sharded: torch's are right
    assert list(original[1]) == list(torch_values)
    assert all(torch.equal(value, torch_values[key]) for key, value in original[1].items())
    paths = [_shared_dir(), _shared_dir()]
    for model, opt, path in zip((ours, theirs), opts, paths):
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    # A fresh 2-D model resumes exactly.
    fresh = _wrap("ours", _tp_model(), "FULL_SHARD", True)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.01)
    msd, osd = get_state_dict(fresh, fresh_opt)
    template = {"model": msd, "optim": osd}
    dcp.load(template, checkpoint_id=paths[0])
    set_state_dict(fresh, fresh_opt, model_state_dict=template["model"], optim_state_dict=template["optim"])
    resumed, continued = _train(fresh, fresh_opt, range(2, 4)), _train(ours, opts[0], range(2, 4))
    assert all(torch.equal(a, b) for a, b in zip(resumed, continued)), (resumed, continued)
    # Other layouts: no TP (FSDP over 4 ranks), TP on (4, 1) and (1, 4) meshes: the original's
    # full parameters and optimizer states. Torch FSDP1 loads its own checkpoint the same way
    # into the first two; on (1, 4) (dp of size 1, so NO_SHARD) its get_state_dict fails
    # (AssertionError: Expected fqn_to_param_info[fqn].handle.flat_param is flat_param).
    for shape, libs in ((None, ("ours", "torch")), ((4, 1), ("ours", "torch")), ((1, 4), ("ours",))):
        for lib, path in zip(libs, paths):
            other = _plain_fsdp(lib) if shape is None else _wrap(lib, _tp_model(shape=shape), "FULL_SHARD", True, shape=shape)
            other_opt = torch.optim.AdamW(other.parameters(), lr=0.01)
            msd, osd = get_state_dict(other, other_opt)
            template = {"model": msd, "optim": osd}
            dcp.load(template, checkpoint_id=path)
            set_state_dict(other, other_opt, model_state_dict=template["model"], optim_state_dict=template["optim"])
            loaded = _full_state(other, other_opt)
            for what in (0, 1):
                assert list(loaded[what]) == list(original[what]), (shape, lib, what)
                for key, value in original[what].items():
                    assert torch.equal(loaded[what][key], value), (shape, lib, key)
            if shape is None and lib == "ours":
                plain, plain_opt = other, other_opt
    # Back the other way, without DCP: the plain model's FULL optimizer state dict (plain full
    # tensors) loads into a 2-D model, each TP parameter's state cut to its tp piece.
    from fsdp import FullyShardedDataParallel as FSDP, StateDictType

    with FSDP.state_dict_type(plain, StateDictType.FULL_STATE_DICT):
        plain_osd = FSDP.optim_state_dict(plain, plain_opt)
    back = _wrap("ours", _tp_model(), "FULL_SHARD", True)
    back_opt = torch.optim.AdamW(back.parameters(), lr=0.01)
    _train(back, back_opt, range(1))
    with FSDP.state_dict_type(back, StateDictType.FULL_STATE_DICT):
        back_opt.load_state_dict(FSDP.optim_state_dict_to_load(back, back_opt, plain_osd))
    back_values = _full_state(back, back_opt)[1]
    assert list(back_values) == list(original[1])
    assert all(torch.equal(back_values[key], value) for key, value in original[1].items())


def test_tp_dcp_state_dict_api(pool4: RankPool) -> None:
    pool4.run(run_tp_dcp_state_dict_api)


def _plain_values(sd: dict[str, Any]) -> dict[str, Any]:
    """``sd`` with every DTensor made a plain full tensor (``full_tensor()``: a collective), as a
    model without tensor parallelism holds it."""
    from torch.distributed.tensor import DTensor

    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in sd.items()}


def _plain_osd(osd: dict[str, Any]) -> dict[str, Any]:
    return {**osd, "state": {key: _plain_values(entry) for key, entry in osd["state"].items()}}


def _gathered_by_torch(osd: dict[str, Any]) -> dict[tuple[str, str], torch.Tensor]:
    """Every state's full tensor, a ShardedTensor's gathered by torch's ``ShardedTensor.gather``
    to rank 0 and broadcast (an oracle independent of fsdp's reading of ShardedTensors)."""
    import warnings

    from torch.distributed._shard.sharded_tensor import ShardedTensor

    result = {}
    for key, entry in osd["state"].items():
        for name, value in entry.items():
            if isinstance(value, ShardedTensor):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    size, dtype = value.metadata().size, value.metadata().tensor_properties.dtype
                    full = torch.empty(size, dtype=dtype) if dist.get_rank() == 0 else None
                    value.gather(0, full)
                value = full if full is not None else torch.empty(size, dtype=dtype)
                dist.broadcast(value, 0)
            result[(key, name)] = value
    return result


def run_tp_load_plain_full(configs: list[tuple[str, bool, bool]]) -> None:
    """A plain FULL model state dict (full torch.Tensors, no TP) loads straight into the 2-D
    model with ``load_state_dict`` under FULL_STATE_DICT, each rank taking its tp piece, then its
    dp shard:

    - from one process (``model.state_dict()`` of the unwrapped model after two steps): the same
      full parameters; training on equals torch FSDP1 given the same values in its own FULL form
      (tp DTensors), bit for bit, and the one-process model within [Note: Tolerance against the
      one-process model]. Torch FSDP1 cannot load the plain tensors (``aten.copy_.default got
      mixed torch.Tensor and DTensor``).
    - from the 2-D model itself, its FULL model and optimizer state dicts made plain: resuming
      equals the continuous run, bit for bit.
    - a plain value of another shape is refused with nn.Module's size-mismatch message, naming the
      global shape, before anything changes.
    - under a root that is no FSDP unit, the plain, FULL and SHARDED forms load alike.
    - torch FSDP1 without a mesh: its FULL model state dict and its SHARDED optimizer state dict
      (ShardedTensors) load, to its values.
    """
    from fsdp import FullyShardedDataParallel as FSDP, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP, StateDictType as TorchType
    from torch.distributed.tensor import DTensor, distribute_tensor

    for strategy, nested, use_orig_params in configs:
        what = f"{strategy} {nested} {use_orig_params}"
        ref = _make_model()
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
        for step in range(2):
            tokens, targets = global_batch(step, _mesh().size(0))
            lm_loss(ref(tokens), targets).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        plain = {k: v.clone() for k, v in ref.state_dict().items()}
        ours = _wrap("ours", _tp_model(), strategy, nested, use_orig_params)
        theirs = _wrap("torch", _tp_model(), strategy, nested, use_orig_params)
        before = _full(ours, FSDP)
        bad = {**plain, "blocks.0.fc1.weight": plain["blocks.0.fc1.weight"][:6]}
        with FSDP.state_dict_type(ours, StateDictType.FULL_STATE_DICT):
            with pytest.raises(RuntimeError, match=r"size mismatch for blocks.0.fc1.weight: copying a param with shape \(6, 7\) from checkpoint, the shape in current model is \(12, 7\)"):
                ours.load_state_dict(bad)
        assert all(torch.equal(v, before[k]) for k, v in _full(ours, FSDP).items()), what
        with FSDP.state_dict_type(ours, StateDictType.FULL_STATE_DICT):
            result = ours.load_state_dict(dict(plain))
        assert not result.missing_keys and not result.unexpected_keys, (what, result)
        with TorchFSDP.state_dict_type(theirs, TorchType.FULL_STATE_DICT):
            with pytest.raises(RuntimeError, match="got mixed torch.Tensor and DTensor"):
                theirs.load_state_dict(dict(plain))
            template = theirs.state_dict()  # torch's own FULL form: tp DTensors
            theirs.load_state_dict(
                {
                    k: distribute_tensor(plain[k], v.device_mesh, v.placements) if isinstance(v, DTensor) else plain[k]
                    for k, v in template.items()
                }
            )
        mine, torch_full = _full(ours, FSDP), _full(theirs, TorchFSDP)
        assert list(mine) == list(torch_full) == list(plain), what
        assert all(torch.equal(mine[k], plain[k]) and torch.equal(torch_full[k], plain[k]) for k in mine), what
        opts = [_make_optim("sgd", m.parameters()) for m in (ours, theirs, ref)]
        ref_opt = opts[2]
        for step in range(2, 2 + _STEPS):
            tokens, targets = global_batch(step, _mesh().size(0))
            lm_loss(ref(tokens), targets).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        losses = [_train(m, o, range(2, 2 + _STEPS)) for m, o in zip((ours, theirs), opts)]
        assert all(torch.equal(a, b) for a, b in zip(*losses)), (what, losses)
        mine, torch_full = _full(ours, FSDP), _full(theirs, TorchFSDP)
        for name, p in ref.named_parameters():
            assert torch.equal(mine[name], torch_full[name]), (what, name)
            torch.testing.assert_close(mine[name], p.detach(), **_ref_tol("sgd"), msg=name)
        # From the 2-D model's own FULL state dicts, made plain: resuming equals continuing.
        with FSDP.state_dict_type(ours, StateDictType.FULL_STATE_DICT):
            msd, osd = _plain_values(ours.state_dict()), _plain_osd(FSDP.optim_state_dict(ours, opts[0]))
        assert not any(isinstance(v, DTensor) for v in msd.values()), what
        fresh = _wrap("ours", _tp_model(), strategy, nested, use_orig_params)
        fresh_opt = _make_optim("sgd", fresh.parameters())
        _train(fresh, fresh_opt, range(1))  # state to replace
        with FSDP.state_dict_type(fresh, StateDictType.FULL_STATE_DICT):
            fresh.load_state_dict(msd)
            fresh_opt.load_state_dict(FSDP.optim_state_dict_to_load(fresh, fresh_opt, osd))
        resumed, continued = _train(fresh, fresh_opt, range(5, 7)), _train(ours, opts[0], range(5, 7))
        assert all(torch.equal(a, b) for a, b in zip(resumed, continued)), (what, resumed, continued)
        _assert_same_values(dict(fresh.named_parameters()), dict(ours.named_parameters()), f"resumed {what}")
        # Under a root that is no FSDP unit (the units' load hooks do the work): each form loads.
        for kind, make_plain in (("FULL_STATE_DICT", True), ("FULL_STATE_DICT", False), ("SHARDED_STATE_DICT", False)):
            with FSDP.state_dict_type(ours, StateDictType[kind]):
                sd = _plain_values(ours.state_dict()) if make_plain else ours.state_dict()
            outer = nn.ModuleDict({"inner": _wrap("ours", _tp_model(), strategy, nested, use_orig_params)})
            with FSDP.state_dict_type(outer, StateDictType[kind]):
                outer.load_state_dict({"inner." + k: v for k, v in sd.items()})
            _assert_same_values(dict(outer["inner"].named_parameters()), dict(ours.named_parameters()), f"outer {kind} {what}")
    # From torch FSDP1 without tensor parallelism (FSDP over all 4 ranks, no device_mesh): its
    # FULL model state dict (plain tensors) and its SHARDED optimizer state dict, whose values
    # are ShardedTensors (chunked over the 4 ranks), each cut to this rank's tp piece ([Note:
    # Tensor-parallel values to load]): the same full parameters and optimizer states.
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    torch_plain = _plain_fsdp("torch")
    torch_opt = torch.optim.AdamW(torch_plain.parameters(), lr=0.01)
    _train(torch_plain, torch_opt, range(2))
    with TorchFSDP.state_dict_type(torch_plain, TorchType.FULL_STATE_DICT):
        torch_msd, torch_full_osd = torch_plain.state_dict(), TorchFSDP.optim_state_dict(torch_plain, torch_opt)
    with TorchFSDP.state_dict_type(torch_plain, TorchType.SHARDED_STATE_DICT):
        torch_osd = TorchFSDP.optim_state_dict(torch_plain, torch_opt)
    assert isinstance(torch_osd["state"]["blocks.0.fc1.weight"]["exp_avg"], ShardedTensor)
    back = _wrap("ours", _tp_model(), "FULL_SHARD", True)
    back_opt = torch.optim.AdamW(back.parameters(), lr=0.01)
    _train(back, back_opt, range(1))
    with FSDP.state_dict_type(back, StateDictType.SHARDED_STATE_DICT):
        back_opt.load_state_dict(FSDP.optim_state_dict_to_load(back, back_opt, torch_osd))
    with FSDP.state_dict_type(back, StateDictType.FULL_STATE_DICT):
        back.load_state_dict(torch_msd)
    loaded, expected = _full_state(back, back_opt), (torch_msd, _gathered_by_torch(torch_osd))
    for which in (0, 1):
        assert list(loaded[which]) == list(expected[which]), which
        assert all(torch.equal(v, expected[which][k]) for k, v in loaded[which].items()), which
    # Torch FSDP1's own FULL optimizer values are wrong here too (every ``exp_avg`` holds
    # ``exp_avg_sq``'s values), hence its SHARDED ones gathered by ShardedTensor.gather above.
    torch_full = _full_values(torch_full_osd)
    assert all(torch.equal(torch_full[(k, "exp_avg")], v) for (k, n), v in expected[1].items() if n == "exp_avg_sq")


def test_tp_load_plain_full(pool4: RankPool) -> None:
    pool4.run(run_tp_load_plain_full, [("FULL_SHARD", True, True), ("SHARD_GRAD_OP", False, False)])


def run_tp_no_shard(configs: list[tuple[bool, str, bool]]) -> str:
    """NO_SHARD over the dp dimension with tensor-parallel blocks: training stays within [Note:
    Tolerance against the one-process model] of one process training the unsharded model, and
    every model state dict type (a NO_SHARD unit gives FULL values for each, with torch's
    warning: tp DTensors for the tensor-parallel parameters) loads back into a fresh model, and
    so does the FULL one made plain (full tensors); FULL and SHARDED model + optimizer state
    dicts resume exactly as the continuous run.
    Torch FSDP1 builds the same model but fails at its first forward; returns its error (''
    if it does not)."""
    import warnings

    from fsdp import FullyShardedDataParallel as FSDP, StateDictType
    from torch.distributed.tensor import DTensor

    for nested, optim, use_orig_params in configs:
        what = f"{nested} {optim} {use_orig_params}"
        ref = _make_model()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # NO_SHARD is deprecated in torch
            ours = _wrap("ours", _tp_model(), "NO_SHARD", nested, use_orig_params)
        models = (ref, ours)
        opts = [_make_optim(optim, m.parameters()) for m in models]
        for step in range(_STEPS):
            tokens, targets = global_batch(step, _mesh().size(0))
            for i, (model, opt) in enumerate(zip(models, opts)):
                x, y = (tokens, targets) if i == 0 else (_dp_rows(tokens), _dp_rows(targets))
                lm_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
        mine = _full(ours, FSDP)
        assert list(mine) == [n for n, _ in ref.named_parameters()], what
        for name, p in ref.named_parameters():
            torch.testing.assert_close(mine[name], p.detach(), **_ref_tol(optim), msg=f"{what} {name}")
        for kind, plain in (("FULL_STATE_DICT", False), ("FULL_STATE_DICT", True), ("SHARDED_STATE_DICT", False), ("LOCAL_STATE_DICT", False)):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                fresh = _wrap("ours", _tp_model(), "NO_SHARD", nested, use_orig_params)
            with FSDP.state_dict_type(ours, StateDictType[kind]), warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                saved = ours.state_dict()  # the FULL values torch gives for NO_SHARD, warned
            assert kind == "FULL_STATE_DICT" or any("full_state_dict will be returned" in str(w.message) for w in seen), (what, kind)
            assert isinstance(saved["blocks.0.fc1.weight"], DTensor) and not isinstance(saved["embed.weight"], DTensor), what
            with FSDP.state_dict_type(fresh, StateDictType[kind]), warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                fresh.load_state_dict(_plain_values(saved) if plain else saved)
            loaded = _full(fresh, FSDP)
            assert all(torch.equal(loaded[k], v) for k, v in mine.items()), (what, kind, plain)
        for i, kind in enumerate(("FULL_STATE_DICT", "SHARDED_STATE_DICT")):  # model + optimizer: resumes exactly
            with FSDP.state_dict_type(ours, StateDictType[kind]), warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                msd, osd = ours.state_dict(), FSDP.optim_state_dict(ours, opts[1])
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                fresh = _wrap("ours", _tp_model(), "NO_SHARD", nested, use_orig_params)
            fresh_opt = _make_optim(optim, fresh.parameters())
            _train(fresh, fresh_opt, range(1))  # state to replace
            with FSDP.state_dict_type(fresh, StateDictType[kind]), warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                fresh.load_state_dict(msd)
                fresh_opt.load_state_dict(FSDP.optim_state_dict_to_load(fresh, fresh_opt, osd))
            steps = range(_STEPS + 2 * i, _STEPS + 2 * i + 2)
            resumed, continued = _train(fresh, fresh_opt, steps), _train(ours, opts[1], steps)
            assert all(torch.equal(a, b) for a, b in zip(resumed, continued)), (what, kind, resumed, continued)
            _assert_same_values(dict(fresh.named_parameters()), dict(ours.named_parameters()), f"resumed {what} {kind}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        theirs = _wrap("torch", _tp_model(), "NO_SHARD", True)
    tokens, targets = global_batch(0, _mesh().size(0))
    try:
        theirs(_dp_rows(tokens))
    except Exception as exc:  # noqa: BLE001 - torch's failure, whatever it is, is reported
        return f"{type(exc).__name__}: {exc}"
    return ""


def test_tp_no_shard(pool4: RankPool) -> None:
    errors = pool4.run(run_tp_no_shard, [(True, "adamw", True), (False, "sgd", False)])
    # torch FSDP1 (2.13) fails where fsdp trains ("Expects torch.Size([42]) but got
    # torch.Size([84])" for the first unit)
    assert all("Cannot writeback when the parameter shape changes" in e for e in errors), errors


def _perturbed_tp_model(seed: int) -> nn.Module:
    """:func:`_tp_model` with every parameter and buffer drawn from ``seed`` (a DTensor: this
    rank's piece of a drawn global tensor): a plain buffer on the root, a tp-replicated DTensor
    buffer in the first block. The two tp ranks of a dp position pass the same seed (a
    consistent tensor-parallel model), the dp positions different ones."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    model = _tp_model()
    model.register_buffer("scale", torch.ones(3))
    model.blocks[0].fc1.register_buffer("tp_scale", distribute_tensor(torch.ones(4), _mesh()["tp"], [Replicate()]))
    generator = torch.Generator().manual_seed(100 + seed)
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            drawn = torch.randn(tensor.shape, generator=generator)
            if isinstance(tensor, DTensor):  # this rank's piece, sliced locally
                local = distribute_tensor(drawn, tensor.device_mesh, tensor.placements, src_data_rank=None)
                tensor.to_local().copy_(local.to_local())
            else:
                tensor.copy_(drawn)
    return model


def run_tp_sync_module_states(configs: list[tuple[str, bool, bool]]) -> None:
    """``sync_module_states=True`` with tensor-parallel parameters and buffers: each rank ends
    with the state of the rank at dp position 0 of its tp column (the local tp pieces broadcast
    over the dp group; a DTensor buffer used to raise ``NotImplementedError: Operator
    c10d.broadcast_.default does not have a sharding strategy registered``), and trains bit for
    bit as that state wrapped without syncing, in ours and in torch FSDP1. (Torch FSDP1 itself
    refuses ``sync_module_states`` on CPU, "requires them to be on GPU", so its run starts from
    the synced state directly.)"""
    from fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
    from fsdp.wrap import ModuleWrapPolicy
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.tensor import DTensor

    def local(x: torch.Tensor) -> torch.Tensor:
        return x.to_local() if isinstance(x, DTensor) else x

    mesh = _mesh()
    dp_position, source = mesh.get_local_rank("dp"), 0  # the state of dp position 0 wins
    for strategy, nested, use_orig_params in configs:
        what = (strategy, nested, use_orig_params)
        synced = FSDP(
            _perturbed_tp_model(seed=dp_position), device_mesh=mesh["dp"],
            sharding_strategy=ShardingStrategy[strategy], auto_wrap_policy=ModuleWrapPolicy({Block}) if nested else None,
            use_orig_params=use_orig_params, sync_module_states=True,
        )
        expected = _wrap("ours", _perturbed_tp_model(seed=source), strategy, nested, use_orig_params)
        theirs = _wrap("torch", _perturbed_tp_model(seed=source), strategy, nested, use_orig_params)
        # This rank's shards (what the sync wrote): rank 0's of the dp group kept, the others' replaced.
        unsynced = _wrap("ours", _perturbed_tp_model(seed=dp_position), strategy, nested, use_orig_params)
        shards = [(n, p, q) for (n, p), (_, q) in zip(synced.named_parameters(), unsynced.named_parameters()) if p.numel()]
        changed = [n for n, p, q in shards if not torch.equal(p, q)]
        assert shards and changed == ([] if dp_position == source else [n for n, _, _ in shards]), (what, changed)
        buffers = dict(synced.named_buffers())
        assert list(buffers) == [n for n, _ in expected.named_buffers()], what
        for name, buf in expected.named_buffers():
            assert type(buffers[name]) is type(buf) and torch.equal(local(buffers[name]), local(buf)), (what, name)
        full, full_expected = _full(synced, FSDP), _full(expected, FSDP)
        assert list(full) == list(full_expected), what
        for name, value in full_expected.items():
            assert torch.equal(full[name], value), (what, name)
        models = (synced, expected, theirs)
        opts = [_make_optim("adamw", m.parameters()) for m in models]
        for step in range(2):
            for model, opt in zip(models, opts):
                _step(model, step)
                opt.step()
                opt.zero_grad()
        with FSDP.summon_full_params(synced), FSDP.summon_full_params(expected), TorchFSDP.summon_full_params(theirs):
            for (name, p), (_, q), (_, t) in zip(
                synced.named_parameters(), expected.named_parameters(), theirs.named_parameters()
            ):
                assert torch.equal(local(p), local(q)) and torch.equal(local(p), local(t)), (what, name)


def test_tp_sync_module_states(pool4: RankPool) -> None:
    pool4.run(run_tp_sync_module_states, [("FULL_SHARD", True, True), ("SHARD_GRAD_OP", False, False)])
