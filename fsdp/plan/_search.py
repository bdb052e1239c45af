"""Searching the configurations whose predicted peak fits a memory budget, cheapest first."""

from __future__ import annotations

from dataclasses import dataclass
# Any below: the FSDP constructor's keyword arguments (mixed types; torch's wrap policies type them
# so) and ``loss_fn``'s argument, the model's output (torch types nn.Module.__call__'s as Any).
from typing import Any, Callable, Optional

import torch
from torch import nn

from fsdp.api import CPUOffload, MixedPrecision, ShardingStrategy
from fsdp.flat_param._policy import HYBRID_STRATEGIES
from fsdp.plan._api import PlanCache, estimate_memory
from fsdp.plan._estimate import MemoryEstimate

__all__ = ["Candidate", "SearchSpace", "search_configurations", "STRATEGY_COST"]

# Cheaper first: less communication per step (SHARD_GRAD_OP gathers once, NO_SHARD never).
STRATEGY_COST = {
    ShardingStrategy.NO_SHARD: 0,
    ShardingStrategy.SHARD_GRAD_OP: 1,
    ShardingStrategy._HYBRID_SHARD_ZERO2: 2,
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
            STRATEGY_COST[self.strategy],
            self.estimate.peak_bytes,
        )

    def fits(self, budget_bytes: int, host_budget_bytes: Optional[int] = None) -> bool:
        """Whether the device peak fits ``budget_bytes`` and the host peak ``host_budget_bytes``."""
        if self.estimate.peak_bytes > budget_bytes:
            return False
        return host_budget_bytes is None or self.estimate.cpu_peak_bytes <= host_budget_bytes


@dataclass
class SearchSpace:
    """The configurations to try: every combination of the lists, less the redundant ones.

    Attributes:
        world_sizes: Ranks.
        strategies: Sharding strategies.
        bf16: Mixed-precision settings (False: full precision; True: ``param_dtype=bfloat16``).
        offload: CPU offload settings.
        checkpointing: Activation checkpointing settings.
        intra_node_size: Hybrid strategies' node size (the shard group).
        device: The training device type (``"cuda"`` or ``"cpu"``).
    """

    world_sizes: list[int]
    strategies: list[ShardingStrategy]
    bf16: list[bool]
    offload: list[bool]
    checkpointing: list[bool]
    intra_node_size: int
    device: str

    def strategies_at(self, world_size: int, offload: bool) -> list[ShardingStrategy]:
        """The strategies worth trying at ``world_size``: what the runtime can run, once each.

        - Hybrid strategies need more than one node of whole nodes (one node is FULL_SHARD).
        - CPU offload has no effect when the training device is the CPU, and fsdp's offload
          refuses NO_SHARD on more than one rank.
        - On one rank every strategy trains as NO_SHARD (offload too: [Note: CPU offload on
          one rank]): only the cheapest is tried.
        """
        if offload and self.device == "cpu":
            return []
        tried = []
        for strategy in sorted(self.strategies, key=STRATEGY_COST.__getitem__):
            if strategy in HYBRID_STRATEGIES and (
                world_size <= self.intra_node_size or world_size % self.intra_node_size
            ):
                continue
            if offload and world_size > 1 and strategy is ShardingStrategy.NO_SHARD:
                continue
            tried.append(strategy)
        return tried[:1] if world_size == 1 else tried

    def size(self) -> int:
        """How many configurations :func:`search_configurations` plans."""
        return sum(
            len(self.strategies_at(ws, offload)) * len(self.bf16) * len(self.checkpointing)
            for ws in self.world_sizes
            for offload in self.offload
        )


def search_configurations(
    build: Callable[[bool], tuple[nn.Module, object]],
    space: SearchSpace,
    *,
    fsdp_kwargs: dict[str, Any],
    loss_fn: Optional[Callable[[Any], torch.Tensor]] = None,
    progress: Optional[Callable[[str], None]] = None,
) -> list[Candidate]:
    """Estimates every configuration of ``space``; returns them all, cheapest first.

    Filter with :meth:`Candidate.fits`.

    Args:
        build: ``build(checkpointing) -> (meta model, example inputs)``.
        space: What to try.
        fsdp_kwargs: Other keywords for the wrapper (``auto_wrap_policy``...).
        loss_fn: As for :func:`fsdp.estimate_memory`.
        progress: Called with one line before each configuration is estimated
            (``[3/24] world size 8, FULL_SHARD, bf16, no offload, checkpointing``).
    """
    candidates: list[Candidate] = []
    total, done = space.size(), 0
    for checkpointing in space.checkpointing:
        model, inputs = build(checkpointing)
        cache = PlanCache()  # [Note: Plan cache]: one per model object
        for world_size in space.world_sizes:
            for offload in space.offload:
                for strategy in space.strategies_at(world_size, offload):
                    intra = space.intra_node_size if strategy in HYBRID_STRATEGIES else None
                    for bf16 in space.bf16:
                        kwargs = dict(fsdp_kwargs)
                        kwargs["sharding_strategy"] = strategy
                        kwargs["device_id"] = torch.device(space.device)
                        if bf16:
                            kwargs["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16)
                        if offload:
                            kwargs["cpu_offload"] = CPUOffload(offload_params=True)
                        done += 1
                        if progress is not None:
                            progress(
                                f"[{done}/{total}] world size {world_size}, {strategy.name}, "
                                f"{'bf16' if bf16 else 'fp32'}, {'offload' if offload else 'no offload'}, "
                                f"{'checkpointing' if checkpointing else 'no checkpointing'}"
                            )
                        estimate = estimate_memory(
                            model,
                            inputs,
                            world_size=world_size,
                            loss_fn=loss_fn,
                            intra_node_size=intra,
                            _cache=cache,
                            **kwargs,
                        )
                        candidates.append(
                            Candidate(world_size, strategy, bf16, offload, checkpointing, intra, estimate)
                        )
    return sorted(candidates, key=Candidate.cost)
