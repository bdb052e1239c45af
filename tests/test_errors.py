"""Every user mistake gets a clear error naming the culprit and the remedy, before any change.

Each case pins the message with ``pytest.raises(..., match=...)`` and then checks that the model
is exactly as it was: same module objects and types, same parameter objects, data, dtypes and
``requires_grad``, same attributes, no FSDP wrapper added anywhere. Cases that need a process
group run in the shared 2-rank gloo pool (``pool2``); the error is raised (and caught) on every
rank alike, before any collective, and each rank function ends with an ``all_reduce`` that proves
the group is still in step for the next test.

Two checks (tied weights in two hand-wrapped units, root-only methods on a nested unit before
the root's first forward) return what went wrong instead of failing inside the ranks, so a
regression is reported without costing a pool restart.
"""

from __future__ import annotations

import functools
import gc
import re
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch import nn

from fsdp import (
    BackwardPrefetch,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    OptimStateKeyType,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictType,
)
from fsdp import FullyShardedDataParallel as FSDP
from fsdp._common import FSDPStateAssertionError
from fsdp.wrap import ModuleWrapPolicy, lambda_auto_wrap_policy, transformer_auto_wrap_policy
from tests._harness import RankPool

D = 4

# ---------------------------------------------------------------------------------------------
# Models and helpers (module level: the ranks import them)
# ---------------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, D)
        self.fc2 = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class Deep(nn.Module):
    """stem -> blocks.0 -> blocks.1.0 -> blocks.1.1 -> head; the Blocks are the natural units."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(D, D)
        self.blocks = nn.ModuleList([Block(), nn.Sequential(Block(), Block())])
        self.head = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Tied(nn.Module):
    """An embedding and an output head that share one weight."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, D)
        self.body = nn.Linear(D, D)
        self.head = nn.Linear(D, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(tokens)))


class NoReset(nn.Module):
    """A module with a parameter but no ``reset_parameters()``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(D))


class SummonsInForward(nn.Module):
    """Calls ``FSDP.summon_full_params`` on the root (kept in ``holder``) inside its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.holder: list[nn.Module] = []  # a plain list: the root is not registered as a child
        self.trigger = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.trigger:
            with FSDP.summon_full_params(self.holder[0]):
                pass
        return self.lin(x)


class OuterWithSummoner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(D, D)
        self.inner = SummonsInForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.pre(x))


def snapshot(model: nn.Module) -> dict[str, Any]:
    """Everything a failed constructor or call must leave untouched."""
    return {
        "modules": [
            (name, m, type(m), sorted(m.__dict__), sorted(m._parameters), sorted(m._buffers))
            for name, m in model.named_modules(remove_duplicate=False)
        ],
        "params": [
            (name, p, None if p.is_meta else p.detach().clone(), p.dtype, p.requires_grad, p.device)
            for name, p in model.named_parameters(remove_duplicate=False)
        ],
        "hooks": [
            (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks))
            for m in model.modules()
        ],
    }


def assert_unchanged(model: nn.Module, before: dict[str, Any], allowed_fsdp: int = 0) -> None:
    after = snapshot(model)
    assert [(n, id(m), t) for n, m, t, *_ in after["modules"]] == [
        (n, id(m), t) for n, m, t, *_ in before["modules"]
    ], "the module tree changed"
    assert [(n, a, p, b) for n, _, _, a, p, b in after["modules"]] == [
        (n, a, p, b) for n, _, _, a, p, b in before["modules"]
    ], "module attributes / parameters / buffers changed"
    assert len(after["params"]) == len(before["params"])
    for (n1, p1, d1, t1, r1, dev1), (n2, p2, d2, t2, r2, dev2) in zip(after["params"], before["params"]):
        assert n1 == n2 and p1 is p2, f"parameter {n2} was replaced"
        assert (t1, r1, dev1) == (t2, r2, dev2), f"parameter {n2} changed dtype/requires_grad/device"
        if d2 is not None:  # (meta tensors have no values)
            assert torch.equal(d1, d2), f"parameter {n2} changed value"
            assert torch.equal(p1.detach(), d2), f"parameter {n2} changed value"
    assert after["hooks"] == before["hooks"], "hooks were added or removed"
    n_fsdp = sum(isinstance(m, FSDP) for m in model.modules())
    assert n_fsdp == allowed_fsdp, f"{n_fsdp} FSDP wrappers in the tree, expected {allowed_fsdp}"


def group_in_step() -> None:
    """A collective every rank must reach: proves no rank is left behind."""
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    ws = dist.get_world_size()
    assert t.item() == ws * (ws + 1) / 2


def expect_raises(exc: type[BaseException], match: str, fn: Callable[[], Any]) -> str:
    with pytest.raises(exc, match=match) as info:
        fn()
    return str(info.value)


def make_deep(bad: str = "") -> Deep:
    """A Deep model; ``bad`` plants a mistake in the deepest Block, ``blocks.1.1``."""
    torch.manual_seed(0)
    model = Deep()
    victim = model.blocks[1][1]
    if bad == "dtype":
        victim.fc2.to(torch.float64)
    elif bad == "requires_grad":
        victim.fc2.requires_grad_(False)
    return model


def wrapped_deep(**kwargs: Any) -> FSDP:
    return FSDP(make_deep(), auto_wrap_policy=ModuleWrapPolicy({Block}), **kwargs)


POLICIES: dict[str, Callable[[], Any]] = {
    "none": lambda: None,
    "module_wrap_policy": lambda: ModuleWrapPolicy({Block}),
    "transformer_policy": lambda: functools.partial(
        transformer_auto_wrap_policy, transformer_layer_cls={Block}
    ),
}

# ---------------------------------------------------------------------------------------------
# No process group (runs in the pytest process itself)
# ---------------------------------------------------------------------------------------------


