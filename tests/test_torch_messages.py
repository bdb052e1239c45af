"""Contract: each user mistake raises (or warns) with torch FSDP1's sentence for it.

Torch's own FSDP1 tests match torch's wording with ``assertRaisesRegex`` / ``assertWarnsRegex``,
and users search for the same sentences. Every case here is a mistake from one of those tests
(file and test named next to it), run through torch FSDP1 (on CPU/gloo, ``device_id="cpu"``)
and through ours on fresh models in one pool job. For each case:

- torch raises the exception type (or warning category) the case names, and its message matches
  the case's pattern, which is the pattern torch's test uses (so the pattern is torch's sentence
  as the installed torch writes it, not a copy that could drift);
- ours raises an instance of the same type (or warns with the same category) and its message
  matches the same pattern. Our messages add the culprit and the fix after torch's sentence,
  or, where torch's pattern anchors the whole message (``^...$``), in a note
  (``BaseException.add_note``), which tracebacks show and ``str(exc)`` does not.
"""

from __future__ import annotations

import functools
import os
import re
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from tests._harness import RankPool
from tests.test_contract_errors import Lib, _lib, without_local_world_size

# ----------------------------------------------------------------------------- models


class _Model(nn.Module):
    """test_fsdp_ignored_modules.py's ``Model``: a nested Sequential between two layers."""

    def __init__(self) -> None:
        super().__init__()
        self.layer0 = nn.Linear(3, 5)
        self.layer1 = nn.Sequential(nn.Linear(5, 4), nn.Linear(4, 4), nn.Linear(4, 4))
        self.layer2 = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer2(torch.relu(self.layer1(torch.relu(self.layer0(x)))))


class _TwoLinears(nn.Module):
    """test_fsdp_use_orig_params.py's writeback ``Model``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(42)
        self.lin1 = nn.Linear(5, 5)
        self.lin2 = nn.Linear(5, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.relu(self.lin1(x)))


class _LoraAttention(nn.Module):
    """test_wrap.py's LoRA attention: frozen projections, trainable LoRA factors."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(8, 8, bias=False)
        self.lora_A = nn.Linear(8, 2, bias=False)
        self.lora_B = nn.Linear(2, 8, bias=False)
        self.k_proj = nn.Linear(8, 8, bias=False)
        self.q_proj.weight.requires_grad_(False)
        self.k_proj.weight.requires_grad_(False)


class _LoraDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = _LoraAttention()
        self.norm = nn.LayerNorm(8)
        self.norm.requires_grad_(False)


class _LoraModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.embed.requires_grad_(False)
        self.layers = nn.ModuleList([_LoraDecoder() for _ in range(2)])


