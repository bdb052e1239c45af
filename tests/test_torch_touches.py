"""[Note: What fsdp changes in torch]: ``import fsdp`` changes nothing in torch and imports neither
the planner, Dynamo nor DCP; the first wrap installs the DCP bridge and the Dynamo marks, and the
after-import finder leaves ``sys.meta_path`` once nothing is left to wait for."""

from __future__ import annotations

import os
from pathlib import Path

from tests._preloaded import run_python

ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = r"""
import os, sys
import torch, torch.distributed as dist
from torch import nn

def finders():
    return [type(f).__name__ for f in sys.meta_path if type(f).__name__ == "_AfterImportFinder"]

import fsdp
assert not finders(), finders()
assert not [m for m in sys.modules if m.startswith("fsdp.plan")], "the planner was imported"
assert "torch._dynamo" not in sys.modules and "torch.distributed.checkpoint.state_dict" not in sys.modules
assert callable(fsdp.estimate_memory) and "fsdp.plan" in sys.modules  # imported on first use

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
model = fsdp.FullyShardedDataParallel(nn.Linear(4, 4), device_id=torch.device("cpu"))
assert finders() == ["_AfterImportFinder"], finders()  # waiting for DCP's module and Dynamo
import torch.distributed.checkpoint.state_dict as dcp_sd
assert getattr(dcp_sd, "_fsdp_dcp_bridge", False), "DCP's state-dict module was not patched"
assert finders() == ["_AfterImportFinder"]  # still waiting for Dynamo
assert not getattr(fsdp.FullyShardedDataParallel.forward, "_torchdynamo_disable", False)
import torch._dynamo
assert not finders(), "the finder stayed after its last module"
assert fsdp.FullyShardedDataParallel.forward._torchdynamo_disable  # the unit's forward is marked now
model(torch.ones(2, 4)).sum().backward()
dist.destroy_process_group()
print("ok")
"""


def test_import_changes_nothing_and_first_wrap_installs_the_touches() -> None:
    port = str(29000 + os.getpid() % 1000)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # A fork of an interpreter that imported torch alone, as the script's first line does ([Note:
    # Test commands forked from a preloaded interpreter] in tests/_preloaded.py).
    proc = run_python(["-c", _SCRIPT, port], cwd=str(ROOT), env=env, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr
