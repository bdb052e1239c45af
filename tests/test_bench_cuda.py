"""The GPU benchmark (``python -m benchmarks --device cuda``) without a GPU: its flags and
errors, the FLOP and MFU arithmetic against torch's FLOP counter, the report's medians, ratios
and targets from hand-made results, and the offload runs on CPU. The same measurement code end
to end on CPU (``--cpu-dry-run``: gloo, world size 1, a tiny GPT), JSON included, is the GPU
run's dry ``bench_eager`` step, asserted in tests/test_gpu_run.py."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from benchmarks import __main__ as bench_main
from benchmarks import cuda as _cuda
from benchmarks.config import (
    BenchConfig,
    CudaBenchConfig,
    block_params,
    gpt_params,
    layers_for_size,
    parse_args,
    parse_cuda_args,
    parse_device,
)
from benchmarks.core import build_model, make_batches, train_step, wrap
from benchmarks.report import (
    evaluate_targets,
    flops_per_token,
    format_gpu_report as format_report,
    format_offload,
    model_unit_numels,
    offload_copy_bytes,
    offload_limits,
    peak_flops,
    summarize_gpu as summarize,
    summarize_offload,
)
from fsdp.plan.gpt import GPT, GPTConfig
from tests._harness import RankPool

TINY_CFG = dict(layers=2, d_model=32, n_head=4, vocab=64, seq=16, batch=2, cpu_dry_run=True)


# ---------------------------------------------------------------------------------------------
# Flags and errors


def test_device_flag_dispatch_and_defaults() -> None:
    assert parse_device([]) == "cpu"
    assert parse_device(["--layers", "3", "--device", "cuda"]) == "cuda"
    with pytest.raises(SystemExit) as e:
        parse_device(["--device", "tpu"])
    assert e.value.code == 2
    # The CPU benchmark accepts --device cpu and is otherwise unchanged.
    assert parse_args(["--device", "cpu", "--layers", "3"]) == parse_args(["--layers", "3"])
    assert parse_args([]) == BenchConfig()

    train = parse_cuda_args(["--device", "cuda"])
    assert (train.layers, train.d_model, train.n_head, train.vocab, train.seq, train.batch) == (18, 2048, 16, 50304, 2048, 6)
    assert (train.rounds, train.warmup_steps, train.steps) == (5, 2, 5)
    assert train.only == ("fsdp", "torch_fsdp1", "torch_fsdp2", "local") and not train.offload
    # About 1.1e9 parameters, as the benchmark's docstring says.
    assert gpt_params(18, 2048, 50304, 2048)[0] == 1_116_692_480

    off = parse_cuda_args(["--offload"])
    assert (off.layers, off.batch, off.rounds, off.warmup_steps, off.steps) == (36, 2, 2, 1, 3)
    assert off.only == ("fsdp", "torch_fsdp1")
    walk = parse_cuda_args(["--offload-sizes", "4,1,2", "--only", "fsdp", "--layers", "3"])
    assert walk.offload and walk.offload_sizes == (4.0, 1.0, 2.0) and walk.only == ("fsdp",)
    assert walk.layers == 3 and walk.offload_optimizer == "default" and off.offload_optimizer == "default"
    assert parse_cuda_args(["--offload", "--offload-optimizer", "fused"]).offload_optimizer == "fused"
    assert parse_cuda_args(["--only", "local,fsdp"]).only == ("fsdp", "local")  # report order


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--only", "ddp"], r"--only: \['ddp'\] not in the training comparison's"),
        (["--offload", "--only", "local"], r"--only: \['local'\] not in --offload's implementations"),
        (["--only", ","], "--only names no implementation"),
        (["--d-model", "100", "--n-head", "16"], "--d-model 100 is not divisible by --n-head 16"),
        (["--batch", "0"], r"must be >= 1: \{'--batch': 0\}"),
        (["--peak-tflops", "-1"], "--peak-tflops must be positive"),
        (["--hang-timeout", "0"], r"--time-budget \(420.0\) and --hang-timeout \(0.0\) must be positive"),
        (["--offload-sizes", "1,x"], "expected comma-separated numbers"),
        (["--offload-sizes", "1,-2"], "--offload-sizes must be positive"),
        (["--offload", "--profile"], "--profile profiles the training comparison"),
        (["--offload-optimizer", "fused"], "--offload-optimizer chooses the CPU AdamW of --offload; add --offload"),
        (["--offload", "--offload-optimizer", "foreach"], "argument --offload-optimizer: invalid choice: 'foreach'"),
        (["--profile", "--only", "local"], "--profile profiles fsdp; keep fsdp in --only"),
        (["--world-size", "2"], "unrecognized arguments: --world-size 2"),
    ],
)
def test_bad_flags_exit_2_with_the_reason(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parse_cuda_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "python -m benchmarks --device cuda: error:" in err
    assert __import__("re").search(message, err), err


def test_device_cuda_without_cuda_is_one_line_status_2(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_main.main(["--device", "cuda", "--json", "/nonexistent/never-written.json"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("python -m benchmarks: error: --device cuda: CUDA is not available")
    # --help still works without a GPU.
    with pytest.raises(SystemExit) as e:
        bench_main.main(["--device", "cuda", "--help"])
    assert e.value.code == 0
    assert "--offload-sizes" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# FLOPs and MFU


def test_flops_per_token_hand_count() -> None:
    # L=2 blocks, d=8, vocab 16, seq 4. One block: 12 d^2 + 13 d = 768 + 104 = 872 parameters;
    # matmul parameters N = 2 * 872 + ln_f 16 + head 16 * 8 = 1888 (the embeddings, 16*8 and
    # 4*8, are lookups); attention 12 * L * d * T = 12 * 2 * 8 * 4 = 768.
    assert gpt_params(2, 8, 16, 4) == (1888 + 128 + 32, 1888)
    assert flops_per_token(2, 8, 16, 4) == 6 * 1888 + 768 == 12096


@pytest.mark.parametrize("layers, d_model, n_head, vocab, seq", [(2, 8, 2, 16, 4), (3, 16, 4, 24, 6)])
def test_flops_per_token_matches_torch_flop_counter(layers: int, d_model: int, n_head: int, vocab: int, seq: int) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=vocab, block_size=seq, n_layer=layers, n_head=n_head, d_model=d_model))
    total, matmul = gpt_params(layers, d_model, vocab, seq)
    assert total == model.num_parameters()
    assert matmul == total - model.tok_emb.weight.numel() - model.pos_emb.weight.numel()
    batch = 3
    tokens = torch.randint(0, vocab, (batch, seq))
    # The math attention backend spells attention as matmuls the counter sees; the counter
    # counts matmul FLOPs only (2mnk), so the biases and LayerNorm weights, which the 6N
    # convention includes, are the whole difference.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(tokens).sum().backward()
    not_matmul_weights = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 1)
    expected = batch * seq * (flops_per_token(layers, d_model, vocab, seq) - 6 * not_matmul_weights)
    assert counter.get_total_flops() == expected


def test_peak_flops_lookup() -> None:
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989.4e12
    assert peak_flops("NVIDIA H100 SXM5 80GB") == 989.4e12
    assert peak_flops("NVIDIA H200") == 989.4e12
    assert peak_flops("NVIDIA H100 PCIe") == 756.0e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") is None
    assert peak_flops("NVIDIA A100-SXM4-80GB", 312.0) == 312.0e12
    assert peak_flops("NVIDIA H100 80GB HBM3", 500.0) == 500.0e12


def test_layers_for_size() -> None:
    # 1e9 parameters at width 2048: (1e9 - 210.3e6 embeddings and head) / 50.36e6 per block.
    assert layers_for_size(1, 2048, 50304, 2048) == 16
    assert layers_for_size(2, 2048, 50304, 2048) == 36
    assert layers_for_size(1e-9, 2048, 50304, 2048) == 1


# ---------------------------------------------------------------------------------------------
# Report from hand-made results


def _run(impl: str, rnd: int, step: float, alloc: int, status: str = "ok", losses: Any = None) -> dict[str, Any]:
    return {
        "impl": impl, "round": rnd, "layers": 2, "status": status, "error": None if status == "ok" else "Traceback\nOutOfMemoryError: CUDA out of memory",
        "setup_s": 1.0, "step_s": [step, step] if status == "ok" else [], "losses": losses or [5.0, 4.0],
        "host_step_s": [step / 4, step / 4] if status == "ok" else [],
        "max_allocated": alloc if status == "ok" else None, "max_reserved": 2 * alloc if status == "ok" else None,
        "allocated_before": 0, "host_rss": None,
    }


def test_summary_ratios_targets_and_table() -> None:
    cfg = CudaBenchConfig(layers=2, d_model=32, n_head=4, vocab=64, seq=16, batch=2, rounds=3)
    gib = 2**30
    runs = [
        # fsdp: step medians 0.9 (of 0.8, 0.9, 1.0), 10 GiB; torch_fsdp1: 1.0, 12 GiB;
        # torch_fsdp2: 2.0, 9 GiB; local out of memory in its first round (then skipped).
        _run("fsdp", 0, 0.8, 10 * gib, losses=[5.0, 4.0]), _run("fsdp", 1, 1.0, 10 * gib), _run("fsdp", 2, 0.9, 10 * gib),
        _run("torch_fsdp1", 0, 1.0, 12 * gib, losses=[5.0, 4.25]), _run("torch_fsdp1", 1, 1.0, 12 * gib), _run("torch_fsdp1", 2, 1.2, 12 * gib),
        _run("torch_fsdp2", 0, 2.0, 9 * gib), _run("torch_fsdp2", 1, 2.0, 9 * gib), _run("torch_fsdp2", 2, 2.0, 9 * gib),
        _run("local", 0, 0.0, 0, status="oom"), _run("local", 1, 0.0, 0, status="skipped"), _run("local", 2, 0.0, 0, status="skipped"),
    ]
    peak = 1e12
    s = summarize(cfg, runs, peak)
    f, t = s["impls"]["fsdp"], s["impls"]["torch_fsdp1"]
    assert (f["rounds"], f["step_s"], t["step_s"]) == (3, 0.9, 1.0)
    assert (f["host_step_s"], t["host_step_s"]) == (0.9 / 4, 1.0 / 4)
    assert f["tokens_per_s"] == 32 / 0.9 and t["tokens_per_s"] == 32.0  # batch 2 x seq 16
    assert s["flops_per_token"] == flops_per_token(2, 32, 64, 16)
    assert f["mfu"] == f["tokens_per_s"] * s["flops_per_token"] / peak
    assert f["ratios"]["tokens_per_s"] == pytest.approx(1 / 0.9, rel=1e-15)  # (32/0.9)/32
    assert f["ratios"]["max_allocated"] == 10 / 12 and f["ratios"]["max_reserved"] == 10 / 12
    assert t["ratios"]["step_s"] == 1.0
    assert s["impls"]["local"]["status"] == "oom" and s["impls"]["local"]["tokens_per_s"] is None
    assert s["impls"]["local"]["ratios"]["tokens_per_s"] is None
    assert s["loss_max_abs_diff"] == 0.25

    targets = {x["target"]: x for x in evaluate_targets(s)}
    assert targets["fsdp tokens/s >= torch_fsdp1's"]["status"] == "met"  # 1.11x
    assert targets["fsdp tokens/s >= torch_fsdp1's"]["ratio"] == f["ratios"]["tokens_per_s"]
    assert targets["fsdp tokens/s >= 0.95x local's"]["status"] == "n/a"  # local did not run
    assert targets["fsdp max allocated <= torch_fsdp2's"]["status"] == "NOT met"  # 10 > 9 GiB
    assert targets["fsdp max allocated <= torch_fsdp2's"]["ratio"] == 10 / 9

    env = {"device_name": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "cuda": "13.0"}
    text = format_report(cfg, env, s, evaluate_targets(s))
    table = text.split("loss_last\n", 1)[1].split("\nloss per step", 1)[0]
    rows = {line.split()[0]: line.split() for line in table.splitlines()}
    assert list(rows) == list(cfg.impls)
    # MFU: 35.6 tokens/s x 177,408 FLOP/token / 1e12 is 0.0%; reserved is twice allocated.
    # host_s: a quarter of each step (0.9 / 4 = 0.225).
    assert rows["fsdp"] == ["fsdp", "3", "0.9000", "0.2250", "36", "0.0%", "10.00", "20.00", "1.111x", "0.833x", "0.833x", "4.00000"]
    assert rows["torch_fsdp1"][8:11] == ["1.000x", "1.000x", "1.000x"]
    assert rows["local"] == ["local", "OOM:", "OutOfMemoryError:", "CUDA", "out", "of", "memory"]
    assert "fsdp tokens/s >= torch_fsdp1's" in text and "NOT met" in text
    assert "max |loss fsdp - loss torch_fsdp1| over the steps: 2.50e-01" in text
    assert len(text) < 4000  # the device's output tail keeps 12,000 characters


def test_offload_summary_and_table() -> None:
    cfg = CudaBenchConfig(layers=2, d_model=32, n_head=4, vocab=64, seq=16, batch=2, offload=True)
    gib = 2**30
    main = [_run("fsdp", 0, 2.0, gib), _run("torch_fsdp1", 0, 4.0, 2 * gib)]
    walk = [
        {**_run("fsdp", 0, 1.0, gib), "size_b": 1.0, "params": 10**9, "host_rss": 20 * gib},
        {**_run("torch_fsdp1", 0, 0.0, 0, status="oom"), "size_b": 1.0, "params": 10**9},
        {**_run("fsdp", 0, 0.0, 0, status="oom"), "size_b": 2.0, "params": 2 * 10**9},
    ]
    s = summarize_offload(cfg, main + walk)
    e = s["main"]["impls"]["fsdp"]
    assert e["step_s"] == 2.0 and e["ratios"]["step_s"] == 0.5 and e["ratios"]["max_allocated"] == 0.5
    assert s["sizes"]["1"]["fsdp"]["status"] == "trains" and s["sizes"]["1"]["fsdp"]["tokens_per_s"] == 32.0
    assert s["sizes"]["1"]["torch_fsdp1"]["status"] == "does not fit"
    assert s["sizes"]["2"]["fsdp"]["status"] == "does not fit" and "torch_fsdp1" not in s["sizes"]["2"]
    text = format_offload(cfg, {"device_name": "gpu"}, s)
    assert "1B (1.00e9, 2 layers): fsdp trains 32 tok/s, 1.0 GiB GPU, 20.0 GiB host RSS; torch_fsdp1 DOES NOT FIT" in text
    assert "2B (2.00e9, 2 layers): fsdp DOES NOT FIT" in text
    # No rates measured: the limits' times are n/a, their bytes are still the model's.
    assert s["sizes"]["1"]["limits"]["copies_s"] is None and s["sizes"]["1"]["fsdp_step_vs_limits"] is None
    assert "offload 1B: step 1.000 s; limits n/a (not measured)" in text
    assert "CPU AdamW torch's default (one tensor after another)" in text


def test_offload_limits_arithmetic_and_line() -> None:
    # The tiny GPT (width 32, vocabulary 64, sequence 16): the root owns 4,672 parameters
    # (token and position tables, final LayerNorm, head), each block 12,704; two blocks: 30,080.
    cfg = CudaBenchConfig(layers=2, d_model=32, n_head=4, vocab=64, seq=16, batch=2, offload=True, offload_optimizer="fused")
    root, blocks = model_unit_numels(cfg.spec())
    assert (root, blocks) == (4672, [12704, 12704]) and root + sum(blocks) == gpt_params(2, 32, 64, 16)[0]
    # Host to device: every unit in forward and backward but the last block: 4 x (2 x 30,080 -
    # 12,704) = 189,824 bytes; device to host: every gradient once, 4 x 30,080 = 120,320.
    assert offload_copy_bytes(root, blocks) == {"h2d_bytes": 189_824, "d2h_bytes": 120_320}
    rates = {
        "copy_how": "pinned", "copy_buffer_bytes": 2**28, "threads": 16, "seconds": 2.0, "error": None,
        "h2d_bytes_per_s": 189_824 * 4.0, "d2h_bytes_per_s": 120_320 * 8.0,  # 0.25 s + 0.125 s
        "host_memcpy_bytes_per_s": 28 * 30_080 * 2.0,  # the traffic bound: 0.5 s
        # Root 0.125 s / 0.0625 s, each block 0.25 s / 0.125 s: 0.625 s default, 0.3125 s fused.
        "adamw_units": [{"numel": 4672, "timed_numel": 4672, "default_s": 0.125, "fused_s": 0.0625},
                        {"numel": 12704, "timed_numel": 12704, "default_s": 0.25, "fused_s": 0.125}],
    }
    lim = offload_limits(rates, root, blocks)
    # Every time is a binary fraction of a few bits and every scale a power of two: exact.
    assert (lim["copies_s"], lim["adamw_default_s"], lim["adamw_fused_s"], lim["adamw_traffic_s"]) == (0.375, 0.625, 0.3125, 0.5)
    assert lim["copies_plus_fused_adamw_s"] == 0.6875 and lim["adamw_traffic_bytes"] == 28 * 30_080
    # A unit size that was not timed takes the nearest timed size's time per element.
    assert offload_limits(rates, root, [2 * 12704])["adamw_default_s"] == 0.125 + 0.5

    walk = [{**_run("fsdp", 0, 1.375, 2**30), "size_b": 1.0, "params": 30_080, "host_rss": 2**30}]
    s = summarize_offload(cfg, walk, rates)
    assert s["rates"] is rates and s["sizes"]["1"]["limits"] == lim
    assert s["sizes"]["1"]["fsdp_step_vs_limits"] == 2.0  # 1.375 / 0.6875
    text = format_offload(cfg, {"device_name": "gpu"}, s)
    assert (
        "  offload 1B: step 1.375 s; limits: copies 0.375 s (H2D 0.0 GB/s, D2H 0.0 GB/s, 0.00031 GB), "
        "CPU AdamW 0.625 s default / 0.312 s fused (traffic bound 0.5 s at 0.0 GB/s); step / (copies + fused AdamW) = 2.00x"
    ) in text
    assert "CPU AdamW fused=True" in text and "copies of 256 MiB (pinned)" in text
    assert "on shards of 4,672, 12,704 elements" in text
    failed = {"error": "Traceback\nRuntimeError: no pinned memory", "seconds": 0.5}
    text = format_offload(cfg, {"device_name": "gpu"}, summarize_offload(cfg, walk, failed))
    assert "offload 1B: step 1.375 s; limits n/a (RuntimeError: no pinned memory)" in text


def _count_offload_copies() -> list[dict[str, int]]:
    """In a world-size-1 gloo rank: the benchmark's fsdp offload configuration (bf16, NO_SHARD
    at world size 1) trains the tiny GPT with 3 blocks; the bytes each step's unshards copy from
    the host shard and its gradients copy into host buffers, counted at fsdp's two copy sites."""
    from fsdp.flat_param import _storage

    cfg = CudaBenchConfig(**{**TINY_CFG, "layers": 3}, offload=True)
    device = torch.device("cpu")
    model = wrap("fsdp", build_model(cfg.spec(), device), _cuda._wrap_options(cfg, device, True))
    opt = _cuda.make_optimizer(model)
    counts = {"h2d_bytes": 0, "d2h_bytes": 0}
    gather, new_host_buffer = _storage.FlatParamStorage.gather, _storage.FlatParamStorage.new_host_buffer

    def counted_gather(self: Any, *args: Any, **kwargs: Any) -> None:
        assert self.offload_params  # every unit offloads: each gather copies the host shard
        counts["h2d_bytes"] += self.local_shard.numel() * self.local_shard.element_size()
        gather(self, *args, **kwargs)

    def counted_host_buffer(self: Any, like: torch.Tensor) -> torch.Tensor:
        counts["d2h_bytes"] += like.numel() * like.element_size()  # after wrapping: gradients only
        return new_host_buffer(self, like)

    per_step = []
    try:
        _storage.FlatParamStorage.gather = counted_gather  # type: ignore[method-assign]
        _storage.FlatParamStorage.new_host_buffer = counted_host_buffer  # type: ignore[method-assign]
        for batch in make_batches(cfg.spec(), 3):
            train_step(model, opt, batch)
            per_step.append(dict(counts))
            counts.update(h2d_bytes=0, d2h_bytes=0)
    finally:
        _storage.FlatParamStorage.gather = gather  # type: ignore[method-assign]
        _storage.FlatParamStorage.new_host_buffer = new_host_buffer  # type: ignore[method-assign]
    return per_step


