"""``python -m fsdp.plan``: flags honoured or refused, what the output says, sizes and units.

Run in-process through ``main(argv)``; every plan is a tiny GPT or a user model on the meta
device. Expected numbers come from ``fsdp.estimate_memory`` called directly with the same
configuration, never from constants.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fsdp import CPUOffload, MixedPrecision, ShardingStrategy, estimate_memory
from fsdp.plan.gpt import GPT, Block, GPTConfig, checkpoint_blocks
from fsdp.plan.__main__ import _parser, main, parse_bytes
from fsdp.plan._estimate import format_bytes, format_count
from fsdp.wrap import ModuleWrapPolicy

TINY = ["--layers", "2", "--d-model", "64", "--heads", "4", "--vocab", "128", "--seq-len", "32", "--batch-size", "2"]


def _tiny_gpt(checkpointing: bool = False) -> GPT:
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, d_model=64))
    if checkpointing:
        checkpoint_blocks(model, Block)
    return model


def _gpt_loss(logits: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), torch.empty(logits.shape[:-1], dtype=torch.long).flatten())


def _direct(world_size: int, strategy: str = "FULL_SHARD", bf16: bool = False, offload: bool = False, ckpt: bool = False, **extra: Any) -> Any:
    """The estimate the CLI must print for TINY with these settings."""
    kwargs: dict[str, Any] = {
        "auto_wrap_policy": ModuleWrapPolicy({Block}),
        "sharding_strategy": ShardingStrategy[strategy],
        "device_id": torch.device(extra.pop("device", "cuda")),
        **extra,
    }
    if bf16:
        kwargs["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16)
    if offload:
        kwargs["cpu_offload"] = CPUOffload(offload_params=True)
    inputs = torch.zeros(2, 32, dtype=torch.long, device="meta")
    return estimate_memory(_tiny_gpt(ckpt), inputs, world_size=world_size, loss_fn=_gpt_loss, **kwargs)


def _rows(out: str) -> list[list[str]]:
    """The search table's rows, split into columns."""
    return [line.split() for line in out.splitlines() if re.match(r"^\s+\d+\s+[A-Z_]+\s+(fp32|bf16)", line)]


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out


def _error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Runs an argument mistake: argparse's exit status 2 and its message, no traceback."""
    with pytest.raises(SystemExit) as info:
        main(list(argv))
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("usage: python -m fsdp.plan")
    return err.splitlines()[-1]


# --- sizes and units -------------------------------------------------------------------------


