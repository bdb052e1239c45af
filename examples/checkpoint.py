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
rank's shards. A half-written folder is never loaded. The checkpoint is SHARDED (ShardedTensor shards,
torch FSDP1's type), so it resumes at any world size.

Each folder also holds ``run.json`` (the ``info`` a save is given: the trainer records its step, the
model's configuration and the flags that shape it), written into the ``.partial`` folder before
the shards, so a complete folder always has it and it can be read without loading anything
(:func:`read_info`).

[Note: Clearing a checkpoint directory]
:func:`clear_checkpoints` (``--overwrite``) deletes an earlier run's checkpoints before a new run
saves its own: kept, they would look newer by name than the new run's, and pruning would delete
the new run's instead. It first moves the ``latest`` pointer into ``.overwritten/`` (one
``os.replace``: from then on :func:`latest_checkpoint` finds nothing), then every ``step_*``
folder, then deletes ``.overwritten/``. A crash part-way leaves no pointer, so ``--resume`` finds
no checkpoint (an error, never a wrong pick), while :func:`has_checkpoints` still sees the
leftover folders, so a new run without ``--overwrite`` is refused as before; ``--overwrite``
again finishes the job. Only the entries a save writes are touched: other files in the
directory stay.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import warnings
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch import nn


LATEST = "latest"
#: The file in each checkpoint folder that holds the save's ``info`` (JSON).
INFO = "run.json"
#: Where :func:`clear_checkpoints` moves what it deletes (see [Note: Clearing a checkpoint directory]).
TRASH = ".overwritten"
#: How many complete step folders a save keeps by default (the newest ones).
DEFAULT_KEEP = 3
_STEP_DIR = re.compile(r"^step_(\d+)$")
#: Every entry a save writes: step folders (with their .partial/.old forms) and the pointer.
_OWNED = re.compile(r"^(step_\d+(\.partial|\.old)?|" + re.escape(LATEST) + r"(\.tmp)?)$")


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


@contextlib.contextmanager
def _quiet_sharded_tensor_deprecation() -> Iterator[None]:
    """Hides the one warning torch gives for ShardedTensor values (torch FSDP1's SHARDED type,
    which fsdp gives too: "Please use DTensor instead and we are deprecating ShardedTensor."),
    at DCP's load and at loading them into the optimizer, with torch FSDP1 and fsdp alike; a
    model built with ``device_mesh`` gives DTensors instead."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor", category=FutureWarning)
        yield


def _state(model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any]) -> dict[str, Any]:
    """The sharded model and optimizer state dicts through DCP's state-dict API (torch's
    recommended form; ``FSDP.state_dict_type`` is deprecated in torch FSDP1, and warns so)."""
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state, "extra": extra}


def save_checkpoint(
    directory: str,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any],
    keep: int = DEFAULT_KEEP,
    info: Optional[dict[str, Any]] = None,
) -> str:
    """Saves model, optimizer and ``extra`` (picklable progress) atomically; returns the folder.

    A collective: every rank must call it with the same arguments. See [Note: Atomic checkpoints].

    Args:
        keep: How many complete step folders to keep (the newest, this one included); older
            ones are deleted after this save is published. At least 1.
        info: JSON-serializable facts about the checkpoint, written as ``run.json`` in the
            folder (read back with :func:`read_info`, without loading the checkpoint).

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
        if info is not None:  # before the shards: a folder with DCP's .metadata has it
            os.makedirs(partial)
            with open(os.path.join(partial, INFO), "w", encoding="utf-8") as f:
                json.dump(info, f, indent=1, sort_keys=True)
    dist.barrier()
    with _quiet_sharded_tensor_deprecation():
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


