"""Flat-shard saves and loads without a global plan: every rank's plan is final as it is made.

[Note: A save without a global plan]
DCP's save protocol (``torch.distributed.checkpoint.save``) serves state dicts whose ranks do not
know what the others hold: every rank sends its plan to the coordinator, which deduplicates the
items, rewrites their index hints, builds and validates the metadata and sends every rank its
final plan back; after the write it gathers the write results, commits, and broadcasts the whole
metadata to every rank. Each of those steps is linear in the chunks of all ranks, on the
coordinator (unpickling every plan, pickling every final plan, unpickling every result) and, for
the broadcast, on every rank. Measured on the 32-unit benchmark at 16 ranks, the coordinator's
save took 2.4 times the CPU time of the others, and the others' grew with the world size too.

A flat-shard save needs none of it, because who writes what is static ([Note: Flat-shard
checkpoints]; [Note: Who writes a replicated value]): every rank plans only the boxes of its own
shards, a value several ranks hold alike is planned by one of them by a rule all ranks apply
alike, and the writer names each rank's files itself (``CommitWriter``: a fresh tag per rank
and save, [Note: Kill-safe re-saves]). So a rank's local plan is its final plan, and the save is:

1. each rank plans and writes its own items with DCP's planner and writer (no communication);
2. each rank sends the coordinator what the metadata needs of it: per written item its key,
   chunk, tensor properties and where its bytes lie (file, offset, length), and the flattening
   paths of the keys it wrote; or the rank's failure. The coordinator receives the reports one
   at a time in rank order and merges each before the next, so it holds one report's buffer at
   a time (a gather would allocate the world size times the largest report at once);
3. the coordinator builds DCP's ``Metadata`` from them, as DCP's default planner builds it (the
   same keys, chunks, properties and storage entries; only the index hints, which readers treat
   as hints, are left unset), checks that each tensor's chunks lie in it and cover it exactly
   once, and commits it (``CommitWriter.commit``: one atomic rename of ``.metadata``);
4. one broadcast of the outcome (nothing, or every rank's failures), so that all ranks return or
   all raise DCP's ``CheckpointException``.

These messages are metadata, Python objects pickled into byte tensors: they travel on a gloo group
of every rank, made once (the one an asynchronous save writes on), whatever backend trains. So
they are staged in host memory, never on a GPU, and the coordinator's receives from each rank
need no NCCL communicator per pair of ranks.

The coordinator's work is the metadata itself (each chunk's entry built once and pickled once
into ``.metadata``, which DCP's format requires), every other rank's is its own items plus two
small messages, whatever the world size. A value written by two ranks after all (the scalar
states of a parameter with no elements, which every rank that has them plans) is entered once,
the lowest rank's copy, as DCP's deduplication would keep it; the other copies' few bytes stay
unreferenced in their files.

The checkpoint is the same kind DCP's protocol writes: ``dcp.load``, torch FSDP1/FSDP2 and
``load_sharded`` read it at any world size. ``save_sharded`` returns the ``Metadata`` on the
coordinator only; handing it to every rank is the broadcast this protocol leaves out (None
elsewhere). A ``storage_writer`` that is not a ``CommitWriter`` cannot name its files per rank,
so ``save_sharded`` hands it to ``dcp.save`` with the same planner.
"""

from __future__ import annotations

import math
import operator
import pickle
from typing import Any, NamedTuple, Optional, Union, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItemType

from fsdp.state_dict._commit_writer import CommitWriter
from fsdp.state_dict._flat_checkpoint import FlatShardLoadPlanner, FlatShardSavePlanner

__all__ = ["save_without_global_plan", "load_without_global_plan"]


class _Written(NamedTuple):
    """What the coordinator needs of one rank's save ([Note: A save without a global plan]).

    Attributes:
        tensors: Per written tensor item: key, chunk (offsets and sizes), properties, the whole
            tensor's shape and where its bytes lie. Chunk, properties and shape objects are
            shared by the items of a parameter, so they pickle once.
        byte_items: Per written non-tensor item: key and where its bytes lie.
        paths: The flattening path of every key written (``Metadata.planner_data``).
    """

    tensors: list[tuple[str, ChunkStorageMetadata, TensorProperties, torch.Size, Any]]
    byte_items: list[tuple[str, Any]]
    paths: dict[str, Any]


_Report = Union[_Written, tuple[BaseException, Any]]