def test_sizes_need_a_unit() -> None:
    import argparse

    assert parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("40GB") == 40 * 10**9
    assert parse_bytes("1.5 MiB") == 3 * 2**19 and parse_bytes("512B") == 512 and parse_bytes("80gib") == 80 * 2**30
    for text, message in [
        ("80", r"'80' has no unit: write 80GiB \(binary\), 80GB \(decimal\) or 80B \(bytes\)"),
        ("0GiB", "must be at least 1 byte"),
        ("...GiB", "not a size"),
        ("80 parsecs", "not a size"),
        ("-1GiB", "not a size"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            parse_bytes(text)


def test_budget_without_a_unit_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert "argument --budget: '80' has no unit" in _error(capsys, *TINY, "--budget", "80")
    assert "argument --host-budget: '200' has no unit" in _error(capsys, *TINY, "--budget", "1GiB", "--host-budget", "200")


def test_parameter_counts_have_units() -> None:
    assert [format_count(n) for n in (512, 99_999, 819_840, 10_700_000, 85_000_000, 999_600_000, 69_500_000_000)] == [
        "512", "99,999", "0.82M", "10.7M", "85M", "1B", "69.5B"
    ]


# --- what the output says --------------------------------------------------------------------


def test_estimate_echoes_model_inputs_loss_and_configuration(capsys: pytest.CaptureFixture[str]) -> None:
    code = main([*TINY, "--world-size", "4", "--bf16", "--checkpointing", "--strategy", "SHARD_GRAD_OP"])
    captured = capsys.readouterr()
    out = captured.out
    params = sum(p.numel() for p in _tiny_gpt().parameters())
    assert code == 0
    # Progress on stderr: one line per phase.
    assert captured.err.splitlines() == [
        "fsdp.plan: building the model on the meta device",
        "fsdp.plan: tracing one forward and backward on fake tensors, then replaying the FSDP schedule",
    ], captured.err
    assert f"2 layers, d_model 64, 4 heads, vocab 128: {format_count(params)} parameters ({params:,})" in out
    assert "micro-batch 2 x sequence 32 tokens per rank; loss: next-token cross-entropy" in out
    assert "configuration: world size 4, SHARD_GRAD_OP, bf16, no offload, activation checkpointing, device cuda" in out
    expected = _direct(4, "SHARD_GRAD_OP", bf16=True, ckpt=True)
    assert f"peak on the training device: {format_bytes(expected.peak_bytes)}" in out


def test_unit_names_are_not_cut(capsys: pytest.CaptureFixture[str]) -> None:
    _, out = _run(capsys, *TINY, "--checkpointing")
    unit_names = [line.split()[0] for line in out.split("units (")[1].splitlines()[2:] if line.startswith("    ")]
    assert "blocks.1._checkpoint_wrapped_module" in unit_names
    assert unit_names == [u.name for u in _direct(8, ckpt=True).units if not u.name.startswith("<")] + ["<root"]


def test_help_shows_every_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for action in _parser()._actions:
        if action.option_strings and action.dest != "help":
            assert "(default:" in (action.help or ""), action.option_strings
    assert "(default: 12)" in text and "(default: FULL_SHARD;" in text and "(default: 8;" in text
    assert "the sum of the model's output tensors" in text  # the --model loss
    assert "a bare number is refused" in text


# --- flags honoured in the search ------------------------------------------------------------


def test_budget_honours_fixed_flags(capsys: pytest.CaptureFixture[str]) -> None:
    """Each configuration flag fixes its dimension of the search; each row equals the direct
    estimate of its configuration."""
    code, out = _run(
        capsys, *TINY, "--budget", "1GiB", "--world-size", "4", "--strategy", "FULL_SHARD", "--bf16", "--offload", "--no-checkpointing"
    )
    assert code == 0
    assert "searched: world size 4; FULL_SHARD; bf16; offload yes; checkpointing no; device cuda" in out
    rows = _rows(out)
    expected = _direct(4, bf16=True, offload=True)
    assert rows == [
        ["4", "FULL_SHARD", "bf16", "yes", "no", *format_bytes(expected.peak_bytes).split(),
         *format_bytes(expected.cpu_peak_bytes).split(), expected.peak_phase]
    ]
    assert "1 of 1 configurations fit <= 1.00 GiB device memory per rank" in out


def test_budget_searches_what_is_not_given(capsys: pytest.CaptureFixture[str]) -> None:
    main([*TINY, "--budget", "1GiB", "--max-world-size", "2", "--no-bf16", "--no-offload"])
    captured = capsys.readouterr()
    out = captured.out
    rows = _rows(out)
    # Progress on stderr: the count, then one line per configuration (8: see below), in order.
    progress = captured.err.splitlines()
    assert progress[0] == (
        "fsdp.plan: searching 8 configurations (the first of each model traces it; the rest reuse the trace)"
    ), progress
    assert [line.split("]")[0] for line in progress[1:]] == [f"fsdp.plan: [{i}/8" for i in range(1, 9)], progress
    assert progress[1] == "fsdp.plan: [1/8] world size 1, NO_SHARD, fp32, no offload, no checkpointing", progress
    assert "searched: world size 1, 2; NO_SHARD, SHARD_GRAD_OP, FULL_SHARD; fp32; offload no; checkpointing no, yes" in out
    configs = {(r[0], r[1], r[4]) for r in rows}
    assert configs == {
        (ws, s, ckpt)
        for ckpt in ("no", "yes")
        for ws, s in [("1", "NO_SHARD"), ("2", "NO_SHARD"), ("2", "SHARD_GRAD_OP"), ("2", "FULL_SHARD")]
    }
    assert [int(r[0]) for r in rows] == sorted(int(r[0]) for r in rows)  # fewest ranks first


def test_host_column_and_host_budget(capsys: pytest.CaptureFixture[str]) -> None:
    """Offload rows show the host memory per rank; --host-budget drops the rows above it."""
    args = [*TINY, "--budget", "1GiB", "--world-size", "2", "--strategy", "FULL_SHARD", "--no-bf16", "--no-checkpointing"]
    _, out = _run(capsys, *args)
    by_offload = {r[3]: r for r in _rows(out)}
    host = _direct(2, offload=True).cpu_peak_bytes
    assert host > 0 and " ".join(by_offload["yes"][7:9]) == format_bytes(host)
    assert by_offload["no"][7] == "-"
    code, out = _run(capsys, *args, "--host-budget", f"{host - 1}B")
    assert code == 0 and [r[3] for r in _rows(out)] == ["no"]
    assert f"and <= {format_bytes(host - 1)} host memory per rank" in out


def test_budget_that_nothing_fits_shows_the_smallest(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _run(capsys, *TINY, "--budget", "1KiB", "--world-size", "2", "--strategy", "FULL_SHARD", "--no-offload", "--no-checkpointing")
    assert code == 1
    smallest = min(_direct(2).peak_bytes, _direct(2, bf16=True).peak_bytes)
    assert "none of the 2 configurations fits <= 1.00 KiB device memory per rank" in out
    assert " ".join(_rows(out)[0][5:7]) == format_bytes(smallest)


def test_cpu_device_has_no_host_column(capsys: pytest.CaptureFixture[str]) -> None:
    _, out = _run(capsys, *TINY, "--budget", "1GiB", "--world-size", "2", "--device", "cpu", "--no-checkpointing", "--no-bf16")
    assert "host memory per rank, cheapest first" in out and "host (offload)" not in out
    assert {r[3] for r in _rows(out)} == {"no"}  # offload: nothing to offload to


# --- mistakes: argparse errors, not tracebacks -----------------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--world-size", "0"], "argument --world-size: must be at least 1, got 0"),
        (["--layers", "0"], "argument --layers: must be at least 1, got 0"),
        (["--d-model", "100", "--heads", "3"], "--heads 3 must divide --d-model 100"),
        (["--strategy", "HYBRID_SHARD"], "--strategy HYBRID_SHARD needs --intra-node-size (ranks per node"),
        (["--strategy", "HYBRID_SHARD", "--intra-node-size", "3"], "--intra-node-size 3 and --world-size 8: HYBRID_SHARD needs whole nodes"),
        (["--intra-node-size", "2"], "--intra-node-size applies to hybrid strategies (--strategy HYBRID_SHARD), not FULL_SHARD (the default)"),
        (["--offload", "--device", "cpu"], "--offload with --device cpu: the parameters already live in host memory"),
        (["--strategy", "NO_SHARD", "--offload"], "--strategy NO_SHARD with --offload: fsdp's CPU offload needs a sharded strategy"),
        (["--max-world-size", "4"], "--max-world-size applies to the --budget search only"),
        (["--host-budget", "1GiB", "--gpus-per-node", "4"], "--host-budget, --gpus-per-node apply to the --budget search only"),
        (["--budget", "1GiB", "--world-size", "2", "--max-world-size", "4"], "--world-size fixes the world size; --max-world-size bounds"),
        (["--budget", "1GiB", "--strategy", "HYBRID_SHARD", "--world-size", "4"], "--gpus-per-node 8 and --world-size 4: HYBRID_SHARD needs whole nodes"),
        (["--wrap-class", "Block"], "--wrap-class applies to --model"),
    ],
)
def test_mistakes_are_argparse_errors(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    assert message in _error(capsys, *TINY[:2], *argv)


def test_hybrid_estimate_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _run(capsys, *TINY, "--strategy", "HYBRID_SHARD", "--intra-node-size", "2", "--world-size", "4")
    expected = _direct(4, "HYBRID_SHARD", intra_node_size=2)
    assert code == 0 and "HYBRID_SHARD in nodes of 2" in out
    assert f"peak on the training device: {format_bytes(expected.peak_bytes)}" in out


# --- user models -----------------------------------------------------------------------------


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


def _user_model() -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(Layer(), Layer(), nn.Linear(32, 4))


def make() -> tuple[nn.Module, torch.Tensor]:
    """A ``--model`` factory without a loss."""
    return _user_model(), torch.zeros(8, 32, device="meta")


def _mse(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def make_with_loss() -> tuple[nn.Module, torch.Tensor, Any]:
    """A ``--model`` factory with its loss."""
    return _user_model(), torch.zeros(8, 32, device="meta"), _mse


def test_user_model_says_which_loss_it_plans(capsys: pytest.CaptureFixture[str]) -> None:
    policy = {"auto_wrap_policy": ModuleWrapPolicy({Layer}), "device_id": torch.device("cuda")}
    inputs = torch.zeros(8, 32, device="meta")
    code, out = _run(capsys, "--model", f"{__name__}:make", "--wrap-class", "Layer", "--world-size", "2")
    assert code == 0
    params = sum(p.numel() for p in _user_model().parameters())
    assert f"model: {__name__}:make() -> Sequential: {format_count(params)} parameters ({params:,})" in out
    assert "inputs: [8, 32] float32 per rank (as the factory returned them); loss: the sum of the model's output tensors" in out
    assert "wrapping: one FSDP unit per Layer and the root" in out
    summed = estimate_memory(_user_model(), inputs, world_size=2, **policy)
    assert f"peak on the training device: {format_bytes(summed.peak_bytes)}" in out
    code, out = _run(capsys, "--model", f"{__name__}:make_with_loss", "--wrap-class", "Layer", "--world-size", "2")
    assert "loss: the factory's loss_fn" in out
    with_loss = estimate_memory(_user_model(), inputs, world_size=2, loss_fn=_mse, **policy)
    assert f"peak on the training device: {format_bytes(with_loss.peak_bytes)}" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "nocolon"], "--model must be 'module:factory', got 'nocolon'"),
        (["--model", "json:nope"], "cannot load --model 'json:nope'"),
        (["--model", f"{__name__}:make", "--layers", "2", "--seq-len", "8"], "--layers, --seq-len configure the example GPT, not --model"),
        (["--model", f"{__name__}:make", "--wrap-class", "Nope"], "--wrap-class 'Nope': no module of that class"),
        (["--model", f"{__name__}:make", "--checkpointing"], "--checkpointing needs --wrap-class"),
    ],
)
def test_user_model_mistakes(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    assert message in _error(capsys, *argv)


def test_user_model_without_wrap_class_searches_no_checkpointing(capsys: pytest.CaptureFixture[str]) -> None:
    _, out = _run(capsys, "--model", f"{__name__}:make", "--budget", "1GiB", "--world-size", "2", "--no-bf16", "--no-offload")
    assert "wrapping: none: the whole model is one FSDP unit (pass --wrap-class)" in out
    assert "checkpointing no;" in out and {r[4] for r in _rows(out)} == {"no"}


def make_without_parameters() -> tuple[nn.Module, torch.Tensor]:
    """A ``--model`` factory whose model has nothing to shard."""
    return nn.ReLU(), torch.zeros(8, 32, device="meta")


def test_planning_error_is_a_message_not_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--model", f"{__name__}:make_without_parameters"])
    assert str(info.value.code).startswith("python -m fsdp.plan: cannot plan this model: fsdp.estimate_memory: the model (ReLU) has no parameters")
