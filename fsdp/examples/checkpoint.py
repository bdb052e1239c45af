"""Sharded, atomic checkpoints for the example trainer (model + optimizer + progress).

[Note: Atomic checkpoints]
Each rank writes its shards with ``torch.distributed.checkpoint`` into ``step_NNNNNN.partial``;
only once every rank has finished (a barrier) does rank 0 rename the folder to ``step_NNNNNN``
and then replace the ``latest`` pointer file (write a temporary file, ``os.replace``: atomic on
POSIX). A save interrupted at any point therefore leaves ``latest`` naming the previous,
complete checkpoint, and a half-written folder is never loaded. The checkpoint is SHARDED
(DTensor shards), so it resumes at any world size.
"""

from __future__ import annotations

import os
import shutil
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch import nn

from fsdp import FullyShardedDataParallel as FSDP
from fsdp import StateDictType

LATEST = "latest"


def _state(model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any]) -> dict[str, Any]:
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        return {
            "model": model.state_dict(),
            "optim": FSDP.optim_state_dict(model, optimizer),
            "extra": extra,
        }


def save_checkpoint(
    directory: str, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any]
) -> str:
    """Saves model, optimizer and ``extra`` (picklable progress) atomically; returns the folder.

    A collective: every rank must call it with the same ``directory`` and ``step``.
    """
    name = f"step_{step:06d}"
    final = os.path.join(directory, name)
    partial = final + ".partial"
    if dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # leftovers of an interrupted save
    dist.barrier()
    dcp.save(_state(model, optimizer, extra), checkpoint_id=partial)
    dist.barrier()  # every rank's shards are on disk
    if dist.get_rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        pointer = os.path.join(directory, LATEST)
        with open(pointer + ".tmp", "w", encoding="utf-8") as f:
            f.write(name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(pointer + ".tmp", pointer)
    dist.barrier()
    return final


def latest_checkpoint(directory: str) -> Optional[str]:
    """The folder ``latest`` names, or None when there is no complete checkpoint yet."""
    pointer = os.path.join(directory, LATEST)
    if not os.path.exists(pointer):
        return None
    with open(pointer, encoding="utf-8") as f:
        name = f.read().strip()
    path = os.path.join(directory, name)
    if not name or not os.path.isdir(path):
        raise RuntimeError(
            f"fsdp example: {pointer} names '{name}', which is not a checkpoint folder; the "
            f"checkpoint directory was modified by hand. Point it at a complete step_* folder."
        )
    return path


def _init_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Creates the optimizer's state tensors (a step with zero gradients and lr 0) so that a
    checkpoint can be loaded into them; parameters do not change."""
    if optimizer.state:
        return
    saved = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
        for param in group["params"]:
            if param.requires_grad and param.grad is None:
                param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, lr in zip(optimizer.param_groups, saved):
        group["lr"] = lr


def load_checkpoint(
    path: str, model: nn.Module, optimizer: torch.optim.Optimizer, extra_template: dict[str, Any]
) -> dict[str, Any]:
    """Loads a checkpoint written by :func:`save_checkpoint` (at any world size); returns ``extra``.

    ``extra_template`` has the keys ``extra`` was saved with (DCP fills the keys it is given).

    Raises:
        RuntimeError: The checkpoint is unreadable (truncated, corrupt, another model), naming
            the folder; the model and optimizer are unchanged.
    """
    _init_optimizer_state(model, optimizer)
    state = _state(model, optimizer, dict(extra_template))
    try:
        dcp.load(state, checkpoint_id=path)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - re-raised, naming the folder
        raise RuntimeError(
            f"fsdp example: cannot read checkpoint {path} ({type(exc).__name__}; details in "
            f"the chained exception). It is truncated, corrupt or from another model; resume "
            f"from an earlier step_* folder by pointing {LATEST} at it, or start without --resume."
        ) from exc
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(FSDP.optim_state_dict_to_load(model, optimizer, state["optim"]))
    return state["extra"]