def test_offload_copy_bytes_are_what_fsdp_copies(pool1: RankPool) -> None:
    (per_step,) = pool1.run(_count_offload_copies)
    params = gpt_params(3, 32, 64, 16)[0]
    expected = offload_copy_bytes(*model_unit_numels(CudaBenchConfig(**{**TINY_CFG, "layers": 3}).spec()))
    assert expected == {"h2d_bytes": 4 * (2 * params - block_params(32)), "d2h_bytes": 4 * params}
    # From the second step on (the phase orders are known, so the last block stays gathered
    # into its backward), every step copies exactly that; the first copies the last block twice.
    assert per_step[1:] == [expected, expected]
    assert per_step[0] == {"h2d_bytes": expected["h2d_bytes"] + 4 * block_params(32), "d2h_bytes": 4 * params}


# ---------------------------------------------------------------------------------------------
# The same code end to end on CPU


# The same code end to end on CPU, ``python -m benchmarks --device cuda --cpu-dry-run`` on the
# tiny GPT with two rounds of two steps and ``--profile``, is the prepared GPU run's dry
# ``bench_eager`` step: tests/test_gpu_run.py asserts it (one run of the command, not two).


def test_json_folder_created_and_replaced_whole(tmp_path: Path) -> None:
    json_path = tmp_path / "sub" / "gpu.json"
    for n in (1, 2):  # rewritten after each run, whole
        _cuda._write_json(CudaBenchConfig(**TINY_CFG, json_out=str(json_path)), {"schema": "benchmarks.cuda/1", "n": n})
    assert os.listdir(json_path.parent) == ["gpu.json"]
    doc = json.loads(json_path.read_text())
    assert doc["date"][:4].isdigit() and "T" in doc["date"] and doc["n"] == 2


