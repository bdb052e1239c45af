"""fsdp's collective layer (``fsdp/_comm/_collectives.py``): one path for every backend.

The flat all-gather and reduce-scatter are torch's collectives themselves; the rank-0 gather of
full state dicts is one collective, an all-to-all that sends every shard to the receiver only
(no per-peer sends). Checked against ``torch.distributed``'s own results, bit for bit, also with
several collectives in flight.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from fsdp._comm import _collectives as comm
from tests._harness import RankPool


def _data(seed: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Mixed magnitudes, so the order of additions would show in the last bits.
    scale = 10.0 ** torch.randint(-4, 4, (numel,), generator=g).double()
    return (torch.randn(numel, generator=g, dtype=torch.float64) * scale).to(dtype)


def gather_to_one_rank() -> None:
    """Each rank's shard lands in its chunk on ``dst`` only, through one collective call
    (``dist.all_to_all_single``, [Note: Gather to one rank])."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    calls: list[str] = []
    originals = {name: getattr(dist, name) for name in ("all_to_all_single", "gather", "isend", "irecv", "send", "recv")}

    def spy(name: str) -> Any:
        def recording(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return originals[name](*args, **kwargs)

        return recording

    for name in originals:
        setattr(dist, name, spy(name))
    try:
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            for dst in range(ws):
                shard = _data(10 * rank + dst, 7, dtype)
                output = torch.empty(7 * ws, dtype=dtype) if rank == dst else None
                work = comm.gather_flat_to(output, shard, None, dst, async_op=True)
                work.wait()
                everyone = [torch.empty_like(shard) for _ in range(ws)]
                dist.all_gather(everyone, shard)
                if rank == dst:
                    assert output is not None and torch.equal(output, torch.cat(everyone)), (dtype, dst)
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    assert set(calls) == {"all_to_all_single"}, calls
    assert len(calls) == 3 * ws


@pytest.mark.parametrize("dist_pool", [2, 3], indirect=True)
def test_gather_to_one_rank_is_one_collective(dist_pool: RankPool) -> None:
    dist_pool.run(gather_to_one_rank)


def interleaved_in_flight() -> None:
    """Gathers and reductions launched together, completed in another order, equal torch's."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    shards = [_data(10 * i + rank, 50 + i, torch.float32) for i in range(3)]
    fulls = [_data(20 * i + rank, (40 + i) * ws, torch.float32) for i in range(3)]
    gathered = [torch.empty(s.numel() * ws) for s in shards]
    reduced = [torch.empty(f.numel() // ws) for f in fulls]
    works = []
    for i in range(3):
        works.append(comm.all_gather_flat(gathered[i], shards[i], None, async_op=True))
        works.append(comm.reduce_scatter_flat(reduced[i], fulls[i].clone(), None, async_op=True))
    for work in reversed(works):
        work.wait()
    for i in range(3):
        expected = torch.empty_like(gathered[i])
        dist.all_gather_into_tensor(expected, shards[i])
        assert torch.equal(gathered[i], expected)
        expected_sum = torch.empty_like(reduced[i])
        dist.reduce_scatter_tensor(expected_sum, fulls[i].clone())
        assert torch.equal(reduced[i], expected_sum)


@pytest.mark.parametrize("dist_pool", [2, 4], indirect=True)
def test_several_in_flight(dist_pool: RankPool) -> None:
    dist_pool.run(interleaved_in_flight)


