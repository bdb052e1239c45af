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
    devices = {p.device for p in module.parameters() if not p.is_meta}
    if len(devices) > 1:
        names: dict[torch.device, str] = {}
        for name, p in module.named_parameters():
            if not p.is_meta:
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
    if device.type == "cpu" and backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def move_modules_to_device(modules: list[nn.Module], device: torch.device) -> None:
    """Moves the own parameters and buffers of ``modules`` to ``device`` (in place).

    Only the given modules (a unit's, not nested units' or ignored modules') are touched;
    Parameter objects stay the same.
    """
    for module in modules:
        tensors = list(module._parameters.values()) + list(module._buffers.values())
        if any(t is not None and t.device != device for t in tensors):
            module._apply(lambda t: t.to(device), recurse=False)
