"""accelerate's FSDP1 plugin runs on fsdp unchanged (through ``fsdp.redirect_torch_fsdp``).

docs/examples/stacks/accelerate_fsdp1.py (a plain accelerate script: FSDP1 plugin with the
transformer auto-wrap policy, FULL_SHARD, activation checkpointing; ``save_state`` /
``load_state`` with SHARDED and FULL state dicts) runs on 2 CPU ranks twice: as is, on torch's
FSDP1, and through ``python -m fsdp.torch_alias`` (the script unchanged), on fsdp, launched by the
example's documented ``accelerate launch`` command. Same seeds,
same data, the same shard layout (FULL_SHARD of the same units at world size 2), so every loss
and every parameter must be bit-identical: the arithmetic is the same operations in the same
order (the project's parity tests show fsdp's steps are bit-identical to torch's FSDP1's).

torch's FSDP1 cannot save accelerate's FULL_STATE_DICT on CPU ranks (accelerate asks for
``offload_to_cpu=True``; torch fails in ``_unflatten_as_params``), so its run saves only the
sharded checkpoint; fsdp's run saves both, and each resumed run must repeat the continued run's
losses exactly (same state, same batches). fsdp's run also resumes from torch's sharded
checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests._stacks import EXAMPLES_DIR, REPO_ROOT, RUN_TIMEOUT_S, BackendRuns, assert_each_backend_ran, run_example

pytest.importorskip(
    "accelerate",
    reason="accelerate is not installed (pip install -e '.[stacks]' installs the stacks' packages)",
)

SCRIPT = "accelerate_fsdp1.py"
STEPS = "3"


def _documented_command(out: str) -> tuple[list[str], int]:
    """The example's documented fsdp command (``accelerate launch ... -m fsdp.torch_alias ...``),
    its ``--out`` set to ``out``; and the ``--num_processes`` it names."""
    with open(os.path.join(EXAMPLES_DIR, SCRIPT), encoding="utf-8") as f:
        doc = f.read()
    command = re.search(r"^    (accelerate launch .* -m fsdp\.torch_alias .*)$", doc, flags=re.M)
    assert command, doc[:2000]
    words = command.group(1).split()
    assert "--cpu" not in words[: words.index("-m")], words  # launch's --cpu: one process
    words[words.index("--out") + 1] = out
    launcher = os.path.join(os.path.dirname(sys.executable), "accelerate")
    return [launcher if os.path.exists(launcher) else "accelerate", *words[1:]], int(words[words.index("--num_processes") + 1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> BackendRuns:
    """torch's FSDP1 run (launched as torchrun launches, :func:`tests._stacks.run_example`), then
    fsdp's through the example's documented command run as written (only ``--out`` changed, and
    the run's length and resume flags added): one fsdp run checks both."""
    torch_out = str(tmp_path_factory.mktemp("accelerate_fsdp1-torch"))
    fsdp_out = str(tmp_path_factory.mktemp("accelerate_fsdp1-fsdp"))
    torch_result = run_example(
        SCRIPT, ["--cpu", "--steps", STEPS, "--state-dict-types", "SHARDED_STATE_DICT"], backend="torch", out_dir=torch_out,
        preload=("accelerate",),  # its ranks forked from one interpreter that imported accelerate
    )
    cmd, _ = _documented_command(fsdp_out)
    cmd += ["--steps", STEPS, "--resume-from", os.path.join(torch_out, "sharded_state_dict")]
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONWARNINGS="ignore::FutureWarning")
    run = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    with open(os.path.join(fsdp_out, "result.json"), encoding="utf-8") as f:
        fsdp_result = json.load(f)
    return BackendRuns(torch_result, fsdp_result, torch_out, fsdp_out)


def test_each_backend_really_ran(runs: BackendRuns) -> None:
    assert_each_backend_ran(runs)
    assert runs.torch_result["num_processes"] == runs.fsdp_result["num_processes"] == 2


def test_training_is_bit_identical_to_torch_fsdp1(runs: BackendRuns) -> None:
    torch_result, fsdp_result = runs.torch_result, runs.fsdp_result
    assert len(fsdp_result["losses"]) == int(STEPS)
    assert fsdp_result["losses"] == torch_result["losses"]
    assert fsdp_result["continued"] == torch_result["continued"]
    # The full state dict after training: the same keys (original parameter names) and values.
    assert list(fsdp_result["digest"]) == list(torch_result["digest"])
    assert "embed.weight" in fsdp_result["digest"] and "blocks.0.mlp.0.weight" in fsdp_result["digest"]
    assert fsdp_result["digest"] == torch_result["digest"]
    # accelerate's own get_state_dict (offload_to_cpu, rank0_only) gives the same on fsdp.
    assert fsdp_result["digest_get_state_dict"] == fsdp_result["digest"]


def test_save_state_load_state_resume_exactly(runs: BackendRuns) -> None:
    torch_result, fsdp_result = runs.torch_result, runs.fsdp_result
    assert torch_result["resumed_SHARDED_STATE_DICT"] == torch_result["continued"]
    for kind in ("SHARDED_STATE_DICT", "FULL_STATE_DICT"):
        assert fsdp_result[f"resumed_{kind}"] == fsdp_result["continued"], kind
        assert fsdp_result[f"digest_{kind}"] == torch_result["digest_SHARDED_STATE_DICT"], kind
    # torch's FSDP1 sharded checkpoint (model and optimizer, through DCP), loaded by fsdp.
    assert fsdp_result["resumed_from_other"] == torch_result["continued"]


def test_documented_cpu_command_starts_the_documented_processes(runs: BackendRuns) -> None:
    """The example's documented fsdp command, run as written (the fixture's fsdp run), starts
    ``--num_processes`` ranks: accelerate's own ``--cpu`` picks its single-process launcher
    whatever ``--num_processes`` says, so the command must not use it."""
    _, processes = _documented_command(runs.fsdp_out)
    assert processes == 2
    result = runs.fsdp_result
    assert result["num_processes"] == processes and result["backend"] == "fsdp.fully_sharded_data_parallel", result
