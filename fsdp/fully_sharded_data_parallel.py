"""The public wrapper: ``FullyShardedDataParallel``.

Thin by design: ``__init__`` is a short sequence of init steps (``fsdp/init/``), ``forward``
hands off to the runtime (``fsdp/runtime/``), and the public methods delegate. See
docs/design.md for the whole picture.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Generator, Iterable, Iterator, Mapping, Optional, TypeVar, Union, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.modules.module import _IncompatibleKeys

from fsdp._comm._groups import ProcessGroupType
from fsdp._comm._watch import entry_agreed
from fsdp._common import FLAT_PARAM, FSDP_PREFIX, FSDP_WRAPPED_MODULE, compile_boundary
from fsdp.api import (  # the config names are re-exported here too, as torch's module does
    BackwardPrefetch,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    OptimStateDictConfig,
    OptimStateKeyType,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from fsdp.flat_param._recast import hidden_from_module_apply, planned_local_shard, recast_handle
from fsdp.flat_param.flat_param import FlatParameter, FlatParamHandle
from fsdp.init._steps import UnitArgs, build_handles, finish_unit, new_unit_state, plan_unit
from fsdp.runtime._clip_grad import clip_root_grad_norm_
from fsdp.runtime._comm_hooks import register_comm_hook as _register_comm_hook
from fsdp.runtime import _hooks
from fsdp.runtime._hooks import no_sync as _no_sync
from fsdp.runtime._lazy_init import lazy_init, reset_lazy_init
from fsdp.runtime._mixed_precision import refresh_cast_buffers
from fsdp.runtime._state import (
    HandleTrainingState,
    TrainingState,
    UnitState,
    check_idle,
    coarse_training_state,
    fsdp_modules,
    unit_state,
)
from fsdp.runtime._summon import apply_summoned, names_in_summon
from fsdp.runtime._summon import summon_full_params as _summon_full_params
from fsdp.state_dict import _model_state_dict, _settings
from fsdp.state_dict import _optim_state_dict as _osd
from fsdp.state_dict._optim_keys import OptimInput
from fsdp.wrap import CustomPolicy, ModuleWrapPolicy

# Torch's module of the same name exports these two; its other public names (the configs and
# enums above, ``FlatParameter``, ``FLAT_PARAM``, ``FSDP_PREFIX``, the wrap policies) are
# importable from it too, and stacks such as accelerate import them from here.
__all__ = ["FullyShardedDataParallel", "OptimStateKeyType"]


class FullyShardedDataParallel(nn.Module):
    """Shards a module's parameters, gradients and optimizer state across data-parallel ranks.

    Same constructor arguments, names, order and defaults as torch FSDP1. The module's
    parameters not claimed by a nested FSDP instance are flattened into one
    :class:`~fsdp.flat_param.FlatParameter`, padded and sharded; forward and backward gather
    them just in time and free them after use, and gradients are reduce-scattered.

    Args:
        module: The module to wrap.
        process_group: The group to shard over (default: the default group), or for hybrid
            strategies an ``(intra_node_group, inter_node_group)`` tuple. Only this group is
            used: the default group need not be initialized when one is given.
        sharding_strategy: FULL_SHARD (default), SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD or
            _HYBRID_SHARD_ZERO2 (see [Note: Hybrid sharding layout]).
        cpu_offload: ``CPUOffload(offload_params=True)`` keeps sharded parameters and their
            gradients on CPU between uses; the optimizer steps on CPU ([Note: CPU offload]).
        auto_wrap_policy: A policy from :mod:`fsdp.wrap` (or a callable with the functional
            policy signature) that picks nested units.
        backward_prefetch: When to launch the next unit's all-gather in backward:
            BACKWARD_PRE (default; overlaps it with this unit's backward), BACKWARD_POST (after
            this unit's gradient), or None. Results are the same; see [Note: Prefetch].
        mixed_precision: ``MixedPrecision``: parameters gathered and used in ``param_dtype``,
            gradients reduced in ``reduce_dtype``, buffers in ``buffer_dtype``; sharded
            parameters, gradients and optimizer state stay in full precision (see
            [Note: Mixed precision dtypes]). With an auto-wrap policy, modules of
            ``_module_classes_to_ignore`` (BatchNorm) become full-precision units.
        ignored_modules: Modules whose parameters and buffers FSDP leaves alone (not sharded,
            not moved, not communicated). FSDP units already wrapped inside them keep working,
            as in torch FSDP1; ignoring the wrapped module itself warns.
        param_init_fn: Called on each module with meta-device states to materialize it (see
            [Note: Meta-device materialization order]); without it ``reset_parameters()``.
        device_id: The compute device: an int (CUDA index), a string such as ``"cpu"`` or
            ``"cuda:0"``, or a torch.device (default: where the module's parameters are).
        sync_module_states: Broadcast parameters and buffers from rank 0 at construction
            (unit by unit; works on CPU too).
        forward_prefetch: Launch the next unit's forward all-gather before this unit computes.
        limit_all_gathers: At most two prefetched all-gathers in flight.
        use_orig_params: Keep the original parameters registered (``named_parameters()``
            yields them, optimizer parameter groups work, frozen and trainable parameters may
            share a unit, and frozen ones cost no gradient memory).
        ignored_states: Parameters or modules to ignore (instead of ignored_modules).
        device_mesh: A 1-D mesh to shard over, or for hybrid strategies a 2-D mesh (dim 0
            replicates, dim 1 shards).
    """

    _is_fsdp_wrapper = True
    _fsdp_state: UnitState

    def __init__(
        self,
        module: nn.Module,
        process_group: ProcessGroupType = None,
        sharding_strategy: Optional[ShardingStrategy] = None,
        cpu_offload: Optional[CPUOffload] = None,
        auto_wrap_policy: Optional[Callable] = None,
        backward_prefetch: Optional[BackwardPrefetch] = BackwardPrefetch.BACKWARD_PRE,
        mixed_precision: Optional[MixedPrecision] = None,
        ignored_modules: Optional[Iterable[nn.Module]] = None,
        param_init_fn: Optional[Callable[[nn.Module], None]] = None,
        device_id: Optional[Union[int, str, torch.device]] = None,
        sync_module_states: bool = False,
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
        use_orig_params: bool = False,
        ignored_states: Union[None, Iterable[nn.Parameter], Iterable[nn.Module]] = None,
        device_mesh: Optional[DeviceMesh] = None,
    ) -> None:
        args = UnitArgs(
            process_group=process_group,
            sharding_strategy=sharding_strategy,
            cpu_offload=cpu_offload,
            backward_prefetch=backward_prefetch,
            mixed_precision=mixed_precision,
            param_init_fn=param_init_fn,
            device_id=device_id,
            sync_module_states=sync_module_states,
            forward_prefetch=forward_prefetch,
            limit_all_gathers=limit_all_gathers,
            use_orig_params=use_orig_params,
            device_mesh=device_mesh,
        )
        # The init steps, in fsdp/init/_steps.py. 1. Check everything a user can get wrong, and
        # plan every unit, before changing anything.
        setup = plan_unit(module, args, auto_wrap_policy, ignored_modules, ignored_states)
        super().__init__()
        # 2. Materialize (meta) in pre-order and wrap nested units bottom-up, then this unit.
        handles, own_modules = build_handles(self, module, args, setup)
        # 3. The unit's runtime state; 4. nested units, hooks and state-dict settings.
        self._fsdp_state = new_unit_state(module, args, setup, handles, own_modules)
        finish_unit(self._fsdp_state, module, setup)
        self._state_dict_settings = _settings.default_settings()
        _model_state_dict.register_state_dict_hooks(self)  # [Note: State dict hooks]

    # ------------------------------------------------------------------ module plumbing
    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return self._fsdp_wrapped_module

    def __getattr__(self, name: str) -> Any:  # Any: the wrapped module's attribute, any type (as torch FSDP1's)
        """Forwards missing attributes to the wrapped module."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == FSDP_WRAPPED_MODULE:
                raise
            return getattr(self._fsdp_wrapped_module, name)

    def __getitem__(self, key: int) -> Any:  # Any: whatever the wrapped module's indexing gives
        """Forwards indexing to the wrapped module (e.g. an ``nn.Sequential``)."""
        return self._fsdp_wrapped_module.__getitem__(key)

    # Any: the wrapped module's output; torch types nn.Module.forward and __call__ as Callable[..., Any].
    def forward(self, *args: object, **kwargs: object) -> Any:
        """Runs the wrapped module with its parameters unsharded (see docs/hook_order.md)."""
        # By module attribute: under torch.compile the name holds the marked function.
        return _hooks.unit_forward(self, args, kwargs)

    # ------------------------------------------------------------------ torch FSDP1's attributes
    # [Note: Wrapper attributes]
    # Torch FSDP1's instances carry their configuration and runtime state as attributes, and
    # stacks read them (accelerate: ``_has_params``, ``_flat_param``, ``_handle``; Lightning and
    # user code: ``sharding_strategy``, ``mixed_precision``, ``process_group``, ``rank``, ...).
    # Here each is a read-only view of the unit's one state object (``_sync_gradients`` may be
    # set, as ``no_sync`` does), with torch's values: e.g. ``mixed_precision`` and
    # ``cpu_offload`` are default configs, never None.
    @property
    def training_state(self) -> TrainingState:
        """What this unit is doing right now, as torch FSDP1 reports it.

        ``IDLE``, ``FORWARD_BACKWARD`` (from the unit's pre-forward to its post-forward, and
        from its pre-backward to the end of backward) or ``SUMMON_FULL_PARAMS``; the handle's
        ``_training_state`` has the finer phase (``FORWARD``, ``BACKWARD_PRE``, ...).
        """
        return coarse_training_state(self._fsdp_state.training_state)

    @property
    def sharding_strategy(self) -> ShardingStrategy:
        """The sharding strategy in effect for this unit (NO_SHARD at world size 1, as torch)."""
        return self._fsdp_state.sharding_strategy

    @property
    def cpu_offload(self) -> CPUOffload:
        """The unit's ``CPUOffload`` config (``CPUOffload()`` when none was given)."""
        return self._fsdp_state.cpu_offload or CPUOffload()

    @property
    def mixed_precision(self) -> MixedPrecision:
        """The unit's ``MixedPrecision`` config (``MixedPrecision()`` when none applies)."""
        return self._fsdp_state.mixed_precision or MixedPrecision()

    @property
    def backward_prefetch(self) -> Optional[BackwardPrefetch]:
        """When this unit prefetches in backward (None: never)."""
        return self._fsdp_state.backward_prefetch

    @property
    def forward_prefetch(self) -> bool:
        """Whether this unit prefetches the next unit's forward all-gather."""
        return self._fsdp_state.forward_prefetch

    @property
    def limit_all_gathers(self) -> bool:
        """Whether prefetched all-gathers in flight are capped."""
        return self._fsdp_state.limit_all_gathers

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The group parameters are sharded over (hybrid strategies: the intra-node group)."""
        return self._fsdp_state.process_group

    @property
    def rank(self) -> int:
        """This process's rank in :attr:`process_group`."""
        return self._fsdp_state.rank

    @property
    def world_size(self) -> int:
        """The size of :attr:`process_group`."""
        return self._fsdp_state.world_size

    @property
    def compute_device(self) -> torch.device:
        """The device this unit computes on."""
        return self._fsdp_state.compute_device

    @property
    def params(self) -> list[nn.Parameter]:
        """The unit's FlatParameters (empty when it manages no parameters)."""
        return [handle.flat_param for handle in self._fsdp_state.handles]

    @property
    def _handle(self) -> Optional[FlatParamHandle]:
        """The unit's FlatParamHandle (the trainable one when it has two), or None."""
        return self._fsdp_state.handle

    @property
    def _has_params(self) -> bool:
        """Whether this unit manages any parameters."""
        return self._fsdp_state.handle is not None

    @property
    def _flat_param(self) -> Optional[FlatParameter]:
        """The unit's FlatParameter, or None when it manages no parameters."""
        handle = self._fsdp_state.handle
        return handle.flat_param if handle is not None else None

    @property
    def _use_orig_params(self) -> bool:
        return self._fsdp_state.use_orig_params

    @property
    def _is_root(self) -> Optional[bool]:
        """None before lazy initialization, then whether this unit is the root."""
        return self._fsdp_state.is_root

    @property
    def _ignored_modules(self) -> set[nn.Module]:
        """Torch FSDP1's value ([Note: Reported ignored states])."""
        return self._fsdp_state.reported_ignored_modules

    @property
    def _ignored_params(self) -> set[nn.Parameter]:
        """Torch FSDP1's value ([Note: Reported ignored states])."""
        return self._fsdp_state.reported_ignored_params

    @property
    def _device_mesh(self) -> Optional[DeviceMesh]:
        return self._fsdp_state.device_mesh

    @property
    def _sync_gradients(self) -> bool:
        """False inside ``no_sync``."""
        return self._fsdp_state.sync_gradients

    @_sync_gradients.setter
    def _sync_gradients(self, value: bool) -> None:
        self._fsdp_state.sync_gradients = bool(value)

    @property
    def _comm_hook(self) -> Optional[Callable]:
        return self._fsdp_state.comm_hook

    @_comm_hook.setter
    def _comm_hook(self, hook: Optional[Callable]) -> None:
        """Sets this unit's hook alone, as assigning torch FSDP1's attribute does (its tests
        do); ``register_comm_hook`` then finds a hook already registered."""
        self._fsdp_state.comm_hook = hook

    @property
    def _comm_hook_state(self) -> object:
        return self._fsdp_state.comm_hook_state

    @_comm_hook_state.setter
    def _comm_hook_state(self, state: object) -> None:
        self._fsdp_state.comm_hook_state = state

    @property
    def _use_full_prec_in_eval(self) -> bool:
        return self._fsdp_state.full_precision_in_eval

    @property
    def _inter_node_pg(self) -> dist.ProcessGroup:
        """Hybrid strategies only: the group sharded gradients are all-reduced over."""
        group = self._fsdp_state.replicate_group
        if group is None:
            raise AttributeError("_inter_node_pg")  # as torch: only hybrid units have one
        return group

    @property
    def _state_dict_type(self) -> StateDictType:
        return self._state_dict_settings.state_dict_type

    @property
    def _state_dict_config(self) -> StateDictConfig:
        return self._state_dict_settings.state_dict_config

    @property
    def _optim_state_dict_config(self) -> OptimStateDictConfig:
        return self._state_dict_settings.optim_state_dict_config

    def _reset_lazy_init(self) -> None:
        """Forgets lazy initialization of this tree (e.g. before wrapping it further)."""
        reset_lazy_init(self)

    def named_parameters(self, *args: object, **kwargs: object) -> Iterator[tuple[str, nn.Parameter]]:
        """As ``nn.Module.named_parameters``; inside ``summon_full_params`` names carry no FSDP prefix."""
        return names_in_summon(self, super().named_parameters, args, kwargs)

    def named_buffers(self, *args: object, **kwargs: object) -> Iterator[tuple[str, torch.Tensor]]:
        """As ``nn.Module.named_buffers``; inside ``summon_full_params`` names carry no FSDP prefix."""
        return names_in_summon(self, super().named_buffers, args, kwargs)

    # ------------------------------------------------------------------ queries
    def check_is_root(self) -> bool:
        """Whether this instance is the root (initializes the runtime if needed)."""
        return bool(lazy_init(self).is_root)

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list["FullyShardedDataParallel"]:
        """Returns the FSDP instances in ``module`` (pre-order); only the top-level ones if ``root_only``."""
        # The runtime layer below cannot name this class; every module it finds is an instance.
        return cast("list[FullyShardedDataParallel]", fsdp_modules(module, root_only))

    def apply(self, fn: Callable[[nn.Module], None]) -> "FullyShardedDataParallel":
        """Applies ``fn`` to every submodule with full parameters gathered (and written back).

        Raises:
            ValueError: Called inside forward, backward or ``summon_full_params`` (as torch
                FSDP1: inside a ``summon_full_params(writeback=False)`` its changes would be
                silently dropped).
        """
        return apply_summoned(self, fn, super().apply)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> "FullyShardedDataParallel":
        """``nn.Module._apply`` (behind ``to``, ``half``, ``float``, ``double``, ``bfloat16``, ...).

        The units' parameters are cast as a plain module's would be: each handle's local shard
        goes through ``fn`` and the handle is rebuilt around it, at any time between training
        steps (torch FSDP1 honours a cast only before the first forward). Buffers, unmanaged
        parameters and nested units go through ``nn.Module._apply``. See [Note: Casting after
        wrapping] in ``fsdp/flat_param/_recast.py``.

        Raises:
            RuntimeError: The cast would change parameters while a unit of the tree is in
                forward, backward or ``summon_full_params``, or would move them to another
                device than the one the unit keeps them on. Nothing is changed.
            TypeError: The cast would give a non-floating-point dtype. Nothing is changed.
        """
        return _cast_units(self, fn, recurse, super()._apply)

    # ------------------------------------------------------------------ training API
    def no_sync(self) -> ContextManager[None]:
        """Skips gradient synchronization: gradients accumulate locally, unsharded.

        The next backward outside the context reduces the accumulated gradients. Root only.
        """
        return _no_sync(self)

    def clip_grad_norm_(self, max_norm: Union[float, int], norm_type: Union[float, int] = 2.0) -> torch.Tensor:
        """Clips gradients of the whole model to ``max_norm``; returns the total norm.

        The norm covers every shard on every rank, equal to ``torch.nn.utils.clip_grad_norm_``
        on the unsharded model. Root only; a collective, so every rank must call it.
        """
        return clip_root_grad_norm_(self, max_norm, norm_type)

    @staticmethod
    def summon_full_params(
        module: nn.Module,
        recurse: bool = True,
        writeback: bool = True,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        with_grads: bool = False,
    ) -> ContextManager[None]:
        """Exposes full parameters of ``module``'s FSDP units inside the context.

        Args:
            module: An FSDP instance or a module containing FSDP instances.
            recurse: Also gather nested FSDP units (default True).
            writeback: Write in-place (or ``.data``) changes back to the shards on exit.
            rank0_only: Only rank 0 sees full parameters (requires writeback=False).
            offload_to_cpu: Expose the full parameters as CPU tensors (works on CPU too).
            with_grads: Also expose full gradients as ``param.grad``.

        Raises:
            NotImplementedError: writeback together with rank0_only, or with_grads together
                with offload_to_cpu.
            FSDPStateAssertionError: Called inside forward or backward (an AssertionError,
                as torch FSDP1 raises, and a RuntimeError).
            RuntimeError: A writeback whose parameter shape changed.
        """
        return _summon_full_params(module, recurse, writeback, rank0_only, offload_to_cpu, with_grads)

    # ------------------------------------------------------------------ state dicts
    @staticmethod
    def set_state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: Optional[StateDictConfig] = None,
        optim_state_dict_config: Optional[OptimStateDictConfig] = None,
    ) -> StateDictSettings:
        """Sets the state-dict type of every FSDP unit in ``module``; returns the previous settings.

        Warns (``FutureWarning``, as torch FSDP1): the setter is deprecated in favour of
        ``torch.distributed.checkpoint.state_dict.get_state_dict`` / ``set_state_dict``.
        """
        _settings.warn_setter_deprecated(stacklevel=2)
        return _settings.set_state_dict_type(
            fsdp_modules(module), state_dict_type, state_dict_config, optim_state_dict_config
        )

    @staticmethod
    def get_state_dict_type(module: nn.Module) -> StateDictSettings:
        """Returns the state-dict settings of ``module``'s FSDP units (they must agree).

        Raises:
            RuntimeError: LOCAL_STATE_DICT is set on a unit built with a ``device_mesh``
                (torch FSDP1's error: "DeviceMesh is not compatible with LOCAL_STATE_DICT.").
        """
        return _settings.get_state_dict_type_checked(
            [(name, sub) for name, sub in module.named_modules() if isinstance(sub, FullyShardedDataParallel)]
        )

    @staticmethod
    def state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: Optional[StateDictConfig] = None,
        optim_state_dict_config: Optional[OptimStateDictConfig] = None,
    ) -> ContextManager[None]:
        """Context manager form of :meth:`set_state_dict_type`; restores the previous settings."""
        return _settings.state_dict_type_context(module, state_dict_type, state_dict_config, optim_state_dict_config)

    # nn.Module.state_dict is two overloads on ``destination``'s type; this one signature serves both.
    # Any: nn.Module's deprecated positional (destination, prefix, keep_vars), and torch's
    # state-dict value type (Dict[str, Any]), as in every state dict below.
    def state_dict(  # type: ignore[override]
        self, *args: Any, destination: Optional[dict[str, Any]] = None, prefix: str = "", keep_vars: bool = False
    ) -> dict[str, Any]:
        """The model state dict of the kind set by ``state_dict_type`` (FULL by default).

        See [Note: Model state dict formats]: FULL has the unwrapped model's keys and full
        tensors; SHARDED the same keys with DTensor shards (for torch.distributed.checkpoint);
        LOCAL each unit's flat local shard. A collective: every rank must call it.
        """
        if args:  # nn.Module's deprecated positional form: (destination, prefix, keep_vars)
            destination = args[0]
            prefix = args[1] if len(args) > 1 else prefix
            keep_vars = args[2] if len(args) > 2 else keep_vars
        with entry_agreed("state_dict", lambda: _groups_of(self, model_save=True)):  # [Note: Blocked collectives]
            return _model_state_dict.save_state_dict(self, super().state_dict, destination, prefix, keep_vars)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> _IncompatibleKeys:
        """Loads a state dict of the kind set by ``state_dict_type`` (FULL by default).

        Keys, shapes and layouts of the whole tree are checked first (``strict`` as in
        ``nn.Module``); on error nothing is changed. Then ``nn.Module.load_state_dict`` runs with
        the units' hooks, which translate keys (so a plain module holding FSDP children loads
        too, see [Note: State dict hooks]). FULL loads need no communication; SHARDED values
        are DTensors (ours, or from torch.distributed.checkpoint into this model's template) or
        torch FSDP1's ShardedTensors; LOCAL values are torch FSDP1's ShardedTensors.
        """
        result: _IncompatibleKeys = _model_state_dict.load_state_dict(
            self, super().load_state_dict, dict(state_dict), strict, assign
        )
        refresh_cast_buffers(self, [unit_state(m) for m in fsdp_modules(self)], state_dict)
        return result

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """Replaces the gradient reduction of every unit with ``hook`` (root only, once).

        Sharded strategies call ``hook(state, padded_unsharded_grad, sharded_grad_output)``,
        NO_SHARD calls ``hook(state, grad)``; the hook averages. Torch's default hooks work, and
        so do :mod:`fsdp.comm_hooks` (also for bf16 on gloo). Hybrid strategies take no hook.

        Raises:
            FSDPStateAssertionError: Not the root, a hook already registered, or a hybrid
                strategy (an AssertionError, as torch FSDP1 raises, and a RuntimeError).
            ValueError: ``hook`` is not callable (torch FSDP1's type).
        """
        _register_comm_hook(self, state, hook)

    # ------------------------------------------------------------------ optimizer state dicts
    # Any: torch types optimizer state dicts Dict[str, Any] (Optimizer.state_dict's StateDict).
    @staticmethod
    def full_optim_state_dict(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_input: OptimInput = None,
        rank0_only: bool = True,
        group: Optional[dist.ProcessGroup] = None,
    ) -> dict[str, Any]:
        """Full optimizer state keyed by parameter names (legacy API; see :meth:`optim_state_dict`)."""
        with entry_agreed("full_optim_state_dict", lambda: _groups_of(model)):
            return _osd.full_optim_state_dict(model, optim, optim_input, rank0_only, group)

    @staticmethod
    def sharded_optim_state_dict(
        model: nn.Module, optim: torch.optim.Optimizer, group: Optional[dist.ProcessGroup] = None
    ) -> dict[str, Any]:
        """Optimizer state keyed by parameter names, each state chunked across ranks (legacy API)."""
        with entry_agreed("sharded_optim_state_dict", lambda: _groups_of(model)):
            return _osd.sharded_optim_state_dict(model, optim, group)

    @staticmethod
    def shard_full_optim_state_dict(
        full_optim_state_dict: dict[str, Any],
        model: nn.Module,
        optim_input: OptimInput = None,
        optim: Optional[torch.optim.Optimizer] = None,
    ) -> dict[str, Any]:
        """This rank's flattened part of a full optimizer state dict (legacy API)."""
        return _osd.shard_full_optim_state_dict(full_optim_state_dict, model, optim_input, optim)

    @staticmethod
    def flatten_sharded_optim_state_dict(
        sharded_optim_state_dict: dict[str, Any], model: nn.Module, optim: torch.optim.Optimizer
    ) -> dict[str, Any]:
        """This rank's flattened part of a sharded optimizer state dict (legacy API)."""
        return _osd.flatten_sharded_optim_state_dict(sharded_optim_state_dict, model, optim)

    @staticmethod
    def scatter_full_optim_state_dict(
        full_optim_state_dict: Optional[dict[str, Any]],
        model: nn.Module,
        optim_input: OptimInput = None,
        optim: Optional[torch.optim.Optimizer] = None,
        group: Optional[dist.ProcessGroup] = None,
    ) -> dict[str, Any]:
        """Like :meth:`shard_full_optim_state_dict`, but only rank 0 passes the state dict (legacy API)."""
        with entry_agreed("scatter_full_optim_state_dict", lambda: _groups_of(model)):
            return _osd.scatter_full_optim_state_dict(full_optim_state_dict, model, optim_input, optim, group)

    @staticmethod
    def rekey_optim_state_dict(
        optim_state_dict: dict[str, Any],
        optim_state_key_type: OptimStateKeyType,
        model: nn.Module,
        optim_input: OptimInput = None,
        optim: Optional[torch.optim.Optimizer] = None,
    ) -> dict[str, Any]:
        """Re-keys an optimizer state dict by parameter names or by parameter IDs."""
        return _osd.rekey_optim_state_dict(optim_state_dict, optim_state_key_type, model, optim_input, optim)

    @staticmethod
    def optim_state_dict(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_state_dict: Optional[dict[str, Any]] = None,
        group: Optional[dist.ProcessGroup] = None,
    ) -> dict[str, Any]:
        """The optimizer state keyed by parameter names, full or sharded per ``state_dict_type``."""
        with entry_agreed("optim_state_dict", lambda: _groups_of(model)):
            return _osd.optim_state_dict_api(model, optim, optim_state_dict, group)

    @staticmethod
    def optim_state_dict_to_load(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_state_dict: dict[str, Any],
        is_named_optimizer: bool = False,
        load_directly: bool = False,
        group: Optional[dist.ProcessGroup] = None,
    ) -> dict[str, Any]:
        """Converts a state dict from :meth:`optim_state_dict` into one ``optim`` can load.

        The result is keyed by ``optim``'s parameter IDs or, with ``is_named_optimizer=True``
        (a ``NamedOptimizer`` / TorchRec ``KeyedOptimizer``), by its parameter names: the names
        ``model.named_parameters()`` gives them (a FlatParameter's, e.g.
        ``_fsdp_wrapped_module._flat_param``, or with ``use_orig_params=True`` an original
        parameter's). ``load_directly=True`` also calls ``optim.load_state_dict(result)``.
        """
        with entry_agreed("optim_state_dict_to_load", lambda: _groups_of(model)):
            return _osd.optim_state_dict_to_load_api(
                model, optim, optim_state_dict, is_named_optimizer, load_directly, group
            )