def _plan_and_write(
    state_dict: dict[str, Any], writer: CommitWriter, planner: FlatShardSavePlanner, rank: int, is_coordinator: bool
) -> _Written:
    """Step 1: plan this rank's items and write them; what the coordinator needs of them."""
    planner.set_up_planner(state_dict=state_dict, storage_meta=writer.storage_meta(), is_coordinator=is_coordinator)
    writer.set_up_storage_writer(is_coordinator, rank=rank)
    plan = planner.create_local_plan()
    plan = writer.prepare_local_plan(plan)  # this rank's own file names: its plan is final
    plan = planner.finish_plan(plan)
    future = writer.write_data(plan, planner)
    future.wait()
    where = {result.index: result.storage_data for result in future.value()}
    tensors, byte_items = [], []
    for item in plan.items:
        if item.type == WriteItemType.BYTE_IO:
            byte_items.append((item.index.fqn, where[item.index]))
        else:
            data = cast(TensorWriteData, item.tensor_data)  # set on every tensor item
            tensors.append((item.index.fqn, data.chunk, data.properties, data.size, where[item.index]))
    mappings = planner.mappings
    paths = {fqn: mappings[fqn] for fqn in {entry[0] for entry in tensors} | {entry[0] for entry in byte_items}}
    return _Written(tensors, byte_items, paths)


class _MetadataBuilder:
    """Step 3: DCP's ``Metadata`` of every rank's items, merged one report at a time in rank
    order, a key and chunk written twice entered once (the lowest rank's), checked to tile each
    tensor ([Note: A save without a global plan]); or the ranks' failures."""

    def __init__(self) -> None:
        self.entries: dict[str, Any] = {}
        self.storage: dict[MetadataIndex, Any] = {}
        self.paths: dict[str, Any] = {}
        self.failures: dict[int, Any] = {}

    def add(self, rank: int, report: _Report) -> None:
        """Merges ``rank``'s report (or records its failure)."""
        if not isinstance(report, _Written):
            self.failures[rank] = report
            return
        if self.failures:
            return  # the save fails: nothing more to build
        entries, storage = self.entries, self.storage
        for fqn, chunk, properties, size, info in report.tensors:
            if storage.setdefault(MetadataIndex(fqn, chunk.offsets), info) is not info:
                continue  # written by a lower rank too
            tensor = entries.get(fqn)
            if tensor is None:
                tensor = entries[fqn] = TensorStorageMetadata(properties=properties, size=size, chunks=[])
            tensor.chunks.append(chunk)
        for fqn, info in report.byte_items:
            if storage.setdefault(MetadataIndex(fqn), info) is info:
                entries[fqn] = BytesStorageMetadata()
        for fqn, path in report.paths.items():
            self.paths.setdefault(fqn, path)

    def build(self) -> Metadata:
        """The checkpoint's metadata, once every rank's report is in and none failed."""
        _check_tiling(self.entries)
        metadata = Metadata(state_dict_metadata=self.entries, planner_data=self.paths)
        metadata.storage_data = self.storage
        return metadata


def _check_tiling(entries: dict[str, Any]) -> None:
    """Every tensor's chunks lie in it and their volumes add up to it: the boxes of the flat
    ranges of all ranks tile each parameter ([Note: A flat range is a few boxes]), and a chunk
    written twice was entered once, so a gap or an overlap is a planning bug. (A parameter's
    optimizer states share its chunk objects: each is checked against a shape once.)"""
    inside: set[tuple[int, tuple[int, ...]]] = set()
    for fqn, entry in entries.items():
        if isinstance(entry, BytesStorageMetadata) or len(entry.size) == 0:
            continue
        size = tuple(entry.size)
        volume = 0
        for chunk in entry.chunks:
            volume += math.prod(chunk.sizes)
            if (id(chunk), size) in inside:
                continue
            ends = tuple(map(operator.add, chunk.offsets, chunk.sizes))
            if min(chunk.offsets) < 0 or not all(map(operator.le, ends, size)):
                raise ValueError(
                    f"Failed to validate global plan: key:{fqn} has out of bounds chunk: tensor-size:"
                    f"{entry.size} chunk: {chunk}. fsdp: a flat-shard save planned a box outside its "
                    "parameter (an internal error; please report it with the model's wrap plan)."
                )
            inside.add((id(chunk), size))
        if volume != math.prod(size):
            raise ValueError(
                f"Failed to validate global plan: key:{fqn} invalid fill tensor-volume: "
                f"{math.prod(size)} chunks-volume: {volume}. fsdp: the ranks' flat-shard boxes do "
                "not cover the parameter exactly once (an internal error; please report it with the "
                "model's wrap plan)."
            )


