"""torch.compile of a wrapped model: the same results as torch FSDP1 compiled the same way, bit
for bit, with no more graph breaks, and the same Dynamo attributes on the managed modules.

Each case trains torch FSDP1 and fsdp one after the other in the same ranks (Dynamo's caches
reset in between: both wrap the same ``Block`` class, whose compiled code would be shared),
and prints both graph-break counts and first-step (compile) times: run with ``-s`` to see them.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests._harness import RankPool
from tests._preloaded import run_python
from tests._models import Block, global_batch, lm_loss, local_rows, make_toy
from tests.test_parity import _full_params

STEPS = 3
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Unrolled(nn.Module):
    """The toy model with each block called by name and user code between units: Dynamo traces
    the root's forward and breaks its graph at each unit (the toy's loop makes it skip that frame)."""

    def __init__(self) -> None:
        super().__init__()
        toy = make_toy()
        self.embed, self.head = toy.embed, toy.head
        self.b0, self.b1, self.b2 = toy.blocks

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.b0(self.embed(tokens))
        x = self.b2(self.b1(torch.relu(x) * 2))
        return self.head(x)


def _wrap(lib: str, model: nn.Module, strategy: str, use_orig_params: bool, **kwargs: Any) -> nn.Module:
    if lib == "ours":
        from fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
        from fsdp.wrap import ModuleWrapPolicy

        return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=ShardingStrategy[strategy], use_orig_params=use_orig_params, **kwargs)
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP, ShardingStrategy as TS
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TP

    return TorchFSDP(model, auto_wrap_policy=TP({Block}), sharding_strategy=TS[strategy], use_orig_params=use_orig_params, device_id=torch.device("cpu"), **kwargs)


def _fsdp_class(lib: str) -> Any:
    if lib == "ours":
        from fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel


def _bf16(lib: str) -> Any:
    if lib == "ours":
        from fsdp import MixedPrecision
    else:
        from torch.distributed.fsdp import MixedPrecision
    return MixedPrecision(param_dtype=torch.bfloat16)


def _warm_up(backend: str) -> None:
    """One small compile first, so neither library's timed first step pays the one-time costs."""
    import torch._dynamo

    torch._dynamo.reset()
    torch.compile(lambda x: torch.tanh(x) * 2, backend=backend)(torch.ones(3, requires_grad=True)).sum().backward()


