"""load_sharded's reads straight into the flat shards (issue 33; [Note: Flat-shard loads]).

Every rank that holds a part reads it: a checkpoint loads bit for bit into each strategy (both
replicas of HYBRID_SHARD and _HYBRID_SHARD_ZERO2, every rank of NO_SHARD, SHARD_GRAD_OP with CPU
offload, mixed precision; use_orig_params both ways). Mixed-precision buffers (kept at full
precision), ignored parameters, the optimizer's param groups and scalar states load as a
state-dict load gives them, bit for bit.

Memory is behaviour: a load allocates at most two of the checkpoint's stored chunks at a time
(DCP's reader), nothing shaped like the rank's shards (the SHARDED state-dict route this
replaced allocated 14x that in the same model: 7.4 MB against 0.5 MB).

Into a tensor-parallel model whose split is uneven:

A SHARDED state dict of a model whose tp split is uneven (hidden 11 over 2 or 4 tp ranks, 6
over 4, where the last tp rank holds nothing) aborts gloo in DTensor's redistribution over dp,
torch FSDP1's too; load_sharded reads straight into the flat shards' boxes instead ([Note:
Flat-shard loads] in fsdp/state_dict/_flat_checkpoint.py), so it loads there:

- from an even-split checkpoint (fsdp without tensor parallelism, trained 2 AdamW steps at 4
  ranks) into uneven (dp, tp) = (2, 2) and (1, 4) models (flat and use_orig_params, nested and
  not), model and AdamW state;
- from the checkpoint such an uneven model saves, into another uneven mesh ((1, 4) at 4 ranks,
  (1, 2) at 2 ranks), into tp degree 1 ((2, 1)) and into fsdp without tensor parallelism;
- each time bit for bit against the full state of the model that saved the source (torch's DCP
  state-dict API, full_state_dict=True), which a plain model (no fsdp, no TP) also reads from
  every checkpoint involved.

(tests/test_flat_checkpoint.py's tp_uneven, the same (2, 2) layout saved model-only, loads into the
targets not loaded here: (2, 2) and (1, 2) with SHARD_GRAD_OP use_orig_params.)
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist

from torch.distributed.checkpoint.api import CheckpointException

from tests._comm_count import count_object_messages
from tests._harness import get_pool
from tests.test_flat_checkpoint import _tp_expected, _tp_load_plain, _tp_ours

_HIDDEN = 11  # 6 + 5 over tp 2, 3 + 3 + 3 + 2 over tp 4
_EMPTY_HIDDEN = 6  # 2 + 2 + 2 + 0 over tp 4: the last tp rank holds an empty piece


def _loaded_equal(model: Any, optim: Any, expected: dict[str, Any], what: str) -> None:
    loaded = _tp_expected(model, optim)
    for key in ("model", "optim"):
        assert sorted(loaded[key]) == sorted(expected[key]), (what, key)
        for k, value in expected[key].items():
            assert torch.equal(loaded[key][k], value), (what, key, k)


def _load_into(model: Any, path: str, expected: dict[str, Any], what: str) -> Any:
    """load_sharded into ``model`` with a fresh AdamW (given state by load_sharded), compared."""
    from fsdp.checkpoint import load_sharded

    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_sharded(model, optim, checkpoint_id=path)
    _loaded_equal(model, optim, expected, what)
    return optim


def uneven_save_and_load(directory: str) -> None:
    """At 4 ranks: even-split checkpoints (fsdp without TP, trained), loaded into uneven (2, 2)
    and (1, 4) models; the (2, 2) model's own save loaded into (1, 4) and fsdp without TP."""
    from fsdp.checkpoint import save_sharded
    from tests.test_tensor_parallel import _plain_fsdp, _train

    for hidden in (_HIDDEN, _EMPTY_HIDDEN):
        source = _plain_fsdp("ours", hidden)
        source_optim = torch.optim.AdamW(source.parameters(), lr=0.01)
        _train(source, source_optim, range(2))
        even = os.path.join(directory, f"even_{hidden}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            save_sharded(source, source_optim, checkpoint_id=even)
        expected = _tp_expected(source, source_optim)
        if dist.get_rank() == 0:
            torch.save(expected, os.path.join(directory, f"expected_{hidden}.pt"))
        _tp_load_plain(even, expected, f"even {hidden}", True, hidden)
        shapes = [(2, 2), (1, 4)] if hidden == _HIDDEN else [(1, 4)]
        for shape, (strategy, nested, orig) in zip(shapes, [("FULL_SHARD", True, False), ("SHARD_GRAD_OP", False, True)]):
            model = _tp_ours(strategy, nested, orig, hidden, shape)
            optim = _load_into(model, even, expected, f"even -> tp {shape} hidden {hidden}")
            if shape == (2, 2):  # the uneven model's own checkpoint
                uneven = os.path.join(directory, f"uneven_{hidden}")
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    save_sharded(model, optim, checkpoint_id=uneven)
                _tp_load_plain(uneven, expected, f"uneven {hidden}", True, hidden)
                _load_into(_tp_ours("SHARD_GRAD_OP", False, True, hidden, (1, 4)), uneven, expected, "uneven (2, 2) -> (1, 4)")
                _load_into(_plain_fsdp("ours", hidden), uneven, expected, "uneven (2, 2) -> fsdp without tp")


def uneven_load_at_2(directory: str) -> None:
    """At 2 ranks: the uneven (2, 2) checkpoint into (1, 2) (6 + 5) and (2, 1) models."""
    expected = torch.load(os.path.join(directory, f"expected_{_HIDDEN}.pt"), weights_only=False)
    path = os.path.join(directory, f"uneven_{_HIDDEN}")
    _load_into(_tp_ours("FULL_SHARD", True, False, _HIDDEN, (1, 2)), path, expected, "uneven (2, 2) -> (1, 2)")
    _load_into(_tp_ours("SHARD_GRAD_OP", False, True, _HIDDEN, (2, 1)), path, expected, "uneven (2, 2) -> (2, 1)")


def test_load_into_uneven_tensor_parallel(tmp_path: Any) -> None:
    get_pool(4).run(uneven_save_and_load, str(tmp_path), _timeout=300)
    get_pool(2).run(uneven_load_at_2, str(tmp_path), _timeout=300)


def _bn_model(seed: int) -> Any:
    """Linear + BatchNorm units, mixed precision with bf16 buffers, one ignored Linear."""
    from torch import nn

    from fsdp import FullyShardedDataParallel as FSDP, MixedPrecision
    from fsdp.wrap import ModuleWrapPolicy

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5)))
            self.side = nn.Linear(3, 3)  # ignored (not run in forward: its parameter is changed by hand)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(x)

    torch.manual_seed(seed)
    net = Net()
    mp = MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16, _module_classes_to_ignore=())
    return FSDP(net, auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}), mixed_precision=mp, ignored_modules=[net.side])


