"""Weight export (fsdp.export): the full-parameter stream and the shard map.

The stream is checked bit for bit against the model's FULL state dict (itself bit-exact against
torch FSDP1, tests/test_state_dict.py) at every strategy, use_orig_params both ways, mixed
precision, CPU offload, tied weights, ignored modules and buffers; its collectives are counted
(one per unit that shards) and its extra memory measured (one unit plus one bucket). The shard
map is checked with a tensor-parallel consumer that assembles its row slices from every rank's
map and views. Under tensor parallelism (2 dp x 2 tp, ColwiseParallel/RowwiseParallel) the
stream gives the full parameters bit for bit (against the FULL state dict and torch FSDP1's
summoned ``full_tensor()``s), its dp and tp collectives counted and its memory bounded, and the
shard map places every range in the full parameter (a consumer of another layout assembles its
slices exactly).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from typing import Any, Iterator, Optional

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests._harness import RankPool
from tests._models import Block, global_batch, lm_loss, local_rows, make_toy


def _model(strategy: str, orig: bool, mp: bool = False, offload: bool = False, seed: int = 0, tie: bool = False) -> nn.Module:
    from fsdp import CPUOffload, FullyShardedDataParallel as FSDP, MixedPrecision, ShardingStrategy
    from fsdp.wrap import ModuleWrapPolicy

    toy = make_toy(seed=seed, tie=tie, unused=True)
    toy.register_buffer("scale", torch.arange(5, dtype=torch.float32))  # persistent: exported
    toy.register_buffer("steps", torch.tensor([3, 4]))  # an integer buffer keeps its dtype
    toy.register_buffer("scratch", torch.ones(2), persistent=False)  # not in state_dict: not exported
    kwargs: dict[str, Any] = {}
    if strategy.startswith(("HYBRID", "_HYBRID")):
        from tests.test_hybrid_shard import _layouts

        kwargs = dict(_layouts()["mesh"])
    return FSDP(
        toy,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        sharding_strategy=ShardingStrategy[strategy],
        use_orig_params=orig,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16) if mp else None,
        cpu_offload=CPUOffload(offload_params=offload),
        ignored_modules=[toy.unused],
        **kwargs,
    )


def _steps(model: nn.Module, steps: range, opt: torch.optim.Optimizer) -> None:
    rank, ws = dist.get_rank(), dist.get_world_size()
    model.train()
    for step in steps:
        tokens, targets = global_batch(step, ws)
        lm_loss(model(local_rows(tokens, rank, ws)), local_rows(targets, rank, ws)).backward()
        opt.step()
        opt.zero_grad()


def _assert_buckets(
    buckets: list[Any], expected: dict[str, torch.Tensor], dtype: Optional[torch.dtype], bucket_bytes: int, what: str
) -> None:
    """Every expected name once, each value bit-equal to the expected one cast to ``dtype``
    (floating point only), and every bucket within ``bucket_bytes`` or one tensor larger."""
    pairs = list(itertools.chain(*buckets))
    names = [name for name, _ in pairs]
    assert len(names) == len(set(names)) and set(names) == set(expected), (what, names)
    for name, tensor in pairs:
        want = expected[name].to(dtype) if dtype is not None and expected[name].is_floating_point() else expected[name]
        assert tensor.dtype == want.dtype and torch.equal(tensor, want), (what, name)
    for bucket in buckets:  # within the size, or one tensor larger than it
        assert len(bucket) == 1 or sum(t.numel() * t.element_size() for _, t in bucket) <= bucket_bytes, what


def _expected(model: nn.Module, tie: bool) -> dict[str, torch.Tensor]:
    """The unwrapped model's parameters and persistent buffers (a FULL state dict), less the
    tied alias."""
    sd = model.state_dict()
    if tie:
        del sd["head.weight"]  # the same Parameter as embed.weight, exported once
    return sd


def _exported(model: nn.Module, **kwargs: Any) -> list[list[tuple[str, torch.Tensor]]]:
    from fsdp.export import full_params_stream

    return [[(name, t.clone()) for name, t in bucket] for bucket in full_params_stream(model, **kwargs)]


def _units_that_shard(model: nn.Module) -> int:
    from fsdp import FullyShardedDataParallel as FSDP

    return sum(h.shard_layout.uses_sharding for m in FSDP.fsdp_modules(model) for h in m._fsdp_state.handles)


def _with_rank0(model: nn.Module) -> bool:
    from fsdp import FullyShardedDataParallel as FSDP

    groups = [h.process_group for m in FSDP.fsdp_modules(model) for h in m._fsdp_state.handles]
    return 0 in dist.get_process_group_ranks(groups[0])


@contextlib.contextmanager
def _count_gathers_to_one() -> Iterator[list[int]]:
    """Counts fsdp's gathers to one rank (one collective each; on gloo an ``all_to_all_single``
    that the shared counter does not list)."""
    from fsdp._comm import _collectives as comm

    calls: list[int] = []
    original = comm.gather_flat_to

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    comm.gather_flat_to = counting  # type: ignore[assignment]
    try:
        yield calls
    finally:
        comm.gather_flat_to = original  # type: ignore[assignment]


def _check_one(strategy: str, orig: bool, mp: bool, offload: bool, tie: bool) -> None:
    from tests._comm_count import count_collectives

    model = _model(strategy, orig, mp, offload, tie=tie)
    _steps(model, range(1), torch.optim.Adam(model.parameters(), lr=0.01))
    model.eval()
    expected = _expected(model, tie)
    what = f"{strategy} orig={orig} mp={mp} offload={offload} tie={tie}"
    for dtype, rank0_only, bucket_bytes in [(None, False, 1 << 20), (torch.bfloat16, True, 200), (torch.float64, False, 1)]:
        with count_collectives() as counts, _count_gathers_to_one() as to_one:
            buckets = _exported(model, dtype=dtype, rank0_only=rank0_only, bucket_bytes=bucket_bytes, transient=rank0_only)
        if rank0_only and dist.get_rank() != 0:
            assert buckets == [], what
        else:
            _assert_buckets(buckets, expected, dtype, bucket_bytes, what)
        units = _units_that_shard(model)
        if rank0_only:  # one gather to rank 0 per unit that shards, nothing else; none in a
            # HYBRID replica group without rank 0 (no rank there receives)
            units = units if _with_rank0(model) else 0
            assert len(to_one) == units and dict(counts.calls) == {}, (what, counts.calls)
        else:  # one all-gather per unit that shards
            assert dict(counts.calls) == ({"all_gather": units} if units else {}) and not to_one, what


def stream_parity(strategies: list[str]) -> None:
    for strategy in strategies:
        for orig, mp, offload in [(False, False, False), (True, True, False), (False, True, True), (True, False, True)]:
            _check_one(strategy, orig, mp, offload, tie=not orig)


@pytest.mark.parametrize("dist_pool", [2, 4], indirect=True)
def test_stream_matches_full_state_dict(dist_pool: RankPool) -> None:
    strategies = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]
    if dist_pool.world_size == 4:
        strategies += ["HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"]
    dist_pool.run(stream_parity, strategies)


def training_unchanged(strategy: str, orig: bool, mp: bool) -> None:
    """A step after an export (in eval and between steps) is bit-identical to one without."""
    models = [_model(strategy, orig, mp, seed=1) for _ in range(2)]
    opts = [torch.optim.Adam(m.parameters(), lr=0.01) for m in models]
    for model, opt in zip(models, opts):
        _steps(model, range(1), opt)
    _exported(models[1], dtype=torch.bfloat16, bucket_bytes=64)
    models[1].eval()
    with torch.no_grad():
        models[1](global_batch(0, 1)[0])
    _exported(models[1], rank0_only=True)
    for model, opt in zip(models, opts):
        _steps(model, range(1, 3), opt)
    a, b = models[0].state_dict(), models[1].state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a), (strategy, orig, mp)


def test_training_unchanged(pool2: RankPool) -> None:
    for strategy, orig, mp in [("FULL_SHARD", False, True), ("SHARD_GRAD_OP", True, False), ("NO_SHARD", False, False)]:
        pool2.run(training_unchanged, strategy, orig, mp)


def stream_memory() -> dict[str, Any]:
    """Extra live bytes while streaming, beside those of the same gathers alone (the floor).

    The stream itself holds at most one gathered unit (checked exactly through weak references
    to every gathered tensor) and one bucket. gloo's all-gather copies through an internal
    buffer of the output's size that its worker thread frees a little later, so the bare gathers
    already peak at 2-3 units: the trace compares the stream with them, measured in the same
    process the same way.
    """
    import weakref

    import fsdp.export as export
    from benchmarks.memory import MemoryTrace
    from fsdp import FullyShardedDataParallel as FSDP
    from fsdp.export import full_params_stream
    from fsdp.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    model = FSDP(nn.Sequential(*[nn.Linear(64, 64) for _ in range(12)]), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    handles = [h for m in FSDP.fsdp_modules(model) for h in m._fsdp_state.handles if h.param_infos]
    unit_bytes = max(h.shard_layout.padded_unsharded_numel * 4 for h in handles)
    result: dict[str, Any] = {"unit_bytes": unit_bytes, "bucket_bytes": 6000, "floor": 0}
    for _ in range(2):
        with MemoryTrace() as trace, trace.window("gathers"):
            for h in handles:
                export.gather(h._local_shard, h.process_group, h.rank, h.world_size, None)
        result["floor"] = max(result["floor"], trace.peaks["gathers"] - trace.starts["gathers"])
    alive: list[weakref.ref[torch.Tensor]] = []
    most_alive = [0]
    original = export._gathered

    def spy(*args: Any, **kwargs: Any) -> Any:
        # gloo's worker drops its hold on the previous output a moment after reporting completion
        # (its own thread; [Note: On CPU a collective completes where it is launched] in
        # fsdp/flat_param/_policy.py): let it, so the count is of what the export holds.
        time.sleep(0.02)
        most_alive[0] = max(most_alive[0], sum(r() is not None for r in alive))  # before this gather
        out = original(*args, **kwargs)
        alive.append(weakref.ref(out))
        return out

    in_place: list[bool] = []  # per all-gather: its input is its output's chunk (the cast went there)
    all_gather = export.comm.all_gather_flat

    def gather_spy(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        in_place.append(input.untyped_storage().data_ptr() == output.untyped_storage().data_ptr())
        return all_gather(output, input, *args, **kwargs)

    export._gathered = spy  # type: ignore[assignment]
    export.comm.all_gather_flat = gather_spy  # type: ignore[assignment]
    try:
        for reuse in (True, False):
            seen = 0
            with MemoryTrace() as trace, trace.window("export"):
                for bucket in full_params_stream(model, dtype=torch.bfloat16, bucket_bytes=6000, transient=reuse):
                    most_alive[0] = max(most_alive[0], sum(r() is not None for r in alive))
                    seen += len(bucket)
                    storages = {t.untyped_storage().data_ptr() for _, t in bucket}
                    if reuse:  # views of the unit gathered last: no copy, never two units
                        newest = alive[-1]()
                        assert newest is not None and storages == {newest.untyped_storage().data_ptr()}
                        del newest
                    else:  # owned copies
                        assert len(storages) == len(bucket) and all(r() is None or r().untyped_storage().data_ptr() not in storages for r in alive)
                    del storages
                    del bucket
            result[f"extra_{reuse}"] = trace.peaks["export"] - trace.starts["export"]
            result[f"seen_{reuse}"] = seen
    finally:
        export._gathered = original  # type: ignore[assignment]
        export.comm.all_gather_flat = all_gather  # type: ignore[assignment]
    result["most_alive"] = most_alive[0]
    result["in_place"] = in_place
    result["unsharded"] = sum(h.storage.unsharded_storage_nbytes() for h in handles)
    return result


def test_stream_memory_is_one_unit_plus_one_bucket(pool2: RankPool) -> None:
    for r in pool2.run(stream_memory):
        assert r["seen_True"] == r["seen_False"] == 24, r
        assert r["most_alive"] == 1 and r["unsharded"] == 0, r  # one gathered unit; handles untouched
        # bf16 from fp32 shards: each shard is cast into its chunk of the gathered unit, no copy beside
        assert r["in_place"] == [True] * 24, r
        # Staging: max(bucket, largest tensor in bf16), allocated once.
        capacity = max(r["bucket_bytes"], 64 * 64 * 2)
        # Beside the gathers alone: at most the bucket (and gloo's late free of one more copy).
        assert r["extra_True"] <= r["floor"] + capacity + r["unit_bytes"], r
        assert r["extra_False"] <= r["floor"] + r["bucket_bytes"] + 64 * 64 * 2 + r["unit_bytes"], r


def refused_inside_forward() -> None:
    from fsdp.export import full_params_stream

    model = _model("FULL_SHARD", False)
    seen: list[str] = []

    def hook(module: nn.Module, args: Any) -> None:
        try:
            next(iter(full_params_stream(model)))
        except RuntimeError as e:
            seen.append(str(e))

    model.module.blocks[0].register_forward_pre_hook(hook)
    model(global_batch(0, 1)[0])
    assert len(seen) == 1 and "needs every unit idle" in seen[0] and "FORWARD" in seen[0], seen
    with pytest.raises(ValueError, match="positive bucket size"):
        next(iter(full_params_stream(model, bucket_bytes=0)))


def test_refused_inside_forward(pool2: RankPool) -> None:
    pool2.run(refused_inside_forward)


# ----------------------------------------------------------------------------- the shard map
def tp_consumer(strategy: str, orig: bool, offload: bool) -> None:
    """A 2-way row split of every Linear weight, assembled from every rank's map and views.

    The map and the views are built with no collective; the test then moves them to every rank
    with plain collectives (the consumer's transport) and checks each tp rank's slice bit for bit
    against the full weight.
    """
    from fsdp.export import local_shard_views, shard_map
    from tests._comm_count import count_collectives

    model = _model(strategy, orig, offload=offload)
    _steps(model, range(1), torch.optim.SGD(model.parameters(), lr=0.1))
    full = model.state_dict()
    with count_collectives() as counts:
        entries = shard_map(model)
        ranges = local_shard_views(model)
    assert dict(counts.calls) == {}, counts.calls
    assert [r.entry for r in ranges] == entries
    shards = [h._local_shard for m in type(model).fsdp_modules(model) for h in m._fsdp_state.handles]
    for r in ranges:  # zero-copy: views of a live local shard
        assert any(r.flat.untyped_storage().data_ptr() == s.untyped_storage().data_ptr() for s in shards)
        assert all(b.untyped_storage().data_ptr() == r.flat.untyped_storage().data_ptr() for b in r.boxes)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, [(r.entry, r.flat.clone(), [b.clone() for b in r.boxes]) for r in ranges])
    linear_weights = {f"{n}.weight" for n, m in model.module.named_modules() if isinstance(m, nn.Linear) and n != "unused"}
    linear_weights = {k.replace("_fsdp_wrapped_module.", "") for k in linear_weights}
    assert linear_weights and linear_weights <= set(full)
    for name in sorted(linear_weights):
        rows = full[name].shape[0]
        for tp_rank in range(2):
            lo, hi = tp_rank * -(-rows // 2), min((tp_rank + 1) * -(-rows // 2), rows)
            mine = torch.full((hi - lo, full[name].shape[1]), float("nan"))
            for held in everyone:
                for entry, flat, boxes in held:
                    if entry.name != name:
                        continue
                    assert entry.shape == full[name].shape and entry.dtype == full[name].dtype
                    assert torch.equal(flat, full[name].reshape(-1)[entry.offset : entry.offset + entry.length])
                    for box, values in zip(entry.boxes, boxes):
                        r0, r1 = max(box.offsets[0], lo), min(box.offsets[0] + box.sizes[0], hi)
                        if r0 < r1:  # the rows of this box the tp rank needs
                            c0 = box.offsets[1]
                            mine[r0 - lo : r1 - lo, c0 : c0 + box.sizes[1]] = values[r0 - box.offsets[0] : r1 - box.offsets[0]]
            assert torch.equal(mine, full[name][lo:hi]), (strategy, orig, name, tp_rank)
    # Each element of every managed parameter is held by exactly one rank of its shard group.
    held_numel: dict[str, int] = {}
    for entry, _, _ in itertools.chain(*everyone):
        held_numel[entry.name] = held_numel.get(entry.name, 0) + entry.length
    replicas = dist.get_world_size() if strategy == "NO_SHARD" else 1
    assert all(held_numel[n] == full[n].numel() * replicas for n in held_numel), held_numel


@pytest.mark.parametrize("dist_pool", [2, 4], indirect=True)
def test_shard_map_tp_consumer(dist_pool: RankPool) -> None:
    for strategy, orig, offload in [("FULL_SHARD", False, False), ("SHARD_GRAD_OP", True, True), ("NO_SHARD", False, False)]:
        dist_pool.run(tp_consumer, strategy, orig, offload)


# ----------------------------------------------------------------------------- deltas
def deltas(strategy: str, orig: bool) -> None:
    """A consumer that applies every delta holds exactly the exported weights (checksums)."""
    from fsdp.export import apply_delta, full_params_delta
    from fsdp import FullyShardedDataParallel as FSDP

    model = _model(strategy, orig)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    snapshot: dict[str, torch.Tensor] = {}
    consumer: dict[str, torch.Tensor] = {}
    rank0 = dist.get_rank() == 0
    for round_ in range(4):
        if round_ == 1:
            _steps(model, range(1), opt)  # SGD: every Linear weight changes
        if round_ == 3:  # one element set by hand, between steps
            with FSDP.summon_full_params(model, writeback=True):
                with torch.no_grad():
                    model.module.blocks[1].fc1.weight[3, 2] += 1.0
        sent = [d for bucket in full_params_delta(model, snapshot, dtype=torch.bfloat16, bucket_bytes=300, rank0_only=True) for d in bucket]
        expected = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in _expected(model, False).items()}
        if not rank0:
            assert sent == [] and snapshot == {}
            continue
        for d in sent:
            if d.name not in consumer:
                consumer[d.name] = torch.zeros(d.shape, dtype=d.values.dtype)
            apply_delta(consumer[d.name], d)
        assert set(consumer) == set(expected) and all(torch.equal(consumer[k], expected[k]) for k in expected), round_
        forms = {d.name: (d.indices is None, 0 if d.indices is None else d.indices.numel()) for d in sent}
        if round_ == 0:
            assert all(dense for dense, _ in forms.values())
        elif round_ == 1:
            assert forms["blocks.0.fc1.weight"][0], forms  # every element changed: dense
        elif round_ == 2:
            assert all(not dense and n == 0 for dense, n in forms.values()), forms  # nothing changed
            assert sum(d.nbytes for d in sent) == 0
        else:
            assert {k: v for k, v in forms.items() if v != (False, 0)} == {"blocks.1.fc1.weight": (False, 1)}, forms
    if rank0:  # a consumer that missed a delta is told so
        from fsdp.export import ParamDelta, checksum

        stale = torch.zeros(2, 2)
        with pytest.raises(ValueError, match="did not hold the previous export"):
            apply_delta(stale, ParamDelta("w", torch.Size([2, 2]), torch.tensor([0]), torch.tensor([1.0]), checksum(torch.ones(2, 2))))


@pytest.mark.parametrize("dist_pool", [2, 4], indirect=True)
def test_deltas(dist_pool: RankPool) -> None:
    for strategy, orig in [("FULL_SHARD", False), ("SHARD_GRAD_OP", True), ("NO_SHARD", False)]:
        dist_pool.run(deltas, strategy, orig)


# ----------------------------------------------------------------------------- tensor parallelism
def _tp_trained(strategy: str, nested: bool, orig: bool, hidden: int) -> nn.Module:
    """The 2-D (dp, tp) toy LM of tests/test_tensor_parallel.py (ColwiseParallel fc1,
    RowwiseParallel fc2), after one AdamW step. With ``hidden`` 11 tp splits fc1 and fc2
    unevenly (6 and 5): such a model cannot train (the tp activations' DTensors infer their
    global shape from the local one, so fc2 sees 12 and 10 columns, a torch TP limit), and is
    exported as initialized."""
    from tests.test_tensor_parallel import _tp_model, _train, _wrap

    model = _wrap("ours", _tp_model(hidden=hidden), strategy, nested, orig)
    _train(model, torch.optim.AdamW(model.parameters(), lr=0.01), range(1 if hidden % 2 == 0 else 0))
    return model


def _full_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The FULL state dict (bit-exact against torch FSDP1's, tests/test_tensor_parallel.py) with
    every tp DTensor made full: the unwrapped model's full parameters and buffers."""
    import warnings

    from fsdp import FullyShardedDataParallel as FSDP, StateDictType
    from torch.distributed.tensor import DTensor

    with warnings.catch_warnings(), FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        warnings.simplefilter("ignore", FutureWarning)  # state_dict_type's deprecation, as torch's
        sd = model.state_dict()
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in sd.items()}


