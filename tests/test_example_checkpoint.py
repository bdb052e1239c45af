"""The example trainer's atomic, sharded checkpoints: resume equals training straight (also at
another world size), an interrupted save leaves the previous checkpoint loadable, a corrupt
checkpoint is a clear error.
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


def save_phase(directory: str) -> None:
    from fsdp.examples.checkpoint import save_checkpoint

    model, optimizer, data = _setup()
    _steps(model, optimizer, data, range(2), 4)
    save_checkpoint(directory, 2, model, optimizer, {"step": 2})
    # An interrupted later save: shards of step 4 half-written, pointer never updated.
    _steps(model, optimizer, data, range(2, 4), 4)
    if dist.get_rank() == 0:
        os.makedirs(os.path.join(directory, "step_000004.partial"))
        with open(os.path.join(directory, "step_000004.partial", "__0_0.distcp"), "wb") as f:
            f.write(b"\x00garbage")
    dist.barrier()


def resume_phase(directory: str, exact: bool) -> None:
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
        if exact:
            assert torch.equal(a[key], b[key]), key
        else:
            torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5, msg=key)


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
    get_pool(2).run(resume_phase, str(tmp_path), True)
    get_pool(4).run(resume_phase, str(tmp_path), False)  # another world size
    get_pool(1).run(resume_phase, str(tmp_path), False)
    get_pool(2).run(corrupt_phase, str(tmp_path))
