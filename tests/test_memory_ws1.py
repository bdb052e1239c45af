"""World size 1, the GPU benchmark's configuration: fsdp holds nothing at the step's peak that
torch FSDP1 frees ([Note: Only a gathered unit stays gathered] in ``fsdp/runtime/_prefetch.py``).

The scenario is ``python -m benchmarks --device cuda``'s at a small scale, built and wrapped by
the same code (``benchmarks.core``, with ``benchmarks.cuda``'s options): the example GPT, one
unit per block, ``MixedPrecision(param_dtype=bfloat16, reduce_dtype=float32)``, FULL_SHARD
(which both FSDP1 designs run as NO_SHARD at world size 1), AdamW. Its vocabulary is large
next to its width, as the benchmark's 50304 next to 2048 is, so the step's peak is the loss:
the logits, their fp32 copy and the log-softmax.
"""

from __future__ import annotations

import dataclasses
import gc
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from benchmarks.core import ModelSpec, WrapOptions, build_model, make_batches, make_optimizer, torch_fsdp, wrap
from benchmarks.memory import MemoryTrace
from tests._harness import RankPool, get_pool

SPEC = ModelSpec("gpt", layers=3, d_model=32, heads=4, batch=2, seq=64, vocab=2048)
OPTIONS = WrapOptions(strategy="FULL_SHARD", device=torch.device("cpu"), bf16=True)  # benchmarks/cuda.py's
STEPS = 3  # the first iteration records the orders; the later ones are the steady state


def _wrapped(impl: str, strategy: str = "FULL_SHARD") -> nn.Module:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*NO_SHARD.*")  # both FSDP1 designs say so at world size 1
        return wrap(impl, build_model(SPEC), dataclasses.replace(OPTIONS, strategy=strategy))


def _low_precision_copies(impl: str, model: nn.Module) -> dict[str, int]:
    """Bytes of each unit's low-precision (bf16) parameter copy that are allocated now.

    fsdp: the handle's ``param_dtype`` buffer; torch FSDP1: its handle's ``_mp_shard`` (at
    NO_SHARD the cast copy that forward and backward use).
    """
    if impl == "fsdp":
        from fsdp import FullyShardedDataParallel as FSDP

        buffers = {}
        for unit in FSDP.fsdp_modules(model):
            state = unit._fsdp_state
            buffers[state.unit_name] = state.handle.storage.padded_unsharded_low
    else:
        torch_fsdp1 = torch_fsdp().FullyShardedDataParallel
        names = {module: name for name, module in model.named_modules()}
        buffers = {}
        for unit in torch_fsdp1.fsdp_modules(model):
            name = names[unit].replace("_fsdp_wrapped_module.", "")
            buffers[name] = unit._handle.flat_param._mp_shard
    return {name: buf.untyped_storage().nbytes() for name, buf in buffers.items() if buf.untyped_storage().nbytes()}


def held_at_the_loss(impl: str, strategy: str = "FULL_SHARD") -> dict[str, Any]:
    """Trains ``STEPS`` steps; in each, which units hold their bf16 copy at the two moments of
    the step's peak (the cross entropy after the model's forward, and the log-softmax's
    backward, before the model's backward starts); and the final parameters."""
    model = _wrapped(impl, strategy)
    opt = make_optimizer(model)
    at_loss: list[dict[str, int]] = []
    at_loss_backward: list[dict[str, int]] = []
    for inputs, targets in make_batches(SPEC, STEPS):
        logits = model(inputs).float()
        at_loss.append(_low_precision_copies(impl, model))
        # Runs in the loss's backward, before any hook of the model (whose output is ``logits``'s input).
        logits.register_hook(lambda grad: at_loss_backward.append(_low_precision_copies(impl, model)))
        F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    with torch_fsdp().FullyShardedDataParallel.summon_full_params(model) if impl == "torch_fsdp1" else _summon(model):
        params = {name.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for name, p in model.named_parameters()}
    kept_unit = model._fsdp_state.ctx.unit_kept_for_backward if impl == "fsdp" else None
    kept = None if kept_unit is None else kept_unit.unit_name
    return {"at_loss": at_loss, "at_loss_backward": at_loss_backward, "params": params, "kept": kept}


def _summon(model: nn.Module) -> Any:
    from fsdp import FullyShardedDataParallel as FSDP

    return FSDP.summon_full_params(model)