def _tp_split(model: nn.Module) -> tuple[int, int]:
    """The parameters a tp group splits (Shard placements: one tp gather each), and the units
    that shard holding some."""
    from fsdp import FullyShardedDataParallel as FSDP

    handles = [h for m in FSDP.fsdp_modules(model) for h in m._fsdp_state.handles]
    split = [
        sum(i.dtensor_spec is not None and any(p.is_shard() for p in i.dtensor_spec.placements) for i in h.param_infos)
        for h in handles
    ]
    return sum(split), sum(n > 0 and h.shard_layout.uses_sharding for n, h in zip(split, handles))


def tp_stream(configs: list[tuple[str, bool, bool, int]]) -> None:
    """The stream of a TP-trained model gives every full (TP-unsharded) parameter bit for bit,
    on every rank and on rank 0 alone, with one dp gather per unit and one tp gather per
    tp-split parameter ([Note: Export of tensor-parallel parameters])."""
    from fsdp.export import full_params_delta
    from tests._comm_count import count_collectives

    for strategy, nested, orig, hidden in configs:
        model = _tp_trained(strategy, nested, orig, hidden)
        expected = _full_tensors(model)
        if hidden % 2 == 0 and strategy != "NO_SHARD":  # the oracle (torch FSDP1 fails with NO_SHARD + TP):
            # torch FSDP1 trained the same way, its summoned full_tensor()s
            from tests.test_tensor_parallel import _full, _tp_model, _train, _wrap
            from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

            theirs = _wrap("torch", _tp_model(hidden=hidden), strategy, nested, orig)
            _train(theirs, torch.optim.AdamW(theirs.parameters(), lr=0.01), range(1))
            for name, value in _full(theirs, TorchFSDP).items():
                assert torch.equal(expected[name], value), (strategy, nested, orig, name)
        units, (split, units_with_split) = _units_that_shard(model), _tp_split(model)
        assert split == 3 * 2  # fc1.weight, fc1.bias (Shard(0)), fc2.weight (Shard(1)) of 2 blocks
        for dtype, rank0_only, bucket_bytes, transient in [
            (None, False, 1 << 20, False),
            (torch.bfloat16, True, 200, True),
            (torch.float64, False, 1, True),
            (None, True, 300, False),
        ]:
            what = (strategy, nested, orig, hidden, dtype, rank0_only, bucket_bytes, transient)
            with count_collectives() as counts, _count_gathers_to_one() as to_one:
                buckets = _exported(model, dtype=dtype, rank0_only=rank0_only, bucket_bytes=bucket_bytes, transient=transient)
            if rank0_only:
                # A unit with tp-split parameters: every dp group ({0, 2} and {1, 3}) gathers it
                # to its member in rank 0's tp group {0, 1}, which sends its tp pieces on to rank
                # 0. Another unit: only rank 0's dp group gathers it, to rank 0.
                gathers = units if dist.get_rank() in (0, 2) else units_with_split
                gathers += split if dist.get_rank() in (0, 1) else 0
                assert dict(counts.calls) == {} and len(to_one) == gathers, (what, len(to_one), gathers)
            else:
                assert dict(counts.calls) == {"all_gather": units + split} and not to_one, (what, counts.calls)
            if rank0_only and dist.get_rank() != 0:
                assert buckets == [], what
                continue
            _assert_buckets(buckets, expected, dtype, bucket_bytes, what)
        snapshot: dict[str, torch.Tensor] = {}  # deltas ride on the stream: the first is dense
        for deltas in full_params_delta(model, snapshot, bucket_bytes=500):
            assert all(d.indices is None and torch.equal(d.values, expected[d.name]) for d in deltas)
        assert snapshot.keys() == expected.keys()


