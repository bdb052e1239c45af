"""torch FSDP1's FlatParameter / handle metadata that client stacks read (accelerate, Lightning),
against torch FSDP1.
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
                # The layout, torch's alignment padding included under use_orig_params.
                sizes = ["_unpadded_unsharded_size", "_sharded_size", "_padded_unsharded_size"]
                for attr in sizes + ["_shard_numel_padded", "_numels_with_padding", "_is_padding_mask"]:
                    assert hasattr(flat, attr) == hasattr(tflat, attr), (where, attr)
                    if hasattr(tflat, attr):
                        assert getattr(flat, attr) == getattr(tflat, attr), (where, attr)
                        assert type(getattr(flat, attr)) is type(getattr(tflat, attr)), (where, attr)
                assert type(flat._shard_param_infos) is type(tflat._shard_param_infos) is tuple
                assert [tuple(i) for i in flat._shard_param_infos] == [tuple(i) for i in tflat._shard_param_infos], where
                assert [i._fields for i in flat._shard_param_infos] == [i._fields for i in tflat._shard_param_infos]
                # The same values in the same places, padding included (copies only: exact).
                assert torch.equal(flat.detach(), tflat.detach()), where
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