def _train_compiled(lib: str, strategy: str, backend: str, use_orig_params: bool, unrolled: bool) -> dict[str, Any]:
    """STEPS AdamW steps of a compiled wrapped model; losses, final parameters and what Dynamo saw."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    rank, ws = dist.get_rank(), dist.get_world_size()
    if unrolled:  # with bf16 mixed precision: the input casts run in the pre-forward step
        torch.manual_seed(0)
        model = _wrap(lib, Unrolled(), strategy, use_orig_params, mixed_precision=_bf16(lib))
    else:
        model = _wrap(lib, make_toy(), strategy, use_orig_params)
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    losses, first_step_s = [], 0.0
    for step in range(STEPS):
        start = time.perf_counter()
        tokens, targets = global_batch(step, ws)
        loss = lm_loss(compiled(local_rows(tokens, rank, ws)), local_rows(targets, rank, ws))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step == 0:
            first_step_s = time.perf_counter() - start
        losses.append(loss.detach())
    return {
        "losses": losses,
        "params": _full_params(model, _fsdp_class(lib)),
        "graph_breaks": sum(counters["graph_break"].values()),
        "break_reasons": sorted(reason.split("\n")[0] for reason in counters["graph_break"]),
        "graphs": dict(counters["stats"]),
        "first_step_s": first_step_s,
    }


def compiled_parity(strategy: str, backend: str, use_orig_params: bool, unrolled: bool) -> dict[str, Any]:
    _warm_up(backend)
    if backend == "inductor":
        import torch._inductor.config as inductor_config

        # No FX-graph cache: the second library would reuse the first one's compiled graph.
        with inductor_config.patch(fx_graph_cache=False):
            theirs = _train_compiled("torch", strategy, backend, use_orig_params, unrolled)
            ours = _train_compiled("ours", strategy, backend, use_orig_params, unrolled)
    else:
        theirs = _train_compiled("torch", strategy, backend, use_orig_params, unrolled)
        ours = _train_compiled("ours", strategy, backend, use_orig_params, unrolled)
    for step, (a, b) in enumerate(zip(ours["losses"], theirs["losses"])):
        assert torch.equal(a, b), f"step {step}: loss {a.item()!r} != torch FSDP1's {b.item()!r}"
    assert ours["params"].keys() == theirs["params"].keys()
    for name, value in theirs["params"].items():
        assert torch.equal(ours["params"][name], value), name
    # The same module code compiled (the same graphs, the same operations captured), with no
    # more graph breaks than torch's.
    assert ours["graphs"] == theirs["graphs"], (ours["graphs"], theirs["graphs"])
    if use_orig_params:
        assert ours["graphs"].get("unique_graphs", 0) >= 1  # something was compiled at all
    assert ours["graph_breaks"] <= theirs["graph_breaks"], (ours["break_reasons"], theirs["break_reasons"])
    return {lib: {k: r[k] for k in ("graph_breaks", "break_reasons", "graphs", "first_step_s")} for lib, r in (("torch", theirs), ("ours", ours))}


def _report(case: str, results: list[dict[str, Any]]) -> None:
    for lib in ("torch", "ours"):
        r = results[0][lib]
        print(
            f"[compile {case}] {lib:5s}: graph breaks {r['graph_breaks']} {r['break_reasons']}, "
            f"graphs {r['graphs']}, first step {r['first_step_s']:.2f} s"
        )


@pytest.mark.parametrize(
    "world_size, strategy, backend, use_orig_params, model",
    [
        (1, "FULL_SHARD", "aot_eager", True, "toy"),
        (2, "FULL_SHARD", "aot_eager", True, "toy"),
        (2, "SHARD_GRAD_OP", "aot_eager", True, "unrolled"),
        (2, "FULL_SHARD", "aot_eager", False, "toy"),
        (2, "SHARD_GRAD_OP", "inductor", True, "toy"),
    ],
)
def test_compiled_equals_torch_fsdp1(
    pool1: RankPool, pool2: RankPool, world_size: int, strategy: str, backend: str, use_orig_params: bool, model: str
) -> None:
    pool = pool1 if world_size == 1 else pool2
    results = pool.run(compiled_parity, strategy, backend, use_orig_params, model == "unrolled", _timeout=300)
    _report(f"ws{world_size} {strategy} {backend} use_orig_params={use_orig_params} {model}", results)


def dynamo_attributes() -> None:
    """Torch FSDP1's ``_is_fsdp_managed_module`` / ``_fsdp_use_orig_params`` on the same modules."""

    def attributes(model: nn.Module) -> dict[str, tuple[Any, Any]]:
        return {
            name: (getattr(m, "_is_fsdp_managed_module", None), getattr(m, "_fsdp_use_orig_params", None))
            for name, m in model.named_modules()
        }

    for use_orig_params in (False, True):
        ours, theirs = make_toy(), make_toy()
        ours = _wrap("ours", ours, "FULL_SHARD", use_orig_params, ignored_modules=[ours.head])
        theirs = _wrap("torch", theirs, "FULL_SHARD", use_orig_params, ignored_modules=[theirs.head])
        assert attributes(ours) == attributes(theirs)
        assert attributes(ours)["_fsdp_wrapped_module.blocks.0._fsdp_wrapped_module.fc1"] == (True, use_orig_params)
        assert attributes(ours)["_fsdp_wrapped_module.head"] == (None, None)  # ignored


def test_dynamo_attributes_as_torch(pool2: RankPool) -> None:
    pool2.run(dynamo_attributes)


_MARKS_CHECK = """
import sys
import torch
{first}
from fsdp import FullyShardedDataParallel as FSDP
from fsdp.runtime import _hooks
assert ("torch._dynamo" in sys.modules) == {dynamo_first}, "import fsdp must not import Dynamo"
import torch._dynamo
# The first wrap installs what fsdp changes in torch ([Note: What fsdp changes in torch]).
import os, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}")
dist.init_process_group("gloo", rank=0, world_size=1)
FSDP(torch.nn.Linear(2, 2), device_id=torch.device("cpu"))
assert getattr(FSDP.forward, "_torchdynamo_disable_recursive", None) is False
assert getattr(_hooks.unit_forward, "_torchdynamo_disable_recursive", None) is False
assert getattr(_hooks._unit_pre_forward, "_torchdynamo_disable", None) is True
assert getattr(_hooks._post_forward, "_torchdynamo_disable", None) is True
assert torch._dynamo.__loader__ is torch._dynamo.__spec__.loader
assert type(torch._dynamo.__loader__).__name__ == "SourceFileLoader", torch._dynamo.__loader__
"""


@pytest.mark.parametrize("dynamo_first", [False, True], ids=["fsdp_first", "dynamo_first"])
def test_compile_markers_either_import_order(dynamo_first: bool) -> None:
    """The markers of [Note: torch.compile] are applied by the first wrap whether Dynamo is
    imported before fsdp or after it (by ``torch.compile``); ``import fsdp`` alone does not
    import Dynamo."""
    port = 29100 + os.getpid() % 500 + (500 if dynamo_first else 0)
    code = _MARKS_CHECK.format(first="import torch._dynamo" if dynamo_first else "", dynamo_first=dynamo_first, port=port)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = run_python(["-c", code], env=env, timeout=120)  # a fork of an interpreter that imported torch alone
    assert done.returncode == 0, done.stderr
