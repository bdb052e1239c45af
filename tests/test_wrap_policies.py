"""Auto-wrap policies and the constructor's auto-wrap planning, checked against torch's choices.

fsdp's side runs the constructor's own steps (:func:`plan_and_wrap`): the policy check of
``validate_init_args``, the one planner ``plan_units``, the mixed-precision overrides and
``materialize_and_wrap``, with a dummy wrapper class instead of FSDP, so no process group is
needed. torch's FSDP is used only as a reference oracle: its private ``_recursive_wrap``
(functional policies), ``_Policy._run_policy`` + ``_post_order_apply`` (policy objects) and
``_wrap_utils._auto_wrap`` (mixed precision) run on an identical copy of the model with the same
dummy wrapper class. ``fsdp`` itself never imports torch FSDP.
"""

from __future__ import annotations

import copy
import functools
import warnings
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, Type

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp_pkg
import torch.distributed.fsdp.wrap as torch_wrap
from torch import nn
from torch.distributed.fsdp import _wrap_utils as torch_wrap_utils

import fsdp.wrap as ours
from fsdp.init._auto_wrap import mixed_precision_classes
from fsdp.init._auto_wrap import validate_auto_wrap_policy as _validate_auto_wrap_policy
from fsdp.init._materialize import materialize_and_wrap
from fsdp.init._validate import UnitPlan, plan_units
from fsdp.runtime._mixed_precision import apply_mixed_precision_overrides
from fsdp.runtime._state import is_fsdp
from fsdp.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    _Policy,
    always_wrap_policy,
    enable_wrap,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
    wrap,
)

D = 8
VOCAB = 50


# ---------------------------------------------------------------------------------------------
# Model and helpers
# ---------------------------------------------------------------------------------------------


class Block(nn.Module):
    """A custom transformer-ish block: MultiheadAttention + MLP + LayerNorm (856 params)."""

    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(d, 2)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.ReLU(), nn.Linear(4 * d, d))
        self.norm = nn.LayerNorm(d)


