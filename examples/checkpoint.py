"""Sharded, atomic checkpoints for the example trainer (model + optimizer + progress).

[Note: Atomic checkpoints]
Each rank writes its shards with ``torch.distributed.checkpoint`` into ``step_NNNNNN.partial``.
Only once every rank has finished (a barrier) does rank 0 publish it:

1. if ``step_NNNNNN`` already exists (the same step saved again, e.g. the demo run twice into one
   directory), it is renamed to ``step_NNNNNN.old``: never deleted before its replacement is in
   place;
2. ``step_NNNNNN.partial`` is renamed to ``step_NNNNNN``;
3. the ``latest`` pointer file is replaced (write a temporary file, ``os.replace``: atomic on
   POSIX);
4. ``step_NNNNNN.old`` and the steps beyond the newest ``keep`` are deleted.

A kill at any point leaves a complete checkpoint that :func:`latest_checkpoint` finds: before step
3, ``latest`` names the previous step (or, in the window of a re-save, a folder that is missing for
a moment, and then the loader takes the complete ``.partial`` or ``.old`` of that step, saying so).
A folder counts as complete when DCP's ``.metadata`` file is in it: DCP writes it last, after every
rank's shards. A half-written folder is never loaded. The checkpoint is SHARDED (DTensor shards), so
it resumes at any world size.
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch import nn

from fsdp import FullyShardedDataParallel as FSDP
from fsdp import StateDictType

LATEST = "latest"
#: How many complete step folders a save keeps by default (the newest ones).
DEFAULT_KEEP = 3
_STEP_DIR = re.compile(r"^step_(\d+)$")


def is_complete(path: str) -> bool:
    """Whether ``path`` is a checkpoint folder whose save finished (DCP's metadata is written)."""
    return os.path.isfile(os.path.join(path, ".metadata"))


def _step_folders(directory: str) -> list[tuple[int, str]]:
    """The complete ``step_*`` folders in ``directory``, oldest first, as (step, path)."""
    found = []
    for entry in os.listdir(directory) if os.path.isdir(directory) else []:
        match = _STEP_DIR.match(entry)
        path = os.path.join(directory, entry)
        if match and is_complete(path):
            found.append((int(match.group(1)), path))
    return sorted(found)


def _prune(directory: str, keep: int, current: str) -> None:
    """Deletes all but the newest ``keep`` complete step folders (never ``current``)."""
    folders = _step_folders(directory)
    for _, path in folders[: max(0, len(folders) - keep)]:
        if path != current:
            shutil.rmtree(path, ignore_errors=True)


def _state(model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any]) -> dict[str, Any]:
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        return {
            "model": model.state_dict(),
            "optim": FSDP.optim_state_dict(model, optimizer),
            "extra": extra,
        }


def save_checkpoint(
    directory: str,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any],
    keep: int = DEFAULT_KEEP,
) -> str:
    """Saves model, optimizer and ``extra`` (picklable progress) atomically; returns the folder.

    A collective: every rank must call it with the same arguments. See [Note: Atomic checkpoints].

    Args:
        keep: How many complete step folders to keep (the newest, this one included); older
            ones are deleted after this save is published. At least 1.

    Raises:
        ValueError: ``keep`` < 1.
    """
    if keep < 1:
        raise ValueError(f"fsdp example: keep={keep}; a save keeps at least the checkpoint it writes (keep >= 1)")
    name = f"step_{step:06d}"
    final = os.path.join(directory, name)
    partial, old = final + ".partial", final + ".old"
    if dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # leftovers of an interrupted save
        if os.path.isdir(final) and os.path.isdir(old):
            shutil.rmtree(old)  # a complete step_N exists: the .old of an earlier re-save is stale
    dist.barrier()
    dcp.save(_state(model, optimizer, extra), checkpoint_id=partial)
    dist.barrier()  # every rank's shards are on disk
    if dist.get_rank() == 0:
        if os.path.isdir(final):
            os.replace(final, old)  # set aside, not deleted, until the new one is published
        os.replace(partial, final)
        pointer = os.path.join(directory, LATEST)
        with open(pointer + ".tmp", "w", encoding="utf-8") as f:
            f.write(name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(pointer + ".tmp", pointer)
        shutil.rmtree(old, ignore_errors=True)
        _prune(directory, keep, final)
    dist.barrier()
    return final


def latest_checkpoint(directory: str) -> Optional[str]:
    """The newest complete checkpoint: the folder ``latest`` names, or None when there is none.

    When a save was killed while it published a re-save of the same step, ``latest`` can name a
    folder that is missing; then the complete ``.partial`` (the newer save) or ``.old`` (the
    previous one) of that step is returned, or else the newest complete step folder, with a
    ``RuntimeWarning`` saying which (see [Note: Atomic checkpoints]).

    Raises:
        RuntimeError: ``latest`` names a folder that is not a complete checkpoint and nothing
            complete is left to fall back to.
    """
    pointer = os.path.join(directory, LATEST)
    if not os.path.exists(pointer):
        return None
    with open(pointer, encoding="utf-8") as f:
        name = f.read().strip()
    path = os.path.join(directory, name)
    if name and is_complete(path):
        return path
    candidates = [path + ".partial", path + ".old"] if name else []
    candidates += [p for _, p in reversed(_step_folders(directory))]
    for candidate in candidates:
        if is_complete(candidate):
            warnings.warn(
                f"fsdp example: {pointer} names '{name}', which is missing or incomplete (a save "
                f"was interrupted while it published); loading the complete checkpoint "
                f"{candidate} instead.",
                RuntimeWarning,
                stacklevel=2,
            )
            return candidate
    raise RuntimeError(
        f"fsdp example: {pointer} names '{name}', which is not a complete checkpoint folder, and "
        f"{directory} holds no other complete step_* folder. Start without --resume, or point "
        f"{LATEST} at a complete checkpoint."
    )


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
