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
from fsdp.state_dict._flat_checkpoint import FlatShardSavePlanner, flat_shard_state_dict, missing_from_checkpoint
from fsdp.state_dict._safetensors import sharded_to_safetensors

__all__ = ["save_sharded", "load_sharded", "sharded_to_safetensors"]


def save_sharded(
    model: nn.Module,
    optim: Optional[torch.optim.Optimizer] = None,
    *,
    checkpoint_id: Union[str, os.PathLike[str]],
    storage_writer: Optional[Any] = None,
    overwrite: bool = True,
    ignore_frozen_params: bool = False,
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
        ignore_frozen_params: Leave out parameters with ``requires_grad=False`` (a frozen base)
            and their optimizer state ([Note: Trainable-only checkpoints]).

    Returns:
        DCP's ``Metadata`` of the checkpoint.

    Raises:
        NotImplementedError: A tensor-parallel (DTensor) parameter whose placements are not
            ``Shard``/``Replicate`` (those are written as boxes of the full parameter, [Note:
            Flat-shard checkpoints of tensor-parallel parameters]).
    """
    import torch.distributed.checkpoint as dcp

    if storage_writer is None:
        storage_writer = dcp.FileSystemWriter(checkpoint_id, overwrite=overwrite)
    state = flat_shard_state_dict(model, optim, ignore_frozen_params)
    return dcp.save(state, checkpoint_id=checkpoint_id, storage_writer=storage_writer, planner=FlatShardSavePlanner())


def load_sharded(
    model: nn.Module,
    optim: Optional[torch.optim.Optimizer] = None,
    *,
    checkpoint_id: Union[str, os.PathLike[str]],
    storage_reader: Optional[Any] = None,
    ignore_frozen_params: bool = False,
) -> None:
    """Loads a sharded DCP checkpoint (from :func:`save_sharded` or a SHARDED state dict with
    the same keys) into ``model`` (and ``optim``), resharding as DCP reads.

    Args:
        model: The root FSDP module, at any world size and wrap plan.
        optim: Its optimizer, or None to load the model only. An optimizer without state yet
            gets it first from one step with zero gradients and learning rate 0 (as DCP's
            ``set_state_dict`` does), which leaves the parameters bit for bit as they are.
        checkpoint_id: The checkpoint folder.
        storage_reader: A DCP ``StorageReader``; default ``FileSystemReader(checkpoint_id)``.
        ignore_frozen_params: Frozen parameters (``requires_grad=False``) the checkpoint lacks
            (saved with ``ignore_frozen_params=True``) keep their current values: the base was
            loaded from elsewhere ([Note: Trainable-only checkpoints]).

    Raises:
        RuntimeError: The checkpoint lacks some of the model's entries (before anything is
            read or changed), naming them and the remedy.
    """
    import torch.distributed.checkpoint as dcp

    if storage_reader is None:
        storage_reader = dcp.FileSystemReader(checkpoint_id)
    saved_keys = set(storage_reader.read_metadata().state_dict_metadata)
    FSDP = FullyShardedDataParallel
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state: dict[str, Any] = {"model": model.state_dict()}
        frozen, others = missing_from_checkpoint(model, state["model"], saved_keys)
        _check_missing(checkpoint_id, frozen, others, ignore_frozen_params)
        for key in frozen:
            del state["model"][key]
        if optim is not None:
            if not optim.state:
                _init_optim_state(optim)
            state["optim"] = FSDP.optim_state_dict(model, optim)
            for key in frozen:
                state["optim"]["state"].pop(key, None)
        dcp.load(state, checkpoint_id=checkpoint_id, storage_reader=storage_reader)
        model.load_state_dict(state["model"], strict=not frozen)
        if optim is not None:
            optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, state["optim"]))


def _check_missing(checkpoint_id: Any, frozen: list[str], others: list[str], ignore_frozen_params: bool) -> None:
    def shown(keys: list[str]) -> str:
        return ", ".join(repr(k) for k in keys[:8]) + (f", ... ({len(keys)} in all)" if len(keys) > 8 else "")

    if others:
        raise RuntimeError(
            f"fsdp: the checkpoint {str(checkpoint_id)!r} holds no values for {shown(others)}; it was saved "
            "from another model (or without these entries). Load it into the model it was saved from."
        )
    if frozen and not ignore_frozen_params:
        raise RuntimeError(
            f"fsdp: the checkpoint {str(checkpoint_id)!r} holds no values for the frozen parameters "
            f"{shown(frozen)} (it was saved with ignore_frozen_params=True, a trainable-only checkpoint). "
            "Load the base model's weights first (e.g. from the pretrained checkpoint) and pass "
            "ignore_frozen_params=True to load_sharded, which then keeps their current values."
        )


def _init_optim_state(optim: torch.optim.Optimizer) -> None:
    """Gives ``optim`` state to load into: one step with zero gradients at learning rate 0 (a
    parameter ``p`` becomes ``p * 1 - 0 * ...``, the same bits), then no gradients again."""
    lrs = [group["lr"] for group in optim.param_groups]
    for group in optim.param_groups:
        for param in group["params"]:
            if param.requires_grad and param.grad is None:
                param.grad = torch.zeros_like(param)
        if torch.is_tensor(group["lr"]):
            group["lr"] = group["lr"].clone().fill_(0.0)
        else:
            group["lr"] = 0.0
    try:
        optim.step()
    finally:
        for group, lr in zip(optim.param_groups, lrs):
            group["lr"] = lr
        optim.zero_grad(set_to_none=True)
