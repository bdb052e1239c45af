"""Per-unit runtime state and the context the root shares with every unit.

All fields are declared here, in one place. A unit's training state is an explicit enum whose
transitions go through :func:`transition`, which checks them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from fsdp._common import clean_fqn, p_assert
from fsdp.api import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from fsdp.flat_param._policy import UnitPolicy

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from fsdp.flat_param.flat_param import FlatParamHandle


class HandleTrainingState(Enum):
    """What a unit (and so each of its FlatParamHandles) is doing right now.

    This is the runtime's state machine (transitions checked by :func:`transition`). Its
    members carry torch FSDP1's ``HandleTrainingState`` names, and a unit's handles report
    it as ``handle._training_state``, as torch's handles do.
    """

    IDLE = auto()
    FORWARD = auto()
    BACKWARD_PRE = auto()
    BACKWARD_POST = auto()
    SUMMON_FULL_PARAMS = auto()


class TrainingState(Enum):
    """What an FSDP instance is doing, as torch FSDP1's instance-level ``TrainingState`` says it.

    ``FullyShardedDataParallel.training_state`` gives this coarse view of the unit's
    :class:`HandleTrainingState`: forward and both backward phases fold into
    ``FORWARD_BACKWARD``.
    """

    IDLE = auto()
    FORWARD_BACKWARD = auto()
    SUMMON_FULL_PARAMS = auto()


_COARSE_STATE: dict[HandleTrainingState, TrainingState] = {
    HandleTrainingState.IDLE: TrainingState.IDLE,
    HandleTrainingState.FORWARD: TrainingState.FORWARD_BACKWARD,
    HandleTrainingState.BACKWARD_PRE: TrainingState.FORWARD_BACKWARD,
    HandleTrainingState.BACKWARD_POST: TrainingState.FORWARD_BACKWARD,
    HandleTrainingState.SUMMON_FULL_PARAMS: TrainingState.SUMMON_FULL_PARAMS,
}


def coarse_training_state(fine: HandleTrainingState) -> TrainingState:
    """The instance-level :class:`TrainingState` for a unit in ``fine``."""
    return _COARSE_STATE[fine]


# Allowed transitions: from -> the states that may follow.
_TRANSITIONS: dict[HandleTrainingState, frozenset[HandleTrainingState]] = {
    HandleTrainingState.IDLE: frozenset(
        {
            HandleTrainingState.FORWARD,
            HandleTrainingState.BACKWARD_PRE,
            HandleTrainingState.BACKWARD_POST,
            HandleTrainingState.SUMMON_FULL_PARAMS,
        }
    ),
    HandleTrainingState.FORWARD: frozenset({HandleTrainingState.IDLE}),
    HandleTrainingState.BACKWARD_PRE: frozenset({HandleTrainingState.BACKWARD_POST, HandleTrainingState.IDLE}),
    HandleTrainingState.BACKWARD_POST: frozenset({HandleTrainingState.BACKWARD_PRE, HandleTrainingState.IDLE}),
    HandleTrainingState.SUMMON_FULL_PARAMS: frozenset({HandleTrainingState.IDLE}),
}


@dataclass
class CastBuffer:
    """A buffer mixed precision cast (see ``fsdp/runtime/_mixed_precision.py``): where it lives and its full-precision value.

    Attributes:
        module: The module the buffer is registered on.
        name: Its name there.
        full_value: The value in the original dtype (see [Note: Full-precision buffers in
            state dicts]).
    """

    module: nn.Module
    name: str
    full_value: torch.Tensor
    compute_dtype: torch.dtype

    def state_dict_value(self) -> torch.Tensor:
        """The value a state dict holds: the kept full-precision value while still current."""
        current = self.module._buffers[self.name]
        assert current is not None
        if current.dtype == self.full_value.dtype:  # full precision in eval right now
            return current.detach().clone()
        if torch.equal(self.full_value.to(current.dtype), current):
            return self.full_value.clone()
        return current.detach().to(self.full_value.dtype)


@dataclass
class UnitState:
    """Everything the runtime knows about one FSDP instance.

    Attributes:
        handles: The unit's FlatParamHandles: none when it owns no parameters, one normally,
            two with use_orig_params when it mixes trainable and frozen parameters (the
            frozen handle has no gradient, so frozen parameters cost no gradient memory).
        process_group: The group parameters are sharded over.
        replicate_group: Hybrid strategies: the group sharded gradients are all-reduced over.
        rank: This rank in ``process_group``.
        world_size: Size of ``process_group``.
        policy: The unit's schedule policy ([Note: One schedule] in ``flat_param/_policy.py``):
            the strategy in effect (FULL_SHARD becomes NO_SHARD at world size 1), the group
            sizes, offload and prefetching; ``sharding_strategy``, ``backward_prefetch``,
            ``forward_prefetch`` and ``limit_all_gathers`` read it.
        compute_device: Where the unit computes and its parameters live.
        unit_name: Qualified name of the wrapped module in the root (set at lazy init).
        training_state: See :class:`HandleTrainingState` (a property: setting it also sets
            each handle's ``_training_state``, torch FSDP1's handle attribute).
        is_root: None until lazy init, then whether this unit is the root.
        ctx: The root's shared context (set at lazy init).
        sync_gradients: False inside ``no_sync``.
        ran_pre_backward: The pre-backward hook already ran in this backward.
        has_fsdp_parent: Another FSDP instance wraps this one (so it can never be the root
            for root-only APIs).
        comm_hook: A registered communication hook replacing the gradient reduction, and
        comm_hook_state: the state passed to it.
        mixed_precision: The unit's ``MixedPrecision`` config (None: full precision).
        full_precision_in_eval: ``FSDP_USE_FULL_PREC_IN_EVAL=1`` was set at construction.
        forward_in_full_precision: The unit's current (or last) forward runs with
            full-precision parameters (eval mode with ``full_precision_in_eval``).
        cast_buffers: The buffers mixed precision cast, with their full-precision values.
        cpu_offload: The unit's ``CPUOffload`` config (None: not given).
        use_orig_params: The ``use_orig_params`` construction argument.
        ignored_modules: Modules this unit leaves alone (closed under descendants).
        ignored_params: Parameters this unit leaves alone.
        reported_ignored_modules, reported_ignored_params: What the wrapper's
            ``_ignored_modules``/``_ignored_params`` report: torch FSDP1's values, which differ
            from what the unit leaves alone for nested units ([Note: Reported ignored states]).
        device_mesh: The ``device_mesh`` construction argument (None: not given).
    """

    handles: list["FlatParamHandle"]
    process_group: dist.ProcessGroup
    replicate_group: Optional[dist.ProcessGroup]
    rank: int
    world_size: int
    policy: UnitPolicy
    compute_device: torch.device
    unit_name: str
    _training_state: HandleTrainingState = field(default=HandleTrainingState.IDLE, init=False)
    is_root: Optional[bool] = None
    ctx: Optional["RootContext"] = None
    sync_gradients: bool = True
    ran_pre_backward: bool = False
    has_fsdp_parent: bool = False
    comm_hook: Optional[Callable[..., object]] = None
    comm_hook_state: object = None
    mixed_precision: Optional[MixedPrecision] = None
    full_precision_in_eval: bool = False
    forward_in_full_precision: bool = False
    cast_buffers: list["CastBuffer"] = field(default_factory=list)
    cpu_offload: Optional[CPUOffload] = None
    use_orig_params: bool = False
    ignored_modules: set[torch.nn.Module] = field(default_factory=set)
    ignored_params: set[torch.nn.Parameter] = field(default_factory=set)
    reported_ignored_modules: set[torch.nn.Module] = field(default_factory=set)
    reported_ignored_params: set[torch.nn.Parameter] = field(default_factory=set)
    device_mesh: Optional[DeviceMesh] = None

    def __post_init__(self) -> None:
        self.training_state = self._training_state

    @property
    def training_state(self) -> HandleTrainingState:
        """What the unit is doing (its handles report the same as ``_training_state``)."""
        return self._training_state

    @training_state.setter
    def training_state(self, new: HandleTrainingState) -> None:
        self._training_state = new
        for handle in self.handles:
            handle._training_state = new

    @property
    def handle(self) -> Optional["FlatParamHandle"]:
        """The unit's first (trainable, if any) handle; None when it owns no parameters."""
        return self.handles[0] if self.handles else None

    @property
    def sharding_strategy(self) -> ShardingStrategy:
        """The strategy in effect (the policy's)."""
        return self.policy.strategy

    @property
    def backward_prefetch(self) -> Optional[BackwardPrefetch]:
        """When this unit launches the next unit's backward gather ([Note: Prefetch]); None: never."""
        return self.policy.backward_prefetch

    @property
    def forward_prefetch(self) -> bool:
        """Whether it launches the next unit's forward gather."""
        return self.policy.forward_prefetch

    @property
    def limit_all_gathers(self) -> bool:
        """Cap prefetched gathers in flight at two."""
        return self.policy.limit_all_gathers

    @property
    def reshards_after_forward(self) -> bool:
        """Whether the strategy frees the unsharded parameter between forward and backward."""
        return self.policy.reshards_after_forward

    def frees_after_forward(self) -> bool:
        """``UnitPolicy.frees_after_forward`` for this unit as it is now (root or not, a
        separate unsharded copy or not)."""
        return self.policy.frees_after_forward(bool(self.is_root), any(h.has_unsharded_buffer for h in self.handles))

    def reshards_after_backward(self) -> bool:
        """``UnitPolicy.reshards_after_backward`` (inside ``no_sync`` or not)."""
        return self.policy.reshards_after_backward(self.sync_gradients)



