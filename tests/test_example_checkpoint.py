"""The example trainer's atomic, sharded checkpoints: resume equals training straight, a load at
another world size restores exactly the saved state and continues exactly as that state loaded
another way, an interrupted save leaves the previous checkpoint loadable, a corrupt checkpoint is a
clear error.

Why the other world sizes are not compared with training straight: a run at world size 1 or 4
reduces gradients in another order than the run at world size 2 that wrote the checkpoint, so the
gradients differ in their last bits. AdamW divides each update by the root of the gradient's second
moment, so for an element whose gradient is near zero (a bias that barely matters) a last-bit
difference can change the update by up to the learning rate: no tolerance follows from the
arithmetic. Resharding itself involves no arithmetic, so it is checked bit for bit instead.
"""

from __future__ import annotations

import glob
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests._harness import get_pool


def _setup(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    from fsdp import FullyShardedDataParallel as FSDP
    from fsdp.examples.data import CharTokenizer, load_corpus
    from fsdp.examples.model import GPT, Block, GPTConfig
    from fsdp.wrap import ModuleWrapPolicy

    text = load_corpus()
    tokenizer = CharTokenizer(text)
    torch.manual_seed(seed)
    model = FSDP(
        GPT(GPTConfig(vocab_size=tokenizer.vocab_size, block_size=16, n_layer=2, n_head=2, d_model=32)),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    return model, optimizer, tokenizer.encode_tensor(text)


def _steps(model: nn.Module, optimizer: torch.optim.Optimizer, data: torch.Tensor, steps: range, data_ws: int) -> None:
    """Trains on the global batch of ``data_ws`` ranks, split over this run's ranks."""
    from fsdp.examples.data import sample_batch

    rank, ws = dist.get_rank(), dist.get_world_size()
    for step in steps:
        batches = [sample_batch(data, 4, 16, seed=0, rank=r, step=step) for r in range(data_ws)]
        inputs = torch.cat([b[0] for b in batches])
        targets = torch.cat([b[1] for b in batches])
        per_rank = inputs.shape[0] // ws
        x, y = inputs[rank * per_rank : (rank + 1) * per_rank], targets[rank * per_rank : (rank + 1) * per_rank]
        logits = model(x)
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_same(expected: Any, actual: Any, where: str) -> None:
    """Bit-for-bit equality of nested dicts / lists of tensors and plain values."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and torch.equal(expected, actual), where
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and set(expected) == set(actual), (where, set(expected) ^ set(actual))
        for key in expected:
            _assert_same(expected[key], actual[key], f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(expected) == len(actual), where
        for i, (e, a) in enumerate(zip(expected, actual)):
            _assert_same(e, a, f"{where}[{i}]")
    else:
        assert expected == actual, (where, expected, actual)


def _full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Full model and optimizer state (a collective; FULL_STATE_DICT is the default type)."""
    from fsdp import FullyShardedDataParallel as FSDP

    return {"model": _full(model), "optim": FSDP.optim_state_dict(model, optimizer)}


def _reference_path(directory: str) -> str:
    return os.path.join(directory, "reference_step_2.pt")


def save_phase(directory: str) -> None:
    from fsdp.examples.checkpoint import save_checkpoint

    model, optimizer, data = _setup()
    _steps(model, optimizer, data, range(2), 4)
    save_checkpoint(directory, 2, model, optimizer, {"step": 2})
    reference = _full_state(model, optimizer)  # what the checkpoint must restore, exactly
    if dist.get_rank() == 0:
        torch.save(reference, _reference_path(directory))
    # An interrupted later save: shards of step 4 half-written, pointer never updated.
    _steps(model, optimizer, data, range(2, 4), 4)
    if dist.get_rank() == 0:
        os.makedirs(os.path.join(directory, "step_000004.partial"))
        with open(os.path.join(directory, "step_000004.partial", "__0_0.distcp"), "wb") as f:
            f.write(b"\x00garbage")
    dist.barrier()


def resume_phase(directory: str) -> None:
    """At the world size that saved: resuming equals training straight, bit for bit."""
    from fsdp.examples.checkpoint import latest_checkpoint, load_checkpoint

    path = latest_checkpoint(directory)
    assert path is not None and path.endswith("step_000002"), path  # the half-written save is ignored
    straight, straight_opt, data = _setup()
    _steps(straight, straight_opt, data, range(4), 4)
    model, optimizer, _ = _setup(seed=99)
    extra = load_checkpoint(path, model, optimizer, {"step": 0})
    assert extra["step"] == 2
    _steps(model, optimizer, data, range(2, 4), 4)
    a, b = _full(straight), _full(model)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def reshard_phase(directory: str) -> None:
    """At another world size: the load restores the saved state bit for bit, and training from
    it equals training from the same state loaded as full state dicts (see the module docstring)."""
    from fsdp import FullyShardedDataParallel as FSDP
    from fsdp.examples.checkpoint import _init_optimizer_state, latest_checkpoint, load_checkpoint

    path = latest_checkpoint(directory)
    assert path is not None and path.endswith("step_000002"), path
    reference = torch.load(_reference_path(directory), weights_only=False)
    model, optimizer, data = _setup(seed=99)
    assert load_checkpoint(path, model, optimizer, {"step": 0})["step"] == 2
    _assert_same(reference, _full_state(model, optimizer), "restored")

    via_full, via_full_opt, _ = _setup(seed=7)
    via_full.load_state_dict(reference["model"])
    _init_optimizer_state(via_full, via_full_opt)
    via_full_opt.load_state_dict(FSDP.optim_state_dict_to_load(via_full, via_full_opt, reference["optim"]))
    _steps(model, optimizer, data, range(2, 4), 4)
    _steps(via_full, via_full_opt, data, range(2, 4), 4)
    _assert_same(_full(via_full), _full(model), "trained")


def corrupt_phase(directory: str) -> None:
    from fsdp.examples.checkpoint import latest_checkpoint, load_checkpoint

    path = latest_checkpoint(directory)
    assert path is not None
    if dist.get_rank() == 0:
        for file in glob.glob(os.path.join(path, "*.distcp")):
            with open(file, "r+b") as f:
                f.truncate(max(0, os.path.getsize(file) // 2))
    dist.barrier()
    model, optimizer, _ = _setup(seed=5)
    before = _full(model)
    with pytest.raises(RuntimeError, match=r"cannot read checkpoint .*step_000002 .*truncated, corrupt or from another model"):
        load_checkpoint(path, model, optimizer, {"step": 0})
    after = _full(model)
    assert all(torch.equal(before[k], after[k]) for k in before), "model unchanged"


def test_resume_bit_exact_and_interrupted_save(tmp_path: Any) -> None:
    get_pool(2).run(save_phase, str(tmp_path))
    get_pool(2).run(resume_phase, str(tmp_path))
    get_pool(4).run(reshard_phase, str(tmp_path))  # another world size
    get_pool(1).run(reshard_phase, str(tmp_path))
    get_pool(2).run(corrupt_phase, str(tmp_path))
