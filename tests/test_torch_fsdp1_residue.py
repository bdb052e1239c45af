"""What torch FSDP1 gives that user code reads, compared with torch FSDP1 itself (issue 31, item 6):

- the handle's ``_sharding_strategy`` and ``uses_sharded_strategy`` (torch's private
  ``HandleShardingStrategy`` compares equal to ours, [Note: A handle's strategy equals torch's]);
- the NO_SHARD state-dict UserWarnings on saves and loads of every state-dict type, FULL too
  ([Note: NO_SHARD state-dict warnings]), the same texts, categories and counts;
- ``FullyShardedDataParallel.get_state_dict_type`` refusing LOCAL_STATE_DICT on a model built
  with a ``device_mesh`` (torch's RuntimeError and sentence);
- the warning torch gives when a meta module's ``reset_parameters()`` fails at construction;
- the ``device_id`` without an index warning (torch's sentence; the CUDA calls stubbed on CPU);
- the optimizer state dict warnings.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests._harness import RankPool
from tests.test_optim_state_dict import _lib, _optim, _train, _wrap


def _caught(fn: Callable[[], Any], about: str = "") -> list[tuple[str, str]]:
    """The (category, message) of every warning ``fn`` gives that mentions ``about``, in order."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [(w.category.__name__, str(w.message)) for w in caught if about in str(w.message)]