def save_without_global_plan(
    state_dict: dict[str, Any],
    writer: CommitWriter,
    planner: FlatShardSavePlanner,
    group: Optional[dist.ProcessGroup] = None,
) -> Optional[Metadata]:
    """Writes ``state_dict`` (a flat-shard state dict) as a DCP checkpoint, each rank sending the
    coordinator one report, and one broadcast of the outcome ([Note: A save without a global plan]). Every rank of ``group``
    calls it.

    Returns:
        The checkpoint's ``Metadata`` on the coordinator (``group``'s rank 0), None elsewhere.

    Raises:
        CheckpointException: On every rank, when any rank failed to plan or write, or the
            coordinator to commit (each failure with its rank and traceback, as DCP's).
    """
    rank = dist.get_rank(group)
    is_coordinator = rank == 0
    report: _Report
    try:
        report = _plan_and_write(state_dict, writer, planner, rank, is_coordinator)
    except BaseException as exc:  # as DCP's protocol: every failure goes to the coordinator
        report = _failure(exc)
    coordinator = _global_rank(group, 0)
    outcome: list[Any] = [None]
    metadata: Optional[Metadata] = None
    if is_coordinator:
        builder = _MetadataBuilder()
        for src in range(dist.get_world_size(group)):
            if src:
                received: list[Any] = [None]
                dist.recv_object_list(received, src=_global_rank(group, src), group=group)
                report = received[0]
            try:
                builder.add(src, report)
            except BaseException as exc:  # a bug in the merge: every rank raises it
                builder.failures.setdefault(0, _failure(exc))
        if not builder.failures:
            try:
                metadata = builder.build()
                writer.commit(metadata)
            except BaseException as exc:
                builder.failures[0] = _failure(exc)
        if builder.failures:
            outcome[0] = CheckpointException("save", builder.failures)
    else:
        dist.send_object_list([report], dst=coordinator, group=group)
    dist.broadcast_object_list(outcome, src=coordinator, group=group)
    if outcome[0] is not None:
        raise outcome[0]
    return metadata


def _failure(exc: BaseException) -> tuple[BaseException, Any]:
    """``exc`` with its traceback, as DCP wraps a rank's failure, made sure to pickle: an
    exception that does not (one holding a lock, a lambda) would fail the message that carries
    it, and the ranks waiting for that message would wait until the group's timeout. Such an
    exception travels as a ``RuntimeError`` with its type, text and traceback."""
    wrapped = _wrap_exception(exc)
    text = RuntimeError(f"{type(exc).__name__}: {exc} (the exception itself does not pickle)")
    for candidate in (wrapped, (text, wrapped[1]), (text, None)):
        try:
            pickle.dumps(candidate)
        except Exception:  # any pickling failure: try the plainer form
            continue
        return candidate
    return text, None  # unreachable: a RuntimeError of a str pickles


def _global_rank(group: Optional[dist.ProcessGroup], group_rank: int) -> int:
    return dist.get_global_rank(group, group_rank) if group is not None else group_rank


# [Note: A load without a global plan]
# DCP's load protocol (``torch.distributed.checkpoint.load``) gathers every rank's read plan to
# the coordinator and scatters it back, and its default global step changes nothing
# (``create_default_global_load_plan`` and ``FileSystemReader.prepare_global_plan`` return the
# plans as they are): at 16 ranks the coordinator's load spent a third of its time unpickling and
# pickling the other ranks' plans. A flat-shard load reads each rank's own boxes ([Note:
# Flat-shard loads] in ``_flat_checkpoint.py``), so with DCP's file reader each rank plans and
# reads alone, as DCP itself does without collectives (``load(..., use_collectives=False)``'s
# path: the global step run on the rank's own plan), with the metadata ``load_sharded`` read once
# for its missing-keys check; then one exchange of the outcome, so that every rank returns or
# every rank raises DCP's ``CheckpointException`` with each rank's failure. A ``storage_reader``
# of the caller's may need its global step to see every plan, so ``load_sharded`` hands it to
# ``dcp.load``.
def load_without_global_plan(
    state_dict: dict[str, Any],
    reader: Any,
    planner: FlatShardLoadPlanner,
    metadata: Metadata,
    group: Optional[dist.ProcessGroup] = None,
) -> None:
    """Reads ``metadata``'s checkpoint into ``state_dict`` (a flat-shard load target), each rank
    alone, then exchanges the outcome ([Note: A load without a global plan]). Every rank of
    ``group`` calls it.

    Raises:
        CheckpointException: On every rank, when any rank failed to plan or read (each failure
            with its rank and traceback, as DCP's).
    """
    rank = dist.get_rank(group)
    failure: Optional[tuple[BaseException, Any]] = None
    try:
        planner.set_up_planner(state_dict, metadata, rank == 0)
        reader.set_up_storage_reader(metadata, rank == 0, rank=rank, use_collectives=False)
        plan = reader.prepare_local_plan(planner.create_local_plan())
        (plan,) = reader.prepare_global_plan(planner.create_global_plan([plan]))
        reader.read_data(planner.finish_plan(plan), planner).wait()
    except BaseException as exc:  # as DCP's protocol: every rank hears of every failure
        failure = _failure(exc)
    outcomes: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(outcomes, failure, group=group)
    failures = {r: got for r, got in enumerate(outcomes) if got is not None}
    if failures:
        raise CheckpointException("load", failures)