@dataclass
class ForwardOrderWatch:
    """The local check of later iterations' forward order ([Note: Forward order after the
    first iteration] in ``_exec_order.py``).

    Attributes:
        first_iteration: Unit indices of the first iteration's training forwards of units with
            parameters, in order, repeats kept.
        position: How many such forwards this iteration has run.
        deviated: This iteration's order differed from ``first_iteration`` (it warns on).
        warned: An earlier iteration differed: no more warnings.
    """

    first_iteration: list[int] = field(default_factory=list)
    position: int = 0
    deviated: bool = False
    warned: bool = False


@dataclass
class RootContext:
    """State the root owns and shares with every unit in its tree (handed down, never copied).

    Attributes:
        root: The root unit's state.
        states: Every unit's state in the tree, root first (pre-order).
        final_callback_queued: The end-of-backward callback is queued for the running backward.
        unit_index: Position of each unit's state in ``states``, by ``id``.
        order_checked: The first iteration's execution-order check is done
            ([Note: Execution order check]).
        exec_order: The first iteration's order of gathers (unit index x phase).
        raised_in_step: The execution-order check raised (on every rank together) since the
            root's last forward.
        inflight_reductions: Handles whose gradient reduction is still in flight, oldest first.
        state_dict_active: A ``state_dict()`` call of this tree is in progress.
        state_dict_done: Ids of state-dict values already finished by nested units.
        forward_order, backward_order: The units in the order they first gathered in each
            phase of the first iteration ([Note: Prefetch]).
        free_events: CUDA, limit_all_gathers: events recorded where units were resharded,
            oldest first ([Note: Prefetch]).
        unshard_stream, post_backward_stream, all_reduce_stream: CUDA: the tree's side streams
            ([Note: Stream edges] in ``flat_param/_streams.py``); None on CPU.
        prefetches_issued: Prefetched all-gathers launched so far (for tests and profiling).
        unit_kept_for_backward: The unit that keeps its parameters from its post-forward into
            its backward, from the second iteration on ([Note: The first backward unit stays
            gathered] in ``_prefetch.py``); None when no unit qualifies.
        kept_unit_pending: That unit, while a forward has kept it and its backward has not yet
            taken it.
        buffers_in_full_precision: Cast buffers are in full precision (eval, see
            ``full_precision_in_eval``).
        forward_watch: Later iterations' forward order against the first one's.
    """

    root: UnitState
    states: list[UnitState] = field(default_factory=list)
    final_callback_queued: bool = False
    unit_index: dict[int, int] = field(default_factory=dict)
    order_checked: bool = False
    # The execution-order check raised on every rank at once (in step): a backward it
    # interrupted needs no agreement to reset ([Note: A backward that raised on some ranks]).
    raised_in_step: bool = False
    exec_order: list[int] = field(default_factory=list)
    inflight_reductions: list["FlatParamHandle"] = field(default_factory=list)
    state_dict_active: bool = False
    state_dict_done: set[int] = field(default_factory=set)
    forward_order: list[UnitState] = field(default_factory=list)
    backward_order: list[UnitState] = field(default_factory=list)
    free_events: list[Any] = field(default_factory=list)  # torch.cuda.Event (the stream layer's)
    unshard_stream: Optional[Any] = None
    post_backward_stream: Optional[Any] = None
    all_reduce_stream: Optional[Any] = None
    prefetches_issued: int = 0
    unit_kept_for_backward: Optional[UnitState] = None
    kept_unit_pending: Optional[UnitState] = None
    buffers_in_full_precision: bool = False
    forward_watch: ForwardOrderWatch = field(default_factory=ForwardOrderWatch)


