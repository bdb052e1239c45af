"""Contract: ``FSDP(..., process_group=pg)`` uses only ``pg``, as torch FSDP1 does.

The default process group is never initialized here: two fresh processes build a
``ProcessGroup`` straight from a ``FileStore`` (what frameworks that manage their own groups
do), and torch FSDP1 and ours train the same model on the same data over that group. Both must
construct, train (FULL_SHARD with nested units, plus ``no_sync``, ``summon_full_params`` and
``clip_grad_norm_``) and produce a FULL state dict; the results must agree bit for bit (the same
reductions in the same order on gloo) and the default group must still be uninitialized at the
end. ``sync_module_states`` (a broadcast over ``pg``) runs for ours only: torch FSDP1 refuses it
for CPU modules.

The pytest harness pools initialize the default group, so this runs in a subprocess with its own
two forked ranks, bounded by a timeout.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

_REPO = Path(__file__).resolve().parent.parent
_STEPS = 3


def _store_group(path: str, rank: int, world_size: int) -> dist.ProcessGroup:
    """A gloo ProcessGroup built from a FileStore, unknown to c10d (no init_process_group)."""
    store = dist.FileStore(path, world_size)
    backend = dist.ProcessGroupGloo(store, rank, world_size)
    group = dist.ProcessGroup(store, rank, world_size)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    return group


def _train(lib: str, group: dist.ProcessGroup, rank: int, world_size: int) -> dict[str, Any]:
    from tests._models import Block, global_batch, lm_loss, local_rows, make_toy

    if lib == "ours":
        from fsdp import FullyShardedDataParallel as F
        from fsdp.wrap import ModuleWrapPolicy

        extra: dict[str, Any] = {}
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as F  # type: ignore[assignment]
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy  # type: ignore[assignment]

        extra = {"device_id": torch.device("cpu")}
    model = F(make_toy(), process_group=group, auto_wrap_policy=ModuleWrapPolicy({Block}), **extra)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, norms = [], []
    for step in range(_STEPS):
        tokens, targets = global_batch(step, world_size)
        x, y = local_rows(tokens, rank, world_size), local_rows(targets, rank, world_size)
        if step == 1:  # accumulate one micro-batch locally, then a synchronized one
            with model.no_sync():
                lm_loss(model(x), y).backward()
        loss = lm_loss(model(x), y)
        loss.backward()
        norms.append(model.clip_grad_norm_(1.0).detach().clone())
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    with F.summon_full_params(model, writeback=False):
        summoned = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "norms": norms, "summoned": summoned, "state_dict": state}


def _sync_module_states(group: dist.ProcessGroup, rank: int) -> dict[str, torch.Tensor]:
    """Ours only: rank 1 starts from other values; sync_module_states broadcasts rank 0's over ``group``."""
    from fsdp import FullyShardedDataParallel as F
    from tests._models import make_toy

    model = F(make_toy(seed=rank), process_group=group, sync_module_states=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _rank_main(rank: int, world_size: int, store_path: str, out_dir: str) -> None:
    result: dict[str, Any] = {}
    try:
        group = _store_group(store_path, rank, world_size)
        result["initialized_before"] = dist.is_initialized()
        result["ours"] = _train("ours", group, rank, world_size)
        result["torch"] = _train("torch", group, rank, world_size)
        result["synced"] = _sync_module_states(group, rank)
        result["initialized_after"] = dist.is_initialized()
    except BaseException:  # reported to the test, which fails with the traceback
        result["error"] = traceback.format_exc()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def test_explicit_group_without_default_group_matches_torch(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(_REPO), os.environ.get("PYTHONPATH", "")])}
    # A fork of an interpreter that imported torch alone ([Note: Test commands forked from a
    # preloaded interpreter]): no process group, as in a fresh one.
    from tests._preloaded import run_python  # here: the command runs this module

    proc = run_python(["-m", "tests.test_contract_process_group", str(tmp_path)], cwd=str(_REPO), env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for rank, result in enumerate(results):
        assert "error" not in result, f"rank {rank}:\n{result['error']}"
        assert result["initialized_before"] is False and result["initialized_after"] is False
        ours, theirs = result["ours"], result["torch"]
        for key in ("losses", "norms"):
            for step, (a, b) in enumerate(zip(ours[key], theirs[key])):
                assert torch.equal(a, b), f"rank {rank} step {step}: {key} {a} != torch FSDP1 {b}"
        for key in ("summoned", "state_dict"):
            assert list(ours[key]) == list(theirs[key]), (key, list(ours[key]), list(theirs[key]))
            for name in ours[key]:
                assert torch.equal(ours[key][name], theirs[key][name]), f"rank {rank}: {key} {name}"
    # Both ranks hold the same full model; sync_module_states gave rank 1 rank 0's values.
    for name, value in results[0]["ours"]["state_dict"].items():
        assert torch.equal(value, results[1]["ours"]["state_dict"][name]), name
    from tests._models import make_toy

    rank0_init = make_toy(seed=0).state_dict()
    assert not torch.equal(make_toy(seed=1).state_dict()["embed.weight"], rank0_init["embed.weight"])
    for rank in range(2):
        synced = results[rank]["synced"]
        assert list(synced) == list(rank0_init)
        for name, value in synced.items():
            assert torch.equal(value, rank0_init[name]), f"rank {rank}: {name} not rank 0's"



class _StandInGroup:
    """An object with the process-group interface construction uses (torch's FSDP tests build
    FSDP over such a stand-in), not a ``torch.distributed.ProcessGroup``."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def _construct_over_stand_in(size: int) -> dict[str, Any]:
    """Both libraries wrap the same model over a stand-in group of ``size`` ranks; returns what
    each reports (rank, world size, sharded numels, the local shards' values)."""
    import warnings

    import torch.distributed.fsdp as torch_fsdp

    import fsdp

    out: dict[str, Any] = {}
    for name, lib, wrap in (("ours", fsdp, fsdp.wrap), ("torch", torch_fsdp, torch_fsdp.wrap)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 5))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the one-rank NO_SHARD warning
            wrapped = lib.FullyShardedDataParallel(
                model,
                process_group=_StandInGroup(0, size),
                auto_wrap_policy=wrap.ModuleWrapPolicy({torch.nn.Linear}),
                device_id=torch.device("cpu"),
            )
        out[name] = {
            "rank": wrapped.rank,
            "world_size": wrapped.world_size,
            "shards": [p.detach().clone() for p in wrapped.parameters()],
        }
    return out


def test_stand_in_group_object_accepted_like_torch() -> None:
    """torch FSDP1 accepts any object with ``rank()`` and ``size()`` as ``process_group``, and
    shards as the size it reports; so does fsdp. Construction runs no collective, so no process
    group is needed at all."""
    for size in (1, 2, 4):
        result = _construct_over_stand_in(size)
        ours, theirs = result["ours"], result["torch"]
        assert (ours["rank"], ours["world_size"]) == (theirs["rank"], theirs["world_size"]) == (0, size)
        assert len(ours["shards"]) == len(theirs["shards"]) == 2  # one per Linear unit (the root has none)
        for mine, other in zip(ours["shards"], theirs["shards"]):
            assert torch.equal(mine, other), (size, mine, other)


def test_object_without_group_interface_is_refused() -> None:
    import fsdp

    with pytest.raises(TypeError, match=r"process_group must be a torch\.distributed\.ProcessGroup.*object"):
        fsdp.FullyShardedDataParallel(torch.nn.Linear(2, 2), process_group="world", device_id=torch.device("cpu"))

def _main(out_dir: str) -> None:
    import torch.multiprocessing as mp

    store_path = os.path.join(out_dir, "store")
    # fork: this process has created no threads or groups yet; each rank exits on its own.
    mp.start_processes(_rank_main, args=(2, store_path, out_dir), nprocs=2, start_method="fork", join=True)


if __name__ == "__main__":
    _main(sys.argv[1])