def _offload_rank() -> dict[str, Any]:
    """In a world-size-1 gloo rank: ``--offload`` and ``--offload-sizes``, on CPU (the whole
    run but the process group, which the rank already has)."""
    device = torch.device("cpu")
    fused: list[Any] = []  # the wrapped models' optimizers: AdamW's "fused" default
    make_optimizer = _cuda.make_optimizer

    def recorded(model: Any, **kwargs: Any) -> torch.optim.Optimizer:
        opt = make_optimizer(model, **kwargs)
        if type(model).__name__ == "FullyShardedDataParallel":
            fused.append(opt.defaults["fused"])
        return opt

    _cuda.make_optimizer = recorded  # type: ignore[assignment]
    try:
        main = _cuda._run(CudaBenchConfig(**TINY_CFG, offload=True, rounds=1, warmup_steps=1, steps=2), device)
        walk = _cuda._run(CudaBenchConfig(**TINY_CFG, offload_sizes=(3e-5, 1e-5)), device)
        default_fused = list(fused)
        fused.clear()
        walk_fused = _cuda._run(CudaBenchConfig(**TINY_CFG, offload_sizes=(1e-5,), offload_optimizer="fused"), device)
    finally:
        _cuda.make_optimizer = make_optimizer  # type: ignore[assignment]
    return {"main": main, "walk": walk, "walk_fused": walk_fused, "default_fused": default_fused, "fused": fused}


