"""Streaming export to Hugging Face safetensors (fsdp.export.save_safetensors,
fsdp.checkpoint.sharded_to_safetensors): a ``transformers`` Llama built from a tiny config,
wrapped by fsdp at 2 and 4 ranks, exported, then ``AutoModelForCausalLM.from_pretrained`` equals
the unwrapped model bit for bit, every parameter; the same from a sharded checkpoint converted in
a process without a process group; the writer's extra memory is one unit plus the file buffer.
Tensor-parallel (DTensor) parameters on a 2 dp x 2 tp mesh are written in full, live and from a
TP sharded checkpoint, within the TP stream's memory bound.

``transformers`` is an optional test dependency (setup.py's ``stacks`` extra, which CI installs):
the tests skip only when it is missing (``safetensors`` and ``huggingface_hub``, which read the
files back here, come with it).
"""

from __future__ import annotations

import gc
import json
import os
import tracemalloc
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests._harness import RankPool, get_pool

pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install -e '.[stacks]' installs the pinned version)"
)

BUFFER_BYTES = 32 << 10  # the file buffer of the memory checks: below one tensor of the model


def _config(tie: bool) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )


def _llama(tie: bool) -> nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(_config(tie))


def _wrapped(model: nn.Module, orig: bool, mp_offload: bool = False) -> nn.Module:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from fsdp import CPUOffload, FullyShardedDataParallel as FSDP, MixedPrecision, ShardingStrategy
    from fsdp.wrap import ModuleWrapPolicy

    return FSDP(
        model,
        auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        use_orig_params=orig,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16) if mp_offload else None,
        cpu_offload=CPUOffload(offload_params=mp_offload),
        device_id=torch.device("cpu"),
    )


# (name, use_orig_params, export dtype, tied embeddings, max_shard_size); the "mp_offload" case
# trains in bf16 with the parameters offloaded: the export holds the full-precision values.
CASES = [
    ("flat_fp32", False, None, False, "50GB"),
    ("orig_bf16_split", True, torch.bfloat16, False, 40_000),
    ("flat_bf16_tied_split", False, torch.bfloat16, True, 40_000),
    ("orig_fp32_tied", True, None, True, "50GB"),
    ("flat_fp32_mp_offload", False, None, False, 40_000),
]


def export_cases(root: str) -> dict[str, Any]:
    """Every case at this world size: the live export (rank 0 writes) and a sharded checkpoint
    of the same model (every rank writes its shards). Rank 0 returns the unwrapped values."""
    from fsdp.checkpoint import save_sharded
    from fsdp.export import save_safetensors

    expected: dict[str, Any] = {}
    for name, orig, dtype, tie, max_shard_size in CASES:
        model = _llama(tie)
        expected[name] = {k: v.clone() for k, v in model.state_dict().items()}
        wrapped = _wrapped(model, orig, mp_offload=name.endswith("mp_offload"))
        written = save_safetensors(
            wrapped, os.path.join(root, name, "live"), dtype=dtype, max_shard_size=max_shard_size, config=_config(tie)
        )
        save_sharded(wrapped, checkpoint_id=os.path.join(root, name, "checkpoint"))
        if dist.get_rank() == 0:
            expected[name + "/written"] = written
        else:
            assert written == [], written
        dist.barrier()
    return expected if dist.get_rank() == 0 else {}


