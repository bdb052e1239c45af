"""Hugging Face safetensors files written as a stream, and a sharded checkpoint turned into them.

[Note: Streaming safetensors]
A safetensors file is 8 bytes (little-endian u64: the header's length), a JSON header naming
every tensor with its ``dtype``, ``shape`` and ``data_offsets`` (begin and end, in bytes, from
the end of the header), then the tensors' raw bytes back to back, in row-major order and
little-endian. The header comes first, but it needs no value: only each tensor's name, dtype
and shape, which an FSDP model knows statically (its units' parameter infos) and a DCP
checkpoint knows from its metadata. So the files are planned in full before any value exists
(:func:`plan_files`: which tensor goes to which file, Hugging Face's split rule), each file's
header is written when the file is opened, and each tensor's bytes are written as the source
yields it: the writer holds no tensor, only a file buffer of ``buffer_bytes``, and a tensor larger
than that buffer goes from its own memory straight to the file. The files are written under a
``.partial`` name and renamed once complete, the index (several files) after all of them.

Where the values come from:
- a live model: ``fsdp.export.save_safetensors`` runs ``full_params_stream`` (one unit gathered at
  a time, on rank 0 only, zero-copy views of the gathered unit), so the writing rank holds one
  unit plus the file buffer ([Note: Export streams one unit at a time]); a tensor-parallel
  parameter comes in full (its header shape is the DTensor's global one), assembled through its
  tp group one parameter at a time ([Note: Export of tensor-parallel parameters]);
- a sharded checkpoint (:func:`sharded_to_safetensors`): DCP's reader, without a process group,
  one stored chunk at a time where the tensor's chunks are runs of consecutive row-major elements
  (a flat-shard checkpoint's boxes, a SHARDED state dict's rows: their bytes go to the file in
  order), else one whole tensor at a time (a tensor-parallel ``Shard(1)`` parameter's column
  boxes); cast while written, 1 MiB at a time. The writer holds
  one chunk (or tensor), DCP's temporary read of it, and the file buffer.

The names are those of the unwrapped model (a SHARDED state dict's keys, less the checkpoint's
``model.`` prefix), so ``transformers``' ``from_pretrained`` loads the folder (with a
``config.json``, written when the caller passes a config).
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import struct
import sys
import warnings
from typing import Any, Iterable, Iterator, NamedTuple, Optional, Union

import torch

from fsdp.flat_param._layout import itemsize

__all__ = [
    "SAFE_WEIGHTS_NAME",
    "SAFE_WEIGHTS_INDEX_NAME",
    "TensorSpec",
    "FilePlan",
    "plan_files",
    "write_safetensors",
    "sharded_to_safetensors",
]

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"

#: The format's dtype names (those the ``safetensors`` package maps to torch).
_DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}
_PARTIAL = ".partial"


class TensorSpec(NamedTuple):
    """What a file's header says of one tensor: its name, dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: torch.Size

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * itemsize(self.dtype)


class FilePlan(NamedTuple):
    """One file of the export: its name and its tensors, in the order they are written."""

    filename: str
    specs: list[TensorSpec]


