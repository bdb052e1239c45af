"""The public API surface of ``fsdp`` matches torch's FSDP1, name for name.

torch's own ``torch.distributed.fsdp`` is imported here only as a reference oracle (names, enum
members, dataclass fields and defaults, signatures); ``fsdp`` itself must never import it, which
the last tests check by parsing every source file under ``fsdp/``. No process group is needed.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import inspect
import os
from typing import Any

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
import torch.distributed.fsdp.wrap as torch_wrap
from torch import nn

import fsdp
import fsdp.wrap as ours_wrap
from fsdp import FullyShardedDataParallel as FSDP

FSDP1_NAMES = [
    "FullyShardedDataParallel",
    "ShardingStrategy",
    "BackwardPrefetch",
    "MixedPrecision",
    "CPUOffload",
    "StateDictType",
    "StateDictConfig",
    "FullStateDictConfig",
    "ShardedStateDictConfig",
    "LocalStateDictConfig",
    "OptimStateDictConfig",
    "FullOptimStateDictConfig",
    "ShardedOptimStateDictConfig",
    "LocalOptimStateDictConfig",
    "StateDictSettings",
    "OptimStateKeyType",
]
ENUMS = ["ShardingStrategy", "BackwardPrefetch", "StateDictType", "OptimStateKeyType"]
DATACLASSES = [n for n in FSDP1_NAMES if n not in ENUMS and n != "FullyShardedDataParallel"]
WRAP_NAMES = [
    "always_wrap_policy",
    "lambda_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "enable_wrap",
    "wrap",
    "CustomPolicy",
    "ModuleWrapPolicy",
]
FSDP_PKG_DIR = os.path.dirname(os.path.abspath(fsdp.__file__))
FORBIDDEN_MODULES = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp")


def _norm_default(value: Any) -> Any:
    """Makes defaults comparable across the two packages (enum members by class and name)."""
    if isinstance(value, enum.Enum):
        return ("enum", type(value).__name__, value.name)
    return value


def _sig(obj: Any) -> list[tuple[str, Any, Any]]:
    return [
        (p.name, p.kind, _norm_default(p.default)) for p in inspect.signature(obj).parameters.values()
    ]


# ---------------------------------------------------------------------------------------------
# Package names, enums, dataclasses
# ---------------------------------------------------------------------------------------------


def test_all_lists_exactly_the_fsdp1_names() -> None:
    assert len(fsdp.__all__) == len(set(fsdp.__all__)), "duplicates in fsdp.__all__"
    assert set(fsdp.__all__) - {"FlatParameter"} == set(FSDP1_NAMES)
    # The reference list really is torch's FSDP1 subset of torch.distributed.fsdp.__all__.
    assert set(FSDP1_NAMES) <= set(torch_fsdp.__all__)
    for name in fsdp.__all__:
        assert getattr(fsdp, name) is not None, name
    assert fsdp.FullyShardedDataParallel is FSDP
    assert issubclass(fsdp.FlatParameter, nn.Parameter)


def test_from_fsdp_import_star_gives_the_fsdp1_names() -> None:
    namespace: dict[str, Any] = {}
    exec("from fsdp import *", namespace)
    assert set(FSDP1_NAMES) <= set(namespace)


@pytest.mark.parametrize("name", ENUMS)
def test_enum_members_match_torch(name: str) -> None:
    ours, ref = getattr(fsdp, name), getattr(torch_fsdp, name)
    assert issubclass(ours, enum.Enum)
    assert [(m, v.value) for m, v in ours.__members__.items()] == [
        (m, v.value) for m, v in ref.__members__.items()
    ]


# Optional fields fsdp adds to torch's dataclasses, after torch's (see each class's docstring).
FSDP_EXTENSION_FIELDS = {"CPUOffload": ["fraction", "offload_module"]}


@pytest.mark.parametrize("name", DATACLASSES)
def test_dataclass_fields_and_defaults_match_torch(name: str) -> None:
    ours, ref = getattr(fsdp, name), getattr(torch_fsdp, name)
    assert dataclasses.is_dataclass(ours), name

    def describe(cls: type) -> list[tuple[Any, ...]]:
        return [
            (
                f.name,
                _norm_default(f.default),
                f.default_factory is dataclasses.MISSING,
                f.init,
                f.repr,
                f.compare,
            )
            for f in dataclasses.fields(cls)
        ]

    # fsdp's own fields come after torch's, default None (torch's behaviour), so torch code
    # (positional arguments included) runs unchanged; nothing else may differ.
    extensions = FSDP_EXTENSION_FIELDS.get(name, [])
    described = describe(ours)
    torch_part, ours_part = described[: len(described) - len(extensions)], described[len(described) - len(extensions) :]
    assert [d[0] for d in ours_part] == extensions
    assert all(d[1] is None for d in ours_part)
    assert torch_part == describe(ref)
    # Same base-class structure (e.g. FullStateDictConfig derives from StateDictConfig).
    assert [b.__name__ for b in ours.__mro__[1:] if b is not object] == [
        b.__name__ for b in ref.__mro__[1:] if b is not object
    ]
    ours_params = ours.__dataclass_params__  # type: ignore[attr-defined]
    ref_params = ref.__dataclass_params__  # type: ignore[attr-defined]
    for flag in ("init", "repr", "eq", "order", "unsafe_hash", "frozen"):
        assert getattr(ours_params, flag) == getattr(ref_params, flag), (name, flag)
    sig = _sig(ours)
    assert sig[: len(sig) - len(extensions)] == _sig(ref)
    assert [s[0] for s in sig[len(sig) - len(extensions) :]] == extensions


def test_dataclass_default_instances_match_torch() -> None:
    for name in DATACLASSES:
        if name == "StateDictSettings":
            continue  # no defaults
        ours, ref = getattr(fsdp, name)(), getattr(torch_fsdp, name)()
        mine = dataclasses.asdict(ours)
        for extra in FSDP_EXTENSION_FIELDS.get(name, []):
            assert mine.pop(extra) is None, (name, extra)
        assert mine == dataclasses.asdict(ref), name
    settings = fsdp.StateDictSettings(
        fsdp.StateDictType.FULL_STATE_DICT, fsdp.FullStateDictConfig(), fsdp.FullOptimStateDictConfig()
    )
    assert settings.state_dict_config.rank0_only is False


# ---------------------------------------------------------------------------------------------
# FullyShardedDataParallel
# ---------------------------------------------------------------------------------------------


def test_constructor_signature_matches_torch() -> None:
    ours = _sig(FSDP.__init__)
    ref = _sig(torch_fsdp.FullyShardedDataParallel.__init__)
    assert len(ref) == 17  # self + torch 2.13's 16 parameters
    assert ours == ref
    assert inspect.signature(FSDP.__init__).parameters["backward_prefetch"].default is (
        fsdp.BackwardPrefetch.BACKWARD_PRE
    )


def _torch_public_members() -> dict[str, Any]:
    """What torch's FSDP1 class defines itself: public members plus nn.Module overrides."""
    ref = torch_fsdp.FullyShardedDataParallel
    return {
        name: obj
        for name, obj in vars(ref).items()
        if not name.startswith("_") or name in ("__getattr__", "__getitem__")
    }