def test_no_default_process_group() -> None:
    assert not dist.is_initialized(), "the pytest process must not have a process group"
    model = make_deep()
    before = snapshot(model)
    with pytest.raises(
        RuntimeError,
        match=r"fsdp: FullyShardedDataParallel needs an initialized default process group, and "
        r"torch\.distributed is not initialized\. Call "
        r"torch\.distributed\.init_process_group\(backend='gloo'\) \(CPU\) or backend='nccl' \(GPU\)",
    ):
        FSDP(model)
    assert_unchanged(model, before)
    with pytest.raises(RuntimeError, match=r"needs an initialized default process group"):
        FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}))
    assert_unchanged(model, before)


# ---------------------------------------------------------------------------------------------
# Constructor mistakes
# ---------------------------------------------------------------------------------------------


def _mixed_dtype_unit(policy_name: str) -> str:
    model = make_deep("dtype")
    before = snapshot(model)
    policy = POLICIES[policy_name]()
    if policy is None:
        # The whole model is one unit: names are relative to the root.
        match = (
            r"fsdp: the FSDP unit '<root Deep>' has parameters of different dtypes \("
            r"torch\.float32: stem\.weight, stem\.bias, blocks\.0\.fc1\.weight, blocks\.0\.fc1\.bias; "
            r"torch\.float64: blocks\.1\.1\.fc2\.weight, blocks\.1\.1\.fc2\.bias\)\. "
            r"A unit's parameters are flattened into one tensor and must share a dtype: cast "
            r"the module \(e\.g\. module\.to\(torch\.float32\)\) or wrap the differing submodules "
            r"as their own units\."
        )
    else:
        match = (
            r"fsdp: the FSDP unit 'blocks\.1\.1' has parameters of different dtypes \("
            r"torch\.float32: fc1\.weight, fc1\.bias; torch\.float64: fc2\.weight, fc2\.bias\)\. "
            r"A unit's parameters are flattened into one tensor and must share a dtype"
        )
    msg = expect_raises(ValueError, match, lambda: FSDP(model, auto_wrap_policy=policy))
    assert_unchanged(model, before)  # in particular blocks.0 and blocks.1.0 were not wrapped
    group_in_step()
    return msg


@pytest.mark.parametrize("policy_name", list(POLICIES))
def test_unit_with_mixed_dtypes(pool2: RankPool, policy_name: str) -> None:
    msgs = pool2.run(_mixed_dtype_unit, policy_name)
    assert msgs[0] == msgs[1]


def _mixed_requires_grad_unit(policy_name: str) -> None:
    model = make_deep("requires_grad")
    before = snapshot(model)
    policy = POLICIES[policy_name]()
    if policy is None:
        match = (
            r"fsdp: <root Deep> has both parameters with requires_grad=True and False\. FSDP does "
            r"not support wrapping such modules when use_orig_params=False\. Must flatten tensors "
            r"with uniform `requires_grad` when `use_orig_params=False`\. If possible, wrap "
            r"the frozen parameters with FSDP separately \(or pass use_orig_params=True, or "
            r"freeze/unfreeze the whole unit\)\.\n"
            r"The following parameters have requires_grad=True:\n\['stem\.weight', 'stem\.bias', "
            r"'blocks\.0\.fc1\.weight', 'blocks\.0\.fc1\.bias', .*\]\n"
            r"The following parameters have requires_grad=False:\n"
            r"\['blocks\.1\.1\.fc2\.weight', 'blocks\.1\.1\.fc2\.bias'\]"
        )
    else:
        match = (
            r"fsdp: blocks\.1\.1 has both parameters with requires_grad=True and False\. FSDP "
            r"does not support wrapping such modules when use_orig_params=False\. .*\n"
            r"The following parameters have requires_grad=True:\n"
            r"\['blocks\.1\.1\.fc1\.weight', 'blocks\.1\.1\.fc1\.bias'\]\n"
            r"The following parameters have requires_grad=False:\n"
            r"\['blocks\.1\.1\.fc2\.weight', 'blocks\.1\.1\.fc2\.bias'\]"
        )
    expect_raises(ValueError, match, lambda: FSDP(model, auto_wrap_policy=policy))
    assert_unchanged(model, before)
    group_in_step()


@pytest.mark.parametrize("policy_name", list(POLICIES))
def test_unit_mixing_requires_grad(pool2: RankPool, policy_name: str) -> None:
    pool2.run(_mixed_requires_grad_unit, policy_name)


def _already_wrapped() -> None:
    # Wrapping an FSDP instance again.
    inner = FSDP(nn.Linear(D, D))
    before = snapshot(inner)
    expect_raises(
        ValueError,
        r"fsdp: the module passed to FullyShardedDataParallel is already wrapped with "
        r"FullyShardedDataParallel \(it wraps a Linear\)\. Wrap each module once: pass the "
        r"inner module, or use the existing wrapper as it is\.",
        lambda: FSDP(inner),
    )
    assert_unchanged(inner, before, allowed_fsdp=1)
    expect_raises(
        ValueError,
        r"already wrapped",
        lambda: FSDP(inner, auto_wrap_policy=ModuleWrapPolicy({nn.Linear})),
    )
    assert_unchanged(inner, before, allowed_fsdp=1)

    # Auto-wrapping a tree that already holds an FSDP instance.
    for policy_name in ("module_wrap_policy", "transformer_policy"):
        model = make_deep()
        model.blocks[0] = FSDP(model.blocks[0])
        before = snapshot(model)
        expect_raises(
            ValueError,
            r"fsdp: FSDP auto wrapping requires modules to not already have FSDP applied but "
            r"found blocks\.0 in Deep \(the module passed to FullyShardedDataParallel\): it is "
            r"already a FullyShardedDataParallel instance\. Either wrap that subtree manually or "
            r"use auto_wrap_policy, not both on the same subtree\.",
            lambda: FSDP(model, auto_wrap_policy=POLICIES[policy_name]()),
        )
        assert_unchanged(model, before, allowed_fsdp=1)
    group_in_step()


