"""The CUDA libraries' workspaces a training step holds on the device besides its tensors.

[Note: cuBLAS workspaces]
torch allocates cuBLAS's workspace from the caching allocator (so it is in
``torch.cuda.memory_allocated`` and ``max_memory_allocated``), once per (cuBLAS handle, stream),
on the first matmul, and keeps it for the life of the process. Handles are reserved per thread:
the forward and the optimizer run on the Python thread, autograd's backward on the engine's
device thread, so a training step holds two workspaces (activation checkpointing's recompute
runs on the backward thread too, and FSDP's side streams run collectives and copies, no
matmuls). Their size is ``CUBLAS_WORKSPACE_CONFIG``'s (``:SIZE_KiB:COUNT`` pairs, summed), else
torch's default: 32 MiB (``:4096:8``) on compute capability 9.0 and later (H100, H200, B200),
8.125 MiB (``:4096:2:16:8``) before. cuBLASLt's workspace reuses it
(``TORCH_CUBLASLT_UNIFIED_WORKSPACE``, the default of torch's CUDA builds).

A measurement above a baseline taken after a warm-up step (``benchmarks/validate_plan.py``)
already holds them in its baseline; ``torch.cuda.max_memory_allocated`` itself (what the example
trainer reports) does not subtract them: on an H200, the trainer's small model at one rank
measured 350 MiB where the planner, without them, predicted 277 MiB (docs/memory.md).
"""

from __future__ import annotations

import os
import re
from typing import Optional

import torch

__all__ = ["CUBLAS_WORKSPACES", "cublas_workspace_bytes", "step_workspace_bytes"]

#: Workspaces a training step holds: the forward's thread and autograd's backward thread.
CUBLAS_WORKSPACES = 2
_HOPPER_DEFAULT_KIB = 4096 * 8
_PRE_HOPPER_DEFAULT_KIB = 4096 * 2 + 16 * 8


def _parse_config(config: str) -> Optional[int]:
    """``":4096:8"`` -> 32 MiB in bytes; None when it is not ``:SIZE:COUNT`` pairs."""
    pairs = re.fullmatch(r"(?::\d+:\d+)+", config.strip())
    if pairs is None:
        return None
    numbers = [int(n) for n in config.strip().strip(":").split(":")]
    return sum(size * count for size, count in zip(numbers[::2], numbers[1::2])) * 1024


def cublas_workspace_bytes(capability_major: Optional[int] = None) -> int:
    """One cuBLAS workspace, in bytes ([Note: cuBLAS workspaces]).

    Args:
        capability_major: The GPU's compute capability (major); None: the current GPU's when
            one is visible, else 9 (an H100-class GPU: plans are usually made before one is).
    """
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if config is not None:
        parsed = _parse_config(config)
        if parsed is not None:
            return parsed
    if capability_major is None:
        capability_major = torch.cuda.get_device_capability()[0] if torch.cuda.is_available() else 9
    return (_HOPPER_DEFAULT_KIB if capability_major >= 9 else _PRE_HOPPER_DEFAULT_KIB) * 1024


def step_workspace_bytes(device: torch.device) -> int:
    """What a training step on ``device`` holds in cuBLAS workspaces (0 off CUDA)."""
    return CUBLAS_WORKSPACES * cublas_workspace_bytes() if device.type == "cuda" else 0
