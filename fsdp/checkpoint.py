"""Sharded checkpoints that move no parameter or optimizer-state bytes between ranks.

``save_sharded`` writes each rank's flat shards with ``torch.distributed.checkpoint`` (DCP)
exactly where they lie ([Note: Flat-shard checkpoints] in
``fsdp/state_dict/_flat_checkpoint.py``); ``load_sharded`` reads such a checkpoint (or any DCP
checkpoint of a SHARDED state dict with the same keys) at any world size and wrap plan. The
files hold the keys and full shapes of ``{"model": model.state_dict(), "optim":
FSDP.optim_state_dict(model, optim)}`` under ``SHARDED_STATE_DICT``, so torch FSDP1, torch FSDP2
and a plain model load them with ``torch.distributed.checkpoint.load`` too (docs/checkpoints.md).
"""

from __future__ import annotations

import os
from typing import Any, Optional, Union

import torch
from torch import nn

from fsdp.api import StateDictType
from fsdp.fully_sharded_data_parallel import FullyShardedDataParallel
from fsdp.state_dict._flat_checkpoint import FlatShardSavePlanner, flat_shard_state_dict

__all__ = ["save_sharded", "load_sharded"]


def save_sharded(
    model: nn.Module,
    optim: Optional[torch.optim.Optimizer] = None,
    *,
    checkpoint_id: Union[str, os.PathLike[str]],
    storage_writer: Optional[Any] = None,
    overwrite: bool = True,
) -> Any:
    """Saves ``model`` (and ``optim``) as a sharded DCP checkpoint, each rank writing its flat
    shards where they lie: no gather, no copy, no collective beyond DCP's planning.

    Args:
        model: The root FSDP module (every rank calls this, outside forward/backward).
        optim: Its optimizer, or None to save the model only.
        checkpoint_id: The checkpoint folder.
        storage_writer: A DCP ``StorageWriter``; default ``FileSystemWriter(checkpoint_id,
            overwrite=overwrite)``.
        overwrite: Whether a save into an existing checkpoint folder replaces its files (passed
            to DCP's writer explicitly, so the result does not depend on DCP's default).

    Returns:
        DCP's ``Metadata`` of the checkpoint.

    Raises:
        NotImplementedError: For tensor-parallel (DTensor) parameters.
    """
    import torch.distributed.checkpoint as dcp

    if storage_writer is None:
        storage_writer = dcp.FileSystemWriter(checkpoint_id, overwrite=overwrite)
    state = flat_shard_state_dict(model, optim)
    return dcp.save(state, checkpoint_id=checkpoint_id, storage_writer=storage_writer, planner=FlatShardSavePlanner())


def load_sharded(
    model: nn.Module,
    optim: Optional[torch.optim.Optimizer] = None,
    *,
    checkpoint_id: Union[str, os.PathLike[str]],
    storage_reader: Optional[Any] = None,
) -> None:
    """Loads a sharded DCP checkpoint (from :func:`save_sharded` or a SHARDED state dict with
    the same keys) into ``model`` (and ``optim``), resharding as DCP reads.

    Args:
        model: The root FSDP module, at any world size and wrap plan.
        optim: Its optimizer, whose state must exist (take one step first, as for any DCP
            load of an optimizer state dict), or None to load the model only.
        checkpoint_id: The checkpoint folder.
        storage_reader: A DCP ``StorageReader``; default ``FileSystemReader(checkpoint_id)``.
    """
    import torch.distributed.checkpoint as dcp

    FSDP = FullyShardedDataParallel
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state: dict[str, Any] = {"model": model.state_dict()}
        if optim is not None:
            state["optim"] = FSDP.optim_state_dict(model, optim)
        dcp.load(state, checkpoint_id=checkpoint_id, storage_reader=storage_reader)
        model.load_state_dict(state["model"])
        if optim is not None:
            optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, state["optim"]))
