"""The planner on the example trainer's own configuration, and the cuBLAS workspaces it adds on CUDA.

On an H200 the trainer's small model at one rank (``--model small``: batch 16 x 64, AdamW, one
block per unit) reported a step peak (``torch.cuda.max_memory_allocated``) of 350 MiB where the
planner predicted 277 MiB, while it is within 2.6% of the GPU at 10M-1B in
benchmarks/validate_plan.py. The difference is not in the step's tensors: on CPU, the trainer's
own set-up and step (``examples.train._setup`` / ``_step``) measure what the planner predicts
(``test_trainer_small_model_predicted_vs_measured_on_cpu``). It is the cuBLAS workspaces
([Note: cuBLAS workspaces] in fsdp/plan/_workspace.py): 32 MiB each on an H200, one for the
forward's thread and one for autograd's backward thread, allocated by torch's caching allocator
(so in ``max_memory_allocated``), and in validate_plan's baseline (taken after a warm-up step),
hence not in its measurement. The planner now counts them on CUDA: 277 + 64 = 341 MiB, -2.6%
of the H200's 350 MiB (the figure and its arithmetic are checked here; no GPU runs this file).
"""

from __future__ import annotations

import gc
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests._harness import RankPool

MIB = 2**20


def _trainer_args(*flags: str) -> Any:
    from examples.train import parse_args

    return parse_args(["--model", "small", "--checkpoint-dir", "", *flags])


def _predict(device: str, world_size: int = 1) -> Any:
    """The trainer's prediction (``predict_memory``) for ``device``."""
    from examples.data import CharTokenizer, load_corpus
    from examples.train import predict_memory

    args = _trainer_args()
    vocab = CharTokenizer(load_corpus()).vocab_size
    if device == "cpu":
        return predict_memory(args, vocab, world_size)
    from fsdp import estimate_memory
    from examples.train import ADAMW_KWARGS, _fsdp_kwargs, _model_config, _next_token_loss
    from fsdp.plan.gpt import GPT

    with torch.device("meta"):
        model = GPT(_model_config(args, vocab))
    return estimate_memory(
        model,
        torch.empty(args.batch_size, args.seq_len, dtype=torch.long, device="meta"),
        world_size=world_size,
        optimizer_kwargs={"lr": args.lr, **ADAMW_KWARGS},
        loss_fn=lambda logits: _next_token_loss(logits, torch.empty(logits.shape[:-1], dtype=torch.long)),
        **_fsdp_kwargs(args, torch.device(device)),
    )


def test_cublas_workspace_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's defaults (``:4096:8`` KiB from compute capability 9, ``:4096:2:16:8`` before) and
    ``CUBLAS_WORKSPACE_CONFIG``'s pairs, summed."""
    from fsdp.plan._workspace import cublas_workspace_bytes

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert cublas_workspace_bytes(9) == cublas_workspace_bytes(10) == 32 * MIB
    assert cublas_workspace_bytes(8) == (4096 * 2 + 16 * 8) * 1024  # 8.125 MiB
    if not torch.cuda.is_available():
        assert cublas_workspace_bytes() == 32 * MIB  # no GPU to ask: an H100-class one
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    assert cublas_workspace_bytes(9) == 128 * 1024
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:2:16:8")
    assert cublas_workspace_bytes(9) == (4096 * 2 + 16 * 8) * 1024


def test_cuda_plan_counts_two_cublas_workspaces(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the trainer's plan holds two workspaces for the whole step, on CPU none; nothing
    else changes at the peak (the backward's, where foreach optimizer temporaries are not)."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    if torch.cuda.is_available():
        pytest.skip("the arithmetic below is for an H200 (capability 9.0); this machine has its own GPU")
    on_cpu, on_cuda = _predict("cpu"), _predict("cuda")
    assert "cuBLAS workspaces" not in on_cpu.breakdown
    assert on_cuda.breakdown["cuBLAS workspaces"] == 2 * 32 * MIB
    assert on_cuda.peak_phase == on_cpu.peak_phase == "backward"
    assert on_cuda.peak_bytes - on_cpu.peak_bytes == 2 * 32 * MIB
    # The H200 run: 350 MiB measured; 277 MiB predicted without the workspaces.
    assert round(on_cpu.peak_bytes / MIB) == 277
    assert abs(on_cuda.peak_bytes / MIB - 350) / 350 < 0.03


def trainer_phase() -> dict[str, int]:
    """One rank: the trainer's small model, its set-up and steps, as it runs them; the peak RSS
    of a steady-state step above the baseline before the model ([Note: Measuring peak RSS])."""
    from examples.train import _setup, _step
    from fsdp.plan._measure import peak_rss_bytes, reset_peak_rss, rss_bytes, set_mmap_threshold

    assert set_mmap_threshold(65536)
    args = _trainer_args()
    peak = 0
    # Trained once unmeasured first ([Note: One-time kernel state] in fsdp/plan/_measure.py).
    for measured in (False, True):
        gc.collect()
        base = rss_bytes()
        run = _setup(dist.get_rank(), 1, torch.device("cpu"), "gloo", args)
        _step(run, 0, time.perf_counter())  # optimizer state, lazy init
        if measured:
            gc.collect()
            reset_peak_rss()
            _step(run, 1, time.perf_counter())
            peak = peak_rss_bytes() - base
        del run
        gc.collect()
    return {"peak": peak}


def test_trainer_small_model_predicted_vs_measured_on_cpu(pool1: RankPool) -> None:
    """The planner's prediction of the trainer's small model (what its CPU summary prints) against
    the trainer's own step measured on CPU, within 1% (2.8 MiB): what the RSS adds to live tensors
    is under 1 MiB of heap-resident small tensors and page rounding (docs/memory.md), and the
    trainer's step keeps only a few small tensors besides (its per-step statistics); the
    planner's 10% target would hide the 64 MiB question this file is about."""
    measured = pool1.run(trainer_phase)[0]["peak"]
    predicted = _predict("cpu").peak_bytes
    error = (predicted - measured) / measured
    print(f"predicted {predicted / MIB:.1f} MiB, measured {measured / MIB:.1f} MiB, {error:+.1%}")
    assert abs(error) < 0.01, (predicted / MIB, measured / MIB)