# ----------------------------------------------------------------------------- the handle
def handle_strategy() -> int:
    """Each strategy at this world size (hybrid ones on a (1, world size) mesh): the handles'
    ``_sharding_strategy`` equals torch's, both ways, as torch's own code compares it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp._flat_param import RESHARD_AFTER_FORWARD_HANDLE_STRATEGIES
    from torch.distributed.fsdp._flat_param import HandleShardingStrategy as TorchHandleStrategy

    ws = dist.get_world_size()
    checked = 0
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"):
        handles = {}
        for lib in ("ours", "torch"):
            m, _ = _lib(lib)
            kwargs: dict[str, Any] = {"sharding_strategy": m.ShardingStrategy[strategy]}
            if strategy.lstrip("_").startswith("HYBRID"):
                kwargs["device_mesh"] = init_device_mesh("cpu", (1, ws))
            if lib == "torch":
                kwargs["device_id"] = torch.device("cpu")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # world size 1 and NO_SHARD's warnings: tests/test_torch_messages.py
                model = m.FullyShardedDataParallel(nn.Linear(4, 4), **kwargs)
            handles[lib] = model._handle
            if lib == "ours":
                assert model._handle._sharding_strategy.name == model.sharding_strategy.name, strategy
        ours, theirs = handles["ours"], handles["torch"]
        if ws == 1 and strategy.lstrip("_").startswith("HYBRID"):
            # torch FSDP1 switches a hybrid unit whose shard group has one rank to NO_SHARD;
            # fsdp keeps the hybrid strategy, and its handle says what its wrapper says (above).
            assert theirs._sharding_strategy.name == "NO_SHARD" and ours.uses_sharded_strategy
            continue
        assert ours._sharding_strategy == theirs._sharding_strategy, (strategy, ours._sharding_strategy, theirs._sharding_strategy)
        assert theirs._sharding_strategy == ours._sharding_strategy
        assert ours._sharding_strategy.name == theirs._sharding_strategy.name
        assert ours._sharding_strategy == TorchHandleStrategy[theirs._sharding_strategy.name]
        assert not ours._sharding_strategy != theirs._sharding_strategy
        others = [s for s in TorchHandleStrategy if s.name != theirs._sharding_strategy.name]
        assert all(ours._sharding_strategy != s for s in others)
        assert (ours._sharding_strategy in RESHARD_AFTER_FORWARD_HANDLE_STRATEGIES) == (
            theirs._sharding_strategy in RESHARD_AFTER_FORWARD_HANDLE_STRATEGIES
        )
        assert ours._sharding_strategy in {theirs._sharding_strategy}
        assert ours.uses_sharded_strategy is theirs.uses_sharded_strategy, strategy
        checked += 1
    return checked


@pytest.mark.parametrize("dist_pool", [1, 2], indirect=True)
def test_handle_sharding_strategy(dist_pool: RankPool) -> None:
    assert dist_pool.run(handle_strategy) == [5 if dist_pool.world_size > 1 else 3] * dist_pool.world_size


# ----------------------------------------------------------------------------- state dicts
def no_shard_state_dict_warnings() -> int:
    """Saves and loads of each state-dict type, NO_SHARD and FULL_SHARD: torch FSDP1's
    NO_SHARD warnings, the same texts and counts (one before and one after each unit's part)."""
    checked = 0
    for strategy in ("NO_SHARD", "FULL_SHARD"):
        for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT"):
            seen = {}
            for lib in ("ours", "torch"):
                m, _ = _lib(lib)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    model = _wrap(lib, strategy, False)
                    m.FullyShardedDataParallel.set_state_dict_type(model, m.StateDictType[kind])
                out: dict[str, Any] = {}
                saved = _caught(lambda: out.update(sd=model.state_dict()), "NO_SHARD")
                loaded = _caught(lambda: model.load_state_dict(out["sd"]), "NO_SHARD")
                seen[lib] = (saved, loaded)
            assert seen["ours"] == seen["torch"], (strategy, kind, seen)
            units = 4  # the root and three blocks
            expected = 2 * units if strategy == "NO_SHARD" else 0
            assert [len(x) for x in seen["ours"]] == [expected, expected], (strategy, kind, seen["ours"])
            checked += 1
    return checked


def test_no_shard_state_dict_warnings(pool2: RankPool) -> None:
    assert pool2.run(no_shard_state_dict_warnings) == [6, 6]


def local_with_mesh() -> int:
    """``get_state_dict_type`` under LOCAL_STATE_DICT with a ``device_mesh``: torch's
    RuntimeError and sentence; without a mesh, or under SHARDED, the settings."""
    seen = {}
    for lib in ("ours", "torch"):
        m, _ = _lib(lib)
        cls = m.FullyShardedDataParallel
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = _wrap(lib, "FULL_SHARD", False, mesh=True)
            plain = _wrap(lib, "FULL_SHARD", False)
            cls.set_state_dict_type(model, m.StateDictType.SHARDED_STATE_DICT)
            assert cls.get_state_dict_type(model).state_dict_type is m.StateDictType.SHARDED_STATE_DICT
            cls.set_state_dict_type(model, m.StateDictType.LOCAL_STATE_DICT)
            cls.set_state_dict_type(plain, m.StateDictType.LOCAL_STATE_DICT)
        assert cls.get_state_dict_type(plain).state_dict_type is m.StateDictType.LOCAL_STATE_DICT
        with pytest.raises(RuntimeError) as raised:
            cls.get_state_dict_type(model)
        seen[lib] = str(raised.value)
    sentence = "DeviceMesh is not compatible with LOCAL_STATE_DICT."
    assert sentence in seen["torch"] and seen["torch"].split(sentence)[0] in seen["ours"], seen
    assert sentence in seen["ours"] and "get_state_dict_type()" in seen["ours"], seen
    return 1


def test_get_state_dict_type_local_with_mesh(pool2: RankPool) -> None:
    assert pool2.run(local_with_mesh) == [1, 1]


# ----------------------------------------------------------------------------- construction
class _NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(3, device="meta"))


class _FailingReset(_NoReset):
    def reset_parameters(self) -> None:
        raise RuntimeError("boom")