def test_wrapping_a_module_that_is_already_fsdp(pool2: RankPool) -> None:
    pool2.run(_already_wrapped)


BAD_POLICIES: dict[str, tuple[Callable[[], Any], str]] = {
    "set_of_classes": (
        lambda: {Block},
        r"auto_wrap_policy must be a ModuleWrapPolicy/CustomPolicy or a callable "
        r"policy\(module, recurse, nonwrapped_numel\) -> bool, but got an object of type set\. "
        r"Pass e\.g\. ModuleWrapPolicy\(\{MyBlock\}\) or "
        r"functools\.partial\(transformer_auto_wrap_policy, transformer_layer_cls=\{MyBlock\}\)\.",
    ),
    "int": (
        lambda: 100,
        r"auto_wrap_policy must be a ModuleWrapPolicy/CustomPolicy or a callable .* but got an "
        r"object of type int\.",
    ),
    "bare_transformer_policy": (
        lambda: transformer_auto_wrap_policy,
        r"transformer_auto_wrap_policy needs its 'transformer_layer_cls' argument bound before "
        r"it can be used as auto_wrap_policy: bind it with functools\.partial, e\.g\. "
        r"functools\.partial\(transformer_auto_wrap_policy, transformer_layer_cls=\.\.\.\) "
        r"\(or use ModuleWrapPolicy\(\{MyBlock\}\)\)\.",
    ),
    "bare_lambda_policy": (
        lambda: lambda_auto_wrap_policy,
        r"lambda_auto_wrap_policy needs its 'lambda_fn' argument bound",
    ),
    "module_class": (
        lambda: Block,
        r"auto_wrap_policy must be a policy, but got the class Block itself; did you mean "
        r"ModuleWrapPolicy\(\{Block\}\)\?",
    ),
}


def _bad_policy(name: str) -> None:
    factory, match = BAD_POLICIES[name]
    model = make_deep()
    before = snapshot(model)
    expect_raises(TypeError, match, lambda: FSDP(model, auto_wrap_policy=factory()))
    assert_unchanged(model, before)
    group_in_step()


@pytest.mark.parametrize("name", list(BAD_POLICIES))
def test_auto_wrap_policy_of_the_wrong_type(pool2: RankPool, name: str) -> None:
    pool2.run(_bad_policy, name)


def _tied_across_units() -> None:
    # With auto_wrap_policy fsdp places a tied parameter in the lowest common ancestor unit; a
    # unit wrapped by hand has already flattened it, so the root cannot take it any more.
    remedy = (
        r" \(tied weights across units\)\. A unit wrapped by hand has already flattened it, so it "
        r"cannot move to a common ancestor unit\. Wrap with auto_wrap_policy instead \(fsdp then "
        r"places tied parameters in the lowest common ancestor unit\), or do not wrap either "
        r"module separately\."
    )
    # Embedding wrapped by hand, output head in the root.
    model = Tied()
    model.embed = FSDP(model.embed)
    before = snapshot(model)
    expect_raises(
        ValueError,
        r"fsdp: parameter 'head\.weight' of FSDP unit '<root Tied>' is the same Parameter as "
        r"'weight' of FSDP unit 'embed'" + remedy,
        lambda: FSDP(model),
    )
    assert_unchanged(model, before, allowed_fsdp=1)

    # Output head wrapped by hand, embedding in the root.
    model = Tied()
    model.head = FSDP(model.head)
    before = snapshot(model)
    msg = expect_raises(ValueError, r"\(tied weights across units\)", lambda: FSDP(model))
    assert re.search(r"'embed\.weight' of FSDP unit '<root Tied>'", msg), msg
    assert re.search(r"'weight' of FSDP unit 'head'", msg), msg
    assert_unchanged(model, before, allowed_fsdp=1)
    group_in_step()


def test_tied_weights_across_two_units(pool2: RankPool) -> None:
    pool2.run(_tied_across_units)


def _tied_two_hand_wrapped_units() -> list[str]:
    """Embedding and head wrapped by hand one after the other, then the root.

    Returns what went wrong (empty when a clear error is raised at one of the wraps).
    """
    model = Tied()
    model.embed = FSDP(model.embed)
    tie = r"\(tied weights across units\)"
    try:
        model.head = FSDP(model.head)  # ideally raises: the weight already lives in 'embed'
    except ValueError as exc:
        # The other unit was wrapped by hand and not yet named by a root: its class names it.
        assert re.search(tie, str(exc)) and "FSDP unit 'Embedding'" in str(exc), str(exc)
        group_in_step()
        return []
    # Nothing but the two FlatParameters refers to the original weight any more; once it is
    # garbage-collected the root cannot see the tie either (collect now, deterministically).
    gc.collect()
    try:
        root = FSDP(model)
    except ValueError as exc:
        assert re.search(tie, str(exc)) and "'embed'" in str(exc) and "'head'" in str(exc), str(exc)
        group_in_step()
        return []
    optim = torch.optim.SGD(root.parameters(), lr=1.0)
    tokens = torch.tensor([[1, 2, 3]])
    root(tokens).sum().backward()
    optim.step()
    with FSDP.summon_full_params(root):
        diff = (root.module.embed.module.weight - root.module.head.module.weight).abs().max()
    group_in_step()
    if diff.item() == 0:
        return []
    return [
        "FSDP(model.head) after FSDP(model.embed) (tied weight) raised nothing, nor did "
        "FSDP(model); each unit flattened its own copy and after one step embed.weight and "
        f"head.weight differ by {diff.item():.3g}"
    ]