class _WithNorms(nn.Module):
    """test_fsdp_mixed_precision.py's batch-norm model: mixed precision skips its norms."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(2, 40, bias=False)
        self.bn = nn.BatchNorm1d(4)
        self.ln = nn.LayerNorm(40)
        self.fc2 = nn.Linear(40, 4, bias=False)


# ----------------------------------------------------------------------------- the mistakes


def _wrap_kwargs(lib: Lib) -> dict[str, Any]:
    return dict(lib["extra"])


def _ignored_modules_of_parameters(lib: Lib) -> None:
    model = _Model()
    ignored = {p for m in list(model.layer1.children())[1:] for p in m.parameters()}
    lib["F"](model, ignored_modules=ignored, **_wrap_kwargs(lib))


def _ignored_modules_and_states(lib: Lib) -> None:
    model = _Model()
    modules = list(model.layer1.children())[1:]
    params = {p for m in modules for p in m.parameters()}
    lib["F"](model, ignored_modules=modules, ignored_states=params, **_wrap_kwargs(lib))


def _ignored_states_mixed(lib: Lib) -> None:
    model = _Model()
    modules = list(model.layer1.children())[1:]
    states = {p for m in modules for p in m.parameters()}.union(set(modules))
    lib["F"](model, ignored_states=states, **_wrap_kwargs(lib))


def _ignored_fsdp_module(lib: Lib) -> None:
    model = _Model()
    model.layer1 = lib["F"](model.layer1, **_wrap_kwargs(lib))
    lib["F"](model, ignored_modules=[model.layer1], **_wrap_kwargs(lib))


def _ignore_the_root(lib: Lib) -> None:
    model = _Model()
    lib["F"](model, ignored_modules=[model], **_wrap_kwargs(lib))


def _param_init_fn_not_callable(lib: Lib) -> None:
    with torch.device("meta"):
        model = _Model()
    lib["F"](model, param_init_fn=42, **_wrap_kwargs(lib))


def _already_wrapped_under_auto_wrap(lib: Lib) -> None:
    model = _Model()
    model.layer1[1] = lib["F"](model.layer1[1], **_wrap_kwargs(lib))
    lib["F"](model, auto_wrap_policy=lib["wrap"].size_based_auto_wrap_policy, **_wrap_kwargs(lib))


def _group_and_mesh(lib: Lib) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    lib["F"](_Model(), process_group=dist.group.WORLD, device_mesh=mesh, **_wrap_kwargs(lib))


def _hybrid_manual_wrap(lib: Lib, strategy: str) -> None:
    strategy_enum = getattr(lib["api"].ShardingStrategy, strategy)
    lib["F"](_Model(), sharding_strategy=strategy_enum, **_wrap_kwargs(lib))


def _hybrid_with_one_group(lib: Lib) -> None:
    lib["F"](
        _Model(),
        auto_wrap_policy=lib["wrap"].ModuleWrapPolicy({nn.Linear}),
        process_group=dist.group.WORLD,
        sharding_strategy=lib["api"].ShardingStrategy.HYBRID_SHARD,
        **_wrap_kwargs(lib),
    )


def _frozen_and_trainable_in_one_unit(lib: Lib, use_orig_params: bool) -> None:
    lib["F"](
        _LoraModel(),
        auto_wrap_policy=lib["wrap"].ModuleWrapPolicy({_LoraAttention, _LoraDecoder}),
        use_orig_params=use_orig_params,
        **_wrap_kwargs(lib),
    )


def _mixed_precision_skips_norms(lib: Lib) -> None:
    from torch.nn.modules.batchnorm import _BatchNorm

    mp = lib["api"].MixedPrecision(
        param_dtype=torch.float16,
        reduce_dtype=torch.float16,
        buffer_dtype=torch.float16,
        _module_classes_to_ignore=[_BatchNorm, nn.LayerNorm],
    )
    lib["F"](_WithNorms(), mixed_precision=mp, auto_wrap_policy=lambda *a, **k: False, **_wrap_kwargs(lib))


def _container_root(lib: Lib) -> None:
    lib["F"](nn.ModuleList([nn.Linear(4, 4) for _ in range(3)]), **_wrap_kwargs(lib))


def _one_rank_group(lib: Lib, strategy: Optional[str]) -> None:
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    kwargs = _wrap_kwargs(lib)
    if strategy is not None:
        kwargs["sharding_strategy"] = getattr(lib["api"].ShardingStrategy, strategy)
    lib["F"](nn.Linear(3, 3), process_group=groups[dist.get_rank()], **kwargs)


def _heterogeneous(lib: Lib, attr: str) -> None:
    F = lib["F"]
    model = _Model()
    if attr == "_use_full_prec_in_eval":
        model.layer1 = F(model.layer1, **_wrap_kwargs(lib))
        os.environ["FSDP_USE_FULL_PREC_IN_EVAL"] = "1"
        try:
            root = F(model, **_wrap_kwargs(lib))
        finally:
            del os.environ["FSDP_USE_FULL_PREC_IN_EVAL"]
    else:
        name = attr.lstrip("_")
        model.layer1 = F(model.layer1, **{name: False}, **_wrap_kwargs(lib))
        root = F(model, **{name: True}, **_wrap_kwargs(lib))
    root(torch.randn(2, 3))


def _wrapped(lib: Lib, **kwargs: Any) -> nn.Module:
    """_Model with ``layer1`` a nested unit."""
    F = lib["F"]
    model = _Model()
    model.layer1 = F(model.layer1, **kwargs, **_wrap_kwargs(lib))
    return F(model, **kwargs, **_wrap_kwargs(lib))


def _step(model: nn.Module) -> torch.Tensor:
    out = model(torch.randn(2, 3))
    out.sum().backward()
    return out


def _noisy_hook(state: Any, grad: torch.Tensor, output: Optional[torch.Tensor] = None) -> None:
    """test_fsdp_comm_hooks.py's dummy hook (never run here)."""


class _HookState:
    def __init__(self) -> None:
        self.process_group = None
        self.noise = 1234


def _comm_hook(lib: Lib, case: str) -> None:
    if case == "hybrid":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (1, dist.get_world_size()))
        root = lib["F"](
            _Model(),
            auto_wrap_policy=lib["wrap"].ModuleWrapPolicy({nn.Linear}),
            sharding_strategy=lib["api"].ShardingStrategy.HYBRID_SHARD,
            device_mesh=mesh,
            **_wrap_kwargs(lib),
        )
    else:
        root = _wrapped(lib)
    if case == "twice":
        root.register_comm_hook(_HookState(), _noisy_hook)
        root.register_comm_hook(_HookState(), _noisy_hook)
    elif case == "nested":
        _step(root)  # torch decides who is root at the first forward
        root.layer1.register_comm_hook(_HookState(), _noisy_hook)
    elif case == "set_on_nested":
        root.layer1._comm_hook = _noisy_hook
        root.register_comm_hook(_HookState(), _noisy_hook)
    elif case == "not_callable":
        root.register_comm_hook(_HookState(), "not a hook")
    else:
        root.register_comm_hook(_HookState(), _noisy_hook)


def _clip_on_nested(lib: Lib) -> None:
    root = _wrapped(lib)
    _step(root)
    root.layer1.clip_grad_norm_(max_norm=2)


def _clip_without_grads(lib: Lib) -> None:
    mp = lib["api"].MixedPrecision(
        param_dtype=torch.float16, reduce_dtype=torch.float32, buffer_dtype=torch.float32
    )
    model = lib["F"](
        nn.Linear(24, 24),
        sharding_strategy=lib["api"].ShardingStrategy.SHARD_GRAD_OP,
        mixed_precision=mp,
        **_wrap_kwargs(lib),
    )
    model(torch.randn(32, 24))
    model.clip_grad_norm_(1)


def _no_sync_on_nested(lib: Lib) -> None:
    root = _wrapped(lib)
    _step(root)  # torch decides who is root at the first forward
    with root.layer1.no_sync():
        pass


def _apply_in_summon(lib: Lib) -> None:
    root = _wrapped(lib)
    with lib["F"].summon_full_params(root):
        root.apply(lambda m: None)


