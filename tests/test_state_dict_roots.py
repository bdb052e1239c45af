"""Model state dicts through any root, compared with torch FSDP1 (keys, values, load results).

The same model and wrapping go through both libraries: an FSDP root with the blocks as units, a
plain module holding FSDP blocks (the root is not wrapped), activation-checkpoint wrappers
around units (inside an FSDP root or a plain one) and inside units. For FULL, SHARDED and
LOCAL state dicts: the keys (and their order) equal torch FSDP1's, the values hold the same
numbers, and each library's state dict loads into a fresh model of the other, with the same
missing/unexpected keys reported.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

from tests._harness import RankPool
from tests._models import Block, make_toy

WRAPPINGS = ["fsdp_root", "plain_root", "ckpt_around_unit", "ckpt_in_unit", "plain_root_ckpt"]
KINDS = ["FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT"]


def _build(lib: str, wrapping: str, seed: int, orig: bool = False) -> nn.Module:
    """ToyLM wrapped as ``wrapping`` by ``lib`` ("ours" or "torch")."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper

    if lib == "ours":
        from fsdp import FullyShardedDataParallel as FSDP
        from fsdp.wrap import ModuleWrapPolicy

        kw: dict[str, Any] = {"use_orig_params": orig}
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # type: ignore[assignment]
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy  # type: ignore[assignment]

        kw = {"use_orig_params": orig, "device_id": torch.device("cpu")}
    model = make_toy(seed=seed)
    if wrapping == "fsdp_root":
        return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), **kw)
    if wrapping in ("plain_root", "plain_root_ckpt"):
        for i in range(3):
            unit = FSDP(model.blocks[i], **kw)
            model.blocks[i] = checkpoint_wrapper(unit) if wrapping == "plain_root_ckpt" else unit
        return model
    if wrapping == "ckpt_around_unit":  # CheckpointWrapper(FSDP(Block)) inside an FSDP root
        root = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), **kw)
        for i in range(3):
            root.module.blocks[i] = checkpoint_wrapper(root.module.blocks[i])
        return root
    assert wrapping == "ckpt_in_unit"  # FSDP(CheckpointWrapper(Block))
    for i in range(3):
        model.blocks[i] = checkpoint_wrapper(model.blocks[i])
    return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({CheckpointWrapper}), **kw)


def _sd(model: nn.Module, lib: str, kind: str) -> dict[str, Any]:
    if lib == "ours":
        from fsdp import FullyShardedDataParallel as FSDP, StateDictType
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # type: ignore[assignment]
        from torch.distributed.fsdp import StateDictType  # type: ignore[assignment]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own deprecation warnings (its state_dict_type)
        with FSDP.state_dict_type(model, StateDictType[kind]):
            return model.state_dict()


def _load(model: nn.Module, lib: str, kind: str, state_dict: dict[str, Any], strict: bool = True) -> Any:
    if lib == "ours":
        from fsdp import FullyShardedDataParallel as FSDP, StateDictType
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # type: ignore[assignment]
        from torch.distributed.fsdp import StateDictType  # type: ignore[assignment]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with FSDP.state_dict_type(model, StateDictType[kind]):
            return model.load_state_dict(state_dict, strict=strict)