class Model(nn.Module):
    """Embedding (tied with lm_head), ModuleList of blocks, TransformerEncoder, nested ModuleDict."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)  # 400
        self.blocks = nn.ModuleList([Block(), Block()])  # 2 x 856
        self.encoder = nn.TransformerEncoder(  # 2 x 600
            nn.TransformerEncoderLayer(D, 2, dim_feedforward=16),
            num_layers=2,
            enable_nested_tensor=False,
        )
        self.heads = nn.ModuleDict(
            {
                "cls": nn.Sequential(nn.Linear(D, D), nn.ModuleDict({"inner": nn.Linear(D, 3)})),
                "bn": nn.BatchNorm1d(D),
            }
        )
        self.lm_head = nn.Linear(D, VOCAB, bias=False)
        self.lm_head.weight = self.embed.weight  # tied


def make_recorder() -> Tuple[Type[nn.Module], List[nn.Module]]:
    """A fresh dummy wrapper class and the list its instances are appended to on construction."""
    log: List[nn.Module] = []

    class Recorder(nn.Module):
        def __init__(self, module: nn.Module, **kwargs: Any) -> None:
            super().__init__()
            self.module = module
            self.kwargs = kwargs
            log.append(self)

    return Recorder, log


def plan_and_wrap(
    model: nn.Module,
    policy: Any,
    wrapper_cls: Type[nn.Module],
    root_kwargs: Dict[str, Any],
    ignored_modules: Optional[Set[nn.Module]] = None,
) -> UnitPlan:
    """The FSDP constructor's auto-wrap steps, in its order, with ``wrapper_cls`` for FSDP.

    ``validate_init_args`` checks the policy; ``plan_units`` (the one planner, also used by
    ``fsdp.plan``) plans and checks every unit before anything changes; the modules mixed
    precision skips get their float32 hooks; ``materialize_and_wrap`` wraps the planned units
    bottom-up. The root is left unwrapped (the constructor wraps it last).
    """
    if policy is not None:
        _validate_auto_wrap_policy(policy)
    plan = plan_units(model, policy, root_kwargs, ignored_modules, None)
    if policy is not None and root_kwargs.get("mixed_precision") is not None:
        apply_mixed_precision_overrides(model, mixed_precision_classes(root_kwargs))
    materialize_and_wrap(
        model,
        plan.targets,
        wrapper_cls,
        torch.device("cpu"),
        None,
        is_skipped=lambda m: is_fsdp(m) or m in plan.ignored_modules,
    )
    return plan


def comparable(kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """A unit's kwargs without the planner's bookkeeping, to compare with torch's.

    fsdp's planner passes ``auto_wrap_policy=None`` to every nested unit (torch leaves it at its
    default, None, for functional policies) and hands each unit the ignored states inside it
    (torch hands every unit the root's); neither changes what a unit is built with.
    """
    out = dict(kwargs)
    if "auto_wrap_policy" in out and out["auto_wrap_policy"] is None:
        del out["auto_wrap_policy"]
    out.pop("ignored_states", None)
    return out


def names_of(model: nn.Module) -> Dict[nn.Module, str]:
    """Qualified names of the (still unwrapped) model's modules."""
    return {module: name for name, module in model.named_modules()}


def wrapped_summary(
    log: List[nn.Module], names: Dict[nn.Module, str]
) -> List[Tuple[str, Dict[str, Any]]]:
    """``(original qualified name, kwargs)`` of each wrapper, in construction order."""
    return [(names[w.module], comparable(w.kwargs)) for w in log]  # type: ignore[index]


def wrapped_names_in_tree(model: nn.Module, recorder: Type[nn.Module]) -> Set[str]:
    """Names of wrapped modules as found in the final tree (``.module`` hops removed)."""
    found = set()
    for name, module in model.named_modules():
        if isinstance(module, recorder):
            found.add(".".join(part for part in name.split(".") if part != "module"))
    return found


def run_ours(
    model: nn.Module,
    policy: Any,
    root_kwargs: Optional[Dict[str, Any]] = None,
    ignored: Optional[Set[str]] = None,
) -> Tuple[List[Tuple[str, Dict[str, Any]]], Type[nn.Module]]:
    names = names_of(model)
    recorder, log = make_recorder()
    ignored_modules = {model.get_submodule(n) for n in (ignored or set())}
    plan_and_wrap(model, policy, recorder, dict(root_kwargs or {}), ignored_modules or None)
    summary = wrapped_summary(log, names)
    assert wrapped_names_in_tree(model, recorder) == {n for n, _ in summary}
    return summary, recorder


def run_torch_functional(
    model: nn.Module,
    policy: Callable[..., bool],
    root_kwargs: Optional[Dict[str, Any]] = None,
    ignored: Optional[Set[str]] = None,
) -> List[Tuple[str, Dict[str, Any]]]:
    names = names_of(model)
    recorder, log = make_recorder()
    ignored_modules = {m for n in (ignored or set()) for m in model.get_submodule(n).modules()}
    ignored_params = {p for m in ignored_modules for p in m.parameters()}
    torch_wrap._recursive_wrap(
        model,
        auto_wrap_policy=policy,
        wrapper_cls=recorder,
        ignored_modules=ignored_modules,
        ignored_params=ignored_params,
        only_wrap_children=True,
        **(root_kwargs or {}),
    )
    return wrapped_summary(log, names)


def run_torch_policy(
    model: nn.Module,
    policy: Any,
    root_kwargs: Optional[Dict[str, Any]] = None,
    ignored: Optional[Set[str]] = None,
) -> List[Tuple[str, Dict[str, Any]]]:
    names = names_of(model)
    recorder, log = make_recorder()
    ignored_modules = {m for n in (ignored or set()) for m in model.get_submodule(n).modules()}
    kwargs = dict(root_kwargs or {})
    kwargs["auto_wrap_policy"] = None  # what torch's FSDP _auto_wrap does for _Policy objects
    targets = policy._run_policy(model, ignored_modules, kwargs)
    torch_wrap._post_order_apply(model, torch_wrap._construct_wrap_fn(model, targets, recorder))
    return wrapped_summary(log, names)


def fresh_pair(factory: Callable[[], nn.Module] = Model) -> Tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = factory()
    return model, copy.deepcopy(model)


# ---------------------------------------------------------------------------------------------
# Functional policies vs torch's _recursive_wrap
# ---------------------------------------------------------------------------------------------


def test_always_wrap_policy_wraps_every_submodule_like_torch() -> None:
    ours_model, ref_model = fresh_pair()
    expected_names = {n for n, _ in ours_model.named_modules() if n}
    got, _ = run_ours(ours_model, always_wrap_policy, {"tag": 1})
    want = run_torch_functional(ref_model, torch_wrap.always_wrap_policy, {"tag": 1})
    assert got == want
    assert {n for n, _ in got} == expected_names
    assert all(kwargs == {"tag": 1} for _, kwargs in got)
    # Post-order: every wrapper is constructed after the wrappers of its descendants.
    order = [n for n, _ in got]
    for i, name in enumerate(order):
        assert not any(other.startswith(name + ".") for other in order[i + 1 :])
    assert repr(ours_model) == repr(ref_model)
    assert always_wrap_policy() is True and always_wrap_policy(1, x=2) is True


def test_lambda_policy_matches_torch() -> None:
    def fn(m: nn.Module) -> bool:
        return isinstance(m, (nn.Linear, nn.LayerNorm))

    ours_model, ref_model = fresh_pair()
    got, _ = run_ours(ours_model, functools.partial(lambda_auto_wrap_policy, lambda_fn=fn))
    want = run_torch_functional(
        ref_model, functools.partial(torch_wrap.lambda_auto_wrap_policy, lambda_fn=fn)
    )
    assert got == want
    got_names = {n for n, _ in got}
    assert "blocks.0.attn.out_proj" in got_names and "blocks.0.ff.0" in got_names
    assert "lm_head" in got_names and "heads.cls.1.inner" in got_names
    assert "blocks.0" not in got_names
    assert repr(ours_model) == repr(ref_model)


def test_transformer_policy_matches_torch() -> None:
    classes = {Block, nn.TransformerEncoderLayer}
    ours_model, ref_model = fresh_pair()
    got, _ = run_ours(
        ours_model,
        functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=classes),
        {"a": 2},
    )
    want = run_torch_functional(
        ref_model,
        functools.partial(torch_wrap.transformer_auto_wrap_policy, transformer_layer_cls=classes),
        {"a": 2},
    )
    assert got == want
    assert [n for n, _ in got] == ["blocks.0", "blocks.1", "encoder.layers.0", "encoder.layers.1"]
    assert isinstance(ours_model.blocks[0].module, Block)  # type: ignore[union-attr]
    assert repr(ours_model) == repr(ref_model)


