"""Contract: the training states and ignored-state attributes read as torch FSDP1's.

- ``FullyShardedDataParallel.training_state`` is the coarse instance state (IDLE,
  FORWARD_BACKWARD, SUMMON_FULL_PARAMS) and ``_handle._training_state`` the fine handle state
  (IDLE, FORWARD, BACKWARD_PRE, BACKWARD_POST, SUMMON_FULL_PARAMS), with torch's member names,
  at every phase: idle, inside forward, inside backward before and after each unit's
  gradient reduction, inside ``summon_full_params`` (recursive or not), after the step.
- ``_ignored_modules`` / ``_ignored_params`` of the root and of nested units, for
  ``ignored_modules``, ``ignored_states`` (modules or parameters) with auto-wrap, and for a unit
  wrapped by hand with its own ignored module.

Both libraries run the same scenario in the same process; the recorded names must be equal.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from tests._harness import RankPool
from tests._models import Block, global_batch, local_rows, make_toy

Snapshot = tuple[str, tuple[tuple[str, str, Optional[str]], ...]]


def _units(model: nn.Module, cls: type) -> list[tuple[str, nn.Module]]:
    return [(n.replace("_fsdp_wrapped_module.", ""), m) for n, m in model.named_modules() if isinstance(m, cls)]


def _states(units: list[tuple[str, nn.Module]]) -> tuple[tuple[str, str, Optional[str]], ...]:
    """(unit name, instance training_state, handle _training_state) for every unit."""
    return tuple(
        (name, unit.training_state.name, None if unit._handle is None else unit._handle._training_state.name)
        for name, unit in units
    )


def _record_states(lib: Any, wrap: Any, policy_classes: set[type]) -> list[Snapshot]:
    """Runs one forward/backward and summons, snapshotting every unit's states at each phase."""
    cls = lib.FullyShardedDataParallel
    model = make_toy(n_blocks=2)
    snapshots: list[Snapshot] = []
    units: list[tuple[str, nn.Module]] = []

    def snap(where: str) -> None:
        snapshots.append((where, _states(units)))

    def watch(name: str, module: nn.Module) -> None:
        """Snapshots inside the module's forward and when its output's gradient arrives."""

        def forward_hook(_: nn.Module, __: Any, output: torch.Tensor) -> None:
            snap(f"forward of {name}")
            if output.requires_grad:
                output.register_hook(lambda grad: snap(f"backward at {name}'s output"))

        module.register_forward_hook(forward_hook)

    # Module hooks registered before wrapping stay on the original modules, which both
    # libraries run unchanged inside their units.
    for name in ("embed", "blocks.0.fc1", "blocks.1.fc2", "head"):
        watch(name, model.get_submodule(name))
    fsdp_model = cls(model, auto_wrap_policy=wrap.ModuleWrapPolicy(policy_classes), device_id="cpu")
    units.extend(_units(fsdp_model, cls))
    snap("constructed")
    tokens, _ = global_batch(0, dist.get_world_size())
    x = local_rows(tokens, dist.get_rank(), dist.get_world_size())
    out = fsdp_model(x)
    snap("after forward")
    out.float().sum().backward()
    snap("after backward")
    with cls.summon_full_params(fsdp_model):
        snap("inside summon_full_params")
    with cls.summon_full_params(fsdp_model, recurse=False):
        snap("inside summon_full_params(recurse=False)")
    with torch.no_grad():
        fsdp_model(x)
    snap("after a no_grad forward")
    return snapshots


def _compare_states() -> int:
    import fsdp
    import fsdp.wrap as wrap
    import torch.distributed.fsdp as tfsdp
    import torch.distributed.fsdp.wrap as twrap

    checked = 0
    # Block units under a root that owns parameters; then every parameterized module its own
    # unit, so the root has no handle (its instance state still changes, as torch's does).
    for policy_classes in ({Block}, {Block, nn.Embedding, nn.Linear}):
        ours = _record_states(fsdp, wrap, policy_classes)
        theirs = _record_states(tfsdp, twrap, policy_classes)
        assert [w for w, _ in ours] == [w for w, _ in theirs]
        for (where, mine), (_, torch_states) in zip(ours, theirs):
            assert mine == torch_states, f"{sorted(policy_classes, key=str)} {where}: ours {mine} torch {torch_states}"
            checked += 1
        # The names are the ones torch uses, and each phase shows what it should: the root is
        # FORWARD_BACKWARD with its handle FORWARD inside the first module's forward, ...
        by_where = dict(ours)
        root = by_where["forward of embed"][0]
        assert root[1] == "FORWARD_BACKWARD" and root[2] in ("FORWARD", None)
        assert by_where["backward at embed's output"][0][1] == "FORWARD_BACKWARD"
        # ... a block whose gradient was reduced is BACKWARD_POST until the end of backward,
        block_states = [s for name, *s in by_where["backward at embed's output"] if name == "blocks.1"]
        assert block_states == [["FORWARD_BACKWARD", "BACKWARD_POST"]]
        assert {s[1] for s in by_where["inside summon_full_params"]} == {"SUMMON_FULL_PARAMS"}
        for where in ("constructed", "after forward", "after backward", "after a no_grad forward"):
            assert {s[1] for s in by_where[where]} == {"IDLE"}, where
            assert {s[2] for s in by_where[where]} <= {"IDLE", None}, where
    return checked


def test_training_states_match_torch_fsdp1(pool2: RankPool) -> None:
    # Snapshots per policy: constructed, 4 forward hooks, after forward, 4 gradient hooks,
    # after backward, 2 summons, a no_grad forward's 4 hooks and after it.
    assert pool2.run(_compare_states) == [2 * 18] * 2