def _assert_limits(offload: dict[str, Any], limits: dict[str, Any], layers: int) -> None:
    """The limits of one size measured on CPU: the bytes are the model's arithmetic, exactly;
    every time is measured and positive."""
    params = gpt_params(layers, 32, 64, 16)[0]
    assert limits["params"] == params
    assert (limits["h2d_bytes"], limits["d2h_bytes"]) == (4 * (2 * params - block_params(32)), 4 * params)
    for key in ("copies_s", "adamw_default_s", "adamw_fused_s", "adamw_traffic_s"):
        assert limits[key] > 0, (key, limits)
    rates = offload["rates"]
    assert rates["error"] is None and rates["copy_how"] == "no GPU: host memcpy"
    assert [row["numel"] for row in rates["adamw_units"]] == [4672, 12704]  # the root's and a block's shard


def test_cpu_dry_run_offload(pool1: RankPool) -> None:
    (result,) = pool1.run(_offload_rank)
    main = result["main"]
    assert main["config"]["offload"] and main["config"]["layers"] == 2
    by_impl = {r["impl"]: r for r in main["runs"]}
    assert list(by_impl) == ["torch_fsdp1", "fsdp"]  # the torch baseline first
    fsdp_run = by_impl["fsdp"]
    assert fsdp_run["status"] == "ok" and len(fsdp_run["step_s"]) == 2 and len(fsdp_run["losses"]) == 3
    assert fsdp_run["host_rss"] > 0
    # torch FSDP1 cannot offload on a CPU-only machine (it needs an accelerator); the run
    # records its error instead of ending the benchmark. On a GPU it trains.
    assert by_impl["torch_fsdp1"]["status"] == "error" and by_impl["torch_fsdp1"]["error"]
    entry = main["offload"]["main"]["impls"]["fsdp"]
    assert entry["step_s"] == sum(fsdp_run["step_s"]) / 2 and entry["ratios"]["step_s"] is None
    assert main["offload"]["sizes"] == {}
    _assert_limits(main["offload"], main["offload"]["main"]["limits"], 2)
    assert main["offload"]["main"]["fsdp_step_vs_limits"] > 0
    # torch's default AdamW unless --offload-optimizer fused, for fsdp and torch FSDP1 alike.
    assert result["default_fused"] == [None] * 6 and result["fused"] == [True, True]
    assert main["config"]["offload_optimizer"] == "default"
    assert result["walk_fused"]["config"]["offload_optimizer"] == "fused"
    assert result["walk_fused"]["offload"]["sizes"]["1e-05"]["fsdp"]["status"] == "trains"

    walk = result["walk"]["runs"]
    # Smallest size first. Width 32: 4,672 parameters outside the blocks, 12,704 per block;
    # 1e-5 x 1e9 = 10,000 parameters -> round(0.42) -> at least 1 block; 3e-5 -> round(1.99) = 2.
    assert [(r["size_b"], r["impl"], r["layers"]) for r in walk] == [
        (1e-5, "fsdp", 1), (1e-5, "torch_fsdp1", 1), (3e-5, "fsdp", 2), (3e-5, "torch_fsdp1", 2)
    ]
    assert [r["status"] for r in walk] == ["ok", "error", "ok", "error"]
    assert walk[0]["params"] == gpt_params(1, 32, 64, 16)[0]
    sizes = result["walk"]["offload"]["sizes"]
    assert list(sizes) == ["1e-05", "3e-05"] and result["walk"]["offload"]["main"] is None
    assert sizes["3e-05"]["fsdp"]["status"] == "trains" and sizes["3e-05"]["layers"] == 2
    assert sizes["3e-05"]["fsdp"]["tokens_per_s"] == 32 / (sum(walk[2]["step_s"]) / 2)
    for size, layers in (("1e-05", 1), ("3e-05", 2)):
        _assert_limits(result["walk"]["offload"], sizes[size]["limits"], layers)
        assert sizes[size]["fsdp_step_vs_limits"] == sizes[size]["fsdp"]["step_s"] / sizes[size]["limits"]["copies_plus_fused_adamw_s"]