@pytest.mark.parametrize(
    "min_num_params", [1, 16, 100, 300, 400, 500, 700, 900, 1200, 2000, 5000, 10**8]
)
def test_size_based_policy_matches_torch_including_tied_params(min_num_params: int) -> None:
    ours_model, ref_model = fresh_pair()
    got, _ = run_ours(
        ours_model, functools.partial(size_based_auto_wrap_policy, min_num_params=min_num_params)
    )
    want = run_torch_functional(
        ref_model,
        functools.partial(torch_wrap.size_based_auto_wrap_policy, min_num_params=min_num_params),
    )
    assert got == want
    assert repr(ours_model) == repr(ref_model)
    got_names = {n for n, _ in got}
    # Defaults: never wrap ModuleList/ModuleDict, never descend into MultiheadAttention.
    assert not any(
        isinstance(Model().get_submodule(n), (nn.ModuleList, nn.ModuleDict)) for n in got_names
    )
    assert not any(".attn." in n or ".self_attn." in n for n in got_names)
    if min_num_params == 10**8:
        assert got == []
    if min_num_params == 400:
        # The embedding (400) and the tied lm_head (also counts 400) both reach the threshold.
        assert {"embed", "lm_head"} <= got_names


@pytest.mark.parametrize("min_num_params", [1, 50, 300, 700])
def test_size_based_policy_call_trace_matches_torch(min_num_params: int) -> None:
    """Same policy calls, in the same order, with the same nonwrapped_numel values."""
    ours_model, ref_model = fresh_pair()

    def tracing(
        policy: Callable[..., bool], model: nn.Module, trace: List[Tuple[str, bool, int]]
    ) -> Callable[..., bool]:
        names = names_of(model)

        def traced(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
            trace.append((names[module], recurse, nonwrapped_numel))
            return policy(module=module, recurse=recurse, nonwrapped_numel=nonwrapped_numel)

        return traced

    ours_trace: List[Tuple[str, bool, int]] = []
    ref_trace: List[Tuple[str, bool, int]] = []
    run_ours(
        ours_model,
        tracing(
            functools.partial(size_based_auto_wrap_policy, min_num_params=min_num_params),
            ours_model,
            ours_trace,
        ),
    )
    run_torch_functional(
        ref_model,
        tracing(
            functools.partial(
                torch_wrap.size_based_auto_wrap_policy, min_num_params=min_num_params
            ),
            ref_model,
            ref_trace,
        ),
    )
    assert ours_trace == ref_trace
    assert ours_trace[0] == ("", True, 400 + 2 * 856 + 2 * 600 + 72 + 27 + 16)  # tied weight once


def test_size_based_policy_function_attributes_and_overrides() -> None:
    assert size_based_auto_wrap_policy.FORCE_LEAF_MODULES == {nn.MultiheadAttention}  # type: ignore[attr-defined]
    assert size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES == {nn.ModuleList, nn.ModuleDict}  # type: ignore[attr-defined]
    mha, ml = nn.MultiheadAttention(8, 2), nn.ModuleList()
    assert size_based_auto_wrap_policy(mha, True, 10, min_num_params=5) is False
    assert size_based_auto_wrap_policy(mha, False, 10, min_num_params=5) is True
    assert size_based_auto_wrap_policy(ml, True, 10, min_num_params=5) is True
    assert size_based_auto_wrap_policy(ml, False, 10, min_num_params=5) is False
    assert size_based_auto_wrap_policy(ml, False, 4, min_num_params=5) is False
    assert (
        size_based_auto_wrap_policy(mha, True, 10, min_num_params=5, force_leaf_modules=set())
        is True
    )
    assert (
        size_based_auto_wrap_policy(ml, False, 10, min_num_params=5, exclude_wrap_modules=set())
        is True
    )
    assert size_based_auto_wrap_policy(nn.Linear(1, 1), False, 10**8 - 1) is False
    assert size_based_auto_wrap_policy(nn.Linear(1, 1), False, 10**8) is True

    # Custom leaf / exclude sets change the choice exactly as in torch.
    kw = {
        "min_num_params": 100,
        "force_leaf_modules": {Block},
        "exclude_wrap_modules": {nn.Sequential},
    }
    ours_model, ref_model = fresh_pair()
    got, _ = run_ours(ours_model, functools.partial(size_based_auto_wrap_policy, **kw))
    want = run_torch_functional(
        ref_model, functools.partial(torch_wrap.size_based_auto_wrap_policy, **kw)
    )
    assert got == want
    got_names = {n for n, _ in got}
    # Blocks are forced leaves (never descended into, so never wrapped: the policy is not asked
    # about them with recurse=False); the ModuleList is no longer excluded, so it takes them.
    assert "blocks" in got_names and not any(n.startswith("blocks.") for n in got_names)


def test_ignored_modules_and_params_match_torch() -> None:
    ignored = {"blocks.1", "heads"}
    for our_policy, ref_policy in [
        (always_wrap_policy, torch_wrap.always_wrap_policy),
        (
            functools.partial(size_based_auto_wrap_policy, min_num_params=100),
            functools.partial(torch_wrap.size_based_auto_wrap_policy, min_num_params=100),
        ),
    ]:
        ours_model, ref_model = fresh_pair()
        got, _ = run_ours(ours_model, our_policy, ignored=ignored)
        want = run_torch_functional(ref_model, ref_policy, ignored=ignored)
        assert got == want
        assert not any(n == p or n.startswith(p + ".") for n, _ in got for p in ignored)
    # Policy objects skip ignored modules (and their descendants) too.
    ours_model, ref_model = fresh_pair()
    got, _ = run_ours(ours_model, ModuleWrapPolicy({nn.Linear}), ignored=ignored)
    want = run_torch_policy(ref_model, torch_wrap.ModuleWrapPolicy({nn.Linear}), ignored=ignored)
    assert got == want
    assert "heads.cls.0" not in {n for n, _ in got} and "lm_head" in {n for n, _ in got}


# ---------------------------------------------------------------------------------------------
# Policy objects vs torch's _run_policy
# ---------------------------------------------------------------------------------------------


def test_module_wrap_policy_matches_torch() -> None:
    classes = {Block, nn.TransformerEncoderLayer, nn.Embedding, nn.BatchNorm1d}
    ours_model, ref_model = fresh_pair()
    policy = ModuleWrapPolicy(classes)
    got, _ = run_ours(ours_model, policy, {"sharding_strategy": "FULL"})
    want = run_torch_policy(
        ref_model, torch_wrap.ModuleWrapPolicy(classes), {"sharding_strategy": "FULL"}
    )
    assert got == want
    assert [n for n, _ in got] == [
        "embed",
        "blocks.0",
        "blocks.1",
        "encoder.layers.0",
        "encoder.layers.1",
        "heads.bn",
    ]
    assert all(kwargs == {"sharding_strategy": "FULL"} for _, kwargs in got)  # comparable()
    wrappers = [w for w in ours_model.modules() if hasattr(w, "kwargs")]
    assert all(
        w.kwargs == {"sharding_strategy": "FULL", "auto_wrap_policy": None} for w in wrappers
    )
    # Each unit gets its own kwargs dict.
    assert len({id(w.kwargs) for w in ours_model.modules() if hasattr(w, "kwargs")}) == 6
    assert repr(ours_model) == repr(ref_model)
    assert policy._module_classes == classes
    assert repr(policy).endswith(f"({policy._module_classes_str})") and "Block" in repr(policy)


def test_module_wrap_policy_run_policy_directly_matches_torch() -> None:
    model = Model()
    classes = {Block, nn.Linear}
    ignored = set(model.blocks[1].modules())
    root_kwargs = {"x": 1}
    ours_targets = ModuleWrapPolicy(classes)._run_policy(model, ignored, root_kwargs)
    ref_targets = torch_wrap.ModuleWrapPolicy(classes)._run_policy(model, ignored, root_kwargs)
    assert list(ours_targets) == list(ref_targets)
    assert list(ours_targets.values()) == list(ref_targets.values())
    assert all(kwargs is not root_kwargs for kwargs in ours_targets.values())


def test_module_wrap_policy_and_custom_policy_as_functional_policies() -> None:
    classes = {Block, nn.TransformerEncoderLayer}
    ours_model, ref_model = fresh_pair()
    mwp = ModuleWrapPolicy(classes)
    assert mwp(module=Block(), recurse=False, nonwrapped_numel=0) is True
    assert mwp(nn.Linear(1, 1), True, 0) is True and mwp(nn.Linear(1, 1), False, 0) is False
    got, _ = run_ours(ours_model, mwp.__call__)  # the bound method is a plain functional policy
    want = run_torch_functional(ref_model, torch_wrap.ModuleWrapPolicy(classes))
    assert got == want and [n for n, _ in got][0] == "blocks.0"

    def fn(m: nn.Module) -> Any:
        return {"k": 1} if isinstance(m, nn.LayerNorm) else isinstance(m, Block)

    cp = CustomPolicy(fn)
    assert cp(nn.LayerNorm(2), True, 0) is True and cp(nn.LayerNorm(2), False, 0) is True
    assert cp(nn.Linear(1, 1), False, 0) is False
    ours_model, ref_model = fresh_pair()
    got, _ = run_ours(ours_model, cp.__call__)
    want = run_torch_functional(
        ref_model,
        functools.partial(torch_wrap.lambda_auto_wrap_policy, lambda_fn=lambda m: bool(fn(m))),
    )
    assert got == want
    assert all(kwargs == {} for _, kwargs in got)  # functional form: root kwargs only


def test_custom_policy_bool_and_dict_overrides_match_torch() -> None:
    def fn(m: nn.Module) -> Any:
        if isinstance(m, Block):
            return True
        if isinstance(m, nn.Linear) and m.out_features == 3:
            return {"sharding_strategy": "SHARD_GRAD_OP", "extra": 7}
        if isinstance(m, nn.TransformerEncoderLayer):
            return {}  # empty dict: not wrapped
        if isinstance(m, nn.Embedding):
            return {"sharding_strategy": "NO_SHARD"}
        return isinstance(m, Model)  # the root: never wrapped by the driver

    root_kwargs = {"sharding_strategy": "FULL_SHARD", "use_orig_params": False}
    ours_model, ref_model = fresh_pair()
    got, _ = run_ours(ours_model, CustomPolicy(fn), root_kwargs)
    want = run_torch_policy(ref_model, torch_wrap.CustomPolicy(fn), root_kwargs)
    assert got == want
    # (comparable() dropped each unit's auto_wrap_policy=None, which both give.)
    assert got == [
        ("embed", {"sharding_strategy": "NO_SHARD", "use_orig_params": False}),
        ("blocks.0", {"sharding_strategy": "FULL_SHARD", "use_orig_params": False}),
        ("blocks.1", {"sharding_strategy": "FULL_SHARD", "use_orig_params": False}),
        (
            "heads.cls.1.inner",
            {"sharding_strategy": "SHARD_GRAD_OP", "use_orig_params": False, "extra": 7},
        ),
    ]
    assert root_kwargs == {
        "sharding_strategy": "FULL_SHARD",
        "use_orig_params": False,
    }  # not mutated
    assert type(ours_model) is Model
    assert repr(ours_model) == repr(ref_model)


def test_custom_policy_invalid_return_raises_naming_module_and_type() -> None:
    def fn(m: nn.Module) -> Any:
        return 1 if isinstance(m, Block) else False

    model = Model()
    before = repr(model)
    with pytest.raises(
        ValueError, match=r"for module 'blocks\.0' \(Block\) it returned 1 of type int"
    ):
        plan_and_wrap(model, CustomPolicy(fn), make_recorder()[0], {})
    assert repr(model) == before
    with pytest.raises(
        ValueError, match=r"module '<root>' \(Linear\) it returned None of type NoneType"
    ):
        CustomPolicy(lambda m: None)._run_policy(nn.Linear(1, 1), set(), {})
    with pytest.raises(ValueError, match=r"returned 'yes' of type str"):
        CustomPolicy(lambda m: "yes")(nn.Linear(1, 1), False, 0)
    with pytest.raises(
        TypeError,
        match=r"CustomPolicy expects a callable lambda_fn\(module\) -> bool \| dict, but got an object of type int",
    ):
        CustomPolicy(3)  # type: ignore[arg-type]


def test_root_is_never_wrapped_by_the_driver() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    recorder, log = make_recorder()
    plan_and_wrap(model, always_wrap_policy, recorder, {})
    assert type(model) is nn.Sequential and len(log) == 1 and isinstance(model[0], recorder)
    model = nn.Sequential(nn.Linear(2, 2))
    recorder, log = make_recorder()
    plan_and_wrap(model, CustomPolicy(lambda m: True), recorder, {})
    assert [type(w.module) for w in log] == [nn.Linear]  # type: ignore[attr-defined]
    # A leaf root: nothing to wrap.
    leaf = nn.Linear(2, 2)
    recorder, log = make_recorder()
    plan_and_wrap(leaf, always_wrap_policy, recorder, {})
    assert log == []


def test_auto_wrap_policy_kwarg_is_not_passed_to_children() -> None:
    root_kwargs = {"auto_wrap_policy": always_wrap_policy, "x": 1}
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    recorder, log = make_recorder()
    plan_and_wrap(model, always_wrap_policy, recorder, root_kwargs)
    assert [w.kwargs for w in log] == [{"auto_wrap_policy": None, "x": 1}] * 2  # type: ignore[attr-defined]
    assert root_kwargs["auto_wrap_policy"] is always_wrap_policy  # caller's dict untouched
    # Without the key (the constructor's own root kwargs never hold it): every nested unit gets
    # auto_wrap_policy=None, which is the constructor's default, as torch's children get.
    model = nn.Sequential(nn.Linear(2, 2))
    recorder, log = make_recorder()
    root_kwargs = {"x": 1}
    plan_and_wrap(model, always_wrap_policy, recorder, root_kwargs)
    assert log[0].kwargs == {"x": 1, "auto_wrap_policy": None}  # type: ignore[attr-defined]
    assert root_kwargs == {"x": 1}


def test_wrap_overrides_attribute_is_honoured_by_functional_path() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[1]._wrap_overrides = {"x": 5}  # type: ignore[assignment]
    ref = copy.deepcopy(model)
    got, _ = run_ours(model, always_wrap_policy, {"x": 1, "y": 2})
    want = run_torch_functional(ref, torch_wrap.always_wrap_policy, {"x": 1, "y": 2})
    assert got == want == [("0", {"x": 1, "y": 2}), ("1", {"x": 5, "y": 2})]


def test_shared_submodule_is_wrapped_once_and_every_parent_points_to_the_wrapper() -> None:
    shared = nn.Linear(2, 2)
    model = nn.Sequential(nn.Sequential(shared), nn.Sequential(shared), shared)
    recorder, log = make_recorder()
    plan_and_wrap(model, ModuleWrapPolicy({nn.Linear}), recorder, {})
    assert len(log) == 1
    assert model[0][0] is log[0] and model[1][0] is log[0] and model[2] is log[0]

    shared = nn.Linear(2, 2)
    model = nn.Sequential(nn.Sequential(shared), nn.Sequential(shared))
    recorder, log = make_recorder()
    plan_and_wrap(
        model,
        functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, nn.Linear)),
        recorder,
        {},
    )
    assert len(log) == 1 and model[0][0] is log[0] and model[1][0] is log[0]