def read_info(path: str) -> Optional[dict[str, Any]]:
    """The ``info`` a checkpoint folder was saved with, or None when it has none (an older save).

    Raises:
        RuntimeError: ``run.json`` exists but is not readable JSON, naming the file.
    """
    file = os.path.join(path, INFO)
    if not os.path.isfile(file):
        return None
    try:
        with open(file, encoding="utf-8") as f:
            info = json.load(f)
    except (OSError, ValueError) as exc:
        raise RuntimeError(f"fsdp example: cannot read {file} ({exc}); the checkpoint folder is damaged") from exc
    if not isinstance(info, dict):
        raise RuntimeError(f"fsdp example: {file} holds {type(info).__name__}, not an object; the checkpoint folder is damaged")
    return info


def checkpoint_step(path: str) -> int:
    """The step of a checkpoint folder, from its name (``step_000300``, ``.partial`` or ``.old``)."""
    match = re.match(r"^step_(\d+)", os.path.basename(path))
    if match is None:
        raise ValueError(f"fsdp example: {path} is not a step_NNNNNN checkpoint folder")
    return int(match.group(1))


def has_checkpoints(directory: str) -> bool:
    """Whether ``directory`` holds a run's checkpoints: a ``latest`` pointer or a complete step folder
    (also what an interrupted :func:`clear_checkpoints` leaves)."""
    return os.path.exists(os.path.join(directory, LATEST)) or bool(_step_folders(directory))


def clear_checkpoints(directory: str) -> int:
    """Deletes the checkpoints a save wrote in ``directory`` (pointer first); returns how many
    step folders went. Not a collective: call it on one process before training starts.
    See [Note: Clearing a checkpoint directory]."""
    if not os.path.isdir(directory):
        return 0
    trash = os.path.join(directory, TRASH)
    shutil.rmtree(trash, ignore_errors=True)  # what an interrupted clear left
    os.makedirs(trash)
    owned = sorted(name for name in os.listdir(directory) if _OWNED.match(name))
    owned.sort(key=lambda name: name != LATEST)  # the pointer first
    for name in owned:
        os.replace(os.path.join(directory, name), os.path.join(trash, name))
    shutil.rmtree(trash)
    return sum(1 for name in owned if _STEP_DIR.match(name))


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


class CheckpointReadError(RuntimeError):
    """A checkpoint folder that cannot be loaded (truncated, corrupt, another model). Its message
    is the advice; the reader's exception is chained (``__cause__``)."""


def _one_line(exc: BaseException) -> str:
    """``TypeName: the first line of the message`` (at most 160 characters): what a reader's
    error says, without DCP's per-rank tracebacks (a ``CheckpointException`` holds every
    failed rank's exception; the first one is named)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, inner = sorted(failures.items())[0]
        inner = inner[0] if isinstance(inner, tuple) else inner
        if isinstance(inner, BaseException):
            return f"{_one_line(inner)}, on rank {rank}"
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else ""
    text = text if len(text) <= 160 else text[:157] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


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
        CheckpointReadError: The checkpoint is unreadable (truncated, corrupt, another model),
            naming the folder; the model and optimizer are unchanged.
    """
    _init_optimizer_state(model, optimizer)
    state = _state(model, optimizer, dict(extra_template))
    try:
        with _quiet_sharded_tensor_deprecation():
            dcp.load(state, checkpoint_id=path)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - re-raised, naming the folder
        directory = os.path.dirname(os.path.abspath(path))
        others = [p for _, p in _step_folders(directory) if os.path.abspath(p) != os.path.abspath(path)]
        earlier = (
            f" (the newest other one: echo {os.path.basename(others[-1])} > {os.path.join(directory, LATEST)})"
            if others
            else " (there is none here)"
        )
        raise CheckpointReadError(
            f"fsdp example: cannot read checkpoint {path} ({_one_line(exc)}). It is truncated, "
            f"corrupt or from another model; resume from an earlier step_* folder by pointing "
            f"{LATEST} at it{earlier}, or start without --resume."
        ) from exc
    with _quiet_sharded_tensor_deprecation():
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return state["extra"]