@pytest.mark.parametrize("world_size, strategy", [(1, "FULL_SHARD"), (2, "NO_SHARD")], ids=["ws1", "ws2-NO_SHARD"])
def test_no_unit_holds_its_bf16_copy_through_the_loss(world_size: int, strategy: str) -> None:
    # World size 1 runs FULL_SHARD as NO_SHARD; at two ranks NO_SHARD is asked for (rank 0's view).
    pool = get_pool(world_size)
    ours = pool.run(held_at_the_loss, "fsdp", strategy)[0]
    theirs = pool.run(held_at_the_loss, "torch_fsdp1", strategy)[0]
    # torch FSDP1 frees every unit's NO_SHARD bf16 copy at its post-forward and casts it again
    # in its pre-backward: none is alive while the loss runs.
    assert theirs["at_loss"] == theirs["at_loss_backward"] == [{}] * STEPS
    # Ours too, from the first iteration on (the steady state once the orders are recorded
    # included: the last block's backward comes first there, yet it is not kept).
    assert ours["at_loss"] == theirs["at_loss"]
    assert ours["at_loss_backward"] == theirs["at_loss_backward"]
    assert ours["kept"] is None  # the orders were recorded, yet no NO_SHARD unit is kept
    # The same training, bit for bit.
    assert ours["params"].keys() == theirs["params"].keys()
    for name, value in theirs["params"].items():
        assert torch.equal(ours["params"][name], value), name


def step_peaks(impl: str) -> tuple[int, list[int]]:
    """Peak live bytes of ``STEPS`` training steps (model, optimizer and data made and
    released inside the trace), and each step's peak; the benchmark's own measure."""
    batches = make_batches(SPEC, STEPS)
    gc.collect()
    dist.barrier()
    with MemoryTrace() as trace:
        model = _wrapped(impl)
        opt = make_optimizer(model)
        for step, (inputs, targets) in enumerate(batches):
            with trace.window(f"step{step}"):
                logits = model(inputs).float()
                F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1)).backward()
                del logits
                opt.step()
                opt.zero_grad(set_to_none=True)
        del model, opt
        gc.collect()
    assert trace.all_threads
    return trace.final, [trace.peaks[f"step{step}"] for step in range(STEPS)]


def test_step_peak_at_most_torch_fsdp1_and_fsdp2() -> None:
    # The steady-state steps (from the second on) of the benchmark's configuration: fsdp's peak
    # is not above either torch design's in the same scenario. Before the note's fix, fsdp kept
    # the last block's bf16 copy through the loss: its peak was that copy's bytes higher.
    # A rank process of its own: the memory profiler the trace runs leaves the process's heap in
    # a state (memory kept resident) that made the RSS measurements of
    # tests/test_plan_measure.py, which run later in the shared one-rank pool, read 28-37% low.
    with RankPool(1) as pool:
        peaks = {impl: pool.run(step_peaks, impl)[0] for impl in ("fsdp", "torch_fsdp1", "torch_fsdp2")}
    final, ours = peaks["fsdp"]
    assert final == 0, "fsdp left memory allocated after the model was dropped"
    for impl in ("torch_fsdp1", "torch_fsdp2"):
        for step in range(1, STEPS):
            assert ours[step] <= peaks[impl][1][step], (impl, step, ours, peaks[impl][1])


def test_kept_unit_rule_needs_an_all_gather() -> None:
    # The rule the runtime and the planner share: the last block (3) of the forward, whose
    # backward comes right after the root's (0) with BACKWARD_PRE, is kept only where its
    # unshard is an all-gather.
    from fsdp.api import BackwardPrefetch
    from fsdp.runtime._prefetch import unit_kept_for_backward

    forward, backward, pre = [0, 1, 2, 3], [0, 3, 2, 1], BackwardPrefetch.BACKWARD_PRE
    assert unit_kept_for_backward(forward, backward, 0, pre, {0, 1, 2, 3}) == 3
    assert unit_kept_for_backward(forward, backward, 0, pre, {0, 1, 2}) is None
    assert unit_kept_for_backward(forward, backward, 0, pre, set()) is None
    assert unit_kept_for_backward(forward, backward, 0, BackwardPrefetch.BACKWARD_POST, {0, 1, 2, 3}) is None