def _in_forward(lib: Lib, call: Callable[[Lib, nn.Module], Any]) -> None:
    root = _wrapped(lib)
    root.layer1.module[0].register_forward_pre_hook(lambda *_: call(lib, root))
    root(torch.randn(2, 3))


def _in_backward(lib: Lib, call: Callable[[Lib, nn.Module], Any]) -> None:
    root = _wrapped(lib)
    out = root(torch.randn(2, 3))
    out.register_hook(lambda grad: (call(lib, root), grad)[1])
    out.sum().backward()


def _summon(lib: Lib, root: nn.Module) -> None:
    with lib["F"].summon_full_params(root):
        pass


def _no_sync(lib: Lib, root: nn.Module) -> None:
    with root.no_sync():
        pass


def _apply(lib: Lib, root: nn.Module) -> None:
    root.apply(lambda m: None)


def _summon_rank0_only_writeback(lib: Lib) -> None:
    root = _wrapped(lib)
    with lib["F"].summon_full_params(root, rank0_only=True, writeback=True):
        pass


def _optimizer_in_backward_with_flat_params(lib: Lib) -> None:
    from torch.distributed.optim import _apply_optimizer_in_backward

    root = lib["F"](
        _TwoLinears(), auto_wrap_policy=lib["wrap"].always_wrap_policy, use_orig_params=False,
        **_wrap_kwargs(lib),
    )
    _apply_optimizer_in_backward(
        optimizer_class=torch.optim.SGD,
        params=root.parameters(),
        optimizer_kwargs={"lr": 0.03},
        register_hook=False,
    )
    root(torch.randn(10, 5))


def _writeback_shape_changed(lib: Lib) -> None:
    root = lib["F"](_TwoLinears(), use_orig_params=True, **_wrap_kwargs(lib))
    inner = root.module
    # Each rank changes a parameter its shard holds (lin1.weight on rank 0, lin2.weight on 1).
    lin = inner.lin1 if dist.get_rank() == 0 else inner.lin2
    shape = [d + 1 for d in lin.weight.shape]
    lin.weight = nn.Parameter(torch.randn(shape))
    lin.weight.grad = torch.randn(shape)
    with lib["F"].summon_full_params(root):
        pass


def _changed_between_forward_and_backward(lib: Lib, how: str) -> None:
    root = lib["F"](
        _TwoLinears(),
        sharding_strategy=lib["api"].ShardingStrategy.SHARD_GRAD_OP,
        auto_wrap_policy=lib["wrap"].ModuleWrapPolicy({nn.Linear}),
        use_orig_params=True,
        **_wrap_kwargs(lib),
    )
    loss = root(torch.randn(2, 5)).sum()
    if how == "data":
        root.lin1.weight.data = root.lin1.weight.clone()
    else:
        root.lin1._fsdp_wrapped_module.weight = nn.Parameter(root.lin1.weight.clone())
    loss.backward()


def _wrong_state_dict_config(lib: Lib) -> None:
    root = _wrapped(lib)
    api = lib["api"]
    with root.state_dict_type(root, api.StateDictType.FULL_STATE_DICT, api.LocalStateDictConfig()):
        pass


def _set_state_dict_type(lib: Lib) -> None:
    api = lib["api"]
    lib["F"].set_state_dict_type(_wrapped(lib), api.StateDictType.SHARDED_STATE_DICT)


def _state_dict_type_context(lib: Lib) -> None:
    api = lib["api"]
    root = _wrapped(lib)
    with lib["F"].state_dict_type(root, api.StateDictType.SHARDED_STATE_DICT):
        pass


def _summon_offload_on_every_rank(lib: Lib) -> None:
    try:
        with lib["F"].summon_full_params(_wrapped(lib), offload_to_cpu=True, rank0_only=False):
            pass
    except RuntimeError as exc:
        # Torch FSDP1 warns, then fails to offload on a CPU device ("setStorage: ... out of
        # bounds for storage of size 0"); ours offloads. The warning is the case.
        if lib["name"] != "torch" or "setStorage" not in str(exc):
            raise


def _optim_states_missing_on_some_ranks(lib: Lib) -> None:
    root = _wrapped(lib)
    params = list(root.parameters())
    if dist.get_rank() != 0:
        params = params[:-1]
    optim = torch.optim.Adam(params, lr=1e-3)
    for _ in range(2):
        optim.zero_grad()
        _step(root)
        optim.step()
    lib["F"].full_optim_state_dict(root, optim)


def _unmanaged_param_in_a_unit(lib: Lib) -> None:
    F = lib["F"]

    def build(unmanaged: bool) -> nn.Module:
        # test_fsdp_optim_state.py's NestedModel.wrap: FSDP children under a plain root.
        model = _Model()
        if unmanaged:
            # After the Linear's own parameters, as torch's test registers it on a BlockB.
            model.layer1[0].register_parameter("unmanaged_param", nn.Parameter(torch.randn(5, 5)))
        model.layer1 = F(model.layer1, **_wrap_kwargs(lib))
        model.layer2 = F(model.layer2, **_wrap_kwargs(lib))
        return model

    model = build(unmanaged=False)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    _step(model)
    optim.step()
    full = F.full_optim_state_dict(model, optim, rank0_only=False)
    new_model = build(unmanaged=True)
    F.shard_full_optim_state_dict(full, new_model, optim=torch.optim.Adam(new_model.parameters()))