def test_stream_tensor_parallel(pool4: RankPool) -> None:
    # torch FSDP1 composes with TP with use_orig_params both ways; hidden 11 splits unevenly.
    pool4.run(
        tp_stream,
        [
            ("FULL_SHARD", True, True, 12),
            ("SHARD_GRAD_OP", False, False, 12),
            ("FULL_SHARD", True, False, 11),
            ("NO_SHARD", True, True, 12),
        ],
    )


def tp_consumer_of_tp_model(configs: list[tuple[str, bool, bool]]) -> None:
    """The shard map of a TP-trained model (2 dp x 2 tp): each entry places its range of the
    tp-local tensor in the full parameter (DTensor's own global offset and placements), with no
    collective; a consumer of another layout (a 3-way row split of every parameter) assembles
    its slices from every rank's global boxes, bit for bit against the full parameters."""
    from fsdp.export import local_shard_views, shard_map
    from fsdp.runtime._state import named_fsdp_states
    from tests._comm_count import count_collectives
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for strategy, nested, orig in configs:
        model = _tp_trained(strategy, nested, orig, 12)
        full = _full_tensors(model)
        with count_collectives() as counts:
            entries = shard_map(model)
            ranges = local_shard_views(model)
        assert dict(counts.calls) == {} and [r.entry for r in ranges] == entries, counts.calls
        specs = {
            (prefix, h, index): info.dtensor_spec
            for prefix, _, state in named_fsdp_states(model)
            for h, handle in enumerate(state.handles)
            for index, info in enumerate(handle.param_infos)
        }
        for entry in entries:
            assert entry.global_shape == full[entry.name].shape and entry.dtype == full[entry.name].dtype, entry
            tp_split = entry.name.endswith(("fc1.weight", "fc1.bias", "fc2.weight"))
            if entry.placements is None:
                assert entry.global_offset == (0,) * len(entry.shape) and entry.shape == entry.global_shape, entry
            else:  # DTensor's own arithmetic for where the tp-local tensor sits
                spec = specs[(entry.unit, entry.handle_index, entry.param_index)]
                local_shape, offset = compute_local_shape_and_global_offset(spec.shape, spec.mesh, spec.placements)
                assert entry.placements == tuple(spec.placements), entry
                assert (tuple(entry.shape), entry.global_offset) == (tuple(local_shape), tuple(offset)), entry
                assert tp_split == any(p.is_shard() for p in entry.placements), entry
            assert len(entry.global_boxes) == len(entry.boxes) and all(
                g.sizes == b.sizes and all(x == y + o for x, y, o in zip(g.offsets, b.offsets, entry.global_offset))
                for g, b in zip(entry.global_boxes, entry.boxes)
            ), entry
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, [(r.entry, [b.clone() for b in r.boxes]) for r in ranges])
        assert {e.name for e, _ in itertools.chain(*everyone)} == set(full)  # every parameter (no buffers)
        for name, whole in full.items():
            rows = whole.shape[0]
            for consumer in range(3):  # a 3-way row split: consumer rank c's rows
                lo, hi = min(consumer * -(-rows // 3), rows), min((consumer + 1) * -(-rows // 3), rows)
                mine = torch.full((hi - lo, *whole.shape[1:]), float("nan"), dtype=whole.dtype)
                for entry, boxes in itertools.chain(*everyone):
                    if entry.name != name:
                        continue
                    for box, values in zip(entry.global_boxes, boxes):
                        r0, r1 = max(box.offsets[0], lo), min(box.offsets[0] + box.sizes[0], hi)
                        if r0 < r1:
                            where = (slice(r0 - lo, r1 - lo), *(slice(o, o + n) for o, n in zip(box.offsets[1:], box.sizes[1:])))
                            mine[where] = values[r0 - box.offsets[0] : r1 - box.offsets[0]]
                assert torch.equal(mine, whole[lo:hi]), (strategy, nested, orig, name, consumer)
            held = torch.zeros(whole.shape, dtype=torch.int32)
            for entry, _ in itertools.chain(*everyone):
                if entry.name == name:
                    for box in entry.global_boxes:
                        held[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))] += 1
            # Each element is held once per shard group: by one of the 4 ranks when tp splits the
            # parameter, by one rank per tp index (2) when every tp rank holds it whole.
            replicas = 1 if name.endswith(("fc1.weight", "fc1.bias", "fc2.weight")) else 2
            assert bool((held == replicas).all()), (strategy, name, held)


