"""``fsdp.redirect_torch_fsdp()``: torch's FSDP1 import path answers with fsdp; FSDP2 stays torch's.

Every check runs in a fresh interpreter (a fork of one that imported torch alone: [Note: Test
commands forked from a preloaded interpreter] in tests/_preloaded.py): the redirect changes
``sys.modules``, and this pytest process and the shared rank pools have torch's package loaded
already. Each child
prints one JSON object of observations; the parent asserts on it.
"""

from __future__ import annotations

import json
import os
import textwrap
from typing import Any, Dict, List, Tuple

import pytest
import torch
from torch import nn

from tests._harness import ends_cleanly
from tests._preloaded import run_python

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCH_FSDP = "torch.distributed" + ".fsdp"


def _run_child(code: str, args: List[str] | None = None, timeout: float = 180.0) -> Dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([REPO_ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    env["OMP_NUM_THREADS"] = "1"
    # A fork of an interpreter that imported torch alone ([Note: Test commands forked from a
    # preloaded interpreter]): the redirect's checks look at torch.distributed.fsdp, not torch.
    proc = run_python(args or ["-c", ends_cleanly(textwrap.dedent(code))], env=env, timeout=timeout)
    assert proc.returncode == 0, f"child failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


_MAIN_CHILD = r"""
import importlib, json, os, pkgutil, sys, warnings
warnings.simplefilter("error", UserWarning)  # the recommended order warns nothing
# ... except torch FSDP1's own warning that one rank means NO_SHARD (this child runs one rank).
warnings.filterwarnings("ignore", message="FSDP is switching to use `NO_SHARD`", category=UserWarning)
import fsdp, fsdp.api, fsdp.wrap, fsdp.sharded_grad_scaler, fsdp.fully_sharded_data_parallel
import torch
import torch.distributed as dist
TF = "torch.distributed" + ".fsdp"
out = {}
handle = fsdp.redirect_torch_fsdp()
out["idempotent"] = fsdp.redirect_torch_fsdp() is handle
out["preloaded"] = list(handle.preloaded)
out["loaded_by_call"] = sorted(m for m in sys.modules if m.startswith(TF))

import torch.distributed.fsdp as tf
from torch.distributed.fsdp.fully_sharded_data_parallel import FullyShardedDataParallel as FromModule, StateDictType
from torch.distributed.fsdp.wrap import ModuleWrapPolicy, transformer_auto_wrap_policy, enable_wrap, wrap
from torch.distributed.fsdp.api import ShardingStrategy
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
names = [n for n in fsdp.__all__]
out["fsdp1_names_ours"] = {n: getattr(tf, n) is getattr(fsdp, n) for n in names}
out["attr_on_torch_distributed"] = torch.distributed.fsdp is tf
out["from_submodules_ours"] = [
    FromModule is fsdp.FullyShardedDataParallel,
    StateDictType is fsdp.StateDictType,
    ModuleWrapPolicy is fsdp.wrap.ModuleWrapPolicy,
    transformer_auto_wrap_policy is fsdp.wrap.transformer_auto_wrap_policy,
    enable_wrap is fsdp.wrap.enable_wrap and wrap is fsdp.wrap.wrap,
    ShardingStrategy is fsdp.ShardingStrategy,
    ShardedGradScaler is fsdp.sharded_grad_scaler.ShardedGradScaler,
    sys.modules[TF + ".api"] is fsdp.api,
    sys.modules[TF + ".fully_sharded_data_parallel"] is fsdp.fully_sharded_data_parallel,
    sys.modules[TF + ".sharded_grad_scaler"] is fsdp.sharded_grad_scaler,
]

# FSDP2: torch's own, fetched on demand, and working (1 rank).
from torch.distributed.fsdp import (
    CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, UnshardHandle,
    fully_shard, register_fsdp_forward_method,
)
fsdp2 = [fully_shard, FSDPModule, MixedPrecisionPolicy, CPUOffloadPolicy, OffloadPolicy,
         register_fsdp_forward_method, UnshardHandle]
out["fsdp2_modules"] = sorted({obj.__module__ for obj in fsdp2})
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + os.environ["PORT"], rank=0, world_size=1)
from torch.distributed.device_mesh import init_device_mesh
torch.manual_seed(0)
reference = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
sharded = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
sharded.load_state_dict(reference.state_dict())
mesh = init_device_mesh("cpu", (1,))
for layer in sharded:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer, mesh=mesh)
fully_shard(sharded, mesh=mesh)
out["fsdp2_is_fsdp_module"] = isinstance(sharded, FSDPModule)
opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1)
opt_sh = torch.optim.SGD(sharded.parameters(), lr=0.1)
x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
for model, opt in ((reference, opt_ref), (sharded, opt_sh)):
    for _ in range(2):
        opt.zero_grad()
        model(x).square().sum().backward()
        opt.step()
# One rank: FSDP2's all-gather and reduce-scatter are copies and the mean over 1 rank divides by
# 1, so the sharded model's steps are the reference's, bit for bit.
out["fsdp2_matches_local"] = all(
    torch.equal(p.full_tensor(), q) for p, q in zip(sharded.parameters(), reference.parameters())
)

# torch.distributed.checkpoint imports and saves/loads the FSDP2 model's state.
import tempfile
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as dcp_sd
out["dcp_state_dict_binds_ours"] = dcp_sd.FSDP is fsdp.FullyShardedDataParallel
with tempfile.TemporaryDirectory() as folder:
    state = {"model": sharded.state_dict()}
    dcp.save(state, checkpoint_id=folder)
    for p in sharded.parameters():
        p.data.zero_()
    dcp.load(state, checkpoint_id=folder)
    sharded.load_state_dict(state["model"])
out["dcp_roundtrip"] = all(
    torch.equal(p.full_tensor(), q) for p, q in zip(sharded.parameters(), reference.parameters())
)

# Every private submodule of torch's package still imports (torch's own code uses them).
failed = []
for info in pkgutil.walk_packages(tf.__path__, TF + "."):
    try:
        importlib.import_module(info.name)
    except Exception as exc:
        failed.append(f"{info.name}: {exc!r}")
out["private_import_failures"] = failed
out["private_is_torch_file"] = sys.modules[TF + "._common_utils"].__file__.startswith(
    os.path.dirname(torch.__file__)
)

# apply_activation_checkpointing imports private helpers from the wrap module.
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointWrapper, apply_activation_checkpointing, checkpoint_wrapper,
)
def tree():
    return torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()))
wrapped = {}
for how, kwargs in (
    ("check_fn", {"check_fn": lambda m: isinstance(m, torch.nn.Linear)}),
    ("policy", {"auto_wrap_policy": ModuleWrapPolicy({torch.nn.Linear})}),
):
    model = tree()
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper, **kwargs)
    wrapped[how] = sorted(n for n, m in model.named_modules() if isinstance(m, CheckpointWrapper))
out["activation_checkpointing"] = wrapped

# FSDP1 through the alias is fsdp's and trains (1 rank).
model = tf.FullyShardedDataParallel(torch.nn.Linear(4, 4), auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}))
model(torch.ones(2, 4)).sum().backward()
out["fsdp1_wrapper_module"] = type(model).__module__

# Undo: torch's own package comes back and torch's FSDP1 works.
handle.undo()
handle.undo()  # twice is fine
out["active_after_undo"] = handle.active
out["left_after_undo"] = sorted(m for m in sys.modules if m.startswith(TF) and "._fully_shard" not in m)
import torch.distributed.fsdp as real
out["real_after_undo"] = [real.FullyShardedDataParallel.__module__, real.ShardingStrategy is fsdp.ShardingStrategy,
                          real.fully_shard is fully_shard]
warnings.simplefilter("ignore")
torch_model = real.FullyShardedDataParallel(torch.nn.Linear(4, 4), device_id=torch.device("cpu"))
torch_model(torch.ones(2, 4)).sum().backward()
out["torch_fsdp1_after_undo"] = type(torch_model).__module__
out["new_handle_after_undo"] = fsdp.redirect_torch_fsdp() is not handle
dist.destroy_process_group()
print(json.dumps(out))
"""


def _free_port() -> str:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


@pytest.fixture(scope="module")
def main_child() -> Dict[str, Any]:
    os.environ["PORT"] = _free_port()
    try:
        return _run_child(_MAIN_CHILD)
    finally:
        del os.environ["PORT"]


def test_call_imports_nothing_of_torch_fsdp(main_child: Dict[str, Any]) -> None:
    assert main_child["idempotent"] is True
    assert main_child["preloaded"] == []
    # Only the alias package and fsdp's public modules under torch's names: no torch FSDP code.
    assert main_child["loaded_by_call"] == sorted(
        [TORCH_FSDP] + [f"{TORCH_FSDP}.{m}" for m in ("api", "fully_sharded_data_parallel", "sharded_grad_scaler", "wrap")]
    )


def test_fsdp1_names_resolve_to_fsdp(main_child: Dict[str, Any]) -> None:
    assert len(main_child["fsdp1_names_ours"]) == 17
    assert all(main_child["fsdp1_names_ours"].values()), main_child["fsdp1_names_ours"]
    assert main_child["attr_on_torch_distributed"] is True
    assert main_child["from_submodules_ours"] == [True] * 10
    assert main_child["fsdp1_wrapper_module"] == "fsdp.fully_sharded_data_parallel"


def test_fsdp2_and_torch_private_modules_stay_torchs(main_child: Dict[str, Any]) -> None:
    assert all(m.startswith(f"{TORCH_FSDP}._fully_shard.") for m in main_child["fsdp2_modules"])
    assert main_child["fsdp2_is_fsdp_module"] is True
    assert main_child["fsdp2_matches_local"] is True
    assert main_child["private_import_failures"] == []
    assert main_child["private_is_torch_file"] is True


def test_torch_distributed_checkpoint_works(main_child: Dict[str, Any]) -> None:
    # Imported after the call, DCP's state_dict helpers see fsdp's wrapper class.
    assert main_child["dcp_state_dict_binds_ours"] is True
    assert main_child["dcp_roundtrip"] is True


def test_apply_activation_checkpointing_works(main_child: Dict[str, Any]) -> None:
    expected = ["0", "1.0"]
    assert main_child["activation_checkpointing"] == {"check_fn": expected, "policy": expected}


def test_undo_restores_torch(main_child: Dict[str, Any]) -> None:
    assert main_child["active_after_undo"] is False
    assert main_child["left_after_undo"] == []
    assert main_child["real_after_undo"] == [f"{TORCH_FSDP}.fully_sharded_data_parallel", False, True]
    assert main_child["torch_fsdp1_after_undo"] == f"{TORCH_FSDP}.fully_sharded_data_parallel"
    assert main_child["new_handle_after_undo"] is True


def test_torch_package_already_imported_warns() -> None:
    out = _run_child(
        r"""
        import json, sys, warnings
        import torch.distributed.checkpoint.state_dict as dcp_sd  # imports torch's fsdp package
        import fsdp
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            handle = fsdp.redirect_torch_fsdp()
        from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
        import torch.distributed.fsdp._common_utils as common
        print(json.dumps({
            "warnings": [str(w.message) for w in caught if issubclass(w.category, UserWarning)],
            "preloaded": len(handle.preloaded),
            "now_ours": FullyShardedDataParallel is fsdp.FullyShardedDataParallel,
            "bound_before_stays_torchs": dcp_sd.FSDP is not fsdp.FullyShardedDataParallel,
            "private_kept": common.__name__ == "torch.distributed" + ".fsdp._common_utils",
            "fsdp2_torchs": fully_shard is sys.modules["torch.distributed" + ".fsdp._fully_shard"].fully_shard,
        }))
        """
    )
    assert len(out["warnings"]) == 1 and "already imported" in out["warnings"][0]
    assert "before importing the training stack" in out["warnings"][0]
    assert out["preloaded"] > 10
    assert out["now_ours"] is True
    assert out["bound_before_stays_torchs"] is True
    assert out["private_kept"] is True
    assert out["fsdp2_torchs"] is True


def test_runner_runs_a_script_unchanged(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "user_script.py"
    script.write_text(
        textwrap.dedent(
            """
            import json, sys
            from torch.distributed.fsdp import FullyShardedDataParallel
            from helper_next_to_script import VALUE  # the script's folder is on the path
            if __name__ == "__main__":
                print(json.dumps({"module": FullyShardedDataParallel.__module__, "argv": sys.argv, "value": VALUE}))
            """
        )
    )
    (tmp_path / "helper_next_to_script.py").write_text("VALUE = 7\n")
    out = _run_child("", args=["-m", "fsdp.torch_alias", str(script), "--flag", "x"])
    assert out == {"module": "fsdp.fully_sharded_data_parallel", "argv": [str(script), "--flag", "x"], "value": 7}
    # The -m MODULE form: the module runs as __main__ with its arguments.
    (tmp_path / "probe_module.py").write_text(
        "import json, sys\n"
        "from torch.distributed.fsdp.wrap import ModuleWrapPolicy\n"
        "if __name__ == '__main__':\n"
        "    print(json.dumps({'module': ModuleWrapPolicy.__module__, 'argv': sys.argv[1:]}))\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    out = _run_child("", args=["-m", "fsdp.torch_alias", "-m", "probe_module", "a", "b"])
    assert out == {"module": "fsdp.wrap", "argv": ["a", "b"]}
    help_out = run_python(["-m", "fsdp.torch_alias", "--help"], env={**os.environ, "PYTHONPATH": REPO_ROOT}, timeout=120)
    assert help_out.returncode == 0 and "usage: python -m fsdp.torch_alias" in help_out.stdout


# ------------------------------------------------------------------------------------------------
# The private wrap helpers the alias's wrap module adds, against torch's own (in this process:
# importing fsdp.torch_alias._wrap_compat installs nothing).
# ------------------------------------------------------------------------------------------------


class _Marker(nn.Module):
    """A stand-in wrapper that records the kwargs it was built with."""

    def __init__(self, module: Any, **kwargs: Any) -> None:
        super().__init__()
        self.inner = module
        self.kwargs = kwargs


def _tree() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 8),
        nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 4), nn.LayerNorm(4))),
        nn.LayerNorm(8),
    )