def _size_to_int(size: Union[int, str]) -> int:
    """``max_shard_size`` in bytes: an int, or a string as Hugging Face takes it ("5GB" is 5 *
    10**9 bytes, "5GiB" 5 * 2**30)."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)\s*", size.upper())
    if match is None:
        raise ValueError(f"fsdp: max_shard_size={size!r} is not a size; pass bytes (an int) or a string like '5GB'.")
    unit = match.group(2)
    scale = 1 if unit == "B" else (1024 if "I" in unit else 1000) ** ("KMGT".index(unit[0]) + 1)
    return int(float(match.group(1)) * scale)


def plan_files(specs: list[TensorSpec], max_shard_size: Union[int, str]) -> list[FilePlan]:
    """Splits the tensors into files of at most ``max_shard_size`` bytes of data, in order.

    Hugging Face's rule (``huggingface_hub.split_torch_state_dict_into_shards``): a tensor joins
    the current file unless that would exceed the size, and a tensor larger than the size gets a
    file of its own. One difference: Hugging Face keeps filling the current file after such a
    tensor, while here it closes the file, so that every file holds a run of consecutive
    tensors and the files are written one after the other as the tensors come. One file is
    named ``model.safetensors``; several ``model-00001-of-0000N.safetensors``.
    """
    limit = _size_to_int(max_shard_size)
    if limit <= 0:
        raise ValueError(f"fsdp: max_shard_size={max_shard_size!r} must be positive.")
    groups: list[list[TensorSpec]] = []
    used = limit + 1  # start a file at the first tensor
    for spec in specs:
        if not groups or used + spec.nbytes > limit:  # a tensor larger than a file starts and ends one
            groups.append([])
            used = 0
        groups[-1].append(spec)
        used += spec.nbytes
    if len(groups) <= 1:
        return [FilePlan(SAFE_WEIGHTS_NAME, groups[0] if groups else [])]
    return [FilePlan(f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors", g) for i, g in enumerate(groups)]


def _header(specs: list[TensorSpec], metadata: dict[str, str]) -> bytes:
    """The length prefix and the JSON header, padded with spaces to a multiple of 8 bytes (as the
    ``safetensors`` package writes it, so the data starts aligned)."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for spec in specs:
        if spec.dtype not in _DTYPE_NAMES:
            raise NotImplementedError(f"fsdp: safetensors has no dtype for {spec.name} ({spec.dtype}).")
        end = offset + spec.nbytes
        header[spec.name] = {"dtype": _DTYPE_NAMES[spec.dtype], "shape": list(spec.shape), "data_offsets": [offset, end]}
        offset = end
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-(len(blob) + 8) % 8)
    return struct.pack("<Q", len(blob)) + blob