def _kind(obj: Any) -> str:
    if isinstance(obj, property):
        return "property"
    if isinstance(obj, staticmethod):
        return "staticmethod"
    if isinstance(obj, classmethod):
        return "classmethod"
    return "method"


def test_every_torch_fsdp1_member_exists_with_the_same_kind_and_signature() -> None:
    ref_members = _torch_public_members()
    assert "summon_full_params" in ref_members and "named_parameters" in ref_members
    missing = sorted(name for name in ref_members if not hasattr(FSDP, name))
    assert not missing, f"members of torch FSDP1 that fsdp.FullyShardedDataParallel lacks: {missing}"
    mismatches = []
    for name, ref_obj in ref_members.items():
        ours_obj = inspect.getattr_static(FSDP, name)
        if _kind(ours_obj) != _kind(ref_obj):
            mismatches.append(f"{name}: {_kind(ours_obj)} vs torch's {_kind(ref_obj)}")
            continue
        if isinstance(ref_obj, property):
            continue
        ours_sig = _sig(getattr(FSDP, name))
        ref_sig = _sig(getattr(torch_fsdp.FullyShardedDataParallel, name))
        if ours_sig != ref_sig:
            mismatches.append(f"{name}: {ours_sig} vs torch's {ref_sig}")
    assert not mismatches, "\n".join(mismatches)


def test_nn_module_overrides_torch_defines_are_overridden_too() -> None:
    ref = torch_fsdp.FullyShardedDataParallel
    overrides = {n for n in vars(ref) if hasattr(nn.Module, n) and not n.startswith("__")}
    overrides.discard("_apply")  # only acts with use_orig_params=True
    assert {"apply", "forward", "named_buffers", "named_parameters"} <= overrides
    for name in overrides:
        assert name in vars(FSDP), f"fsdp.FullyShardedDataParallel does not override nn.Module.{name}"
    # state_dict / load_state_dict exist (torch implements them through nn.Module hooks) and
    # accept nn.Module's arguments.
    ours_sd = inspect.signature(FSDP.state_dict)
    ours_sd.bind(object(), destination=None, prefix="", keep_vars=False)
    ours_sd.bind(object(), None, "", False)
    ours_load = inspect.signature(FSDP.load_state_dict)
    ours_load.bind(object(), {}, strict=True, assign=False)