def _check_folder(folder: str, expected: dict[str, torch.Tensor], dtype: Optional[torch.dtype], tie: bool, split: bool) -> None:
    """``from_pretrained(folder)`` holds ``expected`` (cast to ``dtype``) bit for bit; the files
    hold each tensor once (the tied head left out, as ``save_pretrained`` does)."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if split:
        assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors", files
        with open(os.path.join(folder, "model.safetensors.index.json")) as f:
            index = json.load(f)
        assert set(index["weight_map"].values()) == set(files), index
    else:
        assert files == ["model.safetensors"] and "model.safetensors.index.json" not in os.listdir(folder), files
    stored: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(os.path.join(folder, file), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            stored.update({key: f.get_tensor(key) for key in f.keys()})
    if split:
        assert index["weight_map"] == {k: next(f for f in files if k in _keys(folder, f)) for k in stored}
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in stored.values())
    want = {k: v.to(dtype) if dtype is not None and v.is_floating_point() else v for k, v in expected.items()}
    assert set(stored) == set(want) - ({"lm_head.weight"} if tie else set()), sorted(stored)
    for key, tensor in stored.items():
        assert tensor.dtype == want[key].dtype and torch.equal(tensor, want[key]), key
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype or torch.float32)
    loaded_sd = loaded.state_dict()
    assert set(loaded_sd) == set(want), sorted(set(loaded_sd) ^ set(want))
    for key, value in want.items():
        assert loaded_sd[key].dtype == value.dtype and torch.equal(loaded_sd[key], value), key
    if tie:
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight


def _keys(folder: str, file: str) -> set[str]:
    from safetensors import safe_open

    with safe_open(os.path.join(folder, file), framework="pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("world_size", [2, 4])
def test_from_pretrained_bit_exact(world_size: int, tmp_path: Any) -> None:
    """Live export at ``world_size`` ranks, and the sharded checkpoint of the same model converted
    here, in the test process, which has no process group."""
    from fsdp.checkpoint import sharded_to_safetensors

    expected = get_pool(world_size).run(export_cases, str(tmp_path), _timeout=300)[0]
    assert not dist.is_initialized()
    for name, _, dtype, tie, max_shard_size in CASES:
        split = max_shard_size != "50GB"
        live = os.path.join(tmp_path, name, "live")
        assert sorted(expected[name + "/written"]) == sorted(os.listdir(live)), os.listdir(live)
        _check_folder(live, expected[name], dtype, tie, split)
        converted = os.path.join(tmp_path, name, "converted")
        written = sharded_to_safetensors(
            os.path.join(tmp_path, name, "checkpoint"), converted, dtype=dtype, max_shard_size=max_shard_size, config=_config(tie)
        )
        assert sorted(written) == sorted(os.listdir(converted))
        _check_folder(converted, expected[name], dtype, tie, split)


# ----------------------------------------------------------------------------- memory
def _unit_bytes(wrapped: nn.Module) -> int:
    from fsdp import FullyShardedDataParallel as FSDP

    return max(h.shard_layout.padded_unsharded_numel * 4 for m in FSDP.fsdp_modules(wrapped) for h in m._fsdp_state.handles)


def _export_extra(wrapped: nn.Module, folder: str) -> int:
    """Extra live bytes (torch's allocations) of ``save_safetensors`` into ``folder``0 and 1 (the
    first also warms up: imports, caches), of the second."""
    from benchmarks.memory import MemoryTrace
    from fsdp.export import save_safetensors

    for attempt in range(2):
        with MemoryTrace() as trace, trace.window("export"):
            save_safetensors(wrapped, f"{folder}{attempt}", buffer_bytes=BUFFER_BYTES)
    return trace.peaks["export"] - trace.starts["export"]


def writer_memory(root: str) -> dict[str, Any]:
    """Rank 0's extra live bytes while exporting: torch's allocations (the profiler trace
    test_export.py uses) beside those of the same units' gathers to rank 0 alone (the floor:
    gloo stages a gather through a buffer of its output's size), and Python's (tracemalloc: the
    file buffer, the header)."""
    import fsdp.export as export
    from benchmarks.memory import MemoryTrace
    from fsdp import FullyShardedDataParallel as FSDP
    from fsdp.export import save_safetensors

    wrapped = _wrapped(_llama(False), orig=False)
    handles = [h for m in FSDP.fsdp_modules(wrapped) for h in m._fsdp_state.handles]
    result: dict[str, Any] = {"unit_bytes": _unit_bytes(wrapped), "floor": 0}
    for _ in range(2):
        with MemoryTrace() as trace, trace.window("gathers"):
            for h in handles:
                export.gather(h._local_shard, h.process_group, h.rank, h.world_size, export._dst(h, True, [None] * len(h.param_infos)))
        result["floor"] = max(result["floor"], trace.peaks["gathers"] - trace.starts["gathers"])
    result["extra"] = _export_extra(wrapped, os.path.join(root, "memory"))
    tracemalloc.start()
    save_safetensors(wrapped, os.path.join(root, "memory_python"), buffer_bytes=BUFFER_BYTES)
    _, result["python_peak"] = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    # rank 0 cannot write (the folder is a file): it still joins every unit's gather, so the
    # other ranks return, and then raises.
    blocked = os.path.join(root, "blocked")
    if dist.get_rank() == 0:
        open(blocked, "w").close()
    dist.barrier()
    try:
        result["blocked"] = save_safetensors(wrapped, blocked)
    except (FileExistsError, NotADirectoryError) as error:
        result["blocked"] = type(error).__name__
    dist.barrier()
    return result


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process, on purpose
def test_writer_memory_is_one_unit_plus_one_buffer(pool2: RankPool, tmp_path: Any) -> None:
    from benchmarks.memory import MemoryTrace
    from fsdp.checkpoint import sharded_to_safetensors

    reports = pool2.run(writer_memory, str(tmp_path), _timeout=300)
    assert [x["blocked"] for x in reports] == ["FileExistsError", []], reports
    r = reports[0]
    # torch's allocations: the gathers' own (the floor: the gathered unit and gloo's staging copy
    # of it) and nothing of the writer's (the tensors go from the gathered unit to the file
    # without a copy); the one unit of slack is gloo's worker freeing the previous unit's
    # staging copy a moment late, which either run may catch ([Note: A finished collective's
    # thread runs] in fsdp/_comm/_collectives.py).
    assert r["extra"] <= r["floor"] + r["unit_bytes"], r
    assert r["floor"] <= 3 * r["unit_bytes"], r
    # Python's: the file buffer and the header (a few hundred bytes per tensor).
    assert r["python_peak"] <= BUFFER_BYTES + (64 << 10), r

    # From a checkpoint, in this process (no process group), beside DCP's own reads of the same
    # tensors one at a time (the floor; DCP's planning allocates Python objects per read).
    import torch.distributed.checkpoint as dcp

    model = _llama(False)
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    unit_bytes = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    checkpoint = str(tmp_path / "ckpt")
    dcp.save({"model": model.state_dict()}, checkpoint_id=checkpoint, no_dist=True)
    reader = dcp.FileSystemReader(checkpoint)
    floor = 0
    for _ in range(2):
        gc.collect()
        tracemalloc.start()
        for key, md in reader.read_metadata().state_dict_metadata.items():
            dcp.load({key: torch.empty(md.size, dtype=md.properties.dtype)}, storage_reader=reader, no_dist=True)
        floor = max(floor, tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    for attempt in range(2):  # the first also warms up
        with MemoryTrace() as trace, trace.window("convert"):
            sharded_to_safetensors(checkpoint, str(tmp_path / f"converted{attempt}"), dtype=torch.bfloat16, buffer_bytes=BUFFER_BYTES)
    gc.collect()
    tracemalloc.start()  # apart from the profiler, whose own objects it would count
    sharded_to_safetensors(checkpoint, str(tmp_path / "converted"), dtype=torch.bfloat16, buffer_bytes=BUFFER_BYTES)
    python_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    # torch's: the tensor read, DCP's read of one chunk of it (freed after the copy) and a bf16
    # cast piece (at most 1 MiB of the source, here the whole tensor): at most 2.5 tensors,
    # within one unit (a decoder layer).
    extra = trace.peaks["convert"] - trace.starts["convert"]
    assert extra <= 2 * largest + largest // 2 <= unit_bytes, (extra, largest, unit_bytes)
    # Python's: DCP's (the floor) plus the file buffer and the header.
    assert python_peak <= floor + BUFFER_BYTES + (64 << 10), (python_peak, floor)


# ----------------------------------------------------------------------------- the format
def test_format_read_by_safetensors(tmp_path: Any) -> None:
    """Every dtype and shape (scalars, empty tensors) written by the writer reads back with the
    ``safetensors`` package bit for bit; the split and the index are Hugging Face's."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from huggingface_hub.serialization._base import parse_size_to_int
    from safetensors.torch import load_file

    from fsdp.state_dict._safetensors import TensorSpec, _size_to_int, plan_files, write_safetensors

    g = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(3, 5, generator=g),
        "bf16": torch.randn(7, generator=g).to(torch.bfloat16),
        "f16.scalar": torch.tensor(1.5, dtype=torch.float16),
        "f64.empty": torch.empty(0, 4, dtype=torch.float64),
        "i64": torch.arange(6).view(2, 3),
        "i8": torch.tensor([-1, 2], dtype=torch.int8),
        "u8": torch.tensor([255], dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "f8": torch.randn(4, generator=g).to(torch.float8_e4m3fn),
    }
    specs = [TensorSpec(k, v.dtype, v.shape) for k, v in tensors.items()]
    for max_shard_size in ("50GB", 64):  # 64: several files, no tensor larger than a file
        folder = str(tmp_path / str(max_shard_size))
        written = write_safetensors(folder, specs, iter(tensors.items()), max_shard_size=max_shard_size, buffer_bytes=8)
        assert sorted(written) == sorted(os.listdir(folder)), written
        files = [f for f in written if f.endswith(".safetensors")]
        back: dict[str, torch.Tensor] = {}
        for f in files:
            back.update(load_file(os.path.join(folder, f)))
        assert back.keys() == tensors.keys()
        for k, v in tensors.items():
            assert back[k].dtype == v.dtype and back[k].shape == v.shape and torch.equal(back[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), k
        hf = split_torch_state_dict_into_shards(tensors, max_shard_size=max_shard_size)
        assert {p.filename: [s.name for s in p.specs] for p in plan_files(specs, max_shard_size)} == hf.filename_to_tensors
        if len(files) > 1:
            with open(os.path.join(folder, "model.safetensors.index.json")) as f:
                index = json.load(f)
            assert index["weight_map"] == hf.tensor_to_filename and index["metadata"]["total_size"] == hf.metadata["total_size"]
    for size in ("5GB", "500MB", "1KB", "3TB"):
        assert _size_to_int(size) == parse_size_to_int(size), size
    assert _size_to_int("2GiB") == 2 << 30 and _size_to_int(123) == 123


def test_format_refuses_a_stream_that_differs_from_its_header(tmp_path: Any) -> None:
    """The header is written before the values: a value that is not the one planned, or a source
    that ends early, raises and leaves no file behind."""
    from fsdp.state_dict._safetensors import TensorSpec, write_safetensors

    specs = [TensorSpec("a", torch.float32, torch.Size([2])), TensorSpec("b", torch.float32, torch.Size([3]))]
    cases = [
        ([("a", torch.zeros(2)), ("c", torch.zeros(3))], "yielded c .* where the header says b"),
        ([("a", torch.zeros(2)), ("b", torch.zeros(3, dtype=torch.float64))], "yielded b \\(torch.float64"),
        ([("a", torch.zeros(2))], "the source ended before b"),
        ([("a", torch.zeros(2)), ("b", torch.zeros(3)), ("c", torch.zeros(1))], "more tensors than were planned"),
    ]
    for i, (pairs, message) in enumerate(cases):
        folder = tmp_path / str(i)
        with pytest.raises(RuntimeError, match=message):
            write_safetensors(str(folder), specs, iter(pairs), max_shard_size="1GB", buffer_bytes=1 << 10)
        assert os.listdir(folder) == [], os.listdir(folder)


def test_checkpoint_chunks_read_as_row_major_runs() -> None:
    """A checkpoint's chunks are read one at a time where each is a run of consecutive elements
    and together they tile the tensor (flat-shard boxes, rows); otherwise the tensor is read
    whole."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata as Chunk

    from fsdp.flat_param._shard_map import flat_range_boxes
    from fsdp.state_dict._safetensors import _row_major_runs

    shape = torch.Size([5, 4, 3])
    boxes = [b for lo, hi in [(0, 7), (7, 31), (31, 60)] for b in flat_range_boxes(tuple(shape), lo, hi)]
    chunks = [Chunk(torch.Size(b.offsets), torch.Size(b.sizes)) for b in boxes]
    assert _row_major_runs(shape, chunks[::-1]) == chunks  # sorted into row-major order
    rows = [Chunk(torch.Size([r, 0, 0]), torch.Size([1, 4, 3])) for r in range(5)]
    assert _row_major_runs(shape, rows + [Chunk(torch.Size([0, 0, 0]), torch.Size([0, 4, 3]))]) == rows
    columns = [Chunk(torch.Size([0, 0, c]), torch.Size([5, 4, 1])) for c in range(3)]
    assert _row_major_runs(shape, columns) is None
    assert _row_major_runs(shape, rows[:4]) is None  # a gap: not every element is stored
    assert _row_major_runs(torch.Size([]), [Chunk(torch.Size([]), torch.Size([]))]) == [Chunk(torch.Size([]), torch.Size([]))]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process, on purpose
def test_checkpoint_read_whole_or_by_runs(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ways of reading a checkpoint's tensor (its runs one at a time; whole, for chunks that
    are not runs) write the same files, bit for bit."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    import fsdp.state_dict._safetensors as st
    from fsdp.checkpoint import sharded_to_safetensors

    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(6, 5, generator=g), "b": torch.randn(5, generator=g), "n": torch.tensor(3)}
    dcp.save({"model": state, "optim": {"x": torch.ones(2)}}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    sharded_to_safetensors(str(tmp_path / "ckpt"), str(tmp_path / "runs"), dtype=torch.bfloat16)
    monkeypatch.setattr(st, "_row_major_runs", lambda shape, chunks: None)
    sharded_to_safetensors(str(tmp_path / "ckpt"), str(tmp_path / "whole"), dtype=torch.bfloat16)
    for folder in ("runs", "whole"):
        back = load_file(str(tmp_path / folder / "model.safetensors"))
        assert back.keys() == state.keys(), back.keys()  # the model only, not the optimizer
        for k, v in state.items():
            want = v.to(torch.bfloat16) if v.is_floating_point() else v
            assert back[k].dtype == want.dtype and torch.equal(back[k], want), (folder, k)
    runs, whole = (open(tmp_path / f / "model.safetensors", "rb").read() for f in ("runs", "whole"))
    assert runs == whole


# ----------------------------------------------------------------------------- tensor parallel
# (name, strategy, nested units, use_orig_params, hidden, export dtype, max_shard_size): the 2-D
# (dp, tp) toy LM of tests/test_tensor_parallel.py (ColwiseParallel fc1, RowwiseParallel fc2;
# torch FSDP1 composes with TP with use_orig_params both ways); hidden 11 splits unevenly over tp
# (fc1's rows 6 + 5, fc2's columns 6 + 5); NO_SHARD runs (torch FSDP1 fails with it and TP).
TP_CASES = [
    ("full_orig_fp32", "FULL_SHARD", True, True, 12, None, "50GB"),
    ("grad_op_flat_bf16_split", "SHARD_GRAD_OP", False, False, 12, torch.bfloat16, 400),
    ("full_flat_uneven_bf16", "FULL_SHARD", True, False, 11, torch.bfloat16, "50GB"),
    ("no_shard_orig_fp32_split", "NO_SHARD", True, True, 12, None, 400),
]


def tp_export_cases(root: str) -> dict[str, Any]:
    """Every TP case at 2 dp x 2 tp: the live export (rank 0 writes; the header from the full
    shapes, the full tensors gathered to rank 0) and a sharded checkpoint of the same model
    (full-shape chunks). Rank 0 returns the full parameters (the FULL state dict's, made full)."""
    from fsdp.checkpoint import save_sharded
    from fsdp.export import save_safetensors
    from tests.test_export import _full_tensors, _tp_trained

    expected: dict[str, Any] = {}
    for name, strategy, nested, orig, hidden, dtype, max_shard_size in TP_CASES:
        model = _tp_trained(strategy, nested, orig, hidden)
        expected[name] = _full_tensors(model)
        folder = os.path.join(root, name)
        written = save_safetensors(model, os.path.join(folder, "live"), dtype=dtype, max_shard_size=max_shard_size, buffer_bytes=256)
        save_sharded(model, checkpoint_id=os.path.join(folder, "checkpoint"))
        assert written == [] if dist.get_rank() else sorted(written) == sorted(os.listdir(os.path.join(folder, "live"))), written
        dist.barrier()
    return expected if dist.get_rank() == 0 else {}


def _check_files(folder: str, expected: dict[str, torch.Tensor], dtype: Optional[torch.dtype], split: bool) -> None:
    """The files (read with ``safetensors.torch.load_file``) hold ``expected`` cast to ``dtype``,
    bit for bit, each tensor once, in one file or in several with Hugging Face's index."""
    from safetensors.torch import load_file

    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    assert (len(files) > 1) == split and ("model.safetensors.index.json" in os.listdir(folder)) == split, files
    stored: dict[str, torch.Tensor] = {}
    for file in files:
        tensors = load_file(os.path.join(folder, file))
        assert not stored.keys() & tensors.keys(), file
        stored.update(tensors)
    if split:
        with open(os.path.join(folder, "model.safetensors.index.json")) as f:
            assert set(json.load(f)["weight_map"]) == set(stored)
    assert set(stored) == set(expected), sorted(set(stored) ^ set(expected))
    for key, value in expected.items():
        want = value.to(dtype) if dtype is not None and value.is_floating_point() else value
        assert stored[key].dtype == want.dtype and torch.equal(stored[key], want), (folder, key)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process, on purpose
def test_tensor_parallel_bit_exact(pool4: RankPool, tmp_path: Any) -> None:
    """TP-split parameters are written in full (their global shapes in the header), live and from
    a TP sharded checkpoint converted here, in the test process (no process group)."""
    from fsdp.checkpoint import sharded_to_safetensors

    expected = pool4.run(tp_export_cases, str(tmp_path), _timeout=300)[0]
    for name, _, _, _, hidden, dtype, max_shard_size in TP_CASES:
        full = expected[name]
        assert full["blocks.0.fc1.weight"].shape == (hidden, 7) and full["blocks.1.fc2.weight"].shape == (7, hidden)
        split = max_shard_size != "50GB"
        _check_files(str(tmp_path / name / "live"), full, dtype, split)
        converted = str(tmp_path / name / "converted")
        sharded_to_safetensors(str(tmp_path / name / "checkpoint"), converted, dtype=dtype, max_shard_size=max_shard_size)
        _check_files(converted, full, dtype, split)


def tp_writer_memory(root: str) -> dict[str, Any]:
    """Rank 0's extra live bytes (torch's allocations) while writing a TP model (six MLP units, 64
    -> 128 -> 64, ColwiseParallel fc1, RowwiseParallel fc2, 2 dp x 2 tp), beside the same
    collectives alone (the floor: gloo stages a gather through a buffer of its output's size),
    against the TP stream's bound ([Note: Export of tensor-parallel parameters] in
    fsdp/export.py): U + (tp + 1) * P + B, B the staging buffer (one full tp-split parameter
    here, above the file buffer); the writer adds nothing of its own."""
    import fsdp.export as export
    from benchmarks.memory import MemoryTrace
    from fsdp import FullyShardedDataParallel as FSDP
    from tests.test_export import _tp_mlps

    model, expected = _tp_mlps()
    handles = [h for m in FSDP.fsdp_modules(model) for h in m._fsdp_state.handles if h.param_infos]
    tps = [export._tp_params(h, True) for h in handles]
    split = [p for tp in tps for p in tp if p is not None]
    result: dict[str, Any] = {"floor": 0, "tp": 2, "expected": expected, "U": max(h.shard_layout.padded_unsharded_numel * 4 for h in handles)}
    result["P"] = max(p.pieces[0].numel * 4 for p in split)
    result["B"] = max(max(p.global_shape.numel() * 4 for p in split), BUFFER_BYTES)
    for _ in range(2):  # the bare collectives of the stream with rank0_only, each result dropped at once
        with MemoryTrace() as trace, trace.window("bare"):
            for h, tp in zip(handles, tps):
                unit = export.gather(h._local_shard, h.process_group, h.rank, h.world_size, export._dst(h, True, tp))
                for p in tp if unit is not None else []:
                    if p is not None:
                        out = torch.empty(p.size * p.pieces[0].numel) if dist.get_rank() == 0 else None
                        export.comm.gather_flat_to(out, torch.empty(p.pieces[0].numel), p.group, 0)
                        del out
                del unit
        result["floor"] = max(result["floor"], trace.peaks["bare"] - trace.starts["bare"])
    result["extra"] = _export_extra(model, os.path.join(root, "tp_memory"))
    dist.barrier()
    return result


def test_tensor_parallel_writer_memory(pool4: RankPool, tmp_path: Any) -> None:
    # Measured: rank 0 98816 bytes beside a floor of 83200 (U 33280, P 16384, B 32768; the
    # model in full is 396288); rank 1 holds its gathered units and sends its tp pieces on.
    from safetensors.torch import load_file

    reports = pool4.run(tp_writer_memory, str(tmp_path), _timeout=300)
    for rank, r in enumerate(reports):
        bound = r["U"] + (r["tp"] + 1) * r["P"] + r["B"]
        assert r["extra"] <= r["floor"] + bound, (rank, {k: v for k, v in r.items() if k != "expected"})
        if rank in (2, 3):  # outside rank 0's tp group {0, 1}: they only send their shards
            assert r["extra"] < r["P"], (rank, r["extra"])
    stored = load_file(str(tmp_path / "tp_memory1" / "model.safetensors"))
    expected = reports[0]["expected"]
    assert stored.keys() == expected.keys() and all(torch.equal(stored[k], v) for k, v in expected.items())
