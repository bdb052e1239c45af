"""Contract: each user mistake raises the exception type torch FSDP1 raises for it.

Every case runs the same mistake through torch's FSDP1 (on CPU/gloo, ``device_id="cpu"``) and
through ours on fresh models and records the exception each raises. Ours must be an instance of
torch's type (our messages differ: they name the culprit and the remedy; tests/test_errors.py
pins them). Where torch raises ``AssertionError``, ours raises
:class:`fsdp._common.FSDPStateAssertionError`, which is both an ``AssertionError`` and a
``RuntimeError`` (so it is never mistaken for an internal invariant failure).

Cases where torch's behaviour is an accident of its implementation and ours is deliberately
better are listed in ``BETTER_THAN_TORCH`` with what torch does, and checked to behave as
documented there.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from tests._harness import RankPool
from tests._models import Block, make_toy

Lib = dict[str, Any]


def _lib(name: str) -> Lib:
    """The names a case needs, from our package or torch's."""
    if name == "ours":
        import fsdp
        import fsdp.wrap as wrap

        return {
            "name": "ours",
            "F": fsdp.FullyShardedDataParallel,
            "api": fsdp,
            "wrap": wrap,
            "extra": {},
        }
    import torch.distributed.fsdp as tfsdp
    import torch.distributed.fsdp.wrap as twrap

    return {
        "name": "torch",
        "F": tfsdp.FullyShardedDataParallel,
        "api": tfsdp,
        "wrap": twrap,
        "extra": {"device_id": torch.device("cpu")},
    }


def _wrapped(lib: Lib, **kwargs: Any) -> nn.Module:
    """ToyLM with each Block a nested unit."""
    F, wrap = lib["F"], lib["wrap"]
    return F(make_toy(), auto_wrap_policy=wrap.ModuleWrapPolicy({Block}), **lib["extra"], **kwargs)


def _tokens() -> torch.Tensor:
    return torch.randint(0, 13, (2, 5), generator=torch.Generator().manual_seed(dist.get_rank()))


def _step(model: nn.Module) -> None:
    model(_tokens()).sum().backward()


def _during_forward(lib: Lib, call: Callable[[nn.Module], Any]) -> None:
    """Runs ``call(root)`` from inside the first Block's forward."""
    root = _wrapped(lib)
    fc1 = root.module.blocks[0].module.fc1
    fc1.register_forward_pre_hook(lambda *_: call(root))
    root(_tokens())


def _during_backward(lib: Lib, call: Callable[[nn.Module], Any]) -> None:
    """Runs ``call(root)`` from a hook on the output's gradient."""
    root = _wrapped(lib)
    out = root(_tokens())
    out.register_hook(lambda grad: (call(root), grad)[1])
    out.sum().backward()


def _summon(lib: Lib, **kwargs: Any) -> Callable[[nn.Module], None]:
    def run(root: nn.Module) -> None:
        with lib["F"].summon_full_params(root, **kwargs):
            pass

    return run


def _no_sync(root: nn.Module) -> None:
    with root.no_sync():
        pass


def _apply_inside_summon(lib: Lib) -> None:
    root = _wrapped(lib)
    with lib["F"].summon_full_params(root, writeback=False):
        root.apply(lambda m: None)


def _comm_hook(lib: Lib, on: str) -> None:
    from torch.distributed.algorithms._comm_hooks import default_hooks

    root = _wrapped(lib)
    _step(root)
    hook_state = default_hooks.DefaultState(dist.group.WORLD)
    hook = default_hooks.reduce_scatter_hook
    if on == "nested":
        root.module.blocks[0].register_comm_hook(hook_state, hook)
    elif on == "twice":
        root.register_comm_hook(hook_state, hook)
        root.register_comm_hook(hook_state, hook)
    else:
        root.register_comm_hook(hook_state, "not a hook")


def _hybrid_without_layout(lib: Lib) -> None:
    lib["F"](make_toy(), sharding_strategy=lib["api"].ShardingStrategy.HYBRID_SHARD, **lib["extra"])


def _ignored(lib: Lib, case: str) -> None:
    model = make_toy()
    if case == "not_modules":
        ignored: Any = ["head"]
    elif case == "not_iterable":
        ignored = 5
    else:  # an FSDP instance
        model.blocks[0] = lib["F"](model.blocks[0], **lib["extra"])
        ignored = [model.blocks[0]]
    lib["F"](model, ignored_modules=ignored, **lib["extra"])