@dataclass(frozen=True)
class Case:
    """One mistake: what torch's test expects of it.

    Attributes:
        run: The mistake, given a library (ours or torch's).
        expected: The exception type's or warning category's name.
        pattern: Torch's test's pattern (``{rank}`` is replaced by this rank).
        warns: Whether the case warns (else it raises).
        where: The torch test that matches this pattern.
    """

    run: Callable[[Lib], None]
    expected: str
    pattern: str
    where: str
    warns: bool = False


_FROZEN = "layers.0.attn has both parameters with requires_grad=True and False. "

CASES: dict[str, Case] = {
    # test_fsdp_ignored_modules.py
    "ignored_modules_of_parameters": Case(
        _ignored_modules_of_parameters, "ValueError",
        r"ignored_modules expects nn.Module list elements but got types "
        r"\[<class 'torch.nn.parameter.Parameter'>\]",
        "test_fsdp_ignored_modules.py::test_ignored_states_check"),
    "ignored_modules_and_ignored_states": Case(
        _ignored_modules_and_states, "ValueError",
        "Cannot pass both ignored_modules and ignored_states at the same time",
        "test_fsdp_ignored_modules.py::test_ignored_states_check"),
    "ignored_states_of_mixed_types": Case(
        _ignored_states_mixed, "ValueError",
        r"ignored_states expects all nn.Parameter or all nn.Module list elements but got types "
        r"\[<class 'torch.nn.modules.linear.Linear'>, <class 'torch.nn.parameter.Parameter'>\]",
        "test_fsdp_ignored_modules.py::test_ignored_states_check"),
    "ignored_modules_fsdp_instance": Case(
        _ignored_fsdp_module, "ValueError", "`ignored_modules` should not include FSDP modules",
        "test_fsdp_ignored_modules.py::test_ignored_modules_invalid"),
    "ignored_modules_the_root": Case(
        _ignore_the_root, "UserWarning",
        "Trying to ignore the top-level module passed into the FSDP constructor itself will "
        "result in all parameters being ignored",
        "test_fsdp_ignored_modules.py::test_ignored_modules_invalid", warns=True),
    # test_fsdp_meta.py
    "param_init_fn_not_callable": Case(
        _param_init_fn_not_callable, "ValueError", "to be callable", "test_fsdp_meta.py::test_bad_arg"),
    # test_wrap.py
    "already_wrapped_under_auto_wrap": Case(
        _already_wrapped_under_auto_wrap, "ValueError",
        "FSDP auto wrapping requires modules to not already have FSDP applied but found "
        "layer1.1 in", "test_wrap.py::test_error_already_wrapped"),
    "frozen_and_trainable_with_orig_params": Case(
        functools.partial(_frozen_and_trainable_in_one_unit, use_orig_params=True), "UserWarning",
        _FROZEN + "We do not recommend wrapping such modules", "test_wrap.py::test_frozen_params",
        warns=True),
    "frozen_and_trainable_in_one_flat_unit": Case(
        functools.partial(_frozen_and_trainable_in_one_unit, use_orig_params=False), "ValueError",
        _FROZEN + "FSDP does not support wrapping such modules when use_orig_params=False.",
        "test_wrap.py::test_frozen_params"),
    # test_fsdp_mixed_precision.py
    "mixed_precision_skips_norm_modules": Case(
        _mixed_precision_skips_norms, "UserWarning", "These modules will be wrapped as separate FSDP",
        "test_fsdp_mixed_precision.py::test_mp_batchnorm", warns=True),
    # test_fsdp_misc.py
    "container_root_without_forward": Case(
        _container_root, "UserWarning",
        "FSDP will not all-gather parameters for containers that do not implement forward",
        "test_fsdp_misc.py::test_fsdp_unsupported_module_cls", warns=True),
    "one_rank_full_shard": Case(
        functools.partial(_one_rank_group, strategy="FULL_SHARD"), "UserWarning",
        "FSDP is switching to use `NO_SHARD` instead of ShardingStrategy.FULL_SHARD since the "
        "world size is 1.", "test_fsdp_misc.py::test_world_size_1_sharding_strategy_warning",
        warns=True),
    "one_rank_default_strategy": Case(
        functools.partial(_one_rank_group, strategy=None), "UserWarning",
        "FSDP is switching to use `NO_SHARD` instead of ShardingStrategy.FULL_SHARD since the "
        "world size is 1.", "test_fsdp_misc.py::test_world_size_1_sharding_strategy_warning",
        warns=True),
    "one_rank_shard_grad_op": Case(
        functools.partial(_one_rank_group, strategy="SHARD_GRAD_OP"), "UserWarning",
        "FSDP is switching to use `NO_SHARD` instead of ShardingStrategy.SHARD_GRAD_OP since the "
        "world size is 1.", "test_fsdp_misc.py::test_world_size_1_sharding_strategy_warning",
        warns=True),
    "heterogeneous_use_orig_params": Case(
        functools.partial(_heterogeneous, attr="_use_orig_params"), "ValueError",
        "Expects one homogeneous value for _use_orig_params",
        "test_fsdp_misc.py::test_homogeneous_attributes"),
    "heterogeneous_limit_all_gathers": Case(
        functools.partial(_heterogeneous, attr="limit_all_gathers"), "ValueError",
        "Expects one homogeneous value for limit_all_gathers",
        "test_fsdp_misc.py::test_homogeneous_attributes"),
    "heterogeneous_full_precision_in_eval": Case(
        functools.partial(_heterogeneous, attr="_use_full_prec_in_eval"), "ValueError",
        "Expects one homogeneous value for _use_full_prec_in_eval",
        "test_fsdp_misc.py::test_homogeneous_attributes"),
    "optimizer_in_backward_without_orig_params": Case(
        _optimizer_in_backward_with_flat_params, "RuntimeError",
        "only supported with use_orig_params=True",
        "test_fsdp_misc.py::test_fsdp_optim_overlap_no_use_orig_params_error"),
    # test_fsdp_hybrid_shard.py
    "hybrid_shard_manual_wrap": Case(
        functools.partial(_hybrid_manual_wrap, strategy="HYBRID_SHARD"), "ValueError",
        "requires explicit specification of process group or device_mesh.",
        "test_fsdp_hybrid_shard.py::test_raises_manual_wrap_hybrid_shard_when_none_policy"),
    "hybrid_shard_zero2_manual_wrap": Case(
        functools.partial(_hybrid_manual_wrap, strategy="_HYBRID_SHARD_ZERO2"), "ValueError",
        "requires explicit specification of process group or device_mesh.",
        "test_fsdp_hybrid_shard.py::test_raises_manual_wrap_hybrid_shard_when_none_policy"),
    "hybrid_shard_with_one_group": Case(
        _hybrid_with_one_group, "ValueError", "Expected process_group to be passed in",
        "test_fsdp_hybrid_shard.py::test_invalid_pg_specification_raises"),
    "process_group_and_device_mesh": Case(
        _group_and_mesh, "ValueError",
        "Cannot pass both process_group and device_mesh at the same time. Please just pass "
        "only one of them.", "torch's _init_utils.py (no torch test)"),
    # test_fsdp_comm_hooks.py
    "register_comm_hook_twice": Case(
        functools.partial(_comm_hook, case="twice"), "AssertionError",
        "^A communication hook is already registered$",
        "test_fsdp_comm_hooks.py::test_default_communication_hook_initialization"),
    "register_comm_hook_on_nested_unit": Case(
        functools.partial(_comm_hook, case="nested"), "AssertionError",
        "^register_comm_hook can only be called on a root instance.$",
        "test_fsdp_comm_hooks.py::test_registering_hook_non_root"),
    "register_comm_hook_after_setting_one": Case(
        functools.partial(_comm_hook, case="set_on_nested"), "AssertionError",
        "^A communication hook is already registered$",
        "test_fsdp_comm_hooks.py::test_registering_hook_submodules"),
    "register_comm_hook_hybrid": Case(
        functools.partial(_comm_hook, case="hybrid"), "AssertionError",
        "Communication hook is not supported for hybrid strategies",
        "test_fsdp_comm_hooks.py::test_registering_hook_hybrid_strategy"),
    "register_comm_hook_not_callable": Case(
        functools.partial(_comm_hook, case="not_callable"), "ValueError",
        "The communication hook must be callable but got", "torch's register_comm_hook"),
    # test_fsdp_clip_grad_norm.py
    "clip_grad_norm_on_nested_unit": Case(
        _clip_on_nested, "RuntimeError", "should only be called on the root FSDP instance",
        "test_fsdp_clip_grad_norm.py::test_non_root"),
    "clip_grad_norm_without_gradients": Case(
        _clip_without_grads, "UserWarning",
        r"on rank {rank} with no gradients -- returning the total norm in the default dtype "
        "torch.float32", "test_fsdp_clip_grad_norm.py::test_no_gradients", warns=True),
    # test_fsdp_no_sync.py / torch's no_sync
    "no_sync_on_nested_unit": Case(
        _no_sync_on_nested, "RuntimeError",
        "`no_sync\\(\\)` on inner FSDP instances is not supported. Please call `no_sync\\(\\)` "
        "on root FSDP module.", "torch's no_sync (no torch test)"),
    # test_fsdp_apply.py and torch's IDLE-state checks
    "apply_in_summon_full_params": Case(
        _apply_in_summon, "ValueError", "expected to be in states",
        "test_fsdp_apply.py::test_apply_in_summon_raises_error"),
    "apply_in_forward": Case(
        functools.partial(_in_forward, call=_apply), "ValueError",
        r"expected to be in states \[<TrainingState.IDLE: 1>\] but current state is "
        r"TrainingState.FORWARD_BACKWARD", "torch's _assert_state (no torch test)"),
    "no_sync_in_backward": Case(
        functools.partial(_in_backward, call=_no_sync), "ValueError",
        r"expected to be in states \[<TrainingState.IDLE: 1>\] but current state is "
        r"TrainingState.FORWARD_BACKWARD", "torch's _assert_state (no torch test)"),
    # test_fsdp_unshard_params.py
    "summon_in_forward": Case(
        functools.partial(_in_forward, call=_summon), "AssertionError",
        "Cannot manually unshard parameters during forward/backward",
        "test_fsdp_unshard_params.py::test_unshard_params_from_forward_raises"),
    "summon_in_backward": Case(
        functools.partial(_in_backward, call=_summon), "AssertionError",
        "Cannot manually unshard parameters during forward/backward",
        "test_fsdp_unshard_params.py::test_unshard_params_from_backward_raises"),
    "summon_rank0_only_with_writeback": Case(
        _summon_rank0_only_writeback, "NotImplementedError", "is not supported",
        "test_fsdp_unshard_params.py::test_rank0_only_with_writeback_raises"),
    # test_fsdp_use_orig_params.py
    "writeback_shape_changed": Case(
        _writeback_shape_changed, "RuntimeError", "Cannot writeback",
        "test_fsdp_use_orig_params.py::test_writeback_shape_mismatch"),
    "parameter_data_changed_between_forward_and_backward": Case(
        functools.partial(_changed_between_forward_and_backward, how="data"), "AssertionError",
        "FSDP does not support changing the parameters between forward and backward",
        "test_fsdp_use_orig_params.py::test_writeback_between_fwd_and_bwd_for_no_reshard_raises"),
    "parameter_replaced_between_forward_and_backward": Case(
        functools.partial(_changed_between_forward_and_backward, how="variable"), "AssertionError",
        "FSDP does not support changing the parameters between forward and backward",
        "test_fsdp_use_orig_params.py::test_writeback_between_fwd_and_bwd_for_no_reshard_raises"),
    # test_fsdp_state_dict.py
    "wrong_state_dict_config": Case(
        _wrong_state_dict_config, "RuntimeError", "Expected state_dict_config of type",
        "test_fsdp_state_dict.py::test_wrong_state_dict_config"),
    # torch FSDP1's deprecation of its state-dict setters (no torch test matches it)
    "set_state_dict_type_deprecated": Case(
        _set_state_dict_type, "FutureWarning",
        r"FSDP.state_dict_type\(\) and FSDP.set_state_dict_type\(\) are being deprecated. Please "
        r"use APIs, get_state_dict\(\) and set_state_dict\(\)", "torch's set_state_dict_type",
        warns=True),
    "state_dict_type_context_deprecated": Case(
        _state_dict_type_context, "FutureWarning",
        r"FSDP.state_dict_type\(\) and FSDP.set_state_dict_type\(\) are being deprecated.",
        "torch's state_dict_type", warns=True),
    # torch's summon_full_params (its sentence has no space between "the" and "unsharded")
    "summon_offload_to_cpu_on_every_rank": Case(
        _summon_offload_on_every_rank, "UserWarning",
        "offload_to_cpu=True and rank0_only=False may result in theunsharded parameters being "
        "redundantly copied to CPU memory for GPUs sharing the same CPU memory, which risks CPU "
        "OOM. We recommend using offload_to_cpu=True with rank0_only=True.",
        "torch's _unshard_param_utils.py (no torch test)", warns=True),
    # test_fsdp_optim_state.py
    "optim_states_missing_on_some_ranks": Case(
        _optim_states_missing_on_some_ranks, "RuntimeError",
        "FSDP currently requires each rank to have at least the optimizer states needed by "
        "rank 0's optimizer but some ranks are missing some of those states",
        "test_fsdp_optim_state.py::test_full_optim_state_dict_nested_invalid"),
    "unmanaged_param_in_a_unit": Case(
        _unmanaged_param_in_a_unit, "ValueError",
        "^(All unflattened parameters comprising a single flat parameter must have scalar "
        "state with the same value and dtype)",
        "test_fsdp_optim_state.py::test_shard_full_optim_state_dict_unmanaged_params"),
}


# ----------------------------------------------------------------------------- running them

Outcome = tuple[Optional[list[str]], Optional[str]]  # (type MRO names, message) or (None, None)


def _outcome(case: Case, lib: Lib) -> Outcome:
    """What ``case`` does with ``lib``: the exception raised, or the matching warning."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            case.run(lib)
        except Exception as exc:  # noqa: BLE001 -- every type is the point here
            if not case.warns:
                return [c.__name__ for c in type(exc).__mro__], str(exc)
            return [c.__name__ for c in type(exc).__mro__], f"raised instead of warning: {exc}"
    if case.warns:
        pattern = _pattern(case)
        found = [w for w in caught if re.search(pattern, str(w.message))]
        chosen = found[0] if found else (caught[-1] if caught else None)
        if chosen is not None:
            return [c.__name__ for c in chosen.category.__mro__], str(chosen.message)
    return None, None


def _pattern(case: Case) -> str:
    return case.pattern.replace("{rank}", str(dist.get_rank()))


def _run_cases(names: list[str]) -> dict[str, dict[str, Outcome]]:
    with without_local_world_size():
        results: dict[str, dict[str, Outcome]] = {}
        for name in names:
            case = CASES[name]
            results[name] = {lib: _outcome(case, _lib(lib)) for lib in ("torch", "ours")}
            dist.barrier()
        return results


def test_messages_contain_torch_sentences(pool2: RankPool) -> None:
    per_rank = pool2.run(_run_and_check, list(CASES))
    problems = [p for rank_problems in per_rank for p in rank_problems]
    assert not problems, "\n".join(sorted(set(problems)))


def _run_and_check(names: list[str]) -> list[str]:
    """Runs the cases on this rank; returns what did not match (empty when all did)."""
    problems = []
    for name, outcome in _run_cases(names).items():
        problem = _check(name, CASES[name], _pattern(CASES[name]), outcome)
        if problem:
            problems.append(problem)
    return problems


def _check(name: str, case: Case, pattern: str, outcome: dict[str, Outcome]) -> Optional[str]:
    (theirs, their_msg), (ours, our_msg) = outcome["torch"], outcome["ours"]
    if theirs is None or case.expected not in theirs or not re.search(pattern, their_msg or ""):
        return f"{name}: torch FSDP1 gave {theirs and theirs[0]}: {their_msg!r} (the case is wrong)"
    if ours is None or case.expected not in ours:
        return f"{name}: ours gave {ours and ours[0]}: {our_msg!r}; torch gives {case.expected}"
    if not re.search(pattern, our_msg or ""):
        return f"{name}: our message {our_msg!r} does not match torch's {pattern!r}"
    return None



# ----------------------------------------------------------------------------- behaviours
# The other differences torch's FSDP1 tests found, each run through both libraries.


def _frozen_with_orig_params() -> dict[str, Any]:
    """test_wrap.py::test_frozen_params with use_orig_params=True: both warn for each unit
    mixing frozen and trainable parameters, in the same order, before any other warning of the
    construction, as UserWarnings. torch FSDP1's reason is the gradient memory its flat gradient
    spends on the frozen ones; fsdp gives them a handle of their own, with no gradient
    (fsdp/init/_unit_params.py, split_by_requires_grad), and says so: its reason is the second
    all-gather such a unit costs."""
    from fsdp.runtime._state import unit_state

    out: dict[str, Any] = {}
    for name in ("torch", "ours"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = _frozen_and_trainable_in_one_unit_model(_lib(name))
        out[name] = [str(w.message) for w in caught if "requires_grad=True and False" in str(w.message)]
        out[f"{name}_first"] = (caught[0].category.__name__, str(caught[0].message)) if caught else None
        if name == "ours":
            handles = unit_state(model.layers[0].attn).handles
            out["our_handles"] = [h.flat_param.requires_grad for h in handles]
    return out


def _frozen_and_trainable_in_one_unit_model(lib: Lib) -> nn.Module:
    return lib["F"](
        _LoraModel(),
        auto_wrap_policy=lib["wrap"].ModuleWrapPolicy({_LoraAttention, _LoraDecoder}),
        use_orig_params=True,
        **_wrap_kwargs(lib),
    )


def _ignored_buffers_keep_storage() -> dict[str, list[str]]:
    """test_fsdp_state_dict.py::test_state_dict_with_ignored_modules: ignored parameters and
    every buffer an ignored module (or mixed precision's absence) leaves alone are saved as
    the very tensors, in float32, whatever the mixed precision."""
    out: dict[str, list[str]] = {}
    for name in ("torch", "ours"):
        lib = _lib(name)
        F, api = lib["F"], lib["api"]
        for sdt in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
            for ignore_inner in (False, True):
                for mixed in (False, True):
                    mp = api.MixedPrecision(
                        param_dtype=torch.float16, reduce_dtype=torch.float16, buffer_dtype=torch.float16
                    ) if mixed else None
                    inner = nn.Linear(4, 4)
                    inner.register_buffer("buffer", torch.randn(5, 5))
                    outer = nn.Linear(4, 5)
                    outer.register_buffer("buffer", torch.randn(5, 5))
                    kept = {"outer.weight": outer.weight, "outer.bias": outer.bias, "outer.buffer": outer.buffer}
                    if ignore_inner:
                        kept.update({"inner.weight": inner.weight, "inner.bias": inner.bias})
                    if ignore_inner or not mixed:
                        kept["inner.buffer"] = inner.buffer
                    model = nn.Module()
                    model.inner = F(inner, ignored_modules=[inner] if ignore_inner else [],
                                    mixed_precision=mp, **_wrap_kwargs(lib))
                    model.outer = outer
                    root = F(model, ignored_modules=[outer], mixed_precision=mp, **_wrap_kwargs(lib))
                    with F.state_dict_type(root, getattr(api.StateDictType, sdt)):
                        sd = root.state_dict(prefix="foo.")
                    out.setdefault(name, []).extend(
                        f"{sdt} ignore_inner={ignore_inner} mixed={mixed}: {key}"
                        for key, tensor in kept.items()
                        if sd["foo." + key].data_ptr() != tensor.data_ptr()
                        or sd["foo." + key].dtype != torch.float32
                    )
    return out


def _comm_hook_set_on_a_unit() -> dict[str, Any]:
    """test_fsdp_comm_hooks.py::test_registering_hook_submodules sets ``_comm_hook`` on a
    nested unit: that unit (only) then reduces with it."""
    from torch.distributed.algorithms._comm_hooks import default_hooks

    out: dict[str, Any] = {}
    for name in ("torch", "ours"):
        lib = _lib(name)
        torch.manual_seed(0)
        root = _wrapped(lib)
        calls: list[int] = []

        def hook(state: Any, grad: torch.Tensor, output: Optional[torch.Tensor] = None) -> None:
            calls.append(grad.numel())
            default_hooks.reduce_scatter_hook(state, grad, output)

        root.layer1._comm_hook = hook
        root.layer1._comm_hook_state = default_hooks.DefaultState(dist.group.WORLD)
        torch.manual_seed(1 + dist.get_rank())
        _step(root)
        grads = [p.grad.clone() for p in root.parameters()]  # sharded FlatParameter gradients
        out[name] = (root.layer1._comm_hook is hook, calls, grads)
    return out


def _unmanaged_param_outside_units() -> dict[str, Any]:
    """test_fsdp_optim_state.py::test_shard_full_optim_state_dict_unmanaged_params with the
    parameter on a module no unit manages: no error, and the result loads once the
    parameter's own entry is added."""
    out: dict[str, Any] = {}
    for name in ("torch", "ours"):
        lib = _lib(name)
        F = lib["F"]

        def build(unmanaged: bool) -> nn.Module:
            torch.manual_seed(0)
            model = _Model()
            if unmanaged:
                model.register_parameter("unmanaged_param", nn.Parameter(torch.randn(5, 5)))
            model.layer1 = F(model.layer1, **_wrap_kwargs(lib))
            model.layer2 = F(model.layer2, **_wrap_kwargs(lib))
            return model

        model = build(unmanaged=False)
        optim = torch.optim.Adam(model.parameters(), lr=1e-3)
        torch.manual_seed(1)
        _step(model)
        optim.step()
        full = F.full_optim_state_dict(model, optim, rank0_only=False)
        new_model = build(unmanaged=True)
        new_optim = torch.optim.Adam(new_model.parameters(), lr=1e-3)
        flat = F.shard_full_optim_state_dict(full, new_model, optim=new_optim)
        ids = [i for i, _ in enumerate(new_model.parameters())]
        missing = sorted(set(ids) - set(flat["state"]))
        for i in missing:  # the unmanaged parameter's entry, as torch's test adds it
            flat["state"][i] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(5, 5), "exp_avg_sq": torch.zeros(5, 5)}
        flat["param_groups"][0]["params"] = sorted(set(flat["param_groups"][0]["params"]) | set(missing))
        new_optim.load_state_dict(flat)
        out[name] = (missing, {k: {n: v.clone() for n, v in s.items()} for k, s in new_optim.state_dict()["state"].items()})
    return out