# ---------------------------------------------------------------------------------------------
# Mixed precision: modules of MixedPrecision._module_classes_to_ignore are wrapped separately
# ---------------------------------------------------------------------------------------------


def run_torch_auto_wrap(
    model: nn.Module, policy: Any, root_kwargs: Dict[str, Any]
) -> List[Tuple[str, Dict[str, Any]]]:
    names = names_of(model)
    recorder, log = make_recorder()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch_wrap_utils._auto_wrap(model, policy, set(), set(), dict(root_kwargs), recorder)
    return wrapped_summary(log, names)


@pytest.mark.parametrize("kind", ["size", "module", "custom"])
def test_mixed_precision_wraps_batchnorm_separately_like_torch(kind: str) -> None:
    mp = torch_fsdp_pkg.MixedPrecision(param_dtype=torch.bfloat16)
    root_kwargs = {"mixed_precision": mp, "use_orig_params": False}
    if kind == "size":
        # With mixed precision torch ORs in a class rule that always descends, so even a
        # MultiheadAttention's out_proj may be wrapped: reproduce that exactly.
        our_policy: Any = functools.partial(size_based_auto_wrap_policy, min_num_params=60)
        ref_policy: Any = functools.partial(
            torch_wrap.size_based_auto_wrap_policy, min_num_params=60
        )
    elif kind == "module":
        our_policy, ref_policy = ModuleWrapPolicy({Block}), torch_wrap.ModuleWrapPolicy({Block})
    else:
        def fn(m: nn.Module) -> Any:
            if isinstance(m, nn.BatchNorm1d):
                return {"mixed_precision": mp, "z": 1}
            return isinstance(m, Block)

        our_policy, ref_policy = CustomPolicy(fn), torch_wrap.CustomPolicy(fn)
    ours_model, ref_model = fresh_pair()
    with pytest.warns(UserWarning, match=r"submodules of type \['BatchNorm1d'\], which mixed precision skips .* These modules will be wrapped as separate FSDP"):
        got, _ = run_ours(ours_model, our_policy, root_kwargs)
    want = run_torch_auto_wrap(ref_model, ref_policy, root_kwargs)
    assert got == want
    bn_kwargs = dict(got)["heads.bn"]
    assert bn_kwargs["mixed_precision"] is None
    assert any(kwargs["mixed_precision"] is mp for _, kwargs in got)
    if kind == "size":
        assert "blocks.0.attn.out_proj" in dict(got)
    assert repr(ours_model) == repr(ref_model)


