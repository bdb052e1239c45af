"""A unit's schedule policy: resolved once, run by the runtime's hooks, replayed by the planner.

[Note: One schedule]
Every rule of when a unit's parameters are gathered, kept, freed and reduced is a function of
one small record, :class:`UnitPolicy`, resolved once per unit from the constructor's
arguments and the group sizes (:meth:`UnitPolicy.resolve`). The runtime's hooks
(``runtime/_hooks.py``, ``runtime/_prefetch.py``) and the handle's gradient reduction
(``_reduction.py``) ask the record; the memory planner (``plan/_units.py``, ``plan/_schedule.py``)
builds the same record for the ranks it plans and replays the same functions. A strategy is a
new record, not edits in the hooks and again in the planner: what a strategy means lives here
alone (:data:`HYBRID_STRATEGIES`, :func:`effective_strategy`, the properties below).

The rules that also depend on the step (the root, the unit kept from forward into backward,
``no_sync``, a communication hook, whether the device has streams) take those as arguments, so
the planner passes what it plans and the runtime what it sees.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from torch import nn

from fsdp.api import BackwardPrefetch, CPUOffload, ShardingStrategy
from fsdp.flat_param._sharding import handle_uses_sharding

__all__ = ["HYBRID_STRATEGIES", "UnitPolicy", "effective_strategy", "offloaded_units"]

#: The strategies that shard inside a group and replicate across groups ([Note: Hybrid sharding
#: layout]); they take no communication hook.
HYBRID_STRATEGIES = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)

#: The strategies that free a unit's unsharded parameters between its forward and its backward.
_RESHARD_AFTER_FORWARD = (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)

#: The constructor's keyword arguments :meth:`UnitPolicy.resolve` reads, besides
#: ``sharding_strategy`` (its first argument), under the same names.
_CONSTRUCTOR_KWARGS = ("cpu_offload", "backward_prefetch", "forward_prefetch", "limit_all_gathers")


def effective_strategy(requested: Optional[ShardingStrategy], shard_world_size: int) -> ShardingStrategy:
    """The strategy a unit runs: the one asked for (FULL_SHARD by default), or NO_SHARD when a
    non-hybrid strategy meets a shard group of one rank (nothing to shard; torch FSDP1 switches
    the same way, with its warning, ``init/_validate.py``)."""
    strategy = requested or ShardingStrategy.FULL_SHARD
    if shard_world_size == 1 and strategy not in HYBRID_STRATEGIES:
        return ShardingStrategy.NO_SHARD
    return strategy


# [Note: Fractional offload]
# ``CPUOffload(offload_params=True)`` offloads every unit (torch FSDP1). ``fraction=`` and
# ``offload_module=`` choose some: each chosen unit keeps its fp32 shard, its reduced gradient and
# (the optimizer allocating state like its parameter) its optimizer state on the host; the others
# keep all three on the device. The arithmetic is the same either way (the host copies are
# exact), so a fraction changes where bytes live and what is copied, never a value.
#
# The choice is resolved once, when the root is built, over the units that constructor plans (the
# root and its auto-wrapped units; a unit wrapped by hand before keeps its own), into each unit's
# ``UnitPolicy.offload_params``; the planner (``plan/_units.py``) resolves the same units with
# this same function, so ``fsdp.estimate_memory`` makes the runtime's choice.
#
# ``fraction``: the units are taken in the model's module order (pre-order, the root first,
# which is the order a forward enters them) and offloaded from the *last* one backwards, until
# the offloaded parameters reach ``fraction`` of the parameters of those units (the unit that
# crosses it is offloaded too: 0 offloads none, 1 all, and any fraction above 0 at least one).
# The last units are the ones backward reaches first and the next forward needs last: their
# gradients arrive on the host earliest and their updated parameters are needed latest, so they
# leave the host step the most time to overlap (issue 35's pipeline); the first units, needed at
# once by the next forward, stay on the device. Ties cannot arise: the order is the modules'.
# Units with different fractions (a CustomPolicy overriding ``cpu_offload``) resolve each over
# the units that carry it. A constructor called by hand on a submodule resolves a fraction over
# its own units only (it cannot see the rest of the model), so with wrapping by hand choose the
# units with ``offload_module`` (or per-unit ``CPUOffload(offload_params=...)``), which needs no
# view of the whole model.
#
# ``offload_module``: a predicate on each unit's wrapped module (the user's module), the way an
# auto-wrap policy is one.


def offloaded_units(units: Sequence[tuple[nn.Module, Optional[CPUOffload], int]]) -> list[bool]:
    """Which units offload their parameters (see [Note: Fractional offload]).

    Args:
        units: Per unit in module pre-order (root first): its wrapped module, its ``CPUOffload``
            (None: none), and the number of parameter elements it manages.

    Returns:
        Per unit, whether it offloads.
    """
    chosen = [bool(c is not None and c.offload_params) for _, c, _ in units]
    pools: dict[float, list[int]] = {}
    for i, (module, config, _) in enumerate(units):
        if config is None or not config.selects_units:
            continue
        if config.offload_module is not None:
            chosen[i] = bool(config.offload_module(module))
        else:
            assert config.fraction is not None
            pools.setdefault(float(config.fraction), []).append(i)
    for fraction, members in pools.items():
        total = sum(units[i][2] for i in members)
        offloaded = 0
        for i in reversed(members):
            chosen[i] = fraction > 0 and offloaded < fraction * total
            if chosen[i]:
                offloaded += units[i][2]
    return chosen


@dataclass(frozen=True)
class UnitPolicy:
    """What decides a unit's schedule (see [Note: One schedule]).

    Attributes:
        strategy: The strategy in effect (:func:`effective_strategy`).
        shard_world_size: Ranks a parameter is sharded over (the node for hybrid strategies).
        replicate_world_size: Ranks holding the same shard (hybrid strategies), else 1.
        offload_params: Whether the unit's shard and gradient live on the host: every unit with
            ``CPUOffload(offload_params=True)``, the chosen ones with its ``fraction`` or
            ``offload_module`` ([Note: Fractional offload]).
        backward_prefetch: When the next unit's backward gather is launched (None: never).
        forward_prefetch: Whether the next unit's forward gather is launched early.
        limit_all_gathers: At most two prefetched gathers in flight.
    """

    strategy: ShardingStrategy
    shard_world_size: int
    replicate_world_size: int = 1
    offload_params: bool = False
    backward_prefetch: Optional[BackwardPrefetch] = BackwardPrefetch.BACKWARD_PRE
    forward_prefetch: bool = False
    limit_all_gathers: bool = True

    @classmethod
    def resolve(
        cls,
        requested: Optional[ShardingStrategy],
        shard_world_size: int,
        replicate_world_size: int = 1,
        cpu_offload: Optional[CPUOffload] = None,
        backward_prefetch: Optional[BackwardPrefetch] = BackwardPrefetch.BACKWARD_PRE,
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
    ) -> "UnitPolicy":
        """The record for a unit built with these arguments over groups of these sizes.

        ``cpu_offload`` is the unit's resolved config: one that selects units (``fraction``,
        ``offload_module``) is resolved first, over all the units (:func:`offloaded_units`).
        """
        if cpu_offload is not None and cpu_offload.selects_units:
            raise RuntimeError(
                f"fsdp internal error: UnitPolicy.resolve got the unresolved {cpu_offload!r}; "
                f"resolve it over the units first (offloaded_units)."
            )
        return cls(
            strategy=effective_strategy(requested, shard_world_size),
            shard_world_size=shard_world_size,
            replicate_world_size=replicate_world_size,
            offload_params=bool(cpu_offload is not None and cpu_offload.offload_params),
            backward_prefetch=backward_prefetch,
            forward_prefetch=bool(forward_prefetch),
            limit_all_gathers=bool(limit_all_gathers),
        )

    @classmethod
    def from_kwargs(
        cls, kwargs: Mapping[str, Any], shard_world_size: int, replicate_world_size: int = 1
    ) -> "UnitPolicy":
        """:meth:`resolve` for a unit built with the constructor keyword arguments ``kwargs``
        (the memory planner's units): those a user omitted take :meth:`resolve`'s defaults,
        which are the constructor's, so no caller restates them."""
        given = {name: kwargs[name] for name in _CONSTRUCTOR_KWARGS if name in kwargs}
        return cls.resolve(kwargs.get("sharding_strategy"), shard_world_size, replicate_world_size, **given)

    @property
    def is_hybrid(self) -> bool:
        """Shards inside a group and all-reduces across replicas."""
        return self.strategy in HYBRID_STRATEGIES

    @property
    def strategy_shards(self) -> bool:
        """Whether the strategy shards parameters (every one but NO_SHARD); whether the unit's
        handles take the sharded path also depends on the group and offload
        (:attr:`uses_sharding`)."""
        return self.strategy is not ShardingStrategy.NO_SHARD

    @property
    def uses_sharding(self) -> bool:
        """Whether the unit's handles take the sharded path (``handle_uses_sharding``)."""
        return handle_uses_sharding(self.strategy_shards, self.shard_world_size, self.offload_params)

    @property
    def reshards_after_forward(self) -> bool:
        """Whether the strategy frees the unsharded parameters between forward and backward."""
        return self.strategy in _RESHARD_AFTER_FORWARD

    @property
    def keeps_unsharded_for_backward(self) -> bool:
        """A sharding strategy that keeps every unit's unsharded parameters from its forward into
        its backward (SHARD_GRAD_OP, _HYBRID_SHARD_ZERO2): the names keep the unsharded views
        in between, as torch FSDP1's do ([Note: Original parameters between forward and
        backward] in ``runtime/_hooks.py``)."""
        return not self.reshards_after_forward and self.strategy_shards

    def frees_after_forward(self, is_root: bool, has_unsharded_buffer: bool) -> bool:
        """Whether post-forward frees the unit's unsharded copies when a backward follows.

        FULL_SHARD / HYBRID_SHARD units other than the root (which would gather again at once);
        and NO_SHARD units whose compute copy is separate from the parameter
        (``has_unsharded_buffer``: low-precision parameters, or parameters offloaded to the
        host), the root included: torch FSDP1 frees NO_SHARD's low-precision copy at every
        reshard and casts it again for the backward, so a NO_SHARD model in mixed precision
        never holds every unit's low-precision copy at once. The unit kept from forward into
        backward ([Note: The first backward unit stays gathered]) is the caller's exception.
        """
        if self.reshards_after_forward:
            return not is_root
        return not self.strategy_shards and has_unsharded_buffer

    def reshards_after_backward(self, sync_gradients: bool) -> bool:
        """Whether the unsharded parameters are freed once the unit's backward is done.

        Inside ``no_sync`` (``sync_gradients`` False) SHARD_GRAD_OP and _HYBRID_SHARD_ZERO2
        keep them (the next forward needs them again and the gradient stays unsharded anyway);
        FULL_SHARD and HYBRID_SHARD always free.
        """
        return sync_gradients or self.reshards_after_forward

    @staticmethod
    def reduction_stays_in_flight(has_stream: bool) -> bool:
        """Whether a gradient reduction stays in flight past the post-backward hook (its buffers
        alive until the compute stream waits for it): on a post-backward stream (CUDA), every
        one; without a stream, none ([Note: On CPU a collective completes where it is launched]).
        No strategy changes it, so the reduction itself asks (``GradReduction.reduce``, with
        whether it has a stream) and the planner replays the same answer."""
        return has_stream


# [Note: On CPU a collective completes where it is launched]
# A CPU rank has no stream to queue a collective behind. The only way to overlap one with the
# rank's computation is an asynchronous collective on the backend's host thread, whose staging
# buffers (gloo gathers into an unsharded-size buffer, and reduce-scatters a full-size copy of
# its input) then stay alive for as long as that thread takes to run and to let go of them: a
# matter of thread scheduling, which on a host whose ranks share cores decides the step's peak.
# So on CPU every all-gather (prefetches too) and every gradient reduction completes where it is
# launched, as torch FSDP1's do on CPU: a prefetch moves a gather earlier, to the moment its
# setting names, and completes it there. Which collectives run, and their order, are the same on
# every device; only the waiting differs, and it follows from the stream, not from the backend.
