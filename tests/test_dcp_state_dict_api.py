"""``torch.distributed.checkpoint.state_dict`` on fsdp models, with torch FSDP1 as the oracle.

Torch's DCP state-dict API (``get_state_dict``, ``set_state_dict``, ``get/set_model_state_dict``,
``get/set_optimizer_state_dict``) recognises fsdp's units as FSDP1 units ([Note: DCP state-dict
bridge] in docs/stacks.md), both ways a user gets there:

* the import switch (``from fsdp import FullyShardedDataParallel``, no other call: the rank
  pools import fsdp before torch's state-dict module, and :func:`test_bridge_when_torch_module_came_first`
  checks the other order), and
* ``fsdp.redirect_torch_fsdp()`` (:func:`test_redirect_round_trips_with_torch_fsdp1`, in fresh
  processes: the redirect changes ``sys.modules``).

The same model, seeds, data and calls go through torch FSDP1 and fsdp. Checked: the keys and
their order, the value types (torch's ShardedTensor is our DTensor: [Note: Sharded state dict
values]), the values bit for bit, what ``set_*`` returns and raises, and resumed training: a
state dict (or a DCP checkpoint) taken after training, loaded into a fresh model and optimizer,
gives the continuous run's next losses bit for bit, across the libraries in both directions.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
from torch import nn

from tests._harness import ends_cleanly, get_pool
from tests._models import Block, global_batch, lm_loss, local_rows, make_toy
from tests._preloaded import start_python
from tests.test_state_dict_roots import _local_part

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# StateDictOptions per case; "frozen" runs on a model whose first block is frozen.
OPTIONS: Dict[str, Dict[str, bool]] = {
    "sharded": {},
    "sharded_cpu_offload": {"cpu_offload": True},
    "full": {"full_state_dict": True},
    "full_cpu_offload": {"full_state_dict": True, "cpu_offload": True},
    "frozen": {"ignore_frozen_params": True},
}


def _wrap(fsdp_cls: Any, policy_cls: Any, orig: bool, seed: int, frozen: bool, **kw: Any) -> nn.Module:
    """ToyLM with its blocks as units under an FSDP root (``fsdp_cls`` is either library's)."""
    model = make_toy(seed=seed)
    if frozen:
        model.blocks[0].requires_grad_(False)
    return fsdp_cls(model, auto_wrap_policy=policy_cls({Block}), use_orig_params=orig, **kw)


_MESHES: Dict[int, Any] = {}


def _model(lib: str, orig: bool, seed: int, frozen: bool = False, case: str = "") -> nn.Module:
    """``case == "hybrid"``: HYBRID_SHARD over a (2, 2) mesh (world size 4)."""
    kw: Dict[str, Any] = {}
    if case == "hybrid":
        from torch.distributed.device_mesh import init_device_mesh

        if 4 not in _MESHES:
            _MESHES[4] = init_device_mesh("cpu", (2, 2))
        kw["device_mesh"] = _MESHES[4]
    if lib == "ours":
        from fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
        from fsdp.wrap import ModuleWrapPolicy

        if kw:
            kw["sharding_strategy"] = ShardingStrategy.HYBRID_SHARD
        return _wrap(FSDP, ModuleWrapPolicy, orig, seed, frozen, **kw)
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import ShardingStrategy as TorchStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy

    if kw:
        kw["sharding_strategy"] = TorchStrategy.HYBRID_SHARD
    return _wrap(TorchFSDP, TorchPolicy, orig, seed, frozen, device_id=torch.device("cpu"), **kw)


def _optim(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)


def _train(model: nn.Module, optim: torch.optim.Optimizer, steps: range) -> List[float]:
    """AdamW steps on this rank's rows of each step's global batch; the losses."""
    import torch.distributed as dist

    rank, ws = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in steps:
        tokens, targets = global_batch(step, ws)
        loss = lm_loss(model(local_rows(tokens, rank, ws)), local_rows(targets, rank, ws))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def _assert_same(ours: Any, theirs: Any, path: str = "") -> None:
    """Same structure, keys (in order), types and values (a ShardedTensor: the same metadata,
    local shards and data)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(theirs, ShardedTensor):
        assert isinstance(ours, ShardedTensor), (path, type(ours))
        assert ours.metadata() == theirs.metadata(), (path, ours.metadata(), theirs.metadata())
        assert [s.metadata for s in ours.local_shards()] == [s.metadata for s in theirs.local_shards()], path
        assert _local_part(ours).device == _local_part(theirs).device, path
        assert torch.equal(_local_part(ours), _local_part(theirs)), path  # same arithmetic: bit-exact
    elif isinstance(theirs, torch.Tensor):
        assert type(ours) is type(theirs) and ours.dtype == theirs.dtype, (path, type(ours), type(theirs))
        assert ours.device == theirs.device and torch.equal(ours, theirs), path
    elif isinstance(theirs, dict):
        assert isinstance(ours, dict) and list(ours) == list(theirs), (path, list(ours), list(theirs))
        for key in theirs:
            _assert_same(ours[key], theirs[key], f"{path}.{key}")
    elif isinstance(theirs, (list, tuple)):
        assert type(ours) is type(theirs) and len(ours) == len(theirs), path
        for i, (a, b) in enumerate(zip(ours, theirs)):
            _assert_same(a, b, f"{path}[{i}]")
    else:
        assert ours == theirs, (path, ours, theirs)


def _copied(state: Any) -> Any:
    """``state`` with its plain tensors cloned (sharded values are copies already)."""
    from torch.utils._pytree import tree_map_only

    return tree_map_only(torch.Tensor, lambda t: t.clone() if type(t) is torch.Tensor else t, state)


def _options(**kw: bool) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(**kw)


def _get(model: nn.Module, optim: torch.optim.Optimizer, case: str) -> Tuple[dict, dict]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    return get_state_dict(model, optim, options=_options(**OPTIONS.get(case, {})))


def _set(model: nn.Module, optim: torch.optim.Optimizer, msd: dict, osd: dict, case: str) -> Any:
    """Loads as a user would: a full CPU-offloaded state dict exists on rank 0 only, so it is
    broadcast from there (model and optimizer separately: ``set_state_dict`` with an empty dict
    on the other ranks skips the model there and hangs, for torch FSDP1 as for any model)."""
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
        set_state_dict,
    )

    if case == "full_cpu_offload":
        options = _options(full_state_dict=True, broadcast_from_rank0=True)
        result = set_model_state_dict(model, msd, options=options)
        set_optimizer_state_dict(model, optim, osd, options=options)
        return result
    # Without its frozen parameters a state dict loads only with strict=False (torch's rule).
    options = _options(**OPTIONS.get(case, {}), strict=case != "frozen")
    return set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd, options=options)


def api_parity(orig: bool, frozen: bool) -> None:
    """Every option through both libraries: same state dicts, loads that resume exactly."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    warnings.simplefilter("ignore")  # torch FSDP1's and DCP's deprecation warnings
    cases = ["frozen", "sharded"] if frozen else [c for c in OPTIONS if c != "frozen"]
    trained: Dict[str, Tuple[nn.Module, torch.optim.Optimizer]] = {}
    for lib in ("torch", "ours"):
        model = _model(lib, orig, seed=3, frozen=frozen)
        optim = _optim(model)
        _train(model, optim, range(2))
        trained[lib] = (model, optim)
    resumed: Dict[Tuple[str, str], List[float]] = {}
    for case in cases:
        ours_msd, ours_osd = _get(*trained["ours"], case)
        # torch FSDP1 cannot gather a CPU-offloaded full state dict on CPU ranks (it fails in
        # _flat_param.py, see docs/stacks.md); its documented result is the full state dict on
        # rank 0 and empty dicts elsewhere, which its offload-free full state dict gives.
        torch_case = "full" if case == "full_cpu_offload" else case
        torch_msd, torch_osd = _get(*trained["torch"], torch_case)
        if case == "full_cpu_offload" and dist.get_rank() != 0:
            torch_msd, torch_osd = {}, {}
        _assert_same(ours_msd, torch_msd, f"{case}:model")
        _assert_same(ours_osd, torch_osd, f"{case}:optim")
        _assert_same(get_model_state_dict(trained["ours"][0], options=_options(**OPTIONS[case])), ours_msd)
        _assert_same(get_optimizer_state_dict(*trained["ours"], options=_options(**OPTIONS[case])), ours_osd)
        # Loaded into a fresh model and optimizer of each library, each resumes exactly.
        loaded = {}
        # torch FSDP1's optimizer state dict shares storage with its optimizer at world size 1
        # (docs/design.md), so a fresh optimizer loaded from it would move the original's: load a copy.
        torch_copy = _copied(torch_msd), _copied(torch_osd)
        for lib, (msd, osd) in (("ours", (ours_msd, ours_osd)), ("torch", torch_copy)):
            fresh = _model(lib, orig, seed=4, frozen=frozen)
            fresh_optim = _optim(fresh)
            loaded[lib] = _set(fresh, fresh_optim, msd, osd, case)
            resumed[(case, lib)] = _train(fresh, fresh_optim, range(2, 4))
        assert loaded["ours"] == loaded["torch"], (case, loaded)
        frozen_keys = [k for k, p in make_toy().named_parameters() if k.startswith("blocks.0.")]
        assert list(loaded["ours"].missing_keys) == (frozen_keys if case == "frozen" else []), loaded
    continuous = {lib: _train(*trained[lib], range(2, 4)) for lib in trained}
    assert continuous["ours"] == continuous["torch"]
    for (case, lib), losses in resumed.items():
        # With frozen blocks ignored, the fresh model keeps its own (seed 4) frozen block.
        if case != "frozen":
            assert losses == continuous[lib], (case, lib, losses, continuous[lib])
    if frozen:
        assert resumed[("frozen", "ours")] == resumed[("frozen", "torch")]


def strict_and_errors(orig: bool) -> None:
    """strict=False reports what torch reports; strict=True raises torch's error and changes
    nothing; a model with units of both libraries is refused before anything is gathered."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_model_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    from fsdp import FullyShardedDataParallel as FSDP

    warnings.simplefilter("ignore")
    results, errors = {}, {}
    for lib in ("torch", "ours"):
        model = _model(lib, orig, seed=5)
        state = get_model_state_dict(model)
        del state["head.weight"]
        results[lib] = set_model_state_dict(model, dict(state), options=_options(strict=False))
        before = get_model_state_dict(model, options=_options(full_state_dict=True))
        with pytest.raises(RuntimeError) as caught:
            set_model_state_dict(model, dict(state))
        errors[lib] = str(caught.value)
        if lib == "ours":  # checked before anything is loaded
            _assert_same(get_model_state_dict(model, options=_options(full_state_dict=True)), before)
    assert results["ours"] == results["torch"] and list(results["ours"].missing_keys) == ["head.weight"]
    assert errors["ours"] == errors["torch"], errors

    mixed = make_toy(seed=6)
    mixed.blocks[0] = TorchFSDP(mixed.blocks[0], use_orig_params=orig, device_id=torch.device("cpu"))
    mixed.blocks[1] = FSDP(mixed.blocks[1], use_orig_params=orig)
    optim = _optim(mixed)
    with pytest.raises(ValueError, match="holds units of both fsdp and torch's FSDP1"):
        get_state_dict(mixed, optim)
    assert optim.state == {}  # refused before DCP initialised the optimizer's state


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_state_dict_api_matches_torch_fsdp1(world_size: int) -> None:
    def run(orig: bool, frozen: bool) -> None:
        get_pool(world_size).run(api_parity, orig, frozen, _timeout=300)

    for orig in (False, True):
        run(orig, frozen=False)
        if world_size == 2:
            run(orig, frozen=True)


def test_strict_and_mixed_libraries_error() -> None:
    for orig in (False, True):
        get_pool(2).run(strict_and_errors, orig, _timeout=120)


# ------------------------------------------------------------------ DCP checkpoints, resumed

PAIRS = [("ours", "ours"), ("torch", "ours"), ("ours", "torch")]


def dcp_resume(directory: str, cases: List[str]) -> None:
    """Train 3 steps, save with DCP, train 2 more; a fresh model of either library loads the
    checkpoint and its 2 steps give the same losses, bit for bit (torch FSDP1 writing or reading)."""
    import torch.distributed.checkpoint as dcp

    warnings.simplefilter("ignore")
    # A case changes the writers' run only through its model (hybrid's mesh): the cases on the
    # same model share one run per writer, which saves each case's checkpoint at step 3.
    by_model: Dict[str, List[str]] = {}
    for case in cases:
        by_model.setdefault("hybrid" if case == "hybrid" else "", []).append(case)
    for orig in (False, True):
        for kind, same_model in by_model.items():
            continuous = {}
            for writer in ("torch", "ours"):
                model = _model(writer, orig, seed=7, case=kind)
                optim = _optim(model)
                _train(model, optim, range(3))
                for case in same_model:
                    msd, osd = _get(model, optim, case)
                    path = os.path.join(directory, f"{writer}-{orig}-{case}")
                    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
                continuous[writer] = _train(model, optim, range(3, 5))
            assert continuous["ours"] == continuous["torch"], (orig, same_model)
            for case, (writer, reader) in ((c, p) for c in same_model for p in PAIRS):
                model = _model(reader, orig, seed=8, case=case)
                optim = _optim(model)
                msd, osd = _get(model, optim, case)
                state = {"model": msd, "optim": osd}
                dcp.load(state, checkpoint_id=os.path.join(directory, f"{writer}-{orig}-{case}"))
                _set(model, optim, state["model"], state["optim"], case)
                assert _train(model, optim, range(3, 5)) == continuous[writer], (orig, case, writer, reader)


# "hybrid": HYBRID_SHARD on a (2, 2) mesh. Torch FSDP1 gives DTensors on that 2-D mesh
# (Replicate(), Shard(0)), fsdp on the 1-D shard group (Shard(0)): the same pieces, and DCP moves
# checkpoints between them exactly.
@pytest.mark.parametrize("world_size,cases", [(2, ["sharded", "full"]), (4, ["sharded", "hybrid"])])
def test_dcp_checkpoint_resumes_exactly_across_libraries(tmp_path: Any, world_size: int, cases: List[str]) -> None:
    get_pool(world_size).run(dcp_resume, str(tmp_path), cases, _timeout=300)


# ------------------------------------------------------------------ the redirect, fresh processes

_REDIRECT_CHILD = r"""
import json, os, sys, warnings
warnings.simplefilter("ignore")
import fsdp
fsdp.redirect_torch_fsdp()  # first, as docs/stacks.md says
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from tests.test_dcp_state_dict_api import _get, _optim, _set, _train, _wrap
assert FSDP is fsdp.FullyShardedDataParallel
directory = sys.argv[1]
dist.init_process_group("gloo")
out = {}
for orig in (False, True):
    model = _wrap(FSDP, ModuleWrapPolicy, orig, seed=7, frozen=False)
    optim = _optim(model)
    _train(model, optim, range(3))
    msd, osd = _get(model, optim, "sharded")
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(directory, f"redirect-{orig}"))
    out[f"continuous-{orig}"] = _train(model, optim, range(3, 5))
    model = _wrap(FSDP, ModuleWrapPolicy, orig, seed=8, frozen=False)
    optim = _optim(model)
    msd, osd = _get(model, optim, "sharded")
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=os.path.join(directory, f"torch-{orig}-sharded"))
    _set(model, optim, state["model"], state["optim"], "sharded")
    out[f"from_torch-{orig}"] = _train(model, optim, range(3, 5))