def test_tied_weights_in_two_units_wrapped_by_hand(pool2: RankPool) -> None:
    assert pool2.run(_tied_two_hand_wrapped_units) == [[], []]


BAD_MIXED_PRECISION: dict[str, tuple[Any, type, str]] = {
    "not_a_config": (
        "bf16",
        TypeError,
        r"fsdp: mixed_precision must be a fsdp\.MixedPrecision \(or None\), got str without "
        r"\['param_dtype', 'reduce_dtype', 'buffer_dtype', 'keep_low_precision_grads', "
        r"'_module_classes_to_ignore'\]\.",
    ),
    "integer_param_dtype": (
        MixedPrecision(param_dtype=torch.int64),
        ValueError,
        r"fsdp: MixedPrecision\.param_dtype must be a floating-point torch\.dtype or None, got "
        r"torch\.int64\.",
    ),
    "string_reduce_dtype": (
        MixedPrecision(reduce_dtype="bf16"),  # type: ignore[arg-type]
        ValueError,
        r"fsdp: MixedPrecision\.reduce_dtype must be a floating-point torch\.dtype or None, got "
        r"'bf16'\.",
    ),
}


def _bad_mixed_precision(case: str) -> None:
    model = make_deep()
    value, error, message = BAD_MIXED_PRECISION[case]
    before = snapshot(model)
    expect_raises(
        error, message, lambda: FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), mixed_precision=value)
    )
    assert_unchanged(model, before)
    expect_raises(error, message, lambda: FSDP(model, mixed_precision=value))
    assert_unchanged(model, before)
    group_in_step()


@pytest.mark.parametrize("case", list(BAD_MIXED_PRECISION))
def test_bad_mixed_precision(pool2: RankPool, case: str) -> None:
    pool2.run(_bad_mixed_precision, case)


def _wrong_argument_types() -> None:
    model = make_deep()
    before = snapshot(model)
    cases: list[tuple[dict[str, Any], str]] = [
        (
            dict(sharding_strategy="FULL_SHARD"),
            r"sharding_strategy must be a ShardingStrategy or None, got 'FULL_SHARD'",
        ),
        (
            # torch's enum is not fsdp's
            dict(sharding_strategy=torch_fsdp.ShardingStrategy.FULL_SHARD),
            r"sharding_strategy must be a ShardingStrategy or None",
        ),
        (dict(cpu_offload=True), r"cpu_offload must be a CPUOffload or None, got True"),
        (
            dict(backward_prefetch="pre"),
            r"backward_prefetch must be a BackwardPrefetch or None, got 'pre'",
        ),
        (
            dict(process_group="world"),
            r"fsdp: process_group must be a torch\.distributed\.ProcessGroup \(or an object with its "
            r"rank\(\) and size\(\) methods\), got str; create one with torch\.distributed\.new_group",
        ),
        # TypeError, as torch FSDP1 (strings such as "cpu" are device ids there and here).
        (dict(device_id=1.5), r"device_id must be an int \(CUDA index\), a str or a torch\.device, got float 1\.5"),
    ]
    policy = ModuleWrapPolicy({Block})
    for kwargs, match in cases:
        expect_raises(TypeError, match, lambda: FSDP(model, auto_wrap_policy=policy, **kwargs))
        assert_unchanged(model, before)
    not_a_module: Any = "model"
    expect_raises(TypeError, r"module must be an nn\.Module, got str", lambda: FSDP(not_a_module))
    # BackwardPrefetch.BACKWARD_POST / None and ShardingStrategy.NO_SHARD are accepted.
    FSDP(make_deep(), backward_prefetch=None, sharding_strategy=ShardingStrategy.NO_SHARD)
    FSDP(make_deep(), backward_prefetch=BackwardPrefetch.BACKWARD_POST)
    group_in_step()


def test_arguments_of_the_wrong_type(pool2: RankPool) -> None:
    pool2.run(_wrong_argument_types)


def _ignored_kwargs(case: str, model: Deep) -> dict[str, Any]:
    if case == "both_arguments":
        return {"ignored_modules": [model.head], "ignored_states": [model.stem]}
    if case == "mixed_kinds":
        return {"ignored_states": [model.head, model.stem.weight]}
    if case == "not_a_module":
        return {"ignored_modules": ["head"]}
    if case == "fsdp_module":
        model.blocks[0] = FSDP(model.blocks[0])
        return {"ignored_modules": [model.blocks[0]]}
    raise AssertionError(case)


IGNORED_MISTAKES: dict[str, tuple[type[BaseException], str]] = {
    "both_arguments": (
        ValueError,
        r"fsdp: Cannot pass both ignored_modules and ignored_states at the same time\. Please "
        r"just pass ignored_states \(it accepts modules too\)\.",
    ),
    "mixed_kinds": (
        ValueError,
        r"fsdp: ignored_states expects all nn\.Parameter or all nn\.Module list elements but got "
        r"types \[<class 'torch\.nn\.modules\.linear\.Linear'>, "
        r"<class 'torch\.nn\.parameter\.Parameter'>\]\. Pass only parameters or only modules\.",
    ),
    # ValueError, as torch FSDP1 (tests/test_contract_errors.py runs the mistake through both).
    "not_a_module": (
        ValueError,
        r"fsdp: ignored_modules expects nn\.Module list elements but got types \[<class 'str'>\]\. "
        r"Pass the modules \(e\.g\. \[model\.frozen_encoder\]\); use ignored_states for parameters\.",
    ),
    "fsdp_module": (
        ValueError,
        r"fsdp: `ignored_modules` should not include FSDP modules, but 'blocks\.0' is a "
        r"FullyShardedDataParallel instance\. Ignore the module it wraps \('\.module'\) before "
        r"wrapping it, or do not ignore it\.",
    ),
    # An ignored module that *contains* an FSDP unit is accepted, as in torch FSDP1
    # (tests/test_contract_construction.py).
}