def _groups_of(model: nn.Module, model_save: bool = False) -> list[dist.ProcessGroup]:
    """The shard groups of more than one rank that a state-dict call of ``model`` communicates
    over, for its entry agreement ([Note: Blocked collectives] in ``fsdp/_comm/_watch.py``).

    Optimizer state dicts communicate over every such unit's group. A model state dict
    communicates only where FULL_STATE_DICT gathers a sharded unit: SHARDED and LOCAL are
    built from the local shards, NO_SHARD units hold full values and units inside
    ``summon_full_params`` are gathered already, so a rank may save those alone, and no
    agreement is asked of the others.
    """
    groups: list[dist.ProcessGroup] = []
    for module in fsdp_modules(model):
        state = unit_state(module)
        if state.world_size < 2 or any(g is state.process_group for g in groups):
            continue
        if model_save and (
            state.training_state is not HandleTrainingState.IDLE  # inside summon_full_params: gathered
            or state.sharding_strategy is ShardingStrategy.NO_SHARD
            or _settings.get_state_dict_type([module]).state_dict_type is not StateDictType.FULL_STATE_DICT
        ):
            continue
        groups.append(state.process_group)
    return groups


# Casting a wrapped tree after wrapping (the wrapper's ``nn.Module._apply``): ``to``, ``half``,
# ``float``, ``double``, ``bfloat16`` and the like all go through ``_apply``. Each unit's local
# shard is cast and its handle rebuilt around it (see [Note: Casting after wrapping] in
# ``fsdp/flat_param/_recast.py``); everything else goes through ``nn.Module._apply``.
TensorFn = Callable[[torch.Tensor], torch.Tensor]


