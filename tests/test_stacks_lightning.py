"""Lightning's ``FSDPStrategy`` (Fabric and Trainer) runs on fsdp unchanged.

docs/examples/stacks/lightning_fsdp.py (a plain Lightning script: FSDPStrategy with an
auto-wrap policy, FULL_SHARD; Fabric with flat parameters (``use_orig_params=False``) and
``fabric.save``/``fabric.load``, the Trainer with Lightning's default ``use_orig_params=True`` and
``trainer.save_checkpoint``/``fit(ckpt_path=...)``; sharded and full state dicts) runs on 2 CPU ranks through
``python -m fsdp.torch_alias``. Lightning's FSDPStrategy reads ``param._fsdp_flattened``,
imports ``fsdp.api``/``wrap`` names, rekeys optimizer state with ``OptimStateKeyType`` and
``rekey_optim_state_dict``, and loads full checkpoints from lazily loaded tensors.

The reference: torch's FSDP1 cannot run Lightning's FSDPStrategy on CPU ranks (Lightning passes
``device_id=None`` on CPU and torch's FSDP1 raises "FSDP needs a non-CPU accelerator device"),
so the same script runs with Lightning's DDP strategy on torch instead. The losses must be
bit-identical: same initial weights, same batches (Lightning's own samplers), the same forward
arithmetic on the same values, and the same averaged gradients: DDP computes ``(g0 + g1) / 2``,
FSDP ``g0 / 2 + g1 / 2``; halving is exact in floating point (a power of two; no underflow at
these magnitudes), so both are the same rounded sum, and Adam's update is elementwise.
Each resumed run must repeat the straight run's losses exactly (same state, same batches).
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Dict, Tuple

import pytest

from tests._stacks import run_example

pytest.importorskip(
    "lightning",
    reason="lightning is not installed (pip install -e '.[stacks]' installs the stacks' packages)",
)

SCRIPT = "lightning_fsdp.py"
STEPS = "3"
PRELOAD = ("lightning", "lightning.fabric.strategies", "lightning.pytorch.strategies")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    # The two runs are independent (own folders, own ports): they run at the same time, each
    # with its ranks forked from one interpreter that imported Lightning once ([Note: Stack ranks
    # forked from a preloaded interpreter] in tests/_stacks.py), two imports instead of four.
    def start(pool: concurrent.futures.ThreadPoolExecutor, strategy: str, backend: str) -> Any:
        out_dir = str(tmp_path_factory.mktemp(f"lightning-{strategy}"))
        argv = ["--steps", STEPS, "--strategy", strategy]
        return pool.submit(run_example, SCRIPT, argv, backend=backend, out_dir=out_dir, preload=PRELOAD)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        reference, ours = start(pool, "ddp", "torch"), start(pool, "fsdp", "fsdp")
        return reference.result(), ours.result()


def test_fsdp_strategy_wraps_with_fsdp(runs: Tuple[Dict[str, Any], Dict[str, Any]]) -> None:
    reference, ours = runs
    assert reference["fabric"]["backend"] == "torch.nn.parallel.distributed"
    assert ours["fabric"]["backend"] == "fsdp.fully_sharded_data_parallel"
    assert ours["trainer"]["backend"] == "fsdp.fully_sharded_data_parallel"


def test_fabric_bit_identical_and_resumes_exactly(runs: Tuple[Dict[str, Any], Dict[str, Any]]) -> None:
    reference, ours = runs
    ref, got = reference["fabric"], ours["fabric"]
    assert len(got["losses"]) == int(STEPS) and len(got["continued"]) == int(STEPS)
    assert got["losses"] == ref["losses"]
    assert got["continued"] == ref["continued"]
    _check_fabric_resume(got, "sharded")


def _check_fabric_resume(got: Dict[str, Any], kind: str) -> None:
    assert got[f"resumed_{kind}"] == got["continued"], kind
    assert got[f"resumed_{kind}_step"] == int(STEPS), kind  # the user's metadata came back


def _check_trainer_resume(got: Dict[str, Any], kind: str) -> None:
    # A new Trainer restored from the checkpoint fits the second epoch as the straight run did.
    assert got[f"resumed_{kind}"] == got["straight"][int(STEPS):], kind


def test_fabric_full_checkpoint_resumes_exactly(runs: Tuple[Dict[str, Any], Dict[str, Any]]) -> None:
    _check_fabric_resume(runs[1]["fabric"], "full")


def test_trainer_full_checkpoint_resumes_exactly(runs: Tuple[Dict[str, Any], Dict[str, Any]]) -> None:
    _check_trainer_resume(runs[1]["trainer"], "full")


def test_trainer_bit_identical_and_resumes_exactly(runs: Tuple[Dict[str, Any], Dict[str, Any]]) -> None:
    reference, ours = runs
    ref, got = reference["trainer"], ours["trainer"]
    steps = int(STEPS)
    assert got["losses"] == ref["losses"]
    assert got["straight"] == ref["straight"] and len(got["straight"]) == 2 * steps
    assert got["straight"][:steps] == got["losses"]
    _check_trainer_resume(got, "sharded")