def _ignored_mistake(case: str) -> None:
    exc, match = IGNORED_MISTAKES[case]
    model = make_deep()
    kwargs = _ignored_kwargs(case, model)
    n_fsdp = sum(isinstance(m, FSDP) for m in model.modules())
    before = snapshot(model)
    expect_raises(exc, match, lambda: FSDP(model, **kwargs))
    assert_unchanged(model, before, allowed_fsdp=n_fsdp)
    if n_fsdp == 0:  # (a policy cannot run over an existing wrapper)
        policy = ModuleWrapPolicy({Block})
        expect_raises(exc, match, lambda: FSDP(model, auto_wrap_policy=policy, **kwargs))
        assert_unchanged(model, before)
    group_in_step()


@pytest.mark.parametrize("case", list(IGNORED_MISTAKES))
def test_ignored_modules_and_states_mistakes(pool2: RankPool, case: str) -> None:
    pool2.run(_ignored_mistake, case)


def _meta_device_mistakes() -> None:
    with torch.device("meta"):
        model = make_deep()
        model.blocks[1][1].extra = NoReset()
    before = snapshot(model)
    for policy in (None, ModuleWrapPolicy({Block})):
        expect_raises(
            ValueError,
            r"fsdp: module 'blocks\.1\.1\.extra' \(NoReset\) has parameters or buffers on the "
            r"meta device but no reset_parameters\(\) to initialize them; pass param_init_fn=\.\.\. "
            r"to FullyShardedDataParallel, or build the module on a real device\.",
            lambda: FSDP(model, auto_wrap_policy=policy),
        )
        assert_unchanged(model, before)
        expect_raises(  # ValueError, as torch FSDP1
            ValueError,
            r"fsdp: Expected init to be callable but got <class 'str'>: param_init_fn must be a "
            r"callable taking a module \(e\.g\. lambda m: m\.to_empty\(device='cpu', "
            r"recurse=False\)\)\.",
            lambda: FSDP(model, auto_wrap_policy=policy, param_init_fn="init"),
        )
        assert_unchanged(model, before)
    group_in_step()


def test_meta_device_mistakes(pool2: RankPool) -> None:
    pool2.run(_meta_device_mistakes)


def _layout_kwargs(case: str) -> dict[str, Any]:
    world = dist.group.WORLD
    hybrid = ShardingStrategy.HYBRID_SHARD
    if case == "hybrid_without_layout":
        return {"sharding_strategy": hybrid}
    if case == "hybrid_zero2_without_layout":
        return {"sharding_strategy": ShardingStrategy._HYBRID_SHARD_ZERO2}
    if case == "local_world_size_not_dividing":
        return {"sharding_strategy": hybrid}
    if case == "hybrid_with_single_group":
        return {"sharding_strategy": hybrid, "process_group": world}
    if case == "tuple_without_hybrid":
        return {"process_group": (world, world)}
    if case == "tuple_of_three":
        return {"sharding_strategy": hybrid, "process_group": (world, world, world)}
    if case == "tuple_of_non_groups":
        return {"sharding_strategy": hybrid, "process_group": ("intra", "inter")}
    if case == "tuple_sizes_do_not_cover_world":
        return {"sharding_strategy": hybrid, "process_group": (world, world)}
    if case == "group_and_mesh":
        from torch.distributed.device_mesh import init_device_mesh

        return {"process_group": world, "device_mesh": init_device_mesh("cpu", (2,))}
    if case == "mesh_of_wrong_type":
        return {"device_mesh": [[0, 1]]}
    if case == "2d_mesh_without_hybrid":
        from torch.distributed.device_mesh import init_device_mesh

        return {"device_mesh": init_device_mesh("cpu", (1, 2))}
    if case == "1d_mesh_with_hybrid":
        from torch.distributed.device_mesh import init_device_mesh

        return {"sharding_strategy": hybrid, "device_mesh": init_device_mesh("cpu", (2,))}
    raise AssertionError(case)


LAYOUT_MISTAKES: dict[str, tuple[type[BaseException], str]] = {
    "hybrid_without_layout": (
        ValueError,
        r"fsdp: Wrapping with ShardingStrategy\.HYBRID_SHARD requires explicit specification of "
        r"process group or device_mesh\. Without them fsdp derives the node size from "
        r"LOCAL_WORLD_SIZE, which is not set \(torchrun sets it\)\. Pass "
        r"device_mesh=init_device_mesh\(device_type, \(num_nodes, ranks_per_node\)\) or "
        r"process_group=\(intra_node_group, inter_node_group\)\.",
    ),
    "hybrid_zero2_without_layout": (
        ValueError,
        r"fsdp: Wrapping with ShardingStrategy\._HYBRID_SHARD_ZERO2 requires explicit "
        r"specification of process group or device_mesh\. Without them fsdp derives the node "
        r"size from LOCAL_WORLD_SIZE, which is not set",
    ),
    "local_world_size_not_dividing": (
        ValueError,
        r"fsdp: LOCAL_WORLD_SIZE=3 does not divide the world size 2; pass an explicit "
        r"device_mesh or \(intra, inter\) process_group\.",
    ),
    "hybrid_with_single_group": (
        ValueError,
        r"fsdp: Expected process_group to be passed in as either None or "
        r"Tuple\[dist\.ProcessGroup, dist\.ProcessGroup\] but got <class '.*ProcessGroup'>: "
        r"HYBRID_SHARD needs two groups: pass process_group=\(intra_node_group, "
        r"inter_node_group\) or a 2-D device_mesh, not a single ProcessGroup\.",
    ),
    "tuple_without_hybrid": (
        ValueError,
        r"fsdp: process_group as an \(intra, inter\) tuple needs sharding_strategy=HYBRID_SHARD or "
        r"_HYBRID_SHARD_ZERO2, got ShardingStrategy\.FULL_SHARD\. Pass one ProcessGroup for "
        r"FULL_SHARD\.",
    ),
    "tuple_of_three": (
        ValueError,
        r"fsdp: process_group tuple must be \(intra_node_group, inter_node_group\), got 3 elements",
    ),
    "tuple_of_non_groups": (
        TypeError,
        r"fsdp: process_group\[0\] \(the intra-node group\) must be a "
        r"torch\.distributed\.ProcessGroup \(or an object with its rank\(\) and size\(\) methods\), got str",
    ),
    "tuple_sizes_do_not_cover_world": (
        ValueError,
        r"fsdp: process_group: the intra-node group has 2 ranks and the inter-node group 2, but "
        r"2 x 2 != world size 2\. Every rank must be in one shard group and one replicate group "
        r"that cover the world\.",
    ),
    "group_and_mesh": (
        ValueError,
        r"fsdp: Cannot pass both process_group and device_mesh at the same time\. Please just "
        r"pass only one of them\.",
    ),
    "mesh_of_wrong_type": (TypeError, r"fsdp: device_mesh must be a DeviceMesh, got list"),
    "2d_mesh_without_hybrid": (
        ValueError,
        r"fsdp: FULL_SHARD needs a 1-D device_mesh, got a 2-D mesh of shape \(1, 2\); use "
        r"HYBRID_SHARD for 2-D meshes\.",
    ),
    "1d_mesh_with_hybrid": (
        ValueError,
        r"fsdp: HYBRID_SHARD needs a 2-D device_mesh \(dim 0 replicates, dim 1 shards\), got a "
        r"1-D mesh of shape \(2,\)\.",
    ),
}


