"""Resuming a FULL checkpoint the way Lightning does, against torch FSDP1 doing the same calls.

Lightning's FSDPStrategy saves ``model.state_dict()`` and ``FSDP.optim_state_dict`` under
FULL_STATE_DICT with ``offload_to_cpu=True, rank0_only=True`` (rank 0 ``torch.save``-s them).
To resume, into the same model that has trained on, it reads the file lazily (``torch.load(...,
mmap=True)``, or its own loader whose values are tensor-likes: not ``torch.Tensor`` instances,
read on first use through ``__torch_function__``), calls ``model.load_state_dict`` under
FULL_STATE_DICT with ``rank0_only=False``, and loads the optimizer state through
``FSDP.optim_state_dict_to_load``. Torch FSDP1 loads both kinds of values (``nn.Module`` copies
any tensor-like); so must we.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional, Sequence

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests._harness import RankPool
from tests._models import Block, global_batch, lm_loss, local_rows, make_toy


class LazyTensor:
    """A tensor-like that is not a ``torch.Tensor``, like Lightning's lazily loaded checkpoint
    tensors: its shape and dtype are known, its values are read when a torch function uses it."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor
        self.loads = 0

    @property
    def shape(self) -> torch.Size:
        return self._tensor.shape

    @property
    def dtype(self) -> torch.dtype:
        return self._tensor.dtype

    def _load(self) -> torch.Tensor:
        self.loads += 1
        return self._tensor.clone()

    @classmethod
    def __torch_function__(
        cls, func: Callable[..., Any], types: Sequence[type], args: Sequence[Any] = (), kwargs: Optional[dict] = None
    ) -> Any:
        loaded = [arg._load() if isinstance(arg, LazyTensor) else arg for arg in args]
        return func(*loaded, **(kwargs or {}))


def _wrap(library: str, orig: bool) -> nn.Module:
    if library == "ours":
        from fsdp import FullyShardedDataParallel as FSDP
        from fsdp.wrap import ModuleWrapPolicy

        return FSDP(make_toy(), auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=orig)
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy

    return TorchFSDP(
        make_toy(), auto_wrap_policy=TorchPolicy({Block}), use_orig_params=orig, device_id=torch.device("cpu")
    )


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    rank, ws = dist.get_rank(), dist.get_world_size()
    tokens, targets = global_batch(step, ws)
    lm_loss(model(local_rows(tokens, rank, ws)), local_rows(targets, rank, ws)).backward()
    opt.step()
    opt.zero_grad()


def _run(library: str, orig: bool, directory: str) -> dict[str, dict[str, torch.Tensor]]:
    """Lightning's calls: train 2 steps, save FULL, train 2 more, load (twice), train 2 again."""
    if library == "ours":
        from fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
        from fsdp import FullyShardedDataParallel as FSDP
    else:
        from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    def full(model: nn.Module, rank0_only: bool) -> Any:
        # Torch FSDP1's state_dict() fails on CPU with offload_to_cpu (it frees the unsharded
        # storage it then reads); on CPU offloading moves nothing, so torch runs without it.
        offload = library == "ours"
        return FSDP.state_dict_type(
            model,
            StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(offload_to_cpu=offload, rank0_only=rank0_only),
            FullOptimStateDictConfig(offload_to_cpu=offload, rank0_only=rank0_only),
        )

    def values(model: nn.Module) -> dict[str, torch.Tensor]:
        with full(model, rank0_only=False):
            return {key: value.clone() for key, value in model.state_dict().items()}

    model = _wrap(library, orig)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(2):
        _step(model, opt, step)
    path = os.path.join(directory, f"{library}-{orig}.ckpt")
    with full(model, rank0_only=True):
        checkpoint = {"model": model.state_dict(), "optimizer": FSDP.optim_state_dict(model, opt)}
    if dist.get_rank() == 0:
        torch.save(checkpoint, path)
    dist.barrier()
    result = {"saved": values(model)}
    for step in range(2, 4):  # train on, then go back to the checkpoint
        _step(model, opt, step)
    result["continued"] = values(model)
    for kind in ("mmap", "lazy"):
        loaded = torch.load(path, mmap=True, map_location="cpu")
        lazy = {key: LazyTensor(value) for key, value in loaded["model"].items()}
        with full(model, rank0_only=False):
            model.load_state_dict(lazy if kind == "lazy" else loaded["model"])
            opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, loaded["optimizer"]))
        assert kind == "mmap" or all(value.loads > 0 for value in lazy.values()), library
        result[f"restored_{kind}"] = values(model)
        for step in range(2, 4):
            _step(model, opt, step)
        result[f"resumed_{kind}"] = values(model)
    # Neither a tensor nor a tensor-like: nn.Module's error; we check before copying anything
    # (torch FSDP1 copies the other entries first), so nothing changes.
    bad: dict[str, Any] = dict(result["saved"])
    bad[next(iter(bad))] = "not a tensor"
    with full(model, rank0_only=False), pytest.raises(RuntimeError, match="expected torch.Tensor or Tensor-like"):
        model.load_state_dict(bad)
    if library == "ours":
        assert all(torch.equal(value, result["resumed_lazy"][key]) for key, value in values(model).items())
    return result


def full_resume_like_lightning(orig: bool, directory: str) -> None:
    ours, theirs = _run("ours", orig, directory), _run("torch", orig, directory)
    for what, torchs in theirs.items():
        assert list(ours[what]) == list(torchs), what
        for key in torchs:
            assert torch.equal(ours[what][key], torchs[key]), (what, key)
    # The same state and the same batches: resuming repeats the run exactly.
    for kind in ("mmap", "lazy"):
        for key in ours["saved"]:
            assert torch.equal(ours[f"restored_{kind}"][key], ours["saved"][key]), (kind, key)
            assert torch.equal(ours[f"resumed_{kind}"][key], ours["continued"][key]), (kind, key)


def test_full_resume_like_lightning(pool2: RankPool, tmp_path: Any) -> None:
    for orig in (False, True):
        pool2.run(full_resume_like_lightning, orig, str(tmp_path))


class _WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def lazy_buffer_under_mixed_precision() -> None:
    """A buffer cast by ``MixedPrecision(buffer_dtype=...)`` keeps its full-precision value for
    state dicts; a lazily loaded (tensor-like) value must become that kept value, as a tensor does."""
    from fsdp import FullStateDictConfig, MixedPrecision, StateDictType
    from fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    model = FSDP(_WithBuffer(), mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16))
    model(torch.ones(2, 4)).sum().backward()  # lazy init: the buffer is now bf16 on the module
    # 1 + 2**-12 rounds to 1.0 in bf16 (8 bits of mantissa): only the kept value can carry it.
    loaded = torch.full((4,), 1.0 + 2.0**-12)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False)):
        state = {key: value.clone() for key, value in model.state_dict().items()}
        for kind in ("tensor", "lazy"):
            state["scale"] = LazyTensor(loaded) if kind == "lazy" else loaded.clone()
            model.load_state_dict(state)
            saved = model.state_dict()["scale"]
            assert saved.dtype == torch.float32 and torch.equal(saved, loaded), (kind, saved)
            state["scale"] = torch.ones(4)
            model.load_state_dict(state)  # back to 1.0 before the next kind


def test_lazy_buffer_under_mixed_precision(pool2: RankPool) -> None:
    pool2.run(lazy_buffer_under_mixed_precision)
