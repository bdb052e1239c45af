"""Four of torch's own FSDP1 tests, reproduced with torch FSDP1 as the oracle (issue 31, item 8):
the same scenario through both libraries, compared at every point torch's test checks.

- ``test_fsdp_use_orig_params.py``'s ``TestFSDPUseOrigParamsNoSync::test_no_sync_correctness``:
  a ``no_sync`` backward and a synchronized one, with and without ``use_orig_params``;
- ``TestFSDPUseOrigParamsMultipleParamGroups::test_multiple_optimizers``: two optimizers, only
  one of which sets its gradients to None, read after the next forward;
- ``TestFSDPUseOrigParamsParamAccess::test_access_params_after_forward``: the parameters a
  forward leaves visible, before its backward;
- ``test_wrap.py``'s ``TestAutoWrap::test_frozen_params``: the UserWarning (use_orig_params) or
  ValueError for a unit mixing frozen and trainable parameters, per policy.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests._harness import RankPool
from tests._models import global_batch, lm_loss, local_rows, make_toy
from tests.test_orig_params_grads import STRATEGIES, assert_same, snapshot
from tests.test_orig_params_torch_attrs import _units, _wrap
from tests.test_parity import _full_params


def _libs(lib: str) -> tuple[Any, Any]:
    """(the wrapper class, the wrap module) of ``lib``."""
    if lib == "ours":
        import fsdp
        import fsdp.wrap

        return fsdp.FullyShardedDataParallel, fsdp.wrap
    import torch.distributed.fsdp as torch_fsdp
    import torch.distributed.fsdp.wrap as torch_wrap

    return torch_fsdp.FullyShardedDataParallel, torch_wrap


def _fsdp(lib: str, model: nn.Module, strategy: str, **kwargs: Any) -> nn.Module:
    from fsdp import ShardingStrategy
    from torch.distributed.fsdp import ShardingStrategy as TorchStrategy

    cls, _ = _libs(lib)
    if lib == "torch":
        kwargs["device_id"] = torch.device("cpu")
    enum = ShardingStrategy if lib == "ours" else TorchStrategy
    return cls(model, sharding_strategy=enum[strategy], **kwargs)


# ----------------------------------------------------------------------------- no_sync


USE_ORIG_PARAMS = (True, False)
HYBRID = ["HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"]


def no_sync_correctness() -> int:
    """torch's test (hybrid strategies added): ``nn.Linear(7, 1, bias=False)`` as one unit; a reference backward, then
    ``zero_grad(set_to_none=True)``, a backward inside ``no_sync`` and one outside: the
    gradients are twice the reference. Checked here against torch FSDP1 for both
    ``use_orig_params`` values, at each of torch's checks and after each forward: the
    FlatParameter (a unit kept gathered shows its local shard, [Note: A kept unit shows its
    local shard]) and its ``.grad`` (inside ``no_sync`` the accumulated unsharded gradient,
    [Note: The gradient no_sync accumulates]), bit for bit, None where torch's is None.

    Also, per configuration, a second pass that clips inside ``no_sync`` (the clipped gradients
    and the norm equal torch's), ``summon_full_params(with_grads=True)`` inside ``no_sync``
    (torch FSDP1 refuses or asserts there; fsdp shows this rank's accumulated gradient and
    changes nothing), and memory: ``zero_grad(set_to_none=True)`` inside ``no_sync`` frees the
    accumulated gradient's storage at once, in both libraries."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    base = nn.Linear(7, 1, bias=False)
    inp, grad = torch.randn(2, 7), torch.randn(2, 1)
    compared = 0
    ws = dist.get_world_size()
    for strategy in STRATEGIES + (HYBRID if ws > 1 else []):
        # Hybrid: shard in pairs, replicate across them.
        mesh = {"device_mesh": init_device_mesh("cpu", (ws // 2, 2))} if strategy in HYBRID else {}
        for use_orig_params in USE_ORIG_PARAMS:
            for clip in (False, True):
                log: dict[str, list[tuple[str, Any]]] = {}
                for lib in ("ours", "torch"):
                    model = _fsdp(lib, _copy(base), strategy, use_orig_params=use_orig_params, **mesh)
                    log[lib] = _no_sync_points(lib, model, inp, grad, clip)
                where = f"{strategy}, use_orig_params={use_orig_params}, clip={clip}"
                for (point, mine), (_, theirs) in zip(log["ours"], log["torch"], strict=True):
                    if point.startswith("norm") or point.startswith("freed"):
                        assert mine == theirs, (where, point, mine, theirs)
                    else:
                        assert_same(mine, theirs, f"{where}, {point}")
                    compared += 1
    return compared


def _no_sync_points(lib: str, model: nn.Module, inp: torch.Tensor, grad: torch.Tensor, clip: bool) -> list[tuple[str, Any]]:
    """One library's run of the scenario: ``(point, what it shows)`` at each point."""
    optim = torch.optim.AdamW(model.parameters(), foreach=True)
    points: list[tuple[str, Any]] = []
    model(inp).backward(grad)
    points.append(("reference backward", snapshot(model)))
    reference = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    optim.zero_grad(set_to_none=True)
    with model.no_sync():  # type: ignore[operator]
        out = model(inp)
        points.append(("forward inside no_sync", snapshot(model)))
        out.backward(grad)
        if lib == "ours":
            _check_summon_inside_no_sync(model)
        points.append(("backward inside no_sync", snapshot(model)))
        if clip:
            points.append(("norm", model.clip_grad_norm_(0.05).item()))  # type: ignore[operator]
            points.append(("clipped inside no_sync", snapshot(model)))
    out = model(inp)
    points.append(("forward after no_sync", snapshot(model)))
    out.backward(grad)
    points.append(("synchronized backward", snapshot(model)))
    if not clip:
        # torch's test's own check: two accumulated backwards, twice the reference.
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert len(grads) == len(reference) and all(torch.equal(g, 2 * r) for g, r in zip(grads, reference))
    # Memory: the accumulated unsharded gradient's only reference is ``.grad``.
    optim.zero_grad(set_to_none=True)
    with model.no_sync():  # type: ignore[operator]
        model(inp).backward(grad)
        storages = [weakref_storage(u._flat_param.grad) for u in _units(model) if u._flat_param.grad is not None]
        optim.zero_grad(set_to_none=True)
    points.append(("zero_grad inside no_sync", snapshot(model)))
    points.append(("freed", (len(storages), [torch.UntypedStorage._expired(ref) for ref in storages])))
    return points


def weakref_storage(tensor: torch.Tensor) -> int:
    """A weak reference to ``tensor``'s storage (``torch.UntypedStorage._expired`` reads it)."""
    return tensor.untyped_storage()._weak_ref()


def _check_summon_inside_no_sync(model: nn.Module) -> None:
    """``summon_full_params(with_grads=True)`` inside ``no_sync``: each parameter's ``.grad`` is
    its part of this rank's accumulated unsharded gradient (the FlatParameter's ``.grad``, which
    the snapshots compare with torch FSDP1's), and nothing changes (the next snapshot is
    compared too)."""
    from fsdp import FullyShardedDataParallel as FSDP

    flat_grad = model._flat_param.grad.clone()  # type: ignore[union-attr]
    with FSDP.summon_full_params(model, with_grads=True):
        (param,) = list(model.parameters())
        assert param.grad is not None and torch.equal(param.grad.flatten(), flat_grad[: param.numel()])


def _copy(module: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(module)


@pytest.mark.parametrize("dist_pool", [1, 2, 4], indirect=True)
def test_no_sync_correctness(dist_pool: RankPool) -> None:
    strategies = len(STRATEGIES) + (len(HYBRID) if dist_pool.world_size > 1 else 0)
    assert dist_pool.run(no_sync_correctness) == [strategies * len(USE_ORIG_PARAMS) * (7 + 9)] * dist_pool.world_size


# ----------------------------------------------------------------------------- optimizers


def multiple_optimizers() -> int:
    """torch's test: Adam over the weights and AdamW over the biases (both count steps, which
    a None gradient skips and a zero one does not); after one iteration only the weights'
    optimizer sets its gradients to None, then a forward: the gradients read there (None for
    the weights, the biases' kept ones) and everything after the backward and both steps are
    torch FSDP1's, bit for bit."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    compared = 0
    for strategy in STRATEGIES:
        log: dict[str, list[tuple[str, Any]]] = {}
        for lib in ("ours", "torch"):
            model = _wrap(lib, make_toy(), strategy, True)
            named = list(model.named_parameters())
            optims = [
                torch.optim.Adam([p for n, p in named if "bias" not in n], lr=5e-3),
                torch.optim.AdamW([p for n, p in named if "bias" in n], lr=1e-2),
            ]
            points: list[tuple[str, Any]] = []
            log[lib] = points

            def forward(step: int) -> torch.Tensor:
                tokens, targets = global_batch(step, ws)
                return lm_loss(model(local_rows(tokens, rank, ws)), local_rows(targets, rank, ws))

            forward(0).backward()
            for optim in optims:
                optim.step()
            optims[0].zero_grad(set_to_none=True)  # only the weights' gradients become None
            points.append(("weights' zero_grad", snapshot(model)))
            loss = forward(1)
            points.append(("forward", snapshot(model)))
            loss.backward()
            points.append(("backward", snapshot(model)))
            for optim in optims:
                optim.step()
            forward(2).backward()
            for optim in optims:
                optim.step()
            points.append(("one more iteration", snapshot(model)))
            points.append(("full parameters", _full_params(model, type(model))))
        for (where, mine), (_, theirs) in zip(log["ours"], log["torch"], strict=True):
            if where == "full parameters":
                assert list(mine) == list(theirs) and all(torch.equal(mine[n], theirs[n]) for n in mine), strategy
            else:
                assert_same(mine, theirs, f"{strategy}, {where}")
            compared += 1
    return compared


@pytest.mark.parametrize("dist_pool", [1, 2, 4], indirect=True)
def test_multiple_optimizers(dist_pool: RankPool) -> None:
    assert dist_pool.run(multiple_optimizers) == [3 * 5] * dist_pool.world_size


# ----------------------------------------------------------------------------- access


class _TwoLinears(nn.Module):
    """torch's test's model: 25 and 43 numel (with use_orig_params' alignment padding, 13 and
    22 elements per rank at world size 2, lin2.bias all on rank 1)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(42)
        self.lin1 = nn.Linear(5, 5, bias=False)
        self.lin2 = nn.Linear(5, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(nn.functional.relu(self.lin1(x)))


def access_params_after_forward() -> int:
    """torch's test: each ``Linear`` its own unit (``always_wrap_policy``); the parameters read
    after a forward, before its backward (their types, shapes, values and gradients), after a
    step, and after the next forward, against torch FSDP1 (FULL_SHARD: the sharded 1-D
    parameters; NO_SHARD: the original shapes; SHARD_GRAD_OP: the unsharded views)."""
    compared = 0
    for strategy in STRATEGIES:
        log: dict[str, list[tuple[str, dict[str, Any]]]] = {}
        for lib in ("ours", "torch"):
            model = _fsdp(lib, _TwoLinears(), strategy, auto_wrap_policy=_libs(lib)[1].always_wrap_policy, use_orig_params=True)
            optim = torch.optim.Adam(model.parameters(), lr=1e-2)
            points: list[tuple[str, dict[str, Any]]] = []
            log[lib] = points
            torch.manual_seed(1 + dist.get_rank())
            inputs = [torch.randn(2, 5) for _ in range(3)]
            for step, x in enumerate(inputs):
                out = model(x)
                points.append((f"{step}: after forward", snapshot(model)))
                out.sum().backward()
                optim.step()
                points.append((f"{step}: after the step", snapshot(model)))
        for (where, mine), (_, theirs) in zip(log["ours"], log["torch"], strict=True):
            assert_same(mine, theirs, f"{strategy}, {where}")
            compared += 1
    return compared


def test_access_params_after_forward(pool2: RankPool) -> None:
    assert pool2.run(access_params_after_forward) == [3 * 6] * 2


# ----------------------------------------------------------------------------- frozen params


class _LoraAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(8, 8, bias=False)
        self.lora_A = nn.Linear(8, 2, bias=False)
        self.lora_B = nn.Linear(2, 8, bias=False)
        self.o_proj = nn.Linear(8, 8, bias=False)
        self.q_proj.requires_grad_(False)
        self.o_proj.requires_grad_(False)


class _LoraDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = _LoraAttention()
        self.mlp = nn.Sequential(nn.Linear(8, 16, bias=False), nn.Linear(16, 8, bias=False)).requires_grad_(False)
        self.norm = nn.LayerNorm(8).requires_grad_(False)


class _LoraModel(nn.Module):
    """torch's test's shape of model (smaller): frozen embedding and norm at the root, every
    decoder's attention mixing frozen projections with trainable LoRA factors."""

    def __init__(self, trainable_root: bool = False) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(10, 8).requires_grad_(False)
        self.layers = nn.ModuleList(_LoraDecoder() for _ in range(3))
        self.norm = nn.LayerNorm(8).requires_grad_(trainable_root)


def _policies(wrap: Any) -> dict[str, Any]:
    classes = (_LoraAttention, _LoraDecoder, nn.Sequential)

    def nonuniform(module: nn.Module) -> Any:
        if isinstance(module, _LoraAttention):
            return {"limit_all_gathers": False}
        return isinstance(module, classes)

    return {
        "module": wrap.ModuleWrapPolicy(set(classes)),
        "custom": wrap.CustomPolicy(lambda m: isinstance(m, classes)),
        "custom non-uniform": wrap.CustomPolicy(nonuniform),
        # A policy object that picks the root too (torch checks every module it picks).
        "custom with the root": wrap.CustomPolicy(lambda m: isinstance(m, classes + (_LoraModel,))),
        # A callable policy: torch checks nothing here (use_orig_params=True: no warning).
        "callable": _callable_policy(wrap, classes),
    }


def _callable_policy(wrap: Any, classes: tuple[type, ...]) -> Any:
    import functools

    return functools.partial(wrap.lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, classes))


def frozen_params() -> list[str]:
    """Every policy of torch's test (and two more), both ``use_orig_params`` values, a root
    with and without trainable parameters: the warnings (category, unit, first two sentences'
    start and the parameter lists) or the ValueError are torch FSDP1's, in torch's order, with
    the frozen-parameter warnings before any other warning of the construction."""
    seen: list[str] = []
    for trainable_root in (False, True):
        for policy_name in _policies(_libs("ours")[1]):
            for use_orig_params in (True, False):
                results = {}
                for lib in ("ours", "torch"):
                    cls, wrap = _libs(lib)
                    kwargs: dict[str, Any] = {"device_id": torch.device("cpu")} if lib == "torch" else {}
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        try:
                            cls(
                                _LoraModel(trainable_root),
                                auto_wrap_policy=_policies(wrap)[policy_name],
                                use_orig_params=use_orig_params,
                                **kwargs,
                            )
                            error = None
                        except ValueError as exc:
                            error = str(exc)
                    frozen = [
                        (w.category.__name__, _sentences(str(w.message)))
                        for w in caught
                        if "requires_grad=True and False" in str(w.message)
                    ]
                    first = [_sentences(str(w.message)) for w in caught[: len(frozen)]]
                    results[lib] = (frozen, first, error)
                where = (trainable_root, policy_name, use_orig_params)
                (ours, our_first, our_error), (theirs, their_first, their_error) = results["ours"], results["torch"]
                assert (ours, our_first) == (theirs, their_first), (where, results)
                # An error contains torch's sentence (up to its parameter lists).
                assert (our_error is None) == (their_error is None), (where, results)
                if their_error is not None:
                    for sentence in their_error.split("\n")[0].rstrip(" .").split(". "):
                        assert sentence in our_error, (where, sentence, our_error)
                    if "\n" in their_error:  # (a policy object: torch lists the parameters)
                        assert their_error.split("\n")[1:] == our_error.split("\n")[1:], (where, results)
                seen.append(f"{where}: {len(results['torch'][0])} warnings, error {results['torch'][2] is not None}")
    return seen


def _sentences(message: str) -> tuple[str, str, list[str]]:
    """The unit's sentence, the start of the second (torch's words up to its reason) and the
    parameter lists; ``fsdp: `` prefixes dropped, and fsdp's name for the root (torch's is
    the empty string)."""
    message = message.removeprefix("fsdp: ")
    if message.startswith("<root "):  # torch names the root with its empty module name
        message = message[message.index(">") + 1 :]
    head, _, lists = message.partition("\n")
    first, _, rest = head.partition(". ")
    second = " ".join(rest.split()[:6])
    return first, second, lists.split("\n")


def test_frozen_params(pool1: RankPool) -> None:
    (seen,) = pool1.run(frozen_params)
    assert len(seen) == 2 * 5 * 2
    # torch's own expectations: warnings with use_orig_params, an error without (policy objects).
    assert "(False, 'module', True): 3 warnings, error False" in seen
    assert "(False, 'module', False): 0 warnings, error True" in seen
    assert "(True, 'custom with the root', True): 4 warnings, error False" in seen
    assert "(False, 'callable', True): 0 warnings, error False" in seen