def _warning_counts() -> dict[str, Any]:
    """How often torch FSDP1 warns where a warning repeats: the deprecated ``state_dict_type``
    context sets the type twice (entry and exit: two ``FutureWarning``s); a one-rank group
    with two units shows its ``NO_SHARD`` switch once under Python's default filter (one
    location: the wrapper's constructor), with torch's exact words."""
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    out: dict[str, Any] = {}
    for name in ("torch", "ours"):
        lib = _lib(name)
        root = _wrapped(lib)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with lib["F"].state_dict_type(root, lib["api"].StateDictType.FULL_STATE_DICT):
                pass
        deprecations = [w for w in caught if issubclass(w.category, FutureWarning)]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            one_rank = _wrapped(lib, process_group=groups[dist.get_rank()])
        out[name] = {
            "deprecations": len(deprecations),
            "one_rank": [(w.category.__name__, str(w.message)) for w in caught],
            "strategies": [str(m.sharding_strategy) for m in lib["F"].fsdp_modules(one_rank)],
        }
    return out


def _behaviours() -> dict[str, Any]:
    results = {
        "counts": _warning_counts(),
        "frozen": _frozen_with_orig_params(),
        "ignored_buffers": _ignored_buffers_keep_storage(),
        "comm_hook": _comm_hook_set_on_a_unit(),
        "unmanaged": _unmanaged_param_outside_units(),
    }
    dist.barrier()
    return results