def _layout_mistake(case: str) -> None:
    import os

    exc, match = LAYOUT_MISTAKES[case]
    saved = os.environ.pop("LOCAL_WORLD_SIZE", None)
    if case == "local_world_size_not_dividing":
        os.environ["LOCAL_WORLD_SIZE"] = "3"
    try:
        model = make_deep()
        kwargs = _layout_kwargs(case)
        before = snapshot(model)
        policy = ModuleWrapPolicy({Block})
        expect_raises(exc, match, lambda: FSDP(model, auto_wrap_policy=policy, **kwargs))
        assert_unchanged(model, before)
        expect_raises(exc, match, lambda: FSDP(model, **kwargs))
        assert_unchanged(model, before)
    finally:
        os.environ.pop("LOCAL_WORLD_SIZE", None)
        if saved is not None:
            os.environ["LOCAL_WORLD_SIZE"] = saved
    group_in_step()


@pytest.mark.parametrize("case", list(LAYOUT_MISTAKES))
def test_process_group_and_hybrid_layout_mistakes(pool2: RankPool, case: str) -> None:
    pool2.run(_layout_mistake, case)


# ---------------------------------------------------------------------------------------------
# Runtime mistakes
# ---------------------------------------------------------------------------------------------


def _train_step(root: FSDP) -> None:
    torch.manual_seed(dist.get_rank())
    root(torch.randn(3, D)).sum().backward()


def _root_only_methods(before_forward: bool) -> list[str]:
    """Returns what went wrong with the nested-unit calls (empty when both raised as expected)."""
    root = wrapped_deep()
    inner = root.module.blocks[0]
    assert isinstance(inner, FSDP)
    if not before_forward:
        _train_step(root)
    unit = r"(Block|blocks\.0)" if before_forward else r"blocks\.0"
    grads = [(p, None if p.grad is None else p.grad.clone()) for p in root.parameters()]

    def enter_no_sync() -> None:
        with inner.no_sync():
            pass

    cases = [
        (
            "no_sync()",
            rf"fsdp: `no_sync\(\)` on inner FSDP instances is not supported\. Please call "
            rf"`no_sync\(\)` on root FSDP module\. no_sync\(\) was called on the nested unit "
            rf"'{unit}'\. Call it on the outermost FSDP module\.",
            enter_no_sync,
        ),
        (
            "clip_grad_norm_()",
            rf"fsdp: `clip_grad_norm_\(\)` should only be called on the root FSDP instance: "
            rf"clip_grad_norm_\(\) was called on the nested unit '{unit}'\. Call it on the "
            rf"outermost FSDP module\.",
            lambda: inner.clip_grad_norm_(1.0),
        ),
    ]
    problems = []
    for what, match, call in cases:
        try:
            call()
        except RuntimeError as exc:
            assert re.fullmatch(match, str(exc)), str(exc)
        else:
            problems.append(f"inner.{what} did not raise")
    for p, g in grads:  # gradients untouched by the failed calls
        assert (p.grad is None and g is None) or torch.equal(p.grad, g)
    assert root.check_is_root() and not inner.check_is_root()
    # The root still works normally afterwards (and the ranks are in step).
    with root.no_sync():
        _train_step(root)
    _train_step(root)
    norm = root.clip_grad_norm_(1.0)
    assert torch.isfinite(norm)
    group_in_step()
    return problems


def test_no_sync_and_clip_grad_norm_on_a_nested_unit_after_root_forward(pool2: RankPool) -> None:
    assert pool2.run(_root_only_methods, False) == [[], []]


def test_no_sync_and_clip_grad_norm_on_a_nested_unit_before_root_forward(pool2: RankPool) -> None:
    assert pool2.run(_root_only_methods, True) == [[], []]