def _bn_steps(model: Any, optim: Any, seed: int) -> None:
    torch.manual_seed(seed)  # the same batch on every rank: buffers (BatchNorm stats) agree
    for _ in range(2):
        model(torch.randn(6, 4)).float().sum().backward()
        optim.step()
        optim.zero_grad()


def buffers_groups_load(directory: str) -> None:
    """Save after two steps; change everything (two more steps, another lr); load: the FULL
    state dict (full-precision buffer values), the ignored parameter, the optimizer's FULL state
    and its param groups are the saved ones, bit for bit, and the buffers in use are their
    bf16 casts again."""
    from fsdp.checkpoint import load_sharded, save_sharded
    from tests.test_flat_checkpoint import _assert_equal, _full

    model = _bn_model(3)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    _bn_steps(model, optim, 1)
    path = os.path.join(directory, "bn")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_sharded(model, optim, checkpoint_id=path)
        expected = _full(model, optim)
        buffers = {n: b.clone() for n, b in model.named_buffers()}
        _bn_steps(model, optim, 2)
        with torch.no_grad():
            model.side.weight.add_(1.0)
        optim.param_groups[0]["lr"] = 0.5
        assert not torch.equal(_full(model, optim)[0]["body.1.running_mean"], expected[0]["body.1.running_mean"])
        load_sharded(model, optim, checkpoint_id=path)
        loaded = _full(model, optim)
    _assert_equal(loaded[0], expected[0], "model with bf16 buffers and an ignored Linear")
    _assert_equal(loaded[1], expected[1], "AdamW state")
    assert "side.weight" in expected[0] and any(b.dtype == torch.bfloat16 for b in buffers.values())
    assert expected[0]["body.1.running_mean"].dtype == torch.float32
    assert optim.param_groups[0]["lr"] == 1e-2 and optim.param_groups[0]["weight_decay"] == 0.1
    for name, buffer in model.named_buffers():
        assert buffer.dtype == buffers[name].dtype and torch.equal(buffer, buffers[name]), name
    params = [p for n, p in model.named_parameters() if "side" not in n]  # the flat ones (side had no gradient)
    two_groups = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:]}])
    _bn_steps(model, optim, 3)  # away from the checkpoint, so that a read would show
    before = _full(model, optim)[0]
    with pytest.raises(CheckpointException, match=r"Missing key in checkpoint state_dict: optim\.param_groups\.1\."):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load_sharded(model, two_groups, checkpoint_id=path)  # refused at planning: nothing read
    _assert_equal(_full(model, optim)[0], before, "a refused load changed nothing")