_M = TypeVar("_M", bound=nn.Module)


def _cast_units(wrapper: _M, fn: TensorFn, recurse: bool, module_apply: Callable[[TensorFn, bool], _M]) -> _M:
    """``FullyShardedDataParallel._apply``: applies ``fn`` to the tree, shards included.

    Every unit's change is planned first; the tree must be idle if any shard changes. Then
    buffers, unmanaged parameters and nested units go through ``module_apply`` (nested units
    cast their own shards there) with this unit's FlatParameters hidden from it, and this
    unit's handles are rebuilt around their cast shards.

    Args:
        wrapper: An FSDP instance.
        fn: The tensor function (a dtype or device conversion).
        recurse: ``nn.Module._apply``'s argument (False: only ``wrapper``'s own states, no
            shards).
        module_apply: ``nn.Module._apply`` bound to ``wrapper``.

    Returns:
        ``wrapper`` (with ``recurse=False``: what ``module_apply`` returns).

    Raises:
        RuntimeError: A unit of the tree is in forward, backward or ``summon_full_params``,
            or the cast would move a shard to another device than its unit's. Nothing is
            changed.
        TypeError: The cast would give a non-floating-point dtype. Nothing is changed.
    """
    if not recurse:
        return module_apply(fn, recurse)
    units = [unit_state(m) for m in fsdp_modules(wrapper)]
    changing = [h for unit in units for h in unit.handles if planned_local_shard(h, fn) is not None]
    if changing:
        check_idle(
            wrapper,
            "model.half(), .float(), .to(dtype) or another cast of the parameters",
            error=RuntimeError,
        )
    own = unit_state(wrapper).handles
    with hidden_from_module_apply(own):
        module_apply(fn, recurse)
    for handle in own:
        if any(handle is h for h in changing):
            recast_handle(handle, fn, handle.mixed_precision_config)
    return wrapper


# [Note: torch.compile]: a unit's forward called from code that runs eagerly (a frame Dynamo
# skipped, another unit's forward) is not traced either; the wrapped module's is compiled.
# mypy forbids assigning to a method; the rebinding by name is the point ([Note: torch.compile]).
FullyShardedDataParallel.forward = compile_boundary(FullyShardedDataParallel.forward)  # type: ignore[method-assign]