def test_shard_map_tensor_parallel(pool4: RankPool) -> None:
    pool4.run(tp_consumer_of_tp_model, [("FULL_SHARD", True, True), ("SHARD_GRAD_OP", False, False)])


class _Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _tp_mlps() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """Six MLP units (64 -> 128 -> 64; ColwiseParallel fc1, RowwiseParallel fc2) on the 2 dp x 2
    tp mesh, wrapped with use_orig_params, and the unwrapped model's state dict."""
    from fsdp import FullyShardedDataParallel as FSDP
    from fsdp.wrap import ModuleWrapPolicy
    from tests.test_tensor_parallel import _mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    net = nn.Sequential(*[_Mlp(64, 128) for _ in range(6)])
    plain = {k: v.clone() for k, v in net.state_dict().items()}
    plan: dict[str, Any] = {}
    for i in range(6):
        plan[f"{i}.fc1"], plan[f"{i}.fc2"] = ColwiseParallel(), RowwiseParallel()
    net = parallelize_module(net, _mesh()["tp"], plan)
    return FSDP(net, device_mesh=_mesh()["dp"], auto_wrap_policy=ModuleWrapPolicy({_Mlp}), use_orig_params=True), plain


def tp_stream_memory() -> dict[str, Any]:
    """Extra live bytes while streaming a TP model, beside the same collectives alone (the
    floor, gloo's internal buffers), against the bound of [Note: Export of tensor-parallel
    parameters]: U + (tp + 1) * P + B. Shard(0) parameters split evenly are gathered straight
    into their bucket slot (no temporary)."""
    import fsdp.export as export
    from benchmarks.memory import MemoryTrace
    from fsdp import FullyShardedDataParallel as FSDP
    from fsdp.export import full_params_stream

    model, _ = _tp_mlps()
    handles = [h for m in FSDP.fsdp_modules(model) for h in m._fsdp_state.handles if h.param_infos]
    tps = [export._tp_params(h, False) for h in handles]
    unit_bytes = max(h.shard_layout.padded_unsharded_numel * 4 for h in handles)
    piece_bytes = max(p.pieces[0].numel * 4 for tp in tps for p in tp if p is not None)
    bucket_bytes = 40000
    result: dict[str, Any] = {"U": unit_bytes, "P": piece_bytes, "B": bucket_bytes, "tp": 2, "floor": 0}
    for _ in range(2):  # the bare collectives, each result dropped at once
        with MemoryTrace() as trace, trace.window("bare"):
            for h, tp in zip(handles, tps):
                export.gather(h._local_shard, h.process_group, h.rank, h.world_size, None)
                for p in tp:
                    if p is not None:
                        flat = torch.empty(p.pieces[0].numel)
                        export.comm.all_gather_flat(torch.empty(p.size * flat.numel()), flat, p.group)
                        del flat
        result["floor"] = max(result["floor"], trace.peaks["bare"] - trace.starts["bare"])
    tp_groups = {id(p.group) for tp in tps for p in tp if p is not None}
    into_slot: list[bool] = []  # per tp gather: its output is a view of the bucket slot
    original = export.comm.all_gather_flat

    def spy(output: torch.Tensor, input: torch.Tensor, group: Any, *args: Any, **kwargs: Any) -> Any:
        if id(group) in tp_groups:
            into_slot.append(output._base is not None)
        return original(output, input, group, *args, **kwargs)

    export.comm.all_gather_flat = spy  # type: ignore[assignment]
    try:
        with MemoryTrace() as trace, trace.window("export"):
            for bucket in full_params_stream(model, bucket_bytes=bucket_bytes):
                del bucket
    finally:
        export.comm.all_gather_flat = original  # type: ignore[assignment]
    result["extra"] = trace.peaks["export"] - trace.starts["export"]
    result["into_slot"] = into_slot
    infos = [i for h in handles for i in h.param_infos]
    result["model"] = sum(4 * (i.dtensor_spec.shape.numel() if i.dtensor_spec is not None else i.numel) for i in infos)
    return result