def reset_parameters_warning() -> int:
    """A meta module whose ``reset_parameters()`` is missing or raises: torch FSDP1's
    UserWarning (its text) and its exception type (AttributeError; fsdp's is a ValueError too,
    raised before anything changes, with the remedy)."""
    checked = 0
    for module_type, error in ((_NoReset, AttributeError), (_FailingReset, RuntimeError)):
        seen = {}
        for lib in ("ours", "torch"):
            m, _ = _lib(lib)
            kwargs = {"device_id": torch.device("cpu")} if lib == "torch" else {}
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with pytest.raises(error) as raised:
                    m.FullyShardedDataParallel(module_type(), **kwargs)
            seen[lib] = [(w.category, str(w.message)) for w in caught if "reset_parameters" in str(w.message)]
            if lib == "torch":
                assert str(raised.value) in str(seen["ours"][0][1])  # torch's error in both warnings
        assert seen["ours"] == seen["torch"] and len(seen["ours"]) == 1, seen
        checked += 1
    return checked


def test_reset_parameters_warning(pool1: RankPool) -> None:
    assert pool1.run(reset_parameters_warning) == [2]


def test_device_id_without_index_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    """``device_id="cuda"`` (no index): torch FSDP1's UserWarning, word for word (the CUDA
    calls stubbed: this runs on CPU), naming the rank and the current device it then uses."""
    from torch.distributed.fsdp._init_utils import _get_device_from_device_id

    from fsdp.init._device import parse_device_id

    class _Handle:
        @staticmethod
        def current_device() -> int:
            return 1

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    for device_id in ("cuda", torch.device("cuda")):
        seen = {}
        for lib, call in (
            ("ours", lambda: parse_device_id(device_id, rank=3)),
            ("torch", lambda: _get_device_from_device_id(device_id, 3, _Handle())),  # type: ignore[arg-type]
        ):
            device = None
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    device = call()
                except RuntimeError:  # torch's torch.device(1) needs an accelerator: after its warning
                    assert lib == "torch" and not torch.accelerator.is_available()
            seen[lib] = ([(w.category, str(w.message)) for w in caught], device)
        assert seen["ours"][0] == seen["torch"][0] and len(seen["ours"][0]) == 1, seen
        assert seen["ours"][1] == torch.device("cuda", 1), seen


# ----------------------------------------------------------------------------- optimizer state
def user_defined_optim_state() -> int:
    """An optimizer holding state under a key that is no parameter ([Note: User-defined
    optimizer state]): torch FSDP1's UserWarning on the save (text, category, count), the entry
    copied as it is into the saved and the loadable state dicts, and loaded back, as torch's."""
    checked = 0
    for uop in (False, True):
        for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
            seen: dict[str, Any] = {}
            for lib in ("ours", "torch"):
                m, _ = _lib(lib)
                cls = m.FullyShardedDataParallel
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    model = _wrap(lib, "FULL_SHARD", uop)
                    cls.set_state_dict_type(model, m.StateDictType[kind])
                optim = _optim("adam", model, uop)
                _train(model, optim, range(1))
                optim.state["user_counter"] = {"n": torch.tensor(3)}  # type: ignore[index]
                saved: dict[str, Any] = {}
                about = "Found a optim state"
                warned = _caught(lambda: saved.update(cls.optim_state_dict(model, optim)), about)
                loadable: dict[str, Any] = {}
                warned_load = _caught(lambda: loadable.update(cls.optim_state_dict_to_load(model, optim, saved)), about)
                del optim.state["user_counter"]  # type: ignore[arg-type]
                optim.load_state_dict(loadable)
                seen[lib] = (warned, warned_load, saved["state"]["user_counter"], loadable["state"]["user_counter"],
                             optim.state["user_counter"])  # type: ignore[index]
            ours, theirs = seen["ours"], seen["torch"]
            assert ours[:2] == theirs[:2] and len(ours[0]) == 1 and not ours[1], (uop, kind, ours[:2], theirs[:2])
            for mine, ref in zip(ours[2:], theirs[2:]):
                assert list(mine) == list(ref) == ["n"] and torch.equal(mine["n"], ref["n"]), (uop, kind)
            checked += 1
    return checked


def test_user_defined_optim_state(pool2: RankPool) -> None:
    assert pool2.run(user_defined_optim_state) == [4, 4]