def test_mixed_precision_skipped_module_runs_in_fp32_and_returns_input_dtype() -> None:
    from fsdp.api import MixedPrecision  # our own config class works too (duck-typed)

    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    with pytest.warns(UserWarning, match=r"These modules will be wrapped as separate FSDP instances with mixed precision disabled \(mixed_precision=None: they run in float32\)"):
        plan_and_wrap(
            model,
            ModuleWrapPolicy({nn.Linear}),
            make_recorder()[0],
            {"mixed_precision": MixedPrecision(param_dtype=torch.bfloat16)},
        )
    bn = model[1].module  # type: ignore[union-attr]
    assert isinstance(bn, nn.BatchNorm1d) and model[1].kwargs["mixed_precision"] is None  # type: ignore[union-attr, index]
    x = torch.randn(6, 4)
    ref = nn.BatchNorm1d(4)(x)
    out = bn(x.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    assert bn(x).dtype == torch.float32  # fp32 input untouched


def test_no_mixed_precision_means_no_batchnorm_special_case() -> None:
    model = Model()
    recorder, log = make_recorder()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan_and_wrap(model, ModuleWrapPolicy({Block}), recorder, {"mixed_precision": None})
    assert len(log) == 2 and not model.heads["bn"]._forward_hooks


# ---------------------------------------------------------------------------------------------
# Frozen / trainable mix (policy objects), as torch
# ---------------------------------------------------------------------------------------------


def test_mixed_requires_grad_in_one_unit_raises_before_changing_anything() -> None:
    model = Model()
    model.blocks[0].ff[0].weight.requires_grad_(False)
    ref = copy.deepcopy(model)
    before = repr(model)
    with pytest.raises(
        ValueError,
        match=r"fsdp: blocks\.0 has both parameters with requires_grad=True and False\. FSDP does not "
        r"support wrapping such modules when use_orig_params=False\. .*pass use_orig_params=True.*\n"
        r"The following parameters have requires_grad=True:\n.*\n"
        r"The following parameters have requires_grad=False:\n\['blocks\.0\.ff\.0\.weight'\]",
    ):
        plan_and_wrap(model, ModuleWrapPolicy({Block}), make_recorder()[0], {"use_orig_params": False})
    assert repr(model) == before
    with pytest.raises(
        ValueError, match="blocks.0 has both parameters with requires_grad=True and False"
    ):
        run_torch_auto_wrap(
            ref,
            torch_wrap.ModuleWrapPolicy({Block}),
            {"mixed_precision": None, "use_orig_params": False},
        )
    # use_orig_params=True: wrapping proceeds, with torch FSDP1's UserWarning (its sentence;
    # fsdp's reason: the frozen parameters get a handle of their own, without a gradient, so
    # the unit gathers two flat parameters).
    with pytest.warns(
        UserWarning,
        match=r"^blocks\.0 has both parameters with requires_grad=True and False\. We do not "
        r"recommend wrapping such modules: .* all-gathers two flat parameters .*If possible, wrap "
        r"the frozen parameters with FSDP separately\.\n",
    ) as caught:
        got, _ = run_ours(model, ModuleWrapPolicy({Block}), {"use_orig_params": True})
    assert len(caught) == 1
    assert [n for n, _ in got] == ["blocks.0", "blocks.1"]
    # Wrapping the frozen Linear separately makes every unit uniform.
    model = Model()
    model.blocks[0].ff[0].requires_grad_(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got, _ = run_ours(model, ModuleWrapPolicy({Block, nn.Linear}), {"use_orig_params": False})
    assert "blocks.0.ff.0" in dict(got)


# ---------------------------------------------------------------------------------------------
# Validation errors
# ---------------------------------------------------------------------------------------------


def test_already_wrapped_submodule_raises_naming_it() -> None:
    recorder, _ = make_recorder()
    # The planner recognises FSDP instances by the wrapper class's marker (fsdp.runtime._state.
    # is_fsdp), so a recorder carrying it stands for an FSDP unit wrapped by hand.
    fsdp_like = type("Recorder", (recorder,), {"_is_fsdp_wrapper": True})
    model = Model()
    model.blocks[1] = fsdp_like(model.blocks[1])
    before = repr(model)
    with pytest.raises(
        ValueError,
        match=r"fsdp: FSDP auto wrapping requires modules to not already have FSDP applied but found "
        r"blocks\.1 in \w+ \(the module passed to FullyShardedDataParallel\): it is already a "
        r"FullyShardedDataParallel instance\. Either wrap that subtree manually or use "
        r"auto_wrap_policy, not both on the same subtree\.",
    ):
        plan_and_wrap(model, always_wrap_policy, recorder, {})
    assert repr(model) == before
    with pytest.raises(ValueError, match=r"found <root> in \w+ \(the module passed to FullyShardedDataParallel\): it is already a FullyShardedDataParallel"):
        plan_and_wrap(fsdp_like(nn.Linear(1, 1)), always_wrap_policy, recorder, {})
    # Another wrapper class (not FSDP) is not "already wrapped".
    model = Model()
    model.blocks[1] = recorder(model.blocks[1])
    other, log = make_recorder()
    plan_and_wrap(model, ModuleWrapPolicy({nn.Embedding}), other, {})
    assert [type(w.module) for w in log] == [nn.Embedding]  # type: ignore[attr-defined]


@pytest.mark.parametrize("bad", [{Block}, [Block], "Block", 3, None])
def test_non_callable_policy_raises_type_error(bad: Any) -> None:
    msg = (
        r"auto_wrap_policy must be a ModuleWrapPolicy/CustomPolicy or a callable "
        r"policy\(module, recurse, nonwrapped_numel\) -> bool, but got an object of type "
        + type(bad).__name__
        + r"\. Pass e\.g\. ModuleWrapPolicy\(\{MyBlock\}\) or "
        r"functools\.partial\(transformer_auto_wrap_policy, transformer_layer_cls=\{MyBlock\}\)\."
    )
    with pytest.raises(TypeError, match=msg):
        _validate_auto_wrap_policy(bad)
    if bad is None:  # the constructor's auto_wrap_policy=None: no nested units
        recorder, log = make_recorder()
        plan_and_wrap(Model(), bad, recorder, {})
        assert log == []
        return
    with pytest.raises(TypeError, match=msg):
        plan_and_wrap(Model(), bad, make_recorder()[0], {})


@pytest.mark.parametrize(
    "bad, name, arg",
    [
        (transformer_auto_wrap_policy, "transformer_auto_wrap_policy", "transformer_layer_cls"),
        (
            functools.partial(transformer_auto_wrap_policy),
            "transformer_auto_wrap_policy",
            "transformer_layer_cls",
        ),
        (lambda_auto_wrap_policy, "lambda_auto_wrap_policy", "lambda_fn"),
        (
            torch_wrap.transformer_auto_wrap_policy,
            "transformer_auto_wrap_policy",
            "transformer_layer_cls",
        ),
        (torch_wrap.lambda_auto_wrap_policy, "lambda_auto_wrap_policy", "lambda_fn"),
    ],
)
def test_unbound_transformer_or_lambda_policy_raises(bad: Any, name: str, arg: str) -> None:
    model = Model()
    before = repr(model)
    with pytest.raises(
        TypeError,
        match=rf"{name} needs its '{arg}' argument bound before it can be used as auto_wrap_policy: "
        rf"bind it with functools\.partial, e\.g\. functools\.partial\({name}, {arg}=\.\.\.\)",
    ):
        plan_and_wrap(model, bad, make_recorder()[0], {})
    assert repr(model) == before


def test_class_and_bad_signature_policies_raise() -> None:
    with pytest.raises(
        TypeError, match=r"got the class Block itself; did you mean ModuleWrapPolicy\(\{Block\}\)\?"
    ):
        _validate_auto_wrap_policy(Block)
    with pytest.raises(
        TypeError,
        match=r"got the class ModuleWrapPolicy itself; did you mean an instance of the policy\?",
    ):
        _validate_auto_wrap_policy(ModuleWrapPolicy)
    with pytest.raises(
        TypeError,
        match=r"is called as policy\(module=\.\.\., recurse=\.\.\., nonwrapped_numel=\.\.\.\), but .* cannot accept those arguments",
    ):
        _validate_auto_wrap_policy(lambda m: True)
    with pytest.raises(TypeError, match=r"cannot accept those arguments"):
        _validate_auto_wrap_policy(functools.partial(size_based_auto_wrap_policy, nn.Linear(1, 1)))


@pytest.mark.parametrize(
    "good",
    [
        always_wrap_policy,
        functools.partial(lambda_auto_wrap_policy, lambda_fn=bool),
        functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
        size_based_auto_wrap_policy,
        functools.partial(size_based_auto_wrap_policy, min_num_params=10),
        ModuleWrapPolicy({Block}),
        CustomPolicy(lambda m: False),
        torch_wrap.ModuleWrapPolicy(
            {Block}
        ),  # torch's policy objects are callable functional policies
        lambda module, recurse, nonwrapped_numel: recurse,
    ],
)
def test_valid_policies_pass_validation(good: Any) -> None:
    assert _validate_auto_wrap_policy(good) is None


def test_class_collection_arguments_are_validated() -> None:
    with pytest.raises(
        TypeError,
        match=r"module_classes must be a collection of module classes, but got the single class Block; pass \{Block\} instead\.",
    ):
        ModuleWrapPolicy(Block)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError,
        match=r"module_classes must contain only classes, but it contains 'Block' \(of type str\)\.",
    ):
        ModuleWrapPolicy({"Block"})  # type: ignore[arg-type]
    with pytest.raises(
        TypeError,
        match=r"module_classes must be a collection of module classes such as \{MyBlock\}, but got an object of type int\.",
    ):
        ModuleWrapPolicy(3)  # type: ignore[arg-type]
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=Block)
    model = Model()
    with pytest.raises(
        TypeError,
        match=r"transformer_layer_cls must be a collection of module classes, but got the single class Block",
    ):
        plan_and_wrap(model, policy, make_recorder()[0], {})
    assert transformer_auto_wrap_policy(Block(), False, 0, {Block}) is True
    assert transformer_auto_wrap_policy(nn.Linear(1, 1), False, 0, [Block]) is False
    assert transformer_auto_wrap_policy(nn.Linear(1, 1), True, 0, {Block}) is True
    assert lambda_auto_wrap_policy(nn.Linear(1, 1), True, 0, lambda m: False) is True
    assert lambda_auto_wrap_policy(nn.Linear(1, 1), False, 0, lambda m: False) is False