def set_reported_ignored(
    state: UnitState, wrapped_before: list[UnitState], auto_wrapped: list[UnitState]
) -> None:
    """Sets the ignored modules and parameters ``state``'s wrapper reports, as torch FSDP1's.

    [Note: Reported ignored states]
    Torch FSDP1's ``_ignored_modules`` of an instance is its own argument's modules (closed
    under descendants) plus those of the FSDP instances already nested in it when it is
    built; ``_ignored_params`` likewise. Units it auto-wraps get all of its ignored
    *parameters* as their ``ignored_states``, so they report no ignored modules and every
    ignored parameter of the root, inside them or not. The runtime does not use these sets: a
    unit leaves alone ``ignored_modules``/``ignored_params`` (the ignored modules and
    parameters inside it, buffers included), which torch's nested units do not.

    Args:
        state: The unit just built.
        wrapped_before: The units nested in it that existed before it was built (by hand).
        auto_wrapped: The units its auto-wrap policy built.
    """
    state.reported_ignored_modules = set(state.ignored_modules)
    state.reported_ignored_params = set(state.ignored_params)
    for nested in wrapped_before:
        state.reported_ignored_modules |= nested.reported_ignored_modules
        state.reported_ignored_params |= nested.reported_ignored_params
    for nested in auto_wrapped:
        nested.reported_ignored_modules = set()
        nested.reported_ignored_params = set(state.reported_ignored_params)