def _local_part(value: Any) -> torch.Tensor:
    """This rank's data of a DTensor / ShardedTensor (empty if it holds none), or the tensor."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, ShardedTensor):
        shards = value.local_shards()
        return shards[0].tensor if shards else torch.empty(0)
    return value


def _assert_same_values(mine: dict[str, Any], torchs: dict[str, Any], kind: str) -> None:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    assert list(mine) == list(torchs)
    for key in mine:
        a, b = mine[key], torchs[key]
        if isinstance(b, ShardedTensor) and kind == "SHARDED_STATE_DICT":
            # torch FSDP1's type and layout ([Note: Sharded value forms]): metadata, placements and all
            assert isinstance(a, ShardedTensor) and a.metadata() == b.metadata(), key
            assert [s.metadata for s in a.local_shards()] == [s.metadata for s in b.local_shards()], key
        elif isinstance(b, ShardedTensor):  # LOCAL: the same ShardedTensor, metadata and all
            assert isinstance(a, ShardedTensor), key
            assert a.metadata().size == b.metadata().size, key
            assert [(m.shard_offsets, m.shard_sizes) for m in a.metadata().shards_metadata] == [
                (m.shard_offsets, m.shard_sizes) for m in b.metadata().shards_metadata
            ], key
            assert [s.metadata.shard_offsets for s in a.local_shards()] == [
                s.metadata.shard_offsets for s in b.local_shards()
            ], key
        else:
            assert type(a) is type(b) and a.shape == b.shape, key
        assert a.shape == b.shape, key
        assert torch.equal(_local_part(a), _local_part(b)), key  # same arithmetic: bit-exact


def roots_parity(wrapping: str, orig: bool) -> None:
    """Every kind through ``wrapping``: save, compare with torch, load across libraries."""
    for kind in KINDS:
        ours, theirs = _build("ours", wrapping, 1, orig), _build("torch", wrapping, 1, orig)
        mine, torchs = _sd(ours, "ours", kind), _sd(theirs, "torch", kind)
        # With use_orig_params both align every original parameter to 16 bytes inside the
        # FlatParameter (torch FSDP1's layout), so LOCAL flat shards are the same too.
        _assert_same_values(mine, torchs, kind)
        expected = _sd(ours, "ours", "FULL_STATE_DICT")
        assert list(expected) == list(make_toy().state_dict())  # the unwrapped model's keys

        # Our own state dict loads back (the bug: through a plain root or checkpoint wrapper it
        # could not), reporting nothing; the fresh model then holds the saved values.
        target = _build("ours", wrapping, 7, orig)
        result = _load(target, "ours", kind, mine)
        assert list(result.missing_keys) == [] and list(result.unexpected_keys) == [], (kind, result)
        loaded = _sd(target, "ours", "FULL_STATE_DICT")
        assert all(torch.equal(loaded[k], expected[k]) for k in expected), kind
        # Torch FSDP1's state dict (ShardedTensors for SHARDED and LOCAL) loads into ours.
        target = _build("ours", wrapping, 8, orig)
        _load(target, "ours", kind, torchs)
        loaded = _sd(target, "ours", "FULL_STATE_DICT")
        assert all(torch.equal(loaded[k], expected[k]) for k in expected), kind
        if orig and kind == "LOCAL_STATE_DICT":
            # torch FSDP1 cannot load any LOCAL state dict with use_orig_params, not even its
            # own (its _flat_param is no registered parameter then); ours loads both.
            with pytest.raises(RuntimeError, match=r"Unexpected key\(s\) in state_dict: .*_flat_param"):
                _load(_build("torch", wrapping, 9, orig), "torch", kind, torchs)
        elif kind != "SHARDED_STATE_DICT":  # torch FSDP1 takes no DTensor without a mesh: see DCP tests
            other = _build("torch", wrapping, 9, orig)
            _load(other, "torch", kind, mine)
            theirs_loaded = _sd(other, "torch", "FULL_STATE_DICT")
            assert all(torch.equal(theirs_loaded[k], expected[k]) for k in expected), kind

        # Non-strict loads report what torch FSDP1 reports (clean names, same order).
        partial = dict(mine)
        if kind != "LOCAL_STATE_DICT":  # (torch refuses a LOCAL dict without a unit's entry)
            del partial["blocks.1.fc1.weight"]
            del partial["head.weight"]
        partial["zzz"] = torch.zeros(1)
        partial["blocks.2.zzz"] = torch.zeros(1)
        partial_t = dict(torchs)
        for key in ("blocks.1.fc1.weight", "head.weight"):
            if key not in partial:
                partial_t.pop(key, None)
        partial_t["zzz"] = torch.zeros(1)
        partial_t["blocks.2.zzz"] = torch.zeros(1)
        ours_result = _load(_build("ours", wrapping, 3, orig), "ours", kind, partial, strict=False)
        torch_result = _load(_build("torch", wrapping, 3, orig), "torch", kind, partial_t, strict=False)
        assert sorted(ours_result.missing_keys) == sorted(torch_result.missing_keys), (kind, ours_result, torch_result)
        torch_unexpected = torch_result.unexpected_keys
        if orig and kind == "LOCAL_STATE_DICT":  # torch also reports its own entries (see above)
            torch_unexpected = [k for k in torch_unexpected if not k.endswith("_flat_param")]
        assert sorted(ours_result.unexpected_keys) == sorted(torch_unexpected), (kind, ours_result, torch_result)
        if kind != "LOCAL_STATE_DICT":
            assert sorted(ours_result.missing_keys) == ["blocks.1.fc1.weight", "head.weight"]
        assert sorted(ours_result.unexpected_keys) == ["blocks.2.zzz", "zzz"]
        # Strict: the same error type; an FSDP root changes nothing (checked before any copy).
        victim = _build("ours", wrapping, 4, orig)
        before = _sd(victim, "ours", "FULL_STATE_DICT")
        with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: .*"zzz"'):
            _load(victim, "ours", kind, partial)
        if wrapping in ("fsdp_root", "ckpt_around_unit", "ckpt_in_unit"):
            after = _sd(victim, "ours", "FULL_STATE_DICT")
            assert all(torch.equal(before[k], after[k]) for k in before), "nothing changed"


@pytest.mark.parametrize("orig", [False, True])
@pytest.mark.parametrize("wrapping", WRAPPINGS)
def test_state_dict_through_any_root(pool2: RankPool, wrapping: str, orig: bool) -> None:
    pool2.run(roots_parity, wrapping, orig, _timeout=300)


def shape_error_through_plain_root() -> None:
    """Through a plain root a unit with a bad entry stays as it was (the other units load)."""
    model = _build("ours", "plain_root", 1)
    source = _sd(_build("ours", "plain_root", 2), "ours", "FULL_STATE_DICT")
    before = _sd(model, "ours", "FULL_STATE_DICT")
    bad = dict(source, **{"blocks.1.fc1.weight": torch.zeros(3, 3)})
    with pytest.raises(RuntimeError, match=r"size mismatch for blocks.1.fc1.weight: copying a param with shape \(3, 3\)"):
        _load(model, "ours", "FULL_STATE_DICT", bad)
    after = _sd(model, "ours", "FULL_STATE_DICT")
    unit_keys = [k for k in before if k.startswith("blocks.1.")]
    assert all(torch.equal(after[k], before[k]) for k in unit_keys)
    assert torch.equal(after["blocks.0.fc1.weight"], source["blocks.0.fc1.weight"])  # nn.Module semantics


def test_shape_error_through_plain_root(pool2: RankPool) -> None:
    pool2.run(shape_error_through_plain_root, _timeout=120)


def ignored_buffer_identity() -> None:
    """bf16 buffers: an ignored module's buffer comes back as the buffer itself (no copy), as in torch.

    Swept over FULL (with and without offload_to_cpu, whose values are already on CPU here) and
    SHARDED, with FULL_SHARD and NO_SHARD units (our two ways of saving a unit).
    """
    from fsdp import FullStateDictConfig, FullyShardedDataParallel as FSDP, MixedPrecision, ShardingStrategy, StateDictType
    from torch.distributed.fsdp import FullStateDictConfig as TorchFullCfg
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import MixedPrecision as TorchMP
    from torch.distributed.fsdp import ShardingStrategy as TorchStrategy
    from torch.distributed.fsdp import StateDictType as TorchType

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 3), nn.BatchNorm1d(3))

    for strategy in ("FULL_SHARD", "NO_SHARD"):
        for kind, offload in (("FULL_STATE_DICT", False), ("FULL_STATE_DICT", True), ("SHARDED_STATE_DICT", False)):
            ours_model, torch_model = model(), model()
            ours = FSDP(
                ours_model,
                mixed_precision=MixedPrecision(buffer_dtype=torch.bfloat16),
                ignored_modules=[ours_model[1]],
                sharding_strategy=ShardingStrategy[strategy],
            )
            theirs = TorchFSDP(
                torch_model,
                mixed_precision=TorchMP(buffer_dtype=torch.bfloat16),
                ignored_modules=[torch_model[1]],
                sharding_strategy=TorchStrategy[strategy],
                device_id=torch.device("cpu"),
            )
            ours_cfg = FullStateDictConfig(offload_to_cpu=offload) if kind == "FULL_STATE_DICT" else None
            # torch FSDP1 fails with offload_to_cpu on a CPU model (its unshard frees what it then
            # reads); its code leaves a buffer already on CPU as it is, which we check on ours.
            torch_cfg = TorchFullCfg(offload_to_cpu=False) if kind == "FULL_STATE_DICT" else None
            with FSDP.state_dict_type(ours, StateDictType[kind], ours_cfg):
                mine = ours.state_dict()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with TorchFSDP.state_dict_type(theirs, TorchType[kind], torch_cfg):
                    torchs = theirs.state_dict()
            assert list(mine) == list(torchs)
            for name in ("running_mean", "running_var", "num_batches_tracked"):
                key, where = f"1.{name}", (strategy, kind, offload, name)
                # torch: the buffer itself as nn.Module returns it (a detached alias: the same
                # storage, never cast, never copied).
                torch_buffer, our_buffer = torch_model[1]._buffers[name], ours_model[1]._buffers[name]
                assert torchs[key].data_ptr() == torch_buffer.data_ptr(), where
                assert mine[key].data_ptr() == our_buffer.data_ptr(), where
                assert mine[key].dtype == torchs[key].dtype and torch.equal(mine[key], torchs[key]), where
            for key in ("3.running_mean", "3.running_var"):  # the unit's own buffers: full precision
                assert mine[key].dtype == torchs[key].dtype == torch.float32, key
                assert torch.equal(mine[key], torchs[key]), key


def test_ignored_buffer_is_returned_itself(pool2: RankPool) -> None:
    pool2.run(ignored_buffer_identity, _timeout=120)


def plain_root_cast_buffers() -> None:
    """bf16 buffers of a unit under a plain root: a load sets their full-precision values.

    As through an FSDP root ([Note: Full-precision buffers in state dicts]): the state dict
    then gives back exactly the loaded fp32 values, not their bf16 rounding.
    """
    from fsdp import FullyShardedDataParallel as FSDP, MixedPrecision

    torch.manual_seed(0)
    unit = FSDP(nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6)), mixed_precision=MixedPrecision(buffer_dtype=torch.bfloat16))
    model = nn.Sequential(unit, nn.Linear(6, 2))
    assert unit.module[1].running_mean.dtype == torch.bfloat16
    state = model.state_dict()
    state["0.1.running_mean"] = torch.full((6,), 1.0 + 2.0**-12)  # not a bf16 value
    state["0.1.running_var"] = torch.full((6,), 3.0 - 2.0**-11)
    result = model.load_state_dict(state)
    assert list(result.missing_keys) == [] and list(result.unexpected_keys) == []
    again = model.state_dict()
    for key in ("0.1.running_mean", "0.1.running_var"):
        assert again[key].dtype == torch.float32 and torch.equal(again[key], state[key]), key
    assert unit.module[1].running_mean.dtype == torch.bfloat16  # still computing in bf16


def test_plain_root_cast_buffers(pool2: RankPool) -> None:
    pool2.run(plain_root_cast_buffers, _timeout=120)


def no_shard_local() -> None:
    """LOCAL_STATE_DICT of NO_SHARD units: FULL entries with torch FSDP1's warning, both ways."""
    from fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy, StateDictType
    from fsdp.wrap import ModuleWrapPolicy
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import ShardingStrategy as TorchStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy

    ours = FSDP(make_toy(seed=1), auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=ShardingStrategy.NO_SHARD)
    theirs = TorchFSDP(
        make_toy(seed=1),
        auto_wrap_policy=TorchPolicy({Block}),
        sharding_strategy=TorchStrategy.NO_SHARD,
        device_id=torch.device("cpu"),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with FSDP.state_dict_type(ours, StateDictType.LOCAL_STATE_DICT):
            mine = ours.state_dict()
    assert any("full_state_dict will be returned" in str(w.message) for w in caught)
    torchs = _sd(theirs, "torch", "LOCAL_STATE_DICT")
    _assert_same_values(mine, torchs, "LOCAL_STATE_DICT")
    target = FSDP(make_toy(seed=2), auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=ShardingStrategy.NO_SHARD)
    _load(target, "ours", "LOCAL_STATE_DICT", torchs)
    loaded = _sd(target, "ours", "FULL_STATE_DICT")
    assert all(torch.equal(loaded[k], torchs[k]) for k in torchs)


def test_no_shard_local(pool2: RankPool) -> None:
    pool2.run(no_shard_local, _timeout=120)