def test_size_walk_skips_sizes_the_host_cannot_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    # No process group needed: a size whose estimate exceeds the available host memory is never
    # built, and an implementation that did not fit is not tried at larger sizes.
    monkeypatch.setattr(_cuda, "_host_available", lambda: 1000)
    cfg = CudaBenchConfig(**TINY_CFG, offload_sizes=(1e-5, 2e-5))
    walk = _cuda._walk_sizes(cfg, torch.device("cpu"))
    assert [(r["size_b"], r["impl"], r["status"]) for r in walk] == [
        (1e-5, "fsdp", "oom"), (1e-5, "torch_fsdp1", "oom"), (2e-5, "fsdp", "skipped"), (2e-5, "torch_fsdp1", "skipped")
    ]
    assert "needs about 0 GiB, 0 GiB available" in walk[0]["error"]
    s = summarize_offload(cfg, walk)
    assert s["sizes"]["1e-05"]["fsdp"]["status"] == "does not fit"


@pytest.mark.parametrize(
    "exc, status",
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), "oom"),
        (MemoryError(), "oom"),
        (RuntimeError("CUDA error: out of memory"), "oom"),  # e.g. pinning host memory
        (ValueError("fsdp: something a GPU run found"), "error"),
    ],
)
def test_a_failing_run_is_recorded_not_raised(exc: BaseException, status: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_build(*args: Any, **kwargs: Any) -> None:
        raise exc

    monkeypatch.setattr(_cuda, "build_model", failing_build)
    cfg = CudaBenchConfig(**TINY_CFG)
    rec = _cuda.measure(cfg, torch.device("cpu"), "fsdp", 3, 2, False, 1, 2)
    assert (rec["impl"], rec["round"], rec["layers"], rec["status"]) == ("fsdp", 3, 2, status)
    assert type(exc).__name__ in rec["error"].rstrip().splitlines()[-1]
    assert "failing_build" in rec["error"]  # the traceback's end, where it failed
    assert rec["step_s"] == [] and rec["losses"] == [] and rec["max_allocated"] is None