def test_load_buffers_ignored_params_and_param_groups(tmp_path: Any) -> None:
    get_pool(2).run(buffers_groups_load, str(tmp_path), _timeout=300)


# name -> _ours config (use_orig_params, strategy, mixed precision, cpu offload, hybrid mesh)
_TARGETS = {
    "hybrid_orig": (True, "HYBRID_SHARD", False, False, True),
    "hybrid_zero2_flat": (False, "_HYBRID_SHARD_ZERO2", False, False, True),
    "no_shard_flat": (False, "NO_SHARD", False, False, False),
    "zero2_offload_orig": (True, "SHARD_GRAD_OP", False, True, False),
    "mp_flat": (False, "FULL_SHARD", True, False, False),
}


def load_into_every_strategy(directory: str) -> list[str]:
    """A FULL_SHARD checkpoint of 4 ranks into each strategy at 4 ranks, bit for bit."""
    from fsdp.checkpoint import load_sharded, save_sharded
    from tests.test_flat_checkpoint import _assert_equal, _full, _ours, _train

    source = _ours((False, "FULL_SHARD", False, False, False), seed=5)
    source_optim = _train(source, 2)
    path = os.path.join(directory, "full_shard")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_sharded(source, source_optim, checkpoint_id=path)
        expected = _full(source, source_optim)
        done = []
        for name, config in _TARGETS.items():
            model = _ours(config, seed=9)
            optim = _train(model, 1, lr=0.5)
            load_sharded(model, optim, checkpoint_id=path)
            loaded = _full(model, optim)
            _assert_equal(loaded[0], expected[0], f"model into {name}")
            _assert_equal(loaded[1], expected[1], f"optim into {name}")
            done.append(name)
    return done


def test_load_into_every_strategy(tmp_path: Any) -> None:
    reports = get_pool(4).run(load_into_every_strategy, str(tmp_path), _timeout=300)
    assert reports == [list(_TARGETS)] * 4


def load_memory(directory: str) -> tuple[int, int, int]:
    """Live CPU bytes load_sharded adds at its peak, in a model of four 256 x 256 Linears in one
    unit at 2 ranks (each rank holds 2 of them and their AdamW states: 1.5 MB)."""
    from torch import nn

    import torch.distributed.checkpoint as dcp
    from benchmarks.memory import MemoryTrace
    from fsdp import FullyShardedDataParallel as FSDP
    from fsdp.checkpoint import load_sharded, save_sharded

    path = os.path.join(directory, "linears")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with MemoryTrace() as trace:
            torch.manual_seed(0)
            model = FSDP(nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)]))
            optim = torch.optim.AdamW(model.parameters())
            model(torch.randn(2, 256)).sum().backward()
            optim.step()
            optim.zero_grad()
            save_sharded(model, optim, checkpoint_id=path)
            with trace.window("load"):
                load_sharded(model, optim, checkpoint_id=path)
    assert trace.all_threads, "every thread's allocations are counted"
    metadata = dcp.FileSystemReader(path).read_metadata()
    largest = max(
        chunk.sizes.numel() * 4 for meta in metadata.state_dict_metadata.values() for chunk in getattr(meta, "chunks", [])
    )
    state = sum(t.numel() * t.element_size() for p in model.parameters() for t in [p, *optim.state[p].values()])
    return trace.peaks["load"] - trace.starts["load"], largest, state


def test_load_allocates_one_chunk_at_a_time(tmp_path: Any) -> None:
    """DCP's reader loads each stored chunk (torch.load) and copies the overlap into the box; the
    previous chunk's tensor is released when the next one is loaded, so at most two are alive:
    the bound is 2 x the largest stored chunk (one 256 x 256 weight, 256 KiB), under the rank's
    own state (about 1.5 MB): nothing the size of a shard is allocated."""
    for extra, largest, state in get_pool(2).run(load_memory, str(tmp_path), _timeout=300):
        assert 0 < extra <= 2 * largest < state, (extra, largest, state)