dist.destroy_process_group()
if int(os.environ["RANK"]) == 0:
    print(json.dumps(out))
"""


def _run_ranks(code: str, args: List[str], world_size: int) -> Optional[Dict[str, Any]]:
    """Runs ``code`` as ``world_size`` fresh processes (env:// rendezvous); rank 0's JSON line.

    Each is a fork of an interpreter that imported torch alone ([Note: Test commands forked from
    a preloaded interpreter] in tests/_preloaded.py): what these children check is the order of
    fsdp and torch's FSDP1 and state-dict modules, which ``import torch`` loads none of."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    ranks = []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, OMP_NUM_THREADS="1")
        env["PYTHONPATH"] = os.pathsep.join([REPO_ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
        ranks.append(start_python(["-c", ends_cleanly(code), *args], env=env, cwd=REPO_ROOT))
    outputs = [r.wait(timeout=240) for r in ranks]
    for rank, proc in enumerate(outputs):
        assert proc.returncode == 0, f"rank {rank} failed:\n{proc.stdout}\n{proc.stderr}"
    lines = outputs[0].stdout.strip().splitlines()
    return json.loads(lines[-1]) if lines else None


def torch_side(directory: str, phase: str) -> Dict[str, List[float]]:
    """torch FSDP1 writes ``torch-*`` (phase "save") or resumes from ``redirect-*`` ("load")."""
    import torch.distributed.checkpoint as dcp

    warnings.simplefilter("ignore")
    out = {}
    for orig in (False, True):
        model = _model("torch", orig, seed=7 if phase == "save" else 8)
        optim = _optim(model)
        if phase == "save":
            _train(model, optim, range(3))
            msd, osd = _get(model, optim, "sharded")
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(directory, f"torch-{orig}-sharded"))
        else:
            msd, osd = _get(model, optim, "sharded")
            state = {"model": msd, "optim": osd}
            dcp.load(state, checkpoint_id=os.path.join(directory, f"redirect-{orig}"))
            _set(model, optim, state["model"], state["optim"], "sharded")
        out[str(orig)] = _train(model, optim, range(3, 5))
    return out


def test_redirect_round_trips_with_torch_fsdp1(tmp_path: Any) -> None:
    """After ``fsdp.redirect_torch_fsdp()`` (torch's state-dict module then binds fsdp's wrapper
    and failed in ``_verify_state_dict``): DCP checkpoints resume exactly, to and from torch FSDP1."""
    pool = get_pool(2)
    torch_continuous = pool.run(torch_side, str(tmp_path), "save", _timeout=300)[0]
    redirect = _run_ranks(_REDIRECT_CHILD, [str(tmp_path)], 2)
    assert redirect is not None
    torch_resumed = pool.run(torch_side, str(tmp_path), "load", _timeout=300)[0]
    for orig in (False, True):
        expected = torch_continuous[str(orig)]
        assert redirect[f"continuous-{orig}"] == expected, orig
        assert redirect[f"from_torch-{orig}"] == expected, orig
        assert torch_resumed[str(orig)] == expected, orig


_ORDER_CHILD = r"""
import json, warnings
warnings.simplefilter("ignore")
import torch.distributed.checkpoint.state_dict as dsd  # torch's module first, then fsdp
import torch, torch.distributed as dist
from fsdp import FullyShardedDataParallel as FSDP
from fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import DTensor
from tests.test_dcp_state_dict_api import _optim, _train, _wrap
dist.init_process_group("gloo")
model = _wrap(FSDP, ModuleWrapPolicy, False, seed=7, frozen=False)
optim = _optim(model)
_train(model, optim, range(1))
msd, osd = dsd.get_state_dict(model, optim)
if dist.get_rank() == 0:
    print(json.dumps({"model": {k: type(v).__name__ for k, v in msd.items()}, "optim": sorted(osd["state"])}))
dist.destroy_process_group()
"""


def test_bridge_when_torch_module_came_first() -> None:
    """torch's state-dict module imported before fsdp: ``import fsdp`` patches it at once."""
    out = _run_ranks(_ORDER_CHILD, [], 2)
    assert out is not None
    names = [k for k, _ in make_toy().named_parameters()]
    assert list(out["model"]) == names and set(out["model"].values()) == {"ShardedTensor"}  # as torch FSDP1 gives
    assert out["optim"] == sorted(names)