def test_tp_stream_memory(pool4: RankPool) -> None:
    for r in pool4.run(tp_stream_memory):
        # Per unit: fc1's weight and bias (ColwiseParallel: Shard(0), 128 rows over 2) straight
        # into the slot; fc2's weight (Shard(1)) through one temporary; fc2's bias is Replicate
        # (no gather).
        assert r["into_slot"] == [True, True, False] * 6, r
        bound = r["U"] + (r["tp"] + 1) * r["P"] + r["B"]
        assert r["extra"] <= r["floor"] + bound, r
        print("tp stream memory:", r)


# ----------------------------------------------------------------------------- the benchmark's floor ratio
def test_benchmark_times_stream_and_floor_interleaved(monkeypatch: pytest.MonkeyPatch) -> None:
    """``benchmarks/export.py`` ([Note: The stream and its floor are timed interleaved]): each
    repetition runs both, the order reversed every other one, and the ratio is the median of the
    per-repetition ratios of the slowest rank's times, with min and max; the CPU ratio sums the
    ranks."""
    import benchmarks.export as bench

    order: list[str] = []
    monkeypatch.setattr(bench.dist, "barrier", lambda: None)
    wall, cpu = bench._interleaved({"floor": lambda: order.append("f"), "fsdp_stream": lambda: order.append("s")}, 4)
    assert order == ["f", "s"] + ["f", "s", "s", "f"] * 2  # warm-ups, then ABBA
    assert [len(wall["floor"]), len(cpu["fsdp_stream"])] == [4, 4]

    def rank(floor: list[float], stream: list[float], floor_cpu: list[float], stream_cpu: list[float]) -> dict[str, Any]:
        return {"paired_wall": {"floor": floor, "fsdp_stream": stream}, "paired_cpu": {"floor": floor_cpu, "fsdp_stream": stream_cpu}}

    # Slowest rank per repetition: floor (1.0, 2.0, 4.0), stream (1.5, 2.0, 2.0): ratios 1.5, 1.0, 0.5.
    ranks = [
        rank([1.0, 1.0, 4.0], [1.5, 2.0, 1.0], [1.0, 1.0, 1.0], [1.0, 2.0, 3.0]),
        rank([0.5, 2.0, 1.0], [1.0, 1.0, 2.0], [1.0, 1.0, 1.0], [1.0, 2.0, 3.0]),
    ]
    spread, paired, cpu_ratio = bench._ratio_spread(ranks)
    assert (spread["median"], spread["min"], spread["max"], spread["reps"]) == (1.0, 0.5, 1.5, 3)
    assert paired == {"floor": 2.0, "fsdp_stream": 2.0}  # the median slowest time of each
    assert cpu_ratio == 2.0  # ranks summed per repetition: 2/2, 4/2, 6/2