def transition(state: UnitState, new: HandleTrainingState) -> None:
    """Moves ``state`` to ``new``, checking that the transition is allowed."""
    if new is state.training_state:
        return
    p_assert(
        new in _TRANSITIONS[state.training_state],
        f"unit '{state.unit_name}': invalid training-state transition "
        f"{state.training_state.name} -> {new.name}",
    )
    state.training_state = new


# ----------------------------------------------------------------------------- unit lookups
# Which modules are FSDP units and their states: needed by every layer above this one (init,
# state_dict, the wrapper), so they live next to the state rather than in one of those layers.


def is_fsdp(module: nn.Module) -> bool:
    """Whether ``module`` is an FSDP wrapper (without importing the wrapper class)."""
    return getattr(type(module), "_is_fsdp_wrapper", False)


def unit_state(module: nn.Module) -> UnitState:
    """The runtime state of an FSDP wrapper (typed access to ``unit_state(module)``)."""
    state = module.__dict__.get("_fsdp_state")
    if not isinstance(state, UnitState):
        raise TypeError(f"fsdp: {type(module).__name__} is not a FullyShardedDataParallel instance")
    return state


def fsdp_modules(module: nn.Module, root_only: bool = False) -> list[nn.Module]:
    """The FSDP units in ``module`` in pre-order (``FullyShardedDataParallel.fsdp_modules``).

    Args:
        module: Any module (an FSDP instance or one containing some).
        root_only: Only the units with no FSDP ancestor inside ``module``.
    """
    if not root_only:
        return [m for m in module.modules() if is_fsdp(m)]
    result: list[nn.Module] = []
    # Pre-order with an explicit stack: a recursive closure is a reference cycle that would
    # hold the modules it saw until the cyclic collector runs.
    stack = [module]
    while stack:
        mod = stack.pop()
        if is_fsdp(mod):
            result.append(mod)
            continue
        stack.extend(reversed(list(mod.children())))
    return result


def named_fsdp_states(module: nn.Module) -> Iterator[tuple[str, nn.Module, UnitState]]:
    """Yields ``(qualified name, wrapper, state)`` for every FSDP unit in ``module``, pre-order."""
    for name, sub in module.named_modules():
        if is_fsdp(sub):
            yield clean_fqn(name), sub, unit_state(sub)


def check_idle(
    module: nn.Module,
    what: str,
    allow_summon: bool = False,
    error: type[Exception] = RuntimeError,
    torch_message: str = "",
) -> None:
    """Raises if any unit in ``module``'s root tree is in forward or backward (or summon).

    Args:
        module: An FSDP instance.
        what: The API being called, for the message.
        allow_summon: Accept units inside ``summon_full_params`` (it may nest).
        error: The exception type (torch FSDP1's for the same call: ``ValueError`` for
            ``apply``, ``no_sync`` and ``clip_grad_norm_``, an ``AssertionError`` for
            ``summon_full_params``).
        torch_message: Torch FSDP1's message for the same call, which ours starts with; by
            default torch's state check (``expected to be in states [...] but current state
            is ...``).
    """
    state: UnitState = unit_state(module)
    states = state.ctx.states if state.ctx is not None else [s for _, _, s in named_fsdp_states(module)]
    allowed = {HandleTrainingState.IDLE}
    if allow_summon:
        allowed.add(HandleTrainingState.SUMMON_FULL_PARAMS)
    busy = [s for s in states if s.training_state not in allowed]
    if busy:
        desc = ", ".join(f"'{s.unit_name}' ({s.training_state.name})" for s in busy)
        if not torch_message:
            current = state if state in busy else busy[0]
            torch_message = state_mismatch_message(current.training_state)
        raise error(
            f"fsdp: {torch_message}: {what} cannot be called while FSDP units are in forward, "
            f"backward or summon_full_params: {desc}. Call it between training steps, outside "
            f"the model's forward and backward."
        )


def state_mismatch_message(current: HandleTrainingState) -> str:
    """Torch FSDP1's sentence for an API that needs an idle unit, called in ``current``."""
    return (
        f"expected to be in states {[TrainingState.IDLE]} but current state is "
        f"{coarse_training_state(current)}"
    )