_CAST_PIECE_BYTES = 1 << 20  # a value cast while written is cast in pieces of at most this


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes in row-major order, without a copy when it is a contiguous host tensor."""
    host = tensor.detach().to("cpu").contiguous().reshape(-1)
    return host.view(torch.uint8).numpy().data if host.numel() else memoryview(b"")


def _write_bytes(file: Any, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    """Writes ``tensor``'s bytes in ``dtype``, casting a piece at a time (no whole-tensor copy)."""
    if tensor.dtype == dtype:
        file.write(_raw_bytes(tensor))
        return
    flat = tensor.detach().reshape(-1)
    for piece in flat.split(max(1, _CAST_PIECE_BYTES // flat.element_size())):
        file.write(_raw_bytes(piece.to(dtype)))


class _Writer:
    """Writes the planned files as the tensors come ([Note: Streaming safetensors])."""

    def __init__(self, path: str, plans: list[FilePlan], buffer_bytes: int, metadata: dict[str, str], cast: bool) -> None:
        self.path = path
        self.cast = cast
        self.plans = plans
        self.buffer_bytes = buffer_bytes
        self.metadata = metadata
        self.file_index = 0
        self.tensor_index = 0  # in the current file
        self.file: Optional[Any] = None

    def _expected(self) -> TensorSpec:
        while self.tensor_index == len(self.plans[self.file_index].specs):
            if self.file_index + 1 == len(self.plans):
                raise RuntimeError("fsdp: safetensors export: the source yielded more tensors than were planned.")
            self._close_file()
        return self.plans[self.file_index].specs[self.tensor_index]

    def write(self, name: str, value: Union[torch.Tensor, Iterator[torch.Tensor]]) -> None:
        """Writes ``value``: the tensor, or (``cast`` writers) its row-major runs in order."""
        spec = self._expected()
        if isinstance(value, torch.Tensor):
            dtype = spec.dtype if self.cast else value.dtype
            if (name, dtype, value.shape) != (spec.name, spec.dtype, spec.shape):
                raise RuntimeError(
                    f"fsdp: safetensors export: the source yielded {name} ({value.dtype}, {tuple(value.shape)}) where "
                    f"the header says {spec.name} ({spec.dtype}, {tuple(spec.shape)}); the model changed during the export."
                )
        elif name != spec.name or not self.cast:
            raise RuntimeError(f"fsdp: safetensors export: the source yielded runs of {name} where the header says {spec.name}.")
        file = self._open()
        numel = 0
        for piece in [value] if isinstance(value, torch.Tensor) else value:
            _write_bytes(file, piece, spec.dtype)
            numel += piece.numel()
            del piece
        if numel * itemsize(spec.dtype) != spec.nbytes:
            raise RuntimeError(f"fsdp: safetensors export: {name} came with {numel} elements, not the {tuple(spec.shape)} planned.")
        self.tensor_index += 1

    def _open(self) -> Any:
        """The current file, opened with its header written if it was not yet."""
        if self.file is None:
            plan = self.plans[self.file_index]
            header = _header(plan.specs, self.metadata)
            # The buffer is allocated whole when the file opens: no larger than the file (and 0,
            # unbuffered, for a size of 1, which binary files take as the default size).
            buffering = min(self.buffer_bytes, len(header) + sum(s.nbytes for s in plan.specs))
            buffering = buffering if buffering > 1 else 0
            self.file = open(os.path.join(self.path, plan.filename + _PARTIAL), "wb", buffering=buffering)
            self.file.write(header)
        return self.file

    def _close_file(self) -> None:
        filename = os.path.join(self.path, self.plans[self.file_index].filename)
        if self.file is None:  # a file without tensors (an empty model)
            self.file = open(filename + _PARTIAL, "wb")
            self.file.write(_header([], self.metadata))
        self.file.close()
        os.replace(filename + _PARTIAL, filename)
        self.file = None
        self.file_index += 1
        self.tensor_index = 0

    def finish(self) -> None:
        while self.file_index < len(self.plans):
            if self.tensor_index < len(self.plans[self.file_index].specs):
                missing = self.plans[self.file_index].specs[self.tensor_index].name
                raise RuntimeError(f"fsdp: safetensors export: the source ended before {missing}.")
            self._close_file()

    def abort(self) -> None:
        """Closes and removes a file left incomplete (the export failed)."""
        if self.file is not None:
            self.file.close()
            self.file = None
            os.remove(os.path.join(self.path, self.plans[self.file_index].filename + _PARTIAL))


def _write_index(path: str, plans: list[FilePlan]) -> None:
    """``model.safetensors.index.json`` as Hugging Face writes it (several files only)."""
    specs = [spec for plan in plans for spec in plan.specs]
    numels = [spec.nbytes // max(itemsize(spec.dtype), 1) for spec in specs]
    index = {
        "metadata": {"total_parameters": sum(numels), "total_size": sum(spec.nbytes for spec in specs)},
        "weight_map": {spec.name: plan.filename for plan in plans for spec in plan.specs},
    }
    with open(os.path.join(path, SAFE_WEIGHTS_INDEX_NAME), "w", encoding="utf-8") as f:
        f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _write_config(path: str, config: Any) -> None:
    """``config.json`` from a ``transformers`` config (``to_json_file``) or a dict."""
    target = os.path.join(path, CONFIG_NAME)
    if hasattr(config, "to_json_file"):
        config.to_json_file(target)
    elif isinstance(config, dict):
        with open(target, "w", encoding="utf-8") as f:
            f.write(json.dumps(config, indent=2, sort_keys=True) + "\n")
    else:
        raise TypeError(f"fsdp: config must be a transformers config or a dict, not {type(config).__name__}.")


def write_safetensors(
    path: Union[str, os.PathLike[str]],
    specs: list[TensorSpec],
    tensors: Iterable[tuple[str, Union[torch.Tensor, Iterator[torch.Tensor]]]],
    *,
    max_shard_size: Union[int, str],
    buffer_bytes: int,
    config: Any = None,
    metadata: Optional[dict[str, str]] = None,
    cast: bool = False,
) -> list[str]:
    """Writes ``tensors`` (yielded in the order of ``specs``, each matching its spec) into the
    folder ``path`` as safetensors files, one tensor at a time ([Note: Streaming safetensors]).
    With ``cast``, a tensor may come in another dtype than its spec's and is cast while written,
    1 MiB at a time; without, that is an error.

    Returns:
        The files written (names in ``path``), the index and ``config.json`` included.
    """
    if sys.byteorder != "little":
        raise NotImplementedError("fsdp: safetensors files are little-endian; this host is big-endian.")
    if buffer_bytes <= 0:
        raise ValueError(f"fsdp: buffer_bytes={buffer_bytes} must be positive.")
    folder = os.fspath(path)
    os.makedirs(folder, exist_ok=True)
    plans = plan_files(specs, max_shard_size)
    writer = _Writer(folder, plans, buffer_bytes, {"format": "pt", **(metadata or {})}, cast)
    try:
        for name, value in tensors:
            writer.write(name, value)
            del value  # before the source makes the next (a view would keep its unit alive)
        writer.finish()
    finally:
        writer.abort()
    written = [plan.filename for plan in plans]
    if len(plans) > 1:
        _write_index(folder, plans)
        written.append(SAFE_WEIGHTS_INDEX_NAME)
    if config is not None:
        _write_config(folder, config)
        written.append(CONFIG_NAME)
    return written


# ----------------------------------------------------------------------------- from a checkpoint
class _SavedTensor(NamedTuple):
    key: str  # in the checkpoint
    dtype: torch.dtype  # as saved
    spec: TensorSpec  # as exported


def _checkpoint_specs(storage_reader: Any, prefix: str, dtype: Optional[torch.dtype]) -> list[_SavedTensor]:
    """Every tensor under ``prefix``, in the metadata's order."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    result = []
    for key, md in storage_reader.read_metadata().state_dict_metadata.items():
        if key.startswith(prefix) and isinstance(md, TensorStorageMetadata):
            saved = md.properties.dtype
            exported = dtype if dtype is not None and saved.is_floating_point else saved
            result.append(_SavedTensor(key, saved, TensorSpec(key[len(prefix) :], exported, torch.Size(md.size))))
    return result


def _dcp_load(state_dict: dict[str, Any], storage_reader: Any, planner: Any = None) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # one process, on purpose: DCP warns of it every time
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.load(state_dict, storage_reader=storage_reader, planner=planner, no_dist=True)


def _row_major_runs(shape: torch.Size, chunks: list[Any]) -> Optional[list[Any]]:
    """The chunks in row-major order when each is a run of consecutive elements of the tensor and
    together they cover it once (a flat-shard checkpoint's boxes, a SHARDED state dict's rows);
    None otherwise (columns, say)."""
    strides = [1] * len(shape)
    for dim in range(len(shape) - 2, -1, -1):
        strides[dim] = strides[dim + 1] * shape[dim + 1]
    runs = []
    for chunk in chunks:
        sizes = list(chunk.sizes)
        if 0 in sizes:
            continue
        first = next((d for d, size in enumerate(sizes) if size > 1), len(sizes))
        if any(sizes[d] != shape[d] for d in range(first + 1, len(shape))):
            return None
        start = sum(o * st for o, st in zip(chunk.offsets, strides))
        runs.append((start, math.prod(sizes), chunk))
    runs.sort(key=lambda run: run[0])
    at = 0
    for start, numel, _ in runs:
        if start != at:
            return None
        at += numel
    return [chunk for _, _, chunk in runs] if at == math.prod(shape) else None


@functools.lru_cache(maxsize=None)
def _chunk_planner_type() -> type:
    """:class:`_ChunkPlan` as a DCP ``LoadPlanner`` (DCP imported only when it is used)."""
    from torch.distributed.checkpoint.planner import LoadPlanner

    return type("_ChunkPlanner", (_ChunkPlan, LoadPlanner), {})


def _chunk_planner(key: str, chunk: Any, target: torch.Tensor) -> Any:
    """A DCP load planner that reads one stored chunk of one tensor, whole, into ``target``."""
    return _chunk_planner_type()(key, chunk, target)


class _ChunkPlan:
    """The methods of :func:`_chunk_planner`'s planner (DCP imported only when it is used)."""

    def __init__(self, key: str, chunk: Any, target: torch.Tensor) -> None:
        self.key, self.chunk, self.target = key, chunk, target

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
        pass

    def create_local_plan(self) -> Any:
        from torch.distributed.checkpoint.metadata import MetadataIndex
        from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

        index = MetadataIndex(self.key, self.chunk.offsets)
        zeros = torch.Size([0] * len(self.chunk.sizes))
        return LoadPlan([ReadItem(LoadItemType.TENSOR, index, zeros, index, zeros, torch.Size(self.chunk.sizes))])

    def create_global_plan(self, plans: list[Any]) -> list[Any]:
        return plans

    def finish_plan(self, plan: Any) -> Any:
        return plan

    def resolve_tensor(self, read_item: Any) -> torch.Tensor:
        return self.target

    def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
        pass

    def load_bytes(self, read_item: Any, value: Any) -> None:
        raise RuntimeError(f"fsdp: {self.key} is stored as bytes, not as a tensor.")


def _runs(storage_reader: Any, key: str, dtype: torch.dtype, chunks: list[Any]) -> Iterator[torch.Tensor]:
    """The stored chunks of one tensor, in row-major order, each read alone and dropped."""
    for chunk in chunks:
        target = torch.empty(chunk.sizes, dtype=dtype)
        _dcp_load({}, storage_reader, _chunk_planner(key, chunk, target))
        yield target
        del target


def _read_one_at_a_time(storage_reader: Any, saved: list[_SavedTensor]) -> Iterator[tuple[str, Any]]:
    """Each tensor as saved (the writer casts it), with DCP and no process group: its chunks one at
    a time where they are row-major runs ([Note: Streaming safetensors]), else read whole."""
    chunks = {key: md.chunks for key, md in storage_reader.read_metadata().state_dict_metadata.items()}
    for tensor in saved:
        runs = _row_major_runs(tensor.spec.shape, chunks[tensor.key])
        if runs is not None:
            yield tensor.spec.name, _runs(storage_reader, tensor.key, tensor.dtype, runs)
            continue
        target = {tensor.key: torch.empty(tensor.spec.shape, dtype=tensor.dtype)}
        _dcp_load(target, storage_reader)
        yield tensor.spec.name, target.pop(tensor.key)


def sharded_to_safetensors(
    checkpoint_id: Union[str, os.PathLike[str]],
    path: Union[str, os.PathLike[str]],
    *,
    dtype: Optional[torch.dtype] = None,
    max_shard_size: Union[int, str] = "50GB",
    buffer_bytes: int = 16 << 20,
    config: Any = None,
    metadata: Optional[dict[str, str]] = None,
    storage_reader: Optional[Any] = None,
) -> list[str]:
    """Writes the model of a sharded DCP checkpoint as Hugging Face safetensors files.

    Reads the checkpoint (``fsdp.checkpoint.save_sharded``'s, or any DCP checkpoint of a SHARDED
    state dict under ``"model"``) with DCP's reader, one stored chunk at a time (one tensor at a
    time where its chunks are not row-major runs), in this process alone: no process group is
    needed (and none is used if one exists), and the memory is one chunk (or tensor), DCP's
    temporary read of it and the file buffer ([Note: Streaming safetensors]).

    Args:
        checkpoint_id: The checkpoint folder.
        path: The output folder (created if needed); files already there are replaced.
        dtype: Cast floating-point tensors to it (``torch.bfloat16`` for inference); None keeps
            the saved dtypes.
        max_shard_size: The most bytes of tensor data per file (an int, or "5GB"-style as
            Hugging Face takes it); larger models get several files and
            ``model.safetensors.index.json``.
        buffer_bytes: The file buffer: small tensors are coalesced into writes of this size.
        config: A ``transformers`` config (or a dict) to write as ``config.json``; None writes
            none (``from_pretrained`` needs one in the folder, or passed to it).
        metadata: Extra string entries for each file's ``__metadata__`` (``format`` is "pt").
        storage_reader: A DCP ``StorageReader``; default ``FileSystemReader(checkpoint_id)``.

    Returns:
        The names of the files written in ``path``.
    """
    if storage_reader is None:
        import torch.distributed.checkpoint as dcp

        storage_reader = dcp.FileSystemReader(checkpoint_id)
    saved = _checkpoint_specs(storage_reader, "model.", dtype)
    if not saved:
        raise ValueError(
            f"fsdp: the checkpoint {os.fspath(checkpoint_id)!r} holds no model tensors (keys 'model.<name>'); "
            "pass a checkpoint written by fsdp.checkpoint.save_sharded or dcp.save({'model': ...})."
        )
    return write_safetensors(
        path,
        [tensor.spec for tensor in saved],
        _read_one_at_a_time(storage_reader, saved),
        max_shard_size=max_shard_size,
        buffer_bytes=buffer_bytes,
        config=config,
        metadata=metadata,
        cast=True,
    )