def _summon_inside_forward(nested: bool) -> None:
    torch.manual_seed(0)
    if nested:
        model: nn.Module = OuterWithSummoner()
        summoner = model.inner
        root = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({SummonsInForward}))
        busy = r"'<root>' \(FORWARD\), 'inner' \(FORWARD\)"
    else:
        summoner = model = SummonsInForward()
        root = FSDP(model)
        busy = r"'<root>' \(FORWARD\)"
    summoner.holder.append(root)
    x = torch.randn(2, D)
    expect_raises(  # an AssertionError, as torch FSDP1 raises, and a RuntimeError
        FSDPStateAssertionError,
        rf"fsdp: Cannot manually unshard parameters during forward/backward: "
        rf"summon_full_params\(\) cannot be called while FSDP units are in forward, "
        rf"backward or summon_full_params: {busy}\. Call it between training steps, outside the "
        rf"model's forward and backward\.",
        lambda: root(x),
    )
    # The failed forward leaves the model usable.
    summoner.trigger = False
    root(x).sum().backward()
    with FSDP.summon_full_params(root):
        assert summoner.lin.weight.shape == (D, D)
    group_in_step()


@pytest.mark.parametrize("nested", [False, True], ids=["in_root_forward", "in_nested_unit_forward"])
def test_summon_full_params_inside_forward(pool2: RankPool, nested: bool) -> None:
    pool2.run(_summon_inside_forward, nested)


def _summon_inside_backward() -> None:
    root = wrapped_deep()
    out = root(torch.randn(2, D))

    def hook(grad: torch.Tensor) -> torch.Tensor:
        with FSDP.summon_full_params(root):
            pass
        return grad  # pragma: no cover

    out.register_hook(hook)
    expect_raises(  # an AssertionError, as torch FSDP1 raises, and a RuntimeError
        FSDPStateAssertionError,
        r"fsdp: Cannot manually unshard parameters during forward/backward: "
        r"summon_full_params\(\) cannot be called while FSDP units are in forward, "
        r"backward or summon_full_params: '<root>' \(BACKWARD_PRE\)\. Call it between training "
        r"steps, outside the model's forward and backward\.",
        lambda: out.sum().backward(),
    )
    group_in_step()


def test_summon_full_params_inside_backward(pool2: RankPool) -> None:
    pool2.run(_summon_inside_backward)


def _summon_bad_arguments(after_forward: bool) -> None:
    root = wrapped_deep()
    if after_forward:
        _train_step(root)
    before = snapshot(root)

    def summon(**kwargs: Any) -> Callable[[], None]:
        def run() -> None:
            with FSDP.summon_full_params(root, **kwargs):
                raise AssertionError("must not enter")  # pragma: no cover

        return run

    rank0_msg = (
        r"fsdp: writeback=True and rank0_only=True is not supported yet in summon_full_params: only "
        r"rank 0 would hold full parameters, so ranks would write back different data\. Pass "
        r"writeback=False with rank0_only=True, or rank0_only=False to write back\."
    )
    # NotImplementedError, as torch FSDP1 (tests/test_contract_errors.py).
    expect_raises(NotImplementedError, rank0_msg, summon(rank0_only=True))
    expect_raises(NotImplementedError, rank0_msg, summon(rank0_only=True, writeback=True, recurse=False))
    grads_msg = (
        r"fsdp: summon_full_params\(with_grads=True, offload_to_cpu=True\) is not supported; "
        r"pass offload_to_cpu=False to see gradients, or with_grads=False to offload\."
    )
    expect_raises(NotImplementedError, grads_msg, summon(with_grads=True, offload_to_cpu=True))
    expect_raises(
        NotImplementedError, grads_msg, summon(with_grads=True, offload_to_cpu=True, writeback=False)
    )
    assert_unchanged(root, before, allowed_fsdp=4)
    # The valid combinations still work afterwards.
    with FSDP.summon_full_params(root, rank0_only=True, writeback=False):
        pass
    with FSDP.summon_full_params(root, offload_to_cpu=True):
        pass
    assert_unchanged(root, before, allowed_fsdp=4)
    group_in_step()


@pytest.mark.parametrize("after_forward", [False, True], ids=["fresh", "after_step"])
def test_summon_full_params_bad_argument_combinations(pool2: RankPool, after_forward: bool) -> None:
    pool2.run(_summon_bad_arguments, after_forward)


def _sharded_submodule_called_directly(after_step: bool) -> None:
    root = wrapped_deep()
    if after_step:
        _train_step(root)
    inner = root.module.blocks[0]
    inner_name = r"blocks\.0" if after_step else "Block"
    root_name = "<root>" if after_step else "Deep"
    x = torch.randn(2, D)
    before = snapshot(root)
    tail = (
        r", which is sharded right now, so it holds no data\. Submodule '{}' was used outside "
        r"its unit's forward\. Call the FSDP-wrapped module \(or the root\) instead of its "
        r"submodule, or access full parameters inside "
        r"FullyShardedDataParallel\.summon_full_params\(model\)\."
    )
    def belongs(param: str, unit: str) -> str:
        return rf"fsdp: parameter '{param}' belongs to the FSDP unit '{unit}'"

    cases = [
        (lambda: inner.module.fc1(x), belongs(r"fc1\.weight", inner_name) + tail.format("fc1")),
        (lambda: inner.module(x), belongs(r"fc1\.weight", inner_name)),
        (lambda: inner.module.fc2(x), belongs(r"fc2\.weight", inner_name) + tail.format("fc2")),
        (lambda: root.module.stem(x), belongs(r"stem\.weight", root_name) + tail.format("stem")),
        (lambda: root.module.head(x), belongs(r"head\.weight", root_name)),
    ]
    for call, match in cases:
        msg = expect_raises(RuntimeError, match, call)
        assert "shape" not in msg and "mat1" not in msg, msg
    assert_unchanged(root, before, allowed_fsdp=4)
    # Calling through the wrappers is fine.
    assert root(x).shape == (2, D)
    group_in_step()