def test_policy_run_policy_returning_non_dict_raises() -> None:
    class Bad(_Policy):
        def _run_policy(self, root_module, ignored_modules, root_kwargs):  # type: ignore[no-untyped-def]
            return [root_module]

    with pytest.raises(
        TypeError,
        match=r"Bad\._run_policy must return a dict mapping modules to kwargs dicts, but returned an object of type list\.",
    ):
        plan_and_wrap(Model(), Bad(), make_recorder()[0], {})


# ---------------------------------------------------------------------------------------------
# enable_wrap / wrap
# ---------------------------------------------------------------------------------------------


def test_wrap_outside_context_returns_module_unchanged() -> None:
    lin = nn.Linear(2, 2)
    assert wrap(lin) is lin
    assert wrap(lin, anything=1) is lin


def test_enable_wrap_and_wrap_with_overrides_match_torch() -> None:
    ours_rec, ours_log = make_recorder()
    ref_rec, ref_log = make_recorder()
    lin = nn.Linear(2, 2)
    with enable_wrap(wrapper_cls=ours_rec, a=1, b=2):
        w1 = wrap(lin)
        w2 = wrap(nn.Linear(2, 2), b=3, c=4)
    with torch_wrap.enable_wrap(wrapper_cls=ref_rec, a=1, b=2):
        torch_wrap.wrap(nn.Linear(2, 2))
        torch_wrap.wrap(nn.Linear(2, 2), b=3, c=4)
    assert isinstance(w1, ours_rec) and w1.module is lin  # type: ignore[attr-defined]
    assert [w.kwargs for w in ours_log] == [w.kwargs for w in ref_log] == [{"a": 1, "b": 2}, {"a": 1, "b": 3, "c": 4}]  # type: ignore[attr-defined]
    assert w2 is ours_log[1]
    # After the context: unchanged again.
    assert wrap(lin) is lin