def test_public_members_are_documented() -> None:
    for name in _torch_public_members():
        if name.startswith("_"):
            continue
        assert inspect.getdoc(getattr(FSDP, name)), f"FullyShardedDataParallel.{name} has no docstring"
    assert inspect.getdoc(FSDP)


def test_fsdp_class_is_an_nn_module_and_not_torch_fsdp() -> None:
    assert issubclass(FSDP, nn.Module)
    assert not issubclass(FSDP, torch_fsdp.FullyShardedDataParallel)
    assert FSDP.__module__.startswith("fsdp")
    for name in FSDP1_NAMES:
        assert getattr(fsdp, name) is not getattr(torch_fsdp, name), name
        assert getattr(fsdp, name).__module__.startswith("fsdp"), name


# ---------------------------------------------------------------------------------------------
# fsdp.wrap
# ---------------------------------------------------------------------------------------------


def test_wrap_module_exposes_torchs_names() -> None:
    assert sorted(ours_wrap.__all__) == sorted(WRAP_NAMES)
    assert sorted(torch_wrap.__all__) == sorted(WRAP_NAMES)


@pytest.mark.parametrize("name", WRAP_NAMES)
def test_wrap_signatures_match_torch(name: str) -> None:
    ours, ref = getattr(ours_wrap, name), getattr(torch_wrap, name)
    assert _sig(ours) == _sig(ref)
    assert inspect.getdoc(ours), name
    if inspect.isclass(ref):
        assert inspect.isclass(ours)
        for method in ("_run_policy", "__call__"):
            if method in vars(ref):
                assert _sig(getattr(ours, method)) == _sig(getattr(ref, method)), (name, method)


# ---------------------------------------------------------------------------------------------
# fsdp never imports torch's FSDP
# ---------------------------------------------------------------------------------------------


def _forbidden(module_name: str) -> bool:
    return any(module_name == m or module_name.startswith(m + ".") for m in FORBIDDEN_MODULES)


def _forbidden_imports(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        source = f.read()
    tree = ast.parse(source, filename=path)
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Call):
            # importlib.import_module("...") / __import__("...")
            func = node.func
            fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if fname in ("import_module", "__import__") and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    names = [arg.value]
        bad = [name for name in names if _forbidden(name)]
        if bad:
            where = os.path.relpath(path, os.path.dirname(FSDP_PKG_DIR))
            found.append(f"{where}:{node.lineno}: {bad[0]}")
    return found


def test_forbidden_import_detector_works() -> None:
    # Sanity check of the detector on this very file, which does import torch's FSDP.
    assert _forbidden_imports(__file__)
    assert _forbidden("torch.distributed.fsdp.wrap") and _forbidden("torch.distributed._composable.fsdp")
    assert not _forbidden("torch.distributed.fsdpx") and not _forbidden("fsdp.wrap")


def test_no_source_file_under_fsdp_imports_torch_fsdp() -> None:
    files = []
    for dirpath, _, filenames in os.walk(FSDP_PKG_DIR):
        files.extend(os.path.join(dirpath, f) for f in filenames if f.endswith(".py"))
    assert len(files) > 10
    offenders = [hit for path in sorted(files) for hit in _forbidden_imports(path)]
    assert not offenders, "fsdp/ must not import torch's FSDP:\n" + "\n".join(offenders)



def _flat_param_types() -> list[tuple[str, str, bool, bool]]:
    """(our type, torch's type, ours isinstance FlatParameter, torch's foreach eligibility of ours)."""
    import torch.optim.optimizer as optim_impl
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    from tests._models import make_toy

    ours = FSDP(make_toy())
    theirs = TorchFSDP(make_toy(), device_id=torch.device("cpu"))
    rows = []
    for mine, torchs in zip(ours.parameters(), theirs.parameters()):
        eligible = type(mine) in optim_impl._foreach_supported_types
        rows.append((type(mine).__name__, type(torchs).__name__, isinstance(mine, fsdp.FlatParameter), eligible))
    return rows


def test_flat_parameter_type_is_parameter_like_torch(pool1: Any) -> None:
    """[Note: A FlatParameter's type is nn.Parameter]: found by the CUDA lane, where torch's
    AdamW took its per-tensor path for our FlatParameter subclass (foreach needs the exact type
    ``Parameter``) and rounded one ulp differently from torch FSDP1 with foreach."""
    assert pool1.run(_flat_param_types) == [[("Parameter", "Parameter", True, True)]]
    assert not isinstance(nn.Parameter(torch.zeros(1)), fsdp.FlatParameter)
