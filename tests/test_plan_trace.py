"""The planner's activation trace against the runtime: where each post-backward hook runs.

The memory planner replays FSDP's schedule on a trace of one forward and backward
([Note: Activation trace] in fsdp/plan/_trace.py). When a handle's post-backward runs decides
how long its unsharded parameters and gradients live, so the trace must place it where the
runtime's hook runs: after autograd runs the handle's views node, which for a unit whose
forward runs other units is later than its last gradient ([Note: Post-backward follows the
views node]). These tests run the real wrapper, record the order of its pre- and post-backward
hooks, and compare it with the trace's ``bwd_pre``/``bwd_post`` events for the same model.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests._harness import RankPool


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


class _Stage(nn.Module):
    """A unit whose own parameters are used only after its inner units: its gradients are
    complete before the inner units' backward starts."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(_Block(d), _Block(d))
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(x))


class _Nested(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.stages = nn.Sequential(_Stage(d), _Stage(d))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.inp(x)))


def _gpt(device: str, frozen_embeddings: bool) -> nn.Module:
    from fsdp.plan.gpt import GPT, GPTConfig

    with torch.device(device):
        model = GPT(GPTConfig(vocab_size=61, block_size=8, n_layer=3, n_head=2, d_model=16))
    if frozen_embeddings:
        model.tok_emb.weight.requires_grad_(False)
        model.pos_emb.weight.requires_grad_(False)
    return model


def _case(name: str, device: str) -> tuple[nn.Module, dict[str, Any], torch.Tensor, Callable[[Any], torch.Tensor]]:
    """(model, wrapper keywords, one input, loss function) of a named case."""
    from fsdp.plan.gpt import Block
    from fsdp.wrap import ModuleWrapPolicy

    if name == "nested stages":
        model: nn.Module = _Nested()
        model.to(device)
        policy = ModuleWrapPolicy({_Stage, _Block})
        inputs = torch.ones(4, 8, device=device)
        return model, {"auto_wrap_policy": policy}, inputs, lambda out: out.float().pow(2).sum()
    frozen = name == "gpt frozen embeddings"
    kwargs = {"auto_wrap_policy": ModuleWrapPolicy({Block}), "use_orig_params": frozen}
    inputs = torch.zeros(2, 8, dtype=torch.long, device=device)
    return _gpt(device, frozen), kwargs, inputs, lambda out: F.cross_entropy(out.flatten(0, 1).float(), out.new_zeros(16, dtype=torch.long))


CASES = ["gpt frozen embeddings", "gpt", "nested stages"]


def _runtime_orders(names: list[str]) -> dict[str, list[tuple[Any, ...]]]:
    """Rank function: :func:`_runtime_order` of each case."""
    return {name: _runtime_order(name) for name in names}


def _runtime_order(name: str) -> list[tuple[Any, ...]]:
    """The wrapper's pre-/post-backward hook order in the second step, as ``("bwd_pre", unit
    module name)`` and ``("bwd_post", unit module name, handle index)``."""
    import fsdp.runtime._hooks as hooks
    from fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    model, kwargs, _, loss_fn = _case(name, "cpu")
    names = {id(m): n for n, m in model.named_modules()}
    events: list[tuple[Any, ...]] = []
    original_pre, original_post = hooks._pre_backward_hook, hooks._post_backward_hook
    module_of: dict[int, str] = {}

    def pre(state: Any, grad: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if not state.ran_pre_backward:
            events.append(("bwd_pre", module_of[id(state)]))
        return original_pre(state, grad, **kwargs)

    def post(state_ref: Any, handle_ref: Any, flat_param: Any) -> None:
        state, handle = state_ref(), handle_ref()
        events.append(("bwd_post", module_of[id(state)], state.handles.index(handle)))
        original_post(state_ref, handle_ref, flat_param)

    hooks._pre_backward_hook, hooks._post_backward_hook = pre, post
    try:
        wrapped = FSDP(model, device_id=torch.device("cpu"), **kwargs)
        from fsdp.runtime._state import unit_state

        for unit in FSDP.fsdp_modules(wrapped):
            module_of[id(unit_state(unit))] = names[id(unit.module)]
        optim = torch.optim.SGD([p for p in wrapped.parameters() if p.requires_grad], lr=0.1)
        inputs = _case(name, "cpu")[2]
        for _ in range(2):
            events.clear()
            loss_fn(wrapped(inputs)).backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
    finally:
        hooks._pre_backward_hook, hooks._post_backward_hook = original_pre, original_post
    return events


def _traced_order(name: str) -> list[tuple[Any, ...]]:
    """The trace's ``bwd_pre``/``bwd_post`` events for the same case, by unit module name."""
    from fsdp.plan._api import _plan_units, _setup
    from fsdp.plan._trace import trace_forward_backward

    model, kwargs, inputs, loss_fn = _case(name, "meta")
    setup = _setup(model, 2, None, {**kwargs, "device_id": torch.device("cpu")})
    planned = _plan_units(model, setup, None)
    trace = trace_forward_backward(model, inputs, planned.units, planned.ignored_params, loss_fn, None)
    names = {id(m): n for n, m in model.named_modules()}
    unit_names = [names[id(u.module)] for u in planned.units]
    return [
        (event[0], unit_names[event[1]], *event[2:])
        for event in trace.events
        if event[0] in ("bwd_pre", "bwd_post")
    ]


@pytest.fixture(scope="module")
def runtime_orders(pool2: RankPool) -> dict[str, list[tuple[Any, ...]]]:
    per_rank = pool2.run(_runtime_orders, CASES)
    assert per_rank[0] == per_rank[1]  # both ranks run the same backward
    # Tuples come back from the ranks as lists.
    return {name: [tuple(e) for e in events] for name, events in per_rank[0].items()}


@pytest.mark.parametrize("name", CASES)
def test_trace_places_post_backward_where_the_runtime_runs_it(
    runtime_orders: dict[str, list[tuple[Any, ...]]], name: str
) -> None:
    assert _traced_order(name) == runtime_orders[name]


def test_frozen_embeddings_root_waits_for_the_whole_backward() -> None:
    # The case the rule was written for: the root's trainable handle (head and final LayerNorm)
    # has every gradient after the head's backward, yet its post-backward is the last event.
    events = _traced_order("gpt frozen embeddings")
    assert events[0] == ("bwd_pre", "")
    assert events[-1] == ("bwd_post", "", 0)
    assert [e for e in events if e[0] == "bwd_post"][:-1] == [("bwd_post", f"blocks.{i}", 0) for i in (2, 1, 0)]