def test_other_torch_fsdp1_behaviours(pool2: RankPool) -> None:
    for r in pool2.run(_behaviours):
        frozen = r["frozen"]
        assert frozen["torch"] and any(re.search(
            _FROZEN + r"We do not recommend wrapping such modules since the gradient memory "
            r"usage will be higher than expected", m) for m in frozen["torch"]), frozen
        # torch's test's pattern, for every unit torch names (the same units, in its order),
        # with the same parameter lists; the first warning of the construction is this one.
        pattern = _FROZEN.replace("layers.0.attn", r"layers\.\d\.attn") + "We do not recommend wrapping such modules"
        assert len(frozen["ours"]) == len(frozen["torch"]) == 2, frozen
        for mine, theirs in zip(frozen["ours"], frozen["torch"]):
            assert re.match(pattern, mine) and mine.split(".", 1)[0] == theirs.split(".", 1)[0], (mine, theirs)
            assert mine.split("\n")[1:] == theirs.split("\n")[1:], (mine, theirs)
            assert "If possible, wrap the frozen parameters with FSDP separately." in mine
        assert frozen["ours_first"] == ("UserWarning", frozen["ours"][0]), frozen
        assert frozen["torch_first"] == ("UserWarning", frozen["torch"][0]), frozen
        assert frozen["our_handles"] == [True, False], frozen  # frozen ones: no gradient at all

        assert r["ignored_buffers"]["torch"] == [], r["ignored_buffers"]
        assert r["ignored_buffers"]["ours"] == [], r["ignored_buffers"]

        (t_set, t_calls, t_grads), (o_set, o_calls, o_grads) = r["comm_hook"]["torch"], r["comm_hook"]["ours"]
        assert t_set and o_set
        assert o_calls == t_calls and len(t_calls) == 1, (t_calls, o_calls)
        for t, o in zip(t_grads, o_grads):
            torch.testing.assert_close(o, t, rtol=0, atol=0)

        counts = r["counts"]
        assert counts["torch"]["deprecations"] == 2, counts
        assert counts["torch"]["one_rank"] == [(
            "UserWarning",
            "FSDP is switching to use `NO_SHARD` instead of ShardingStrategy.FULL_SHARD since the world size is 1.",
        )], counts
        assert counts["torch"]["strategies"] == ["ShardingStrategy.NO_SHARD"] * 2, counts
        assert counts["ours"] == counts["torch"], counts

        (t_missing, t_state), (o_missing, o_state) = r["unmanaged"]["torch"], r["unmanaged"]["ours"]
        assert o_missing == t_missing and len(t_missing) == 1, (t_missing, o_missing)
        assert o_state.keys() == t_state.keys()
        for key in t_state:
            assert o_state[key].keys() == t_state[key].keys()
            for n in t_state[key]:
                torch.testing.assert_close(o_state[key][n], t_state[key][n], rtol=0, atol=0)
