"""Checkpoints moving between fsdp and torch FSDP1, and sharded state dicts at the wrong world size.

- SHARDED through torch.distributed.checkpoint (DCP) in both directions, at the same and at
  another world size: the loaded parameters equal the saved ones bit for bit (we save DTensors,
  torch FSDP1 ShardedTensors; see [Note: Sharded state dict values]).
- LOCAL files (torch.save per rank) in both directions, bit-exact, with use_orig_params too
  (torch FSDP1's aligned layout); our LOCAL save prints none of torch's ShardedTensor
  deprecation warnings.
- A SHARDED state dict written with plain torch.save at world size 2 and loaded at 1 or 4: our
  error naming the parameter, the saved and the current layout and DCP, nothing changed.

Pools of different sizes share nothing but the directory, so each save and load is its own job.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests._harness import get_pool
from tests._models import Block, make_toy
from tests.test_state_dict_roots import _build, _load, _sd


def _full(model: torch.nn.Module, lib: str) -> dict[str, torch.Tensor]:
    return _sd(model, lib, "FULL_STATE_DICT")


def dcp_save(lib: str, directory: str) -> None:
    """``lib`` saves a SHARDED state dict with DCP; rank 0 also writes the FULL one to compare."""
    import torch.distributed.checkpoint as dcp

    model = _build(lib, "fsdp_root", seed=11)
    full = _full(model, lib)
    state = _sd(model, lib, "SHARDED_STATE_DICT")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's and torch's own deprecation notes
        dcp.save(state, checkpoint_id=os.path.join(directory, "dcp"))
    if dist.get_rank() == 0:
        torch.save(full, os.path.join(directory, "full.pt"))
    dist.barrier()


def dcp_load(lib: str, directory: str) -> None:
    """``lib`` loads the DCP checkpoint into its own SHARDED template: bit-exact parameters."""
    import torch.distributed.checkpoint as dcp

    model = _build(lib, "fsdp_root", seed=12)
    template = _sd(model, lib, "SHARDED_STATE_DICT")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(template, checkpoint_id=os.path.join(directory, "dcp"))
    result = _load(model, lib, "SHARDED_STATE_DICT", template)
    assert list(result.missing_keys) == [] and list(result.unexpected_keys) == []
    expected = torch.load(os.path.join(directory, "full.pt"))
    loaded = _full(model, lib)
    assert list(loaded) == list(expected)
    for key in expected:
        assert torch.equal(loaded[key], expected[key]), key  # copies only: bit for bit


@pytest.mark.parametrize(
    "writer,save_ws,reader,load_ws",
    [
        ("torch", 2, "ours", 2),
        ("ours", 2, "torch", 2),
        ("torch", 2, "ours", 4),
        ("ours", 4, "torch", 2),
        ("ours", 2, "torch", 3),
        ("torch", 3, "ours", 1),
    ],
)
def test_dcp_between_libraries(tmp_path: Any, writer: str, save_ws: int, reader: str, load_ws: int) -> None:
    get_pool(save_ws).run(dcp_save, writer, str(tmp_path), _timeout=300)
    get_pool(load_ws).run(dcp_load, reader, str(tmp_path), _timeout=300)


def local_files_interop(directory: str, orig: bool) -> None:
    """LOCAL state dicts saved per rank by each library load into the other, bit-exact.

    With ``orig`` (use_orig_params) too: both lay out the FlatParameter with torch FSDP1's
    16-byte alignment padding, so the files hold the same shards and torch's load into ours
    (torch FSDP1 itself loads no LOCAL state dict with use_orig_params).
    """
    rank = dist.get_rank()
    paths = {lib: os.path.join(directory, f"{lib}_local_{rank}.pt") for lib in ("ours", "torch")}
    sources = {lib: _build(lib, "fsdp_root", seed=21 if lib == "ours" else 22, orig=orig) for lib in paths}
    for lib, model in sources.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state = _sd(model, lib, "LOCAL_STATE_DICT") if lib == "torch" else _our_local_sd(model)
        if lib == "ours":  # our own ShardedTensor construction stays quiet
            assert not [w for w in caught if "ShardedTensor" in str(w.message)], [str(w.message) for w in caught]
        torch.save(state, paths[lib])
    if orig:
        # torch FSDP1 cannot load any LOCAL state dict with use_orig_params, not even its own
        # (its _flat_param is no registered parameter then): only ours reads the files.
        with pytest.raises(RuntimeError, match=r"Unexpected key\(s\) in state_dict: .*_flat_param"):
            _load(_build("torch", "fsdp_root", seed=23, orig=orig), "torch", "LOCAL_STATE_DICT", torch.load(paths["torch"], weights_only=False))
    pairs = [("torch", "ours"), ("ours", "ours")] if orig else [("torch", "ours"), ("ours", "torch")]
    for writer, reader in pairs:
        target = _build(reader, "fsdp_root", seed=23, orig=orig)
        _load(target, reader, "LOCAL_STATE_DICT", torch.load(paths[writer], weights_only=False))
        expected, loaded = _full(sources[writer], writer), _full(target, reader)
        assert list(loaded) == list(expected)
        assert all(torch.equal(loaded[k], expected[k]) for k in expected), (writer, reader)


def _our_local_sd(model: torch.nn.Module) -> dict[str, Any]:
    from fsdp import FullyShardedDataParallel as FSDP, StateDictType

    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        return model.state_dict()


@pytest.mark.parametrize("world_size,orig", [(2, False), (2, True), (4, True)])
def test_local_files_between_libraries(tmp_path: Any, world_size: int, orig: bool) -> None:
    get_pool(world_size).run(local_files_interop, str(tmp_path), orig, _timeout=300)


def torch_save_sharded(directory: str) -> None:
    """Our SHARDED state dicts written with plain torch.save, one file per rank: the model built
    without a mesh (ShardedTensors, torch FSDP1's type) and with a 1-D mesh (DTensors)."""
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp import FullyShardedDataParallel as FSDP
    from fsdp.wrap import ModuleWrapPolicy

    model = _build("ours", "fsdp_root", seed=31)
    torch.save(_sd(model, "ours", "SHARDED_STATE_DICT"), os.path.join(directory, f"ours_sharded_{dist.get_rank()}.pt"))
    meshed = FSDP(make_toy(seed=31), auto_wrap_policy=ModuleWrapPolicy({Block}), device_mesh=init_device_mesh("cpu", (2,)))
    path = os.path.join(directory, f"ours_sharded_mesh_{dist.get_rank()}.pt")
    torch.save(_sd(meshed, "ours", "SHARDED_STATE_DICT"), path)
    dist.barrier()


def wrong_world_size_load(directory: str) -> None:
    """Loading a 2-rank SHARDED torch.save file here. ShardedTensors refuse to unpickle at another
    world size themselves (torch's error, as for torch FSDP1's files); DTensors unpickle, and
    loading them gives our error, and nothing changed."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    with pytest.raises(RuntimeError, match=r"Local (world size|rank) at save time was \d, but at load time was \d"):
        torch.load(os.path.join(directory, f"ours_sharded_{rank % 2}.pt"), weights_only=False)
    model = _build("ours", "fsdp_root", seed=32)
    before = _full(model, "ours")
    saved = torch.load(os.path.join(directory, f"ours_sharded_mesh_{rank % 2}.pt"), weights_only=False)
    all_ranks = list(range(ws))
    with pytest.raises(
        RuntimeError,
        match=(
            r"fsdp: cannot load '(embed|blocks\.0\.norm)\.weight' \(shape \(\d+, 7\)|\(7,\)\): it was saved as a "
            r"DTensor over 2 rank\(s\) \[0, 1\] with placements \[Shard\(dim=0\)\] and local shard shape "
            rf"\(\d+(, 7)?,?\) on this rank, but this model shards it over {ws} rank\(s\) {all_ranks}.*"
            r"save and load it with torch.distributed.checkpoint"
        ),
    ):
        _load(model, "ours", "SHARDED_STATE_DICT", saved)
    after = _full(model, "ours")
    assert all(torch.equal(before[k], after[k]) for k in before), "nothing changed"


@pytest.mark.parametrize("load_ws", [1, 4])
def test_sharded_torch_save_at_another_world_size(tmp_path: Any, load_ws: int) -> None:
    get_pool(2).run(torch_save_sharded, str(tmp_path), _timeout=120)
    get_pool(load_ws).run(wrong_world_size_load, str(tmp_path), _timeout=120)