def _already_wrapped_under_auto_wrap(lib: Lib) -> None:
    model = make_toy()
    model.blocks[0] = lib["F"](model.blocks[0], **lib["extra"])
    lib["F"](model, auto_wrap_policy=lib["wrap"].ModuleWrapPolicy({Block}), **lib["extra"])


def _param_init_fn_not_callable(lib: Lib) -> None:
    with torch.device("meta"):
        model = make_toy()
    lib["F"](model, param_init_fn=5, **lib["extra"])


def _state_dict_config_of_wrong_type(lib: Lib) -> None:
    api = lib["api"]
    lib["F"].set_state_dict_type(
        _wrapped(lib), api.StateDictType.FULL_STATE_DICT, api.ShardedStateDictConfig()
    )


def _optim_state_dict_config_of_wrong_type(lib: Lib) -> None:
    api = lib["api"]
    with lib["F"].state_dict_type(
        _wrapped(lib), api.StateDictType.SHARDED_STATE_DICT, None, api.FullOptimStateDictConfig()
    ):
        pass


def _group_and_mesh(lib: Lib) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    lib["F"](make_toy(), process_group=dist.group.WORLD, device_mesh=mesh, **lib["extra"])


def _hybrid_with_one_group(lib: Lib) -> None:
    lib["F"](
        make_toy(),
        process_group=dist.group.WORLD,
        sharding_strategy=lib["api"].ShardingStrategy.HYBRID_SHARD,
        **lib["extra"],
    )


def _root_only_on_nested(lib: Lib, what: str) -> None:
    root = _wrapped(lib)
    _step(root)
    inner = root.module.blocks[0]
    if what == "no_sync":
        _no_sync(inner)
    else:
        inner.clip_grad_norm_(1.0)


def _bad_device_id(lib: Lib, device_id: Any) -> None:
    extra = {k: v for k, v in lib["extra"].items() if k != "device_id"}
    lib["F"](make_toy(), device_id=device_id, **extra)


# case name -> the mistake, run with a library
CASES: dict[str, Callable[[Lib], None]] = {
    "state_dict_config_of_wrong_type": _state_dict_config_of_wrong_type,
    "optim_state_dict_config_of_wrong_type": _optim_state_dict_config_of_wrong_type,
    "ignored_modules_not_modules": lambda lib: _ignored(lib, "not_modules"),
    "ignored_modules_not_iterable": lambda lib: _ignored(lib, "not_iterable"),
    "ignored_modules_fsdp_instance": lambda lib: _ignored(lib, "fsdp"),
    "param_init_fn_not_callable": _param_init_fn_not_callable,
    "register_comm_hook_on_nested_unit": lambda lib: _comm_hook(lib, "nested"),
    "register_comm_hook_twice": lambda lib: _comm_hook(lib, "twice"),
    "register_comm_hook_not_callable": lambda lib: _comm_hook(lib, "not_callable"),
    "hybrid_shard_manual_without_layout": _hybrid_without_layout,
    "hybrid_shard_with_one_group": _hybrid_with_one_group,
    "process_group_and_device_mesh": _group_and_mesh,
    "already_wrapped_under_auto_wrap": _already_wrapped_under_auto_wrap,
    "summon_rank0_only_with_writeback": lambda lib: _summon(lib, rank0_only=True, writeback=True)(_wrapped(lib)),
    "summon_with_grads_and_offload": lambda lib: _summon(lib, with_grads=True, offload_to_cpu=True)(_wrapped(lib, use_orig_params=True)),
    "summon_in_forward": lambda lib: _during_forward(lib, _summon(lib)),
    "summon_in_backward": lambda lib: _during_backward(lib, _summon(lib)),
    "no_sync_in_forward": lambda lib: _during_forward(lib, _no_sync),
    "no_sync_in_backward": lambda lib: _during_backward(lib, _no_sync),
    "clip_grad_norm_in_forward": lambda lib: _during_forward(lib, lambda root: root.clip_grad_norm_(1.0)),
    "apply_in_forward": lambda lib: _during_forward(lib, lambda root: root.apply(lambda m: None)),
    "apply_in_backward": lambda lib: _during_backward(lib, lambda root: root.apply(lambda m: None)),
    "apply_inside_summon_full_params": _apply_inside_summon,
    "no_sync_on_nested_unit": lambda lib: _root_only_on_nested(lib, "no_sync"),
    "clip_grad_norm_on_nested_unit": lambda lib: _root_only_on_nested(lib, "clip"),
    "device_id_not_a_device_string": lambda lib: _bad_device_id(lib, "not-a-device"),
    "device_id_of_wrong_type": lambda lib: _bad_device_id(lib, 1.5),
}


