"""A script written for torch's FSDP1 (pytorch/examples' ``distributed/FSDP`` style) runs on fsdp unchanged.

docs/examples/stacks/torch_fsdp1_script.py imports only from torch's fsdp package:
``transformer_auto_wrap_policy`` through ``functools.partial``, bf16 ``MixedPrecision``,
``apply_activation_checkpointing``, a FULL checkpoint with ``FullStateDictConfig(offload_to_cpu=True,
rank0_only=True)`` and ``FSDP.optim_state_dict``, a SHARDED checkpoint through
``torch.distributed.checkpoint``. It runs on 2 CPU ranks twice: as is on torch's FSDP1, and
through ``python -m fsdp.torch_alias`` on fsdp. Same seeds, same batches, the same units and
shard layout, and fsdp's bf16 mixed precision is bit-identical to torch's FSDP1's (the same casts
and reductions in the same order, see tests/test_mixed_precision.py), so losses, saved model
and optimizer state must be bit-identical.

torch's FSDP1 cannot gather a full state dict with ``offload_to_cpu=True`` on CPU ranks, so its
run uses ``offload_to_cpu=False`` (the script's ``--no-offload-to-cpu``); fsdp's uses the
script's default, ``True``. The saved values do not depend on it (a copy to the same device).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from tests._stacks import BackendRuns, assert_each_backend_ran, run_on_both_backends

SCRIPT = "torch_fsdp1_script.py"
STEPS = "3"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> BackendRuns:
    return run_on_both_backends(
        SCRIPT,
        tmp_path_factory,
        ["--steps", STEPS, "--no-offload-to-cpu"],
        lambda torch_out: ["--steps", STEPS, "--resume-from", torch_out],
        out_created_by_script=True,  # the script makes its --out folder, as a user's run needs
        # Each run's ranks forked from one interpreter that imported torch's distributed
        # packages once ([Note: Stack ranks forked from a preloaded interpreter]).
        preload=("torch.distributed", "torch.distributed.checkpoint"),
    )


def test_each_backend_really_ran(runs: BackendRuns) -> None:
    assert_each_backend_ran(runs)
    # --out did not exist before the run: the script created it (and wrote result.json in it).
    assert os.path.basename(runs.fsdp_out) == "out" and os.path.isfile(os.path.join(runs.fsdp_out, "result.json"))


def test_losses_bit_identical_and_resumes_exact(runs: BackendRuns) -> None:
    torch_result, fsdp_result = runs.torch_result, runs.fsdp_result
    assert len(fsdp_result["losses"]) == int(STEPS)
    assert fsdp_result["losses"] == torch_result["losses"]
    assert fsdp_result["continued"] == torch_result["continued"]
    for result in (torch_result, fsdp_result):
        assert result["resumed_sharded"] == result["continued"]
        assert result["resumed_full"] == result["continued"]
    # fsdp loads torch's FSDP1 checkpoints (the DCP sharded one and the rank-0 full one).
    assert fsdp_result["resumed_other_sharded"] == torch_result["continued"]
    assert fsdp_result["resumed_other_full"] == torch_result["continued"]


def _assert_same(actual: Any, expected: Any, where: str) -> None:
    assert type(actual) is type(expected), where
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
        assert torch.equal(actual, expected), where
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), where
        for key in expected:
            _assert_same(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            _assert_same(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, where


def test_full_checkpoint_bit_identical(runs: BackendRuns) -> None:
    torch_out, fsdp_out = runs.torch_out, runs.fsdp_out
    name = "full_checkpoint.pt"
    expected = torch.load(os.path.join(torch_out, name), weights_only=False)
    actual = torch.load(os.path.join(fsdp_out, name), weights_only=False)
    assert "tok.weight" in expected["model"] and "blocks.2.out.bias" in expected["model"]
    assert expected["optim"]["state"]["head.weight"]["exp_avg"].shape == (64, 32)
    _assert_same(actual, expected, "checkpoint")