@pytest.mark.parametrize("after_step", [False, True], ids=["fresh", "after_step"])
def test_calling_a_submodule_of_a_sharded_unit_directly(pool2: RankPool, after_step: bool) -> None:
    pool2.run(_sharded_submodule_called_directly, after_step)


# ---------------------------------------------------------------------------------------------
# State dicts and other planned features
# ---------------------------------------------------------------------------------------------


def _state_dict_type_wrong_config() -> None:
    root = wrapped_deep()
    default = FSDP.get_state_dict_type(root)
    cases = [
        (StateDictType.FULL_STATE_DICT, ShardedStateDictConfig(), None,
         r"fsdp: Expected state_dict_config of type <class '.*'> but got <class '.*'>: state_dict_config must be a FullStateDictConfig for StateDictType\.FULL_STATE_DICT, "
         r"got ShardedStateDictConfig\. Pass FullStateDictConfig\(\.\.\.\) or None for the default\."),
        (StateDictType.SHARDED_STATE_DICT, FullStateDictConfig(), None,
         r"fsdp: Expected state_dict_config of type <class '.*'> but got <class '.*'>: state_dict_config must be a ShardedStateDictConfig for "
         r"StateDictType\.SHARDED_STATE_DICT, "
         r"got FullStateDictConfig\."),
        (StateDictType.LOCAL_STATE_DICT, None, FullOptimStateDictConfig(),
         r"fsdp: Expected optim_state_dict_config of type <class '.*'> but got <class '.*'>: optim_state_dict_config must be a LocalOptimStateDictConfig for "
         r"StateDictType\.LOCAL_STATE_DICT, got FullOptimStateDictConfig\."),
        (StateDictType.FULL_STATE_DICT, FullStateDictConfig(), ShardedOptimStateDictConfig(),
         r"optim_state_dict_config must be a FullOptimStateDictConfig .* "
         r"got ShardedOptimStateDictConfig"),
        # torch's own config class is not fsdp's.
        (StateDictType.FULL_STATE_DICT, torch_fsdp.FullStateDictConfig(), None,
         r"state_dict_config must be a FullStateDictConfig for StateDictType\.FULL_STATE_DICT, got "
         r"FullStateDictConfig\."),
        (StateDictType.SHARDED_STATE_DICT, LocalStateDictConfig(), None,
         r"state_dict_config must be a ShardedStateDictConfig .* got LocalStateDictConfig"),
    ]
    for sd_type, config, optim_config, match in cases:

        def use_context() -> None:
            with FSDP.state_dict_type(root, sd_type, config, optim_config):
                raise AssertionError("must not enter")  # pragma: no cover

        # RuntimeError, as torch FSDP1 (tests/test_contract_errors.py).
        expect_raises(RuntimeError, match, use_context)
        assert FSDP.get_state_dict_type(root) == default
        expect_raises(
            RuntimeError, match, lambda: FSDP.set_state_dict_type(root, sd_type, config, optim_config)
        )
        assert FSDP.get_state_dict_type(root) == default
        for unit in FSDP.fsdp_modules(root):
            assert FSDP.get_state_dict_type(unit) == default
    expect_raises(
        TypeError,
        r"state_dict_type must be a StateDictType, got 'FULL_STATE_DICT'",
        lambda: FSDP.set_state_dict_type(root, "FULL_STATE_DICT"),  # type: ignore[arg-type]
    )
    assert FSDP.get_state_dict_type(root) == default
    group_in_step()


def test_state_dict_type_with_a_config_of_the_wrong_type(pool2: RankPool) -> None:
    pool2.run(_state_dict_type_wrong_config)


def _optim_state_dict_bad_input() -> None:
    root = wrapped_deep()
    optim = torch.optim.Adam(root.parameters(), lr=0.1)
    root(torch.randn(2, D)).sum().backward()
    optim.step()
    osd = FSDP.optim_state_dict(root, optim)
    before = snapshot(root)
    optim_before = {k: {n: v.clone() for n, v in st.items()} for k, st in optim.state_dict()["state"].items()}
    unknown = {"state": {**osd["state"], "blocks.7.fc1.weight": osd["state"]["stem.weight"]}, "param_groups": osd["param_groups"]}
    wrong_shape = {"state": {**osd["state"], "stem.bias": {**osd["state"]["stem.bias"], "exp_avg": torch.zeros(D + 1)}}, "param_groups": osd["param_groups"]}
    cases: list[tuple[str, Callable[[], Any]]] = [
        (
            r"fsdp: the optimizer state dict has state for 'blocks\.7\.fc1\.weight', which is not a "
            r"parameter of this model\. Was it saved from another model\? The model's parameters are: "
            r"'stem\.weight' \(4, 4\), 'stem\.bias' \(4,\), 'head\.weight' \(4, 4\)",
            lambda: FSDP.optim_state_dict_to_load(root, optim, unknown, load_directly=True),
        ),
        (
            r"fsdp: optimizer state 'exp_avg' of parameter 'stem\.bias' has shape \(5,\), but the "
            r"parameter has shape \(4,\)\. Was it saved from another model\?",
            lambda: FSDP.optim_state_dict_to_load(root, optim, wrong_shape, load_directly=True),
        ),
        (
            r"fsdp: optimizer state key 0 is not a parameter name\.",
            lambda: FSDP.shard_full_optim_state_dict(optim.state_dict(), root, optim=optim),
        ),
    ]
    for match, call in cases:
        expect_raises(ValueError, match, call)
    assert_unchanged(root, before, allowed_fsdp=4)
    after = optim.state_dict()["state"]
    assert list(after) == list(optim_before)
    for key, st in after.items():
        for name, value in st.items():
            assert torch.equal(value, optim_before[key][name]), f"optimizer state {key}/{name} changed"
    group_in_step()


def test_optim_state_dict_bad_input(pool2: RankPool) -> None:
    pool2.run(_optim_state_dict_bad_input)