class _SmallFirst(torch.nn.Module):
    """One unit whose first parameter (4 elements) lies wholly in rank 0's half of the flat
    parameter (4 + 100 elements over 2 ranks): rank 1 holds none of it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(4))
        self.b = torch.nn.Parameter(torch.randn(10, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.b).sum() + self.a.sum()


def scalar_states_on_every_rank(directory: str) -> list[float]:
    """Saves after 3 AdamW steps, loads into a fresh model and optimizer (``load_sharded`` gives
    it state first, on every rank, for every parameter): each rank's ``step`` of each parameter
    is the checkpoint's, also on the rank that holds none of ``a`` (where the save writes no
    ``step`` of it: [Note: A save's per-value work])."""
    from fsdp import FullyShardedDataParallel as FSDP
    from fsdp.checkpoint import load_sharded, save_sharded

    def build() -> tuple[Any, Any]:
        torch.manual_seed(0)
        model = FSDP(_SmallFirst(), use_orig_params=True)
        return model, torch.optim.AdamW(model.parameters(), lr=0.01)

    def steps(model: Any, optim: Any, n: int) -> None:
        for _ in range(n):
            model(torch.ones(3, 10)).backward()
            optim.step()
            optim.zero_grad()

    path = os.path.join(directory, "scalars")
    model, optim = build()
    steps(model, optim, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_sharded(model, optim, checkpoint_id=path)
    fresh, fresh_optim = build()
    with warnings.catch_warnings(), count_object_messages() as messages:
        warnings.simplefilter("ignore")
        load_sharded(fresh, fresh_optim, checkpoint_id=path)
    # [Note: A load without a global plan]: no plan travels, one exchange of the outcome.
    assert {k: v for k, v in messages.items() if v} == {"all_gather_object": 1}, messages
    return [float(state["step"]) for state in fresh_optim.state.values()]


def load_failing_on_one_rank(directory: str) -> str:
    """A read that fails on rank 1 only: every rank raises DCP's ``CheckpointException`` naming
    rank 1's failure (nobody returns while a peer failed, nobody hangs); the same for a save
    whose failure on rank 1 does not pickle."""
    import torch.distributed.checkpoint as dcp

    from fsdp import FullyShardedDataParallel as FSDP
    from fsdp.checkpoint import load_sharded, save_sharded

    model = FSDP(_SmallFirst(), use_orig_params=True)
    path = os.path.join(directory, "failing")
    save_sharded(model, checkpoint_id=path)
    original = dcp.FileSystemReader.read_data

    def failing(self: Any, plan: Any, planner: Any) -> Any:
        if dist.get_rank() == 1:
            raise OSError("unreadable disk (planted)")
        return original(self, plan, planner)

    dcp.FileSystemReader.read_data = failing  # type: ignore[method-assign]
    try:
        with pytest.raises(CheckpointException, match="unreadable disk") as caught:
            load_sharded(model, checkpoint_id=path)
    finally:
        dcp.FileSystemReader.read_data = original  # type: ignore[method-assign]
    # A save whose write fails on rank 1 with an exception that does not pickle: its text
    # travels instead, and every rank raises (the report could not be sent otherwise, and rank
    # 0 would wait for it until the group's timeout).
    from fsdp.state_dict._commit_writer import CommitWriter

    class Unpicklable(OSError):
        def __init__(self) -> None:
            super().__init__("disk gone (planted)")
            self.callback = lambda: None  # a lambda does not pickle

    written = CommitWriter.write_data

    def failing_write(self: Any, plan: Any, planner: Any) -> Any:
        if dist.get_rank() == 1:
            raise Unpicklable()
        return written(self, plan, planner)

    CommitWriter.write_data = failing_write  # type: ignore[method-assign]
    try:
        with pytest.raises(CheckpointException, match=r"Unpicklable: disk gone \(planted\) \(the exception itself does not pickle\)") as saved:
            save_sharded(model, checkpoint_id=os.path.join(directory, "unpicklable"))
    finally:
        CommitWriter.write_data = written  # type: ignore[method-assign]
    assert sorted(saved.value.failures) == [1]
    assert not os.path.exists(os.path.join(directory, "unpicklable", ".metadata")), "nothing committed"
    return str(sorted(caught.value.failures))


def test_scalar_states_load_on_ranks_that_hold_none_of_the_parameter(tmp_path: Any) -> None:
    for rank, loaded in enumerate(get_pool(2).run(scalar_states_on_every_rank, str(tmp_path), _timeout=300)):
        assert loaded == [3.0, 3.0], (rank, loaded)  # a and b, three steps each
    assert get_pool(2).run(load_failing_on_one_rank, str(tmp_path), _timeout=120) == ["[1]", "[1]"]
