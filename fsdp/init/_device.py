"""Choosing the compute device and moving a unit's module there."""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn


def resolve_compute_device(
    module: nn.Module,
    device_id: Optional[Union[int, torch.device]],
    backend: Optional[str] = None,
) -> torch.device:
    """Returns the device a unit computes on.

    ``device_id`` wins when given (an int means that CUDA device). Otherwise the device of the
    module's parameters is used; a module on CPU stays on CPU (this works without any
    accelerator, unlike torch FSDP1, which requires device_id for CPU) unless the group's
    backend is NCCL, which needs CUDA tensors: then the current CUDA device is used and the
    module is moved there.

    Raises:
        ValueError: If the module's parameters are on more than one device, or device_id is
            not an int or torch.device.
    """
    devices = {p.device for p in module.parameters()}
    if len(devices) > 1:
        names = {}
        for name, p in module.named_parameters():
            names.setdefault(p.device, name)
        listing = ", ".join(f"'{n}' on {d}" for d, n in names.items())
        raise ValueError(
            f"fsdp: {type(module).__name__} has parameters on several devices ({listing}); move "
            f"the whole module to one device first, or pass device_id=... to choose one."
        )
    if device_id is not None:
        if isinstance(device_id, int):
            return torch.device("cuda", device_id)
        if isinstance(device_id, torch.device):
            if device_id.type == "cuda" and device_id.index is None:
                return torch.device("cuda", torch.cuda.current_device())
            return device_id
        raise ValueError(
            f"fsdp: device_id must be an int or torch.device, got {type(device_id).__name__}"
        )
    device = next(iter(devices)) if devices else torch.device("cpu")
    if device.type in ("cpu", "meta") and backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if device.type == "meta":
        return torch.device("cpu")
    return device


def move_module_to_device(module: nn.Module, device: torch.device) -> None:
    """Moves parameters and buffers of ``module`` to ``device`` when they live elsewhere."""
    if any(t.device != device for t in list(module.parameters()) + list(module.buffers())):
        module.to(device)
