"""Searching the configurations whose predicted peak fits a memory budget, cheapest first."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from fsdp.api import CPUOffload, MixedPrecision, ShardingStrategy
from fsdp.plan._api import PlanCache, estimate_memory
from fsdp.plan._estimate import MemoryEstimate

__all__ = ["Candidate", "search_configurations"]

# Cheaper first: less communication per step (SHARD_GRAD_OP gathers once, NO_SHARD never).
_STRATEGY_COST = {
    ShardingStrategy.NO_SHARD: 0,
    ShardingStrategy.SHARD_GRAD_OP: 1,
    ShardingStrategy.HYBRID_SHARD: 2,
    ShardingStrategy.FULL_SHARD: 3,
}


@dataclass
class Candidate:
    """One configuration and its estimate.

    Attributes:
        world_size: Ranks.
        strategy: The sharding strategy.
        bf16: bfloat16 mixed precision (``param_dtype``).
        offload: CPU offload of parameters.
        checkpointing: Activation checkpointing of every wrapped block.
        intra_node_size: Hybrid strategies: the node size.
        estimate: The prediction.
    """

    world_size: int
    strategy: ShardingStrategy
    bf16: bool
    offload: bool
    checkpointing: bool
    intra_node_size: Optional[int]
    estimate: MemoryEstimate

    def cost(self) -> tuple[int, int, int, int, int]:
        """Fewer ranks first; then no offload, no recomputation, less communication, less memory."""
        return (
            self.world_size,
            int(self.offload),
            int(self.checkpointing),
            _STRATEGY_COST[self.strategy],
            self.estimate.peak_bytes,
        )


def search_configurations(
    build: Callable[[bool], tuple[nn.Module, Any]],
    *,
    budget_bytes: int,
    max_world_size: int,
    gpus_per_node: int,
    device: str,
    fsdp_kwargs: dict[str, Any],
    loss_fn: Optional[Callable[[Any], torch.Tensor]] = None,
) -> list[Candidate]:
    """Estimates every configuration and returns those that fit, cheapest first.

    Args:
        build: ``build(checkpointing) -> (meta model, example inputs)``.
        budget_bytes: Device memory per rank.
        max_world_size: Largest world size tried (powers of two from 1).
        gpus_per_node: The intra-node size for HYBRID_SHARD.
        device: The training device type (``"cuda"`` or ``"cpu"``).
        fsdp_kwargs: Other keywords for the wrapper (``auto_wrap_policy``...).
        loss_fn: As for :func:`fsdp.estimate_memory`.
    """
    fits: list[Candidate] = []
    world_sizes = [1 << i for i in range(max_world_size.bit_length()) if (1 << i) <= max_world_size]
    for checkpointing in (False, True):
        model, inputs = build(checkpointing)
        cache = PlanCache()  # [Note: Plan cache]: one per model object
        for world_size in world_sizes:
            for strategy in _STRATEGY_COST:
                if world_size == 1 and strategy is not ShardingStrategy.NO_SHARD:
                    continue  # the same as NO_SHARD at one rank
                intra = None
                if strategy is ShardingStrategy.HYBRID_SHARD:
                    intra = min(gpus_per_node, world_size)
                    if world_size <= gpus_per_node or world_size % intra:
                        continue  # one node: that is FULL_SHARD
                for bf16 in (False, True):
                    offloads = (False, True) if strategy not in (ShardingStrategy.NO_SHARD,) and device != "cpu" else (False,)
                    for offload in offloads:
                        kwargs = dict(fsdp_kwargs)
                        kwargs["sharding_strategy"] = strategy
                        kwargs["device_id"] = torch.device(device)
                        if bf16:
                            kwargs["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16)
                        if offload:
                            kwargs["cpu_offload"] = CPUOffload(offload_params=True)
                        estimate = estimate_memory(
                            model,
                            inputs,
                            world_size=world_size,
                            loss_fn=loss_fn,
                            intra_node_size=intra,
                            _cache=cache,
                            **kwargs,
                        )
                        if estimate.peak_bytes <= budget_bytes:
                            fits.append(
                                Candidate(world_size, strategy, bf16, offload, checkpointing, intra, estimate)
                            )
    return sorted(fits, key=Candidate.cost)
