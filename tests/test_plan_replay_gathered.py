"""The planner's schedule replay holds, at every hook of a step, exactly the gathered parameters
the runtime holds.

The replay (fsdp/plan/_schedule.py, [Note: Schedule replay]) records after each hook of its
steady-state step the bytes of unsharded flat parameters it has gathered or prefetched
(``ReplayResult.gathered_at_hooks``). The runtime is measured on a real step on 2 CPU ranks: the
hooks of fsdp/runtime/_hooks.py are wrapped (before the model's first forward, so the hooks
registered at lazy init and on the outputs are the wrappers) and, after each, the padded
unsharded buffers' allocated bytes of every handle are summed. The step measured is the second:
the first records the execution order that the prefetches follow, as the replay's steady state
assumes. Every prefetch mode (BACKWARD_PRE, BACKWARD_POST, None; forward_prefetch on and off) with
FULL_SHARD and SHARD_GRAD_OP: the sequence of (hook, unit, bytes) must be equal, element for
element, so a replay that skips a prefetch (the last unit of an order, say) or keeps a unit
gathered that the runtime frees differs at that hook.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests._harness import RankPool

BATCH, SEQ, VOCAB = 2, 16, 64
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP")
BACKWARD_PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST", None)
CONFIGS = list(itertools.product(STRATEGIES, BACKWARD_PREFETCH, (False, True)))


def _gpt(device: str) -> Any:
    from fsdp.plan.gpt import GPT, GPTConfig

    # Odd sizes: the padded unsharded numel differs from the unpadded one.
    with torch.device(device):
        return GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=3, n_head=2, d_model=34))


def _fsdp_kwargs(strategy: str, backward_prefetch: Any, forward_prefetch: bool) -> dict[str, Any]:
    from fsdp import BackwardPrefetch, ShardingStrategy
    from fsdp.plan.gpt import Block
    from fsdp.wrap import ModuleWrapPolicy

    return {
        "auto_wrap_policy": ModuleWrapPolicy({Block}),
        "sharding_strategy": ShardingStrategy[strategy],
        "backward_prefetch": BackwardPrefetch[backward_prefetch] if backward_prefetch else None,
        "forward_prefetch": forward_prefetch,
        "device_id": torch.device("cpu"),
    }


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def _unit_name(name: str) -> str:
    """A unit's name in the unwrapped model (the planner's), from the runtime's."""
    return "" if name == "<root>" else name.replace("_fsdp_wrapped_module.", "")


def _wrap(hooks: Any, name: str, record: Callable[[str, Any], None], state_of: Callable[..., Any]) -> None:
    original = getattr(hooks, name)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        state = state_of(*args)
        first = not getattr(state, "ran_pre_backward", False)
        out = original(*args, **kwargs)
        if name != "_pre_backward_hook" or first:
            record(name, state)
        return out

    setattr(hooks, name, wrapper)


def runtime_phase(configs: list[tuple[str, Any, bool]]) -> dict[str, list[tuple[str, str, int]]]:
    """Per configuration, the runtime's (hook, unit, gathered bytes) after each hook of step 2."""
    import torch._dynamo  # noqa: F401 - imported before the hooks are wrapped: fsdp marks its hooks for dynamo at that import

    from fsdp import FullyShardedDataParallel as FSDP
    from fsdp.runtime import _hooks as hooks

    names = {"_pre_forward": "fwd_pre", "_post_forward": "fwd_post", "_pre_backward_hook": "bwd_pre",
             "_post_backward_hook": "bwd_post"}
    found: dict[str, list[tuple[str, str, int]]] = {}
    saved = {name: getattr(hooks, name) for name in names}
    try:
        for config in configs:
            log: list[tuple[str, str, int]] = []
            recording = [False]
            model_box: list[Any] = []

            def record(hook: str, state: Any) -> None:
                if not recording[0]:
                    return
                held = sum(
                    h.storage.unsharded_storage_nbytes()
                    for m in FSDP.fsdp_modules(model_box[0])
                    for h in m._fsdp_state.handles
                    if h.storage.has_unsharded_buffer
                )
                log.append((names[hook], _unit_name(state.unit_name), held))

            for name, original in saved.items():
                setattr(hooks, name, original)
            _wrap(hooks, "_pre_forward", record, lambda state: state)
            _wrap(hooks, "_post_forward", record, lambda state, output, owner=None: state)
            _wrap(hooks, "_pre_backward_hook", record, lambda state, grad, owner=None: state)
            _wrap(hooks, "_post_backward_hook", record, lambda state_ref, handle_ref, flat_param: state_ref())
            torch.manual_seed(0)
            model = FSDP(_gpt("cpu"), **_fsdp_kwargs(*config))
            model_box.append(model)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            gen = torch.Generator().manual_seed(dist.get_rank())
            for step in range(2):
                recording[0] = step == 1
                inputs = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
                loss = _loss(model(inputs), torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen))
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            found[repr(config)] = log
            del model, optimizer, model_box[:]
    finally:
        for name, original in saved.items():
            setattr(hooks, name, original)
    return found


def _replayed(config: tuple[str, Any, bool]) -> list[tuple[str, str, int]]:
    """The replay's (hook, unit, gathered bytes) for the same model, batch and keywords."""
    from fsdp.plan._api import _plan_units, _schedule, _setup, _trace

    model = _gpt("meta")
    setup = _setup(model, 2, None, _fsdp_kwargs(*config))
    planned = _plan_units(model, setup, None)
    inputs = torch.empty(BATCH, SEQ, dtype=torch.long, device="meta")
    loss_fn = lambda logits: _loss(logits, torch.empty(logits.shape[:-1], dtype=torch.long))  # noqa: E731
    trace = _trace(model, inputs, loss_fn, planned, setup, None)
    result = _schedule(model, planned, trace, (0, 0), setup)
    return [(hook, planned.units[u].name, nbytes) for hook, u, nbytes in result.gathered_at_hooks]


def test_replay_holds_the_runtimes_gathered_bytes_at_every_hook(pool2: RankPool) -> None:
    ranks = pool2.run(runtime_phase, CONFIGS)
    assert ranks[0] == ranks[1]  # the same shard sizes on both ranks (even padding)
    for config in CONFIGS:
        runtime = ranks[0][repr(config)]
        replayed = _replayed(config)
        # 4 units (root + 3 blocks): 4 pre- and post-forwards, 4 pre-backwards, 4 post-backwards.
        assert sorted(h for h, _, _ in runtime) == sorted(["fwd_pre", "fwd_post", "bwd_pre", "bwd_post"] * 4)
        assert any(nbytes for _, _, nbytes in runtime), config
        assert replayed == runtime, (config, [(i, r, p) for i, (r, p) in enumerate(zip(runtime, replayed)) if r != p])