def _layout(model: Any) -> List[Tuple[str, str, Dict[str, Any]]]:
    return [
        (name, type(module.inner).__name__, module.kwargs)
        for name, module in model.named_modules()
        if isinstance(module, _Marker)
    ]


def test_wrap_compat_helpers_match_torch() -> None:
    import functools

    import torch.distributed.fsdp.wrap as torch_wrap

    from fsdp.torch_alias import _wrap_compat as ours

    # _recursive_wrap (torch's signature): the same wrapped modules, kwargs and wrapped numel.
    policy = functools.partial(torch_wrap.size_based_auto_wrap_policy, min_num_params=100)
    for only_children in (True, False):
        results = []
        for impl in (torch_wrap._recursive_wrap, ours._recursive_wrap):
            model = _tree()
            wrapped, numel = impl(
                module=model,
                auto_wrap_policy=policy,
                wrapper_cls=_Marker,
                ignored_modules=set(),
                ignored_params=set(),
                only_wrap_children=only_children,
                tag="x",
            )
            results.append((type(wrapped).__name__, numel, _layout(wrapped)))
        assert results[0] == results[1], only_children
        assert results[0][2], "the policy wraps something"

    # _post_order_apply + _construct_wrap_fn with policy targets (apply_activation_checkpointing's path).
    layouts = []
    for impl in (torch_wrap, ours):
        model = _tree()
        targets = {m: {"k": i} for i, m in enumerate(model.modules()) if isinstance(m, (nn.Linear, nn.Sequential))}
        impl._post_order_apply(model, impl._construct_wrap_fn(model, targets, _Marker))
        layouts.append(_layout(model))
    assert layouts[0] == layouts[1] and len(layouts[0]) == 5  # 3 Linears, 2 inner Sequentials; never the root

    # _run_mixed_precision_override_policy: the same targets, mixed_precision=None on each.
    overrides = []
    for impl in (torch_wrap, ours):
        model = _tree()
        names = {m: n for n, m in model.named_modules()}
        ignored = {model[1][2]}
        out = impl._run_mixed_precision_override_policy(
            model, {nn.LayerNorm}, ignored, {"mixed_precision": "bf16", "a": 1}, {model[0]: {"b": 2}}
        )
        overrides.append(sorted((names[m], sorted(kw.items())) for m, kw in out.items()))
    assert overrides[0] == overrides[1]

    # The functional policies.
    linear, norm = nn.Linear(2, 2), nn.LayerNorm(2)
    for module in (linear, norm):
        for recurse in (True, False):
            args = dict(module=module, recurse=recurse, nonwrapped_numel=6)
            assert ours._wrap_module_cls_individually(
                module_classes={nn.Linear}, **args
            ) == torch_wrap._wrap_module_cls_individually(module_classes={nn.Linear}, **args)
            policies = [functools.partial(torch_wrap._wrap_module_cls_individually, module_classes={nn.Linear})]
            assert ours._or_policy(policies=policies, **args) == torch_wrap._or_policy(policies=policies, **args)
