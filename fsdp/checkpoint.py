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
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from fsdp.state_dict._commit_writer import CommitWriter, checkpoint_exists
from fsdp.state_dict._flat_checkpoint import (
    FlatShardLoadPlanner,
    FlatShardSavePlanner,
    apply_loaded,
    collector_paused,
    flat_shard_load_target,
    flat_shard_state_dict,
    missing_from_checkpoint,
    optim_load_target,
)
from fsdp.state_dict._local_plans import load_without_global_plan, save_without_global_plan
from fsdp.state_dict._safetensors import sharded_to_safetensors
from fsdp.state_dict._staging import HostStaging

__all__ = ["save_sharded", "async_save_sharded", "AsyncSaveFuture", "load_sharded", "sharded_to_safetensors"]


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
        storage_writer: A DCP ``StorageWriter``, used as it is (``overwrite`` is then its own
            business). Default: a ``FileSystemWriter`` whose re-save into an existing
            checkpoint is kill-safe ([Note: Kill-safe re-saves]).
        overwrite: Whether a save into a folder holding a checkpoint replaces it (the old one
            stays loadable until the new one is committed, whatever DCP's writer default is).
            With ``False``, such a folder raises before anything is written.
        ignore_frozen_params: Leave out parameters with ``requires_grad=False`` (a frozen base)
            and their optimizer state ([Note: Trainable-only checkpoints]).

    Returns:
        DCP's ``Metadata`` of the checkpoint on rank 0; None on the other ranks with the default
        writer (which saves without a global plan: [Note: A save without a global plan] in
        ``fsdp/state_dict/_local_plans.py``), DCP's on every rank with a ``storage_writer`` of the
        caller's.

    Raises:
        RuntimeError: ``overwrite=False`` and ``checkpoint_id`` holds a checkpoint (on every
            rank, before anything is written).
        NotImplementedError: A tensor-parallel (DTensor) parameter whose placements are not
            ``Shard``/``Replicate`` (those are written as boxes of the full parameter, [Note:
            Flat-shard checkpoints of tensor-parallel parameters]).
    """
    import torch.distributed.checkpoint as dcp

    writer, state = _start_save("save_sharded", model, optim, checkpoint_id, storage_writer, overwrite, ignore_frozen_params)
    with collector_paused():  # [Note: No cyclic garbage collection during a save]
        if isinstance(writer, CommitWriter):  # [Note: A save without a global plan]
            return save_without_global_plan(state, writer, FlatShardSavePlanner(), _ASYNC.group())
        return dcp.save(state, checkpoint_id=checkpoint_id, storage_writer=writer, planner=FlatShardSavePlanner())


def _start_save(
    caller: str,
    model: nn.Module,
    optim: Optional[torch.optim.Optimizer],
    checkpoint_id: Union[str, os.PathLike[str]],
    storage_writer: Optional[Any],
    overwrite: bool,
    ignore_frozen_params: bool,
) -> tuple[Any, dict[str, Any]]:
    """What a sync and an async save share before DCP writes: wait for a save in flight, the
    writer (by default our ``CommitWriter``, after the ``overwrite=False`` check: [Note:
    Kill-safe re-saves]), and the flat-shard state dict (box views, no collective)."""
    _ASYNC.wait_for_in_flight(caller)
    if storage_writer is None:
        if not overwrite and checkpoint_exists(checkpoint_id):
            raise RuntimeError(
                f"Checkpoint already exists and self.overwrite=False. fsdp: {caller} found a complete "
                f"checkpoint in {str(checkpoint_id)!r} (its .metadata) and, with overwrite=False, wrote "
                "nothing. Pass overwrite=True to replace it (kill-safe: the old checkpoint stays loadable "
                "until the new one is committed) or save into another folder."
            )
        storage_writer = CommitWriter(checkpoint_id)
    return storage_writer, flat_shard_state_dict(model, optim, ignore_frozen_params)


# [Note: Async flat-shard saves]
# ``async_save_sharded`` splits a flat-shard save in two. In the caller (the training loop is
# blocked only for this): wait for a save still in flight, build the flat-shard state dict
# (box views, no collective), and copy every tensor it writes into host staging buffers that
# are allocated at the first save and reused by every later one (``HostStaging``: pinned host
# memory when the shards are on a GPU, so the copy is a DMA; on CPU, one memcpy per flat shard and
# optimizer state). Then the same save as ``save_sharded`` runs on the staged state dict in a
# background thread (one per process, kept): with the default writer the save without a global
# plan ([Note: A save without a global plan]), with a writer of the caller's DCP's own
# ``async_save`` (our stager hands it the staged state dict as is).
#
# The staging copy is the snapshot: training may step the optimizer as soon as the call returns,
# the write reads only the buffers. Therefore one save at a time per process: the next save (or
# a ``save_sharded``/``load_sharded``) first waits for the one in flight, since it would copy into
# the buffers the writer is reading; a failed previous save whose future nobody read is raised
# there, once, so that no failure goes unseen.
#
# The background thread's object messages (each rank's report to the coordinator and the
# outcome's broadcast; DCP's planning with a caller's writer) run on a process group of their
# own, created once on the first call with every rank (``dist.new_group(backend="gloo")``, as
# torch's async_save asks of its callers): on the training's group they could interleave with
# the training loop's collectives, which gloo and NCCL both require to be issued in the same
# order on every rank.
#
# Kill safety: the default writer commits a checkpoint by one atomic rename of ``.metadata``, on
# the coordinator after every rank's data files are written, and never writes into a file a
# committed ``.metadata`` names ([Note: Kill-safe re-saves] in
# ``fsdp/state_dict/_commit_writer.py``). A process killed at any moment of a background write
# (or of a synchronous one) leaves at the path the previous checkpoint or the new one, complete,
# also for a re-save into the previous checkpoint's own folder; a first save into a new folder
# that is killed leaves no ``.metadata`` there (``load_sharded`` refuses such a folder).
class _AsyncSaves:
    """The process's staging buffers, its checkpoint process group and the save in flight."""

    def __init__(self) -> None:
        self.staging = HostStaging()
        self.in_flight: Optional[AsyncSaveFuture] = None
        self.in_flight_id = ""
        self._group: Optional[dist.ProcessGroup] = None
        self._group_world: Optional[dist.ProcessGroup] = None
        self._executor: Optional[ThreadPoolExecutor] = None
        self._lock = threading.Lock()

    def executor(self) -> ThreadPoolExecutor:
        """The background writes' thread (one: one save in flight at a time), made on first use."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fsdp_async_save")
        return self._executor

    def group(self) -> dist.ProcessGroup:
        """The saves' process group (every rank of the default group, gloo: [Note: A save
        without a global plan]), made on first use; a new default group (after
        ``destroy_process_group``) gets a new one."""
        world = dist.group.WORLD
        if self._group is None or self._group_world is not world:
            self._group = dist.new_group(backend="gloo")
            self._group_world = world  # kept alive: the identity check stays meaningful
        return self._group

    def wait_for_in_flight(self, caller: str) -> None:
        """Blocks until the save in flight (if any) has finished; a failure that nobody read
        from its future is raised here, as a ``RuntimeError`` naming the checkpoint."""
        with self._lock:
            future, checkpoint_id = self.in_flight, self.in_flight_id
        if future is None:
            return
        exc = future._inner_exception()  # waits; the record stays until the write is over
        with self._lock:
            if self.in_flight is future:
                self.in_flight = None
        if exc is not None and not future.observed:
            lines = [line for line in str(exc).splitlines() if line.strip()]  # DCP's errors carry tracebacks
            raise RuntimeError(
                f"fsdp: the asynchronous save to {checkpoint_id!r} failed ({type(exc).__name__}: "
                f"{lines[-1].strip() if lines else ''}; the whole error is chained below), and "
                f"{caller} waits for it before it starts (one save in flight at a time: the next one "
                "reuses its staging buffers). That checkpoint is incomplete; this call did nothing. "
                "Call it again to save anew."
            ) from exc

    def start(self, future: "AsyncSaveFuture", checkpoint_id: Any) -> None:
        with self._lock:
            self.in_flight, self.in_flight_id = future, str(checkpoint_id)


class AsyncSaveFuture(Future):
    """The ``concurrent.futures.Future`` of an :func:`async_save_sharded` (DCP's ``Metadata``,
    or the write's error). It remembers whether its outcome was read (``result()`` or
    ``exception()``), so that the next save raises a failure only when nobody has seen it."""

    def __init__(self, inner: Future[Any]) -> None:
        super().__init__()
        self.observed = False
        inner.add_done_callback(self._copy)

    def _copy(self, inner: Future[Any]) -> None:
        exc = inner.exception()
        if exc is not None:
            self.set_exception(exc)
        else:
            self.set_result(inner.result())

    def _inner_exception(self) -> Optional[BaseException]:
        """Waits for the write; its error (without marking the outcome read)."""
        return super().exception()

    def result(self, timeout: Optional[float] = None) -> Any:
        self.observed = True
        return super().result(timeout)

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        self.observed = True
        return super().exception(timeout)


_ASYNC = _AsyncSaves()


class _StagedAlready:
    """DCP's ``AsyncStager``, for a state dict that is staged already (by ``HostStaging``)."""

    _synchronize_after_execute = False
    should_synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def async_save_sharded(
    model: nn.Module,
    optim: Optional[torch.optim.Optimizer] = None,
    *,
    checkpoint_id: Union[str, os.PathLike[str]],
    storage_writer: Optional[Any] = None,
    overwrite: bool = True,
    ignore_frozen_params: bool = False,
) -> "AsyncSaveFuture":
    """Starts saving ``model`` (and ``optim``) as :func:`save_sharded` does, writing in the
    background; returns once the shards are copied into host staging buffers.

    The files are the same as :func:`save_sharded`'s. Training may go on (step the optimizer,
    change parameters) as soon as this returns: the write reads the staged copy, taken when this
    was called ([Note: Async flat-shard saves]). The staging buffers are allocated by the first
    call and reused by the later ones (pinned host memory for GPU shards).

    One save at a time per process: a call while a save is still in flight first waits for it
    (and raises a ``RuntimeError`` if it failed), as do :func:`save_sharded` and
    :func:`load_sharded`. A process killed during the background write leaves at
    ``checkpoint_id`` the checkpoint that was there (if any) or the new one, complete, with the
    default writer, also when the previous checkpoint is in the same folder ([Note: Kill-safe
    re-saves]).

    Args:
        model: The root FSDP module (every rank calls this, outside forward/backward).
        optim: Its optimizer, or None to save the model only.
        checkpoint_id: The checkpoint folder.
        storage_writer: As in :func:`save_sharded`.
        overwrite: As in :func:`save_sharded`.
        ignore_frozen_params: As in :func:`save_sharded`.

    Returns:
        An :class:`AsyncSaveFuture`, a ``concurrent.futures.Future`` as DCP's ``async_save``
        returns, whose ``result()`` waits for the write and gives what :func:`save_sharded`
        returns, or raises the write's error.

    Raises:
        RuntimeError: The previous asynchronous save failed and its future's outcome was never
            read (nothing is started; the next call saves); or as :func:`save_sharded`
            (``overwrite=False`` into a checkpoint).
        NotImplementedError: As :func:`save_sharded` (a tensor-parallel parameter whose
            placements are not ``Shard``/``Replicate``).
    """
    import torch.distributed.checkpoint as dcp

    writer, state = _start_save(
        "async_save_sharded", model, optim, checkpoint_id, storage_writer, overwrite, ignore_frozen_params
    )
    group = _ASYNC.group()
    staged = _ASYNC.staging.stage(state)
    future: Future[Any]
    if isinstance(writer, CommitWriter):  # [Note: A save without a global plan]
        future = _ASYNC.executor().submit(save_without_global_plan, staged, writer, FlatShardSavePlanner(), group)
    else:
        future = dcp.async_save(  # type: ignore[assignment]
            staged,
            checkpoint_id=checkpoint_id,
            storage_writer=writer,
            planner=FlatShardSavePlanner(),
            process_group=group,
            async_stager=_StagedAlready(),
        )
    handle = AsyncSaveFuture(future)
    _ASYNC.start(handle, checkpoint_id)
    return handle