# ------------------------------------------------------------------ ignored modules / params
def _names(objs: set[Any], model: nn.Module, params: bool) -> list[str]:
    """Qualified names (wrapper segments removed) of the ignored modules or parameters."""
    items = model.named_parameters(remove_duplicate=False) if params else model.named_modules()
    return sorted({n.replace("_fsdp_wrapped_module.", "") for n, o in items if o in objs})


def _ignored_attributes(lib: Any, wrap: Any, how: str) -> list[tuple[str, list[str], list[str]]]:
    cls = lib.FullyShardedDataParallel
    model = make_toy()
    policy = wrap.ModuleWrapPolicy({Block})
    ignored: Callable[[nn.Module], list[Any]] = lambda m: [m.blocks[1].fc2, m.embed]  # noqa: E731
    if how == "ignored_modules":
        fsdp_model = cls(model, auto_wrap_policy=policy, ignored_modules=ignored(model), device_id="cpu")
    elif how == "ignored_states modules":
        fsdp_model = cls(model, auto_wrap_policy=policy, ignored_states=ignored(model), device_id="cpu")
    elif how == "ignored_states params":
        params = [model.blocks[1].fc2.weight, model.embed.weight, model.blocks[2].norm.bias]
        fsdp_model = cls(model, auto_wrap_policy=policy, ignored_states=params, device_id="cpu")
    else:  # by hand: a nested unit with its own ignored module, then the root
        model.blocks[1] = cls(model.blocks[1], ignored_modules=[model.blocks[1].fc2], device_id="cpu")
        model.blocks[2] = cls(model.blocks[2], device_id="cpu")
        fsdp_model = cls(model, ignored_modules=[model.head], device_id="cpu")
    return [
        (name, _names(unit._ignored_modules, fsdp_model, params=False), _names(unit._ignored_params, fsdp_model, params=True))
        for name, unit in _units(fsdp_model, cls)
    ]


def _compare_ignored() -> int:
    import fsdp
    import fsdp.wrap as wrap
    import torch.distributed.fsdp as tfsdp
    import torch.distributed.fsdp.wrap as twrap

    checked = 0
    for how in ("ignored_modules", "ignored_states modules", "ignored_states params", "by hand"):
        ours = _ignored_attributes(fsdp, wrap, how)
        theirs = _ignored_attributes(tfsdp, twrap, how)
        assert ours == theirs, f"{how}: ours {ours} torch {theirs}"
        checked += len(ours)
    # What torch reports, spelled out for the first case: the root has the ignored modules
    # (closed under descendants); auto-wrapped units none, but all of the root's parameters.
    root, *nested = _ignored_attributes(fsdp, wrap, "ignored_modules")
    assert root[1] == ["blocks.1.fc2", "embed"]
    assert all(n[1] == [] and n[2] == root[2] for n in nested)
    return checked


def test_ignored_modules_and_params_match_torch_fsdp1(pool2: RankPool) -> None:
    # 4 units in each auto-wrapped case, 3 by hand.
    assert pool2.run(_compare_ignored) == [4 * 3 + 3] * 2


# ------------------------------------------------------------------ load_state_dict(strict=False)
def _incompatible_keys_in_order() -> int:
    """Missing and unexpected keys of non-strict loads, in order, as torch FSDP1 reports them."""
    from tests.test_state_dict_roots import KINDS, WRAPPINGS, _build, _load, _sd

    checked = 0
    for orig in (False, True):
        for wrapping in WRAPPINGS:  # FSDP roots and plain roots, with and without checkpoint wrappers
            for kind in KINDS:
                reported = []
                for lib in ("ours", "torch"):
                    partial = _sd(_build(lib, wrapping, 1, orig), lib, kind)
                    if kind != "LOCAL_STATE_DICT":  # (torch refuses a LOCAL dict lacking a unit's entry)
                        # Missing from the root unit (first and last module) and from two nested units.
                        for key in ("blocks.1.fc1.weight", "head.weight", "embed.weight", "blocks.0.norm.bias"):
                            del partial[key]
                    # Unexpected keys first, last and inside units.
                    partial = {"aaa": torch.zeros(1), **partial, "zzz": torch.zeros(1)}
                    partial["blocks.2.zzz"] = torch.zeros(1)
                    partial["blocks.0.fc1.qqq"] = torch.zeros(1)
                    result = _load(_build(lib, wrapping, 3, orig), lib, kind, partial, strict=False)
                    reported.append((list(result.missing_keys), list(result.unexpected_keys)))
                if orig and kind == "LOCAL_STATE_DICT":
                    # Torch FSDP1 with use_orig_params also reports each unit's own
                    # "_flat_param" entry as unexpected (nn.Module does not see the
                    # FlatParameter registered while it loads); ours does not.
                    torch_unexpected = [k for k in reported[1][1] if not k.endswith("_flat_param")]
                    units = 3 if wrapping.startswith("plain_root") else 4
                    assert len(torch_unexpected) == len(reported[1][1]) - units
                    reported[1] = (reported[1][0], torch_unexpected)
                assert reported[0] == reported[1], f"{wrapping} {kind} orig={orig}: ours {reported[0]} torch {reported[1]}"
                if kind != "LOCAL_STATE_DICT":  # the unwrapped model's order
                    assert reported[0][0] == ["embed.weight", "blocks.0.norm.bias", "blocks.1.fc1.weight", "head.weight"]
                # (nn.Module reports unexpected keys module by module, in pre-order.)
                assert reported[0][1] == ["aaa", "zzz", "blocks.0.fc1.qqq", "blocks.2.zzz"]
                checked += 1
    return checked


def test_load_state_dict_incompatible_keys_order_matches_torch_fsdp1(pool2: RankPool) -> None:
    assert pool2.run(_incompatible_keys_in_order, _timeout=300) == [2 * 5 * 3] * 2