def test_enable_wrap_nested_raises_like_torch_and_state_resets() -> None:
    rec, log = make_recorder()
    with enable_wrap(wrapper_cls=rec, a=1):
        with pytest.raises(NotImplementedError, match=r"enable_wrap\(\) contexts cannot be nested"):
            with enable_wrap(wrapper_cls=rec, a=2):
                pass  # pragma: no cover
        # The outer context is still active and unchanged.
        assert wrap(nn.Linear(1, 1)).kwargs == {"a": 1}  # type: ignore[union-attr]
    with torch_wrap.enable_wrap(wrapper_cls=rec):
        with pytest.raises(NotImplementedError):
            with torch_wrap.enable_wrap(wrapper_cls=rec):
                pass  # pragma: no cover
    lin = nn.Linear(1, 1)
    assert wrap(lin) is lin
    # An exception inside the body also resets the state.
    with pytest.raises(RuntimeError, match="boom"):
        with enable_wrap(wrapper_cls=rec):
            raise RuntimeError("boom")
    assert wrap(lin) is lin
    with enable_wrap(wrapper_cls=rec, z=9):  # usable again afterwards
        assert wrap(lin).kwargs == {"z": 9}  # type: ignore[union-attr]


def test_enable_wrap_rejects_non_callable_wrapper_cls() -> None:
    with pytest.raises(
        TypeError,
        match=r"enable_wrap\(\) needs a callable wrapper_cls such as FullyShardedDataParallel, but got an object of type NoneType\.",
    ):
        with enable_wrap(wrapper_cls=None):
            pass  # pragma: no cover
    lin = nn.Linear(1, 1)
    assert wrap(lin) is lin


def test_public_api_and_signatures_match_torch() -> None:
    import inspect

    assert ours.__all__ == torch_wrap.__all__
    for name in ours.__all__:
        ours_obj, ref_obj = getattr(ours, name), getattr(torch_wrap, name)
        ours_params = [
            (p.name, p.kind, p.default) for p in inspect.signature(ours_obj).parameters.values()
        ]
        ref_params = [
            (p.name, p.kind, p.default) for p in inspect.signature(ref_obj).parameters.values()
        ]
        assert ours_params == ref_params, name
        assert inspect.getdoc(ours_obj), name
    assert issubclass(ModuleWrapPolicy, _Policy) and issubclass(CustomPolicy, _Policy)