def load_sharded(
    model: nn.Module,
    optim: Optional[torch.optim.Optimizer] = None,
    *,
    checkpoint_id: Union[str, os.PathLike[str]],
    storage_reader: Optional[Any] = None,
    ignore_frozen_params: bool = False,
) -> None:
    """Loads a sharded DCP checkpoint (from :func:`save_sharded` or a SHARDED state dict with
    the same keys) into ``model`` (and ``optim``), resharding as DCP reads: each rank reads the
    boxes its flat shards hold (and its optimizer states shaped like them) straight into them, in
    place, with no SHARDED state dict ([Note: Flat-shard loads]); so a tensor-parallel model whose
    split is uneven loads too.

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

    _ASYNC.wait_for_in_flight("load_sharded")
    reader = storage_reader if storage_reader is not None else dcp.FileSystemReader(checkpoint_id)
    metadata = reader.read_metadata()
    saved_keys = set(metadata.state_dict_metadata)
    state = flat_shard_load_target(model)
    frozen, others = missing_from_checkpoint(model, state["model"], saved_keys)
    _check_missing(checkpoint_id, frozen, others, ignore_frozen_params)  # before anything changes
    if optim is not None:
        if not optim.state:
            _init_optim_state(optim)
        state["optim"] = optim_load_target(model, optim)
    for key in frozen:
        del state["model"][key]
        if optim is not None:
            state["optim"]["state"].pop(key, None)
    with torch.no_grad():
        if storage_reader is None:  # [Note: A load without a global plan]
            load_without_global_plan(state, reader, FlatShardLoadPlanner(), metadata, _ASYNC.group())
        else:
            dcp.load(state, checkpoint_id=checkpoint_id, storage_reader=reader, planner=FlatShardLoadPlanner())
        apply_loaded(model, optim, state)


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