def _raised(fn: Callable[[], None]) -> Optional[list[str]]:
    """The names in the MRO of what ``fn`` raised (None if it raised nothing)."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 -- every type is the point here
        return [cls.__name__ for cls in type(exc).__mro__]
    return None


@contextlib.contextmanager
def without_local_world_size() -> Iterator[None]:
    """Hides ``LOCAL_WORLD_SIZE`` (hybrid-layout cases: no node size known, as in torch's tests)."""
    env_backup = os.environ.pop("LOCAL_WORLD_SIZE", None)
    try:
        yield
    finally:
        if env_backup is not None:
            os.environ["LOCAL_WORLD_SIZE"] = env_backup


def _run_cases(names: list[str]) -> dict[str, tuple[Optional[list[str]], Optional[list[str]]]]:
    with without_local_world_size():
        results = {}
        for name in names:
            theirs = _raised(lambda: CASES[name](_lib("torch")))
            ours = _raised(lambda: CASES[name](_lib("ours")))
            results[name] = (ours, theirs)
        # The group is still in step for the next test.
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == dist.get_world_size()
        return results


def test_exception_types_match_torch_fsdp1(pool2: RankPool) -> None:
    per_rank = pool2.run(_run_cases, list(CASES))
    assert per_rank[0] == per_rank[1]
    mismatches = []
    for name, (ours, theirs) in per_rank[0].items():
        assert theirs is not None, f"{name}: torch FSDP1 raised nothing (the case is wrong)"
        if ours is None or theirs[0] not in ours:
            mismatches.append(f"{name}: ours {ours and ours[0]}, torch {theirs[0]}")
    assert not mismatches, "\n".join(mismatches)


# Mistakes where torch FSDP1's behaviour is accidental or worse and ours deliberately differs:
# case -> (torch's exception type name or None when torch accepts it, ours).
BETTER_THAN_TORCH: dict[str, tuple[Optional[str], Optional[str]]] = {
    # Torch raises AssertionError; ours supports nesting (the inner context is a no-op for
    # units already summoned), as tests/test_summon_full_params.py checks by value.
    "nested_summon_same_unit": ("AssertionError", None),
    # Torch raises KeyError from a dict lookup; ours names the argument.
    "state_dict_type_not_an_enum": ("KeyError", "TypeError"),
    # Torch accepts a non-callable param_init_fn when nothing is on the meta device (and
    # fails later only if it is used); ours rejects it at once, with torch's type.
    "param_init_fn_not_callable_without_meta": (None, "ValueError"),
    # summon_full_params(writeback=True) after a parameter was replaced by one of another
    # shape inside the context: torch silently drops the change; ours raises RuntimeError,
    # torch's type for a changed shape when it does check: with use_orig_params, a .data of
    # another shape set between steps (there torch raises on the ranks whose shard holds the
    # parameter and hangs the others, so that case cannot run here).
    "summon_writeback_changed_shape": (None, "RuntimeError"),
}


def _better_cases() -> dict[str, tuple[Optional[list[str]], Optional[list[str]]]]:
    def nested_summon(lib: Lib) -> None:
        root = _wrapped(lib)
        with lib["F"].summon_full_params(root):
            with lib["F"].summon_full_params(root):
                pass

    def not_an_enum(lib: Lib) -> None:
        lib["F"].set_state_dict_type(_wrapped(lib), "FULL_STATE_DICT")

    def init_fn(lib: Lib) -> None:
        lib["F"](make_toy(), param_init_fn=5, **lib["extra"])

    def writeback_changed_shape(lib: Lib) -> None:
        root = _wrapped(lib, use_orig_params=True)
        _step(root)
        with lib["F"].summon_full_params(root, writeback=True):
            root.module.head.weight.data = torch.zeros(2, 2)
        _step(root)

    cases = {
        "summon_writeback_changed_shape": writeback_changed_shape,
        "nested_summon_same_unit": nested_summon,
        "state_dict_type_not_an_enum": not_an_enum,
        "param_init_fn_not_callable_without_meta": init_fn,
    }
    return {
        name: (_raised(lambda: fn(_lib("ours"))), _raised(lambda: fn(_lib("torch"))))
        for name, fn in cases.items()
    }


def test_documented_differences_from_torch_fsdp1(pool2: RankPool) -> None:
    results = pool2.run(_better_cases)[0]
    for name, (torch_type, our_type) in BETTER_THAN_TORCH.items():
        ours, theirs = results[name]
        assert (theirs[0] if theirs else None) == torch_type, (name, theirs)
        assert (ours[0] if ours else None) == our_type, (name, ours)
