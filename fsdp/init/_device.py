"""Choosing the compute device and moving a unit's module there."""

from __future__ import annotations

import warnings
from typing import Optional, Union

import torch
from torch import nn

DeviceId = Union[int, str, torch.device]


def parse_device_id(device_id: DeviceId, rank: int = 0) -> torch.device:
    """The ``torch.device`` that ``device_id`` names (torch FSDP1 accepts the same forms).

    An int is a CUDA index; a string is anything ``torch.device`` parses (``"cpu"``,
    ``"cuda"``, ``"cuda:1"``); ``"cpu:N"`` means the CPU. A CUDA device without an index is the
    current CUDA device (with torch FSDP1's warning, naming ``rank``).

    Raises:
        TypeError: ``device_id`` is not an int, str or torch.device.
        RuntimeError: A string that is no device, or a CUDA device while CUDA is not available.
        ValueError: A device FSDP cannot compute on (``meta``).
    """
    if isinstance(device_id, bool) or not isinstance(device_id, (int, str, torch.device)):
        raise TypeError(
            f"fsdp: device_id must be an int (CUDA index), a str or a torch.device, got "
            f"{type(device_id).__name__} {device_id!r}"
        )
    if isinstance(device_id, int):
        device = torch.device("cuda", device_id)
    elif isinstance(device_id, str):
        try:
            device = torch.device(device_id)
        except RuntimeError as e:
            raise RuntimeError(
                f"fsdp: device_id={device_id!r} is not a device ({e}). Pass e.g. 'cpu', 'cuda', "
                f"'cuda:0', an int CUDA index or a torch.device."
            ) from None
    else:
        device = device_id
    if device.type == "cpu":
        return torch.device("cpu")  # "cpu:0" is the CPU too (CPU tensors report plain "cpu")
    if device.type == "meta":
        raise ValueError(
            f"fsdp: device_id={device_id!r}: FSDP cannot compute on the meta device. Keep the "
            f"module on meta and pass the device to materialize on (e.g. 'cuda:0' or 'cpu')."
        )
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"fsdp: device_id={device_id!r} names a CUDA device, but CUDA is not available "
                f"here. Pass device_id='cpu' (or leave it out) to train on CPU."
            )
        if device.index is None:
            current = torch.cuda.current_device()
            warnings.warn(  # torch FSDP1's text
                f"FSDP got the argument `device_id` {device_id} on rank {rank}, which does not have "
                f"an explicit index. FSDP will use the current device {current}. If this is "
                f"incorrect, please explicitly call `torch.{device.type}.set_device()` before FSDP "
                f"initialization or pass in the explicit device index as the `device_id` argument.",
                stacklevel=5,  # the caller of FullyShardedDataParallel(...)
            )
            device = torch.device("cuda", current)
    return device


def resolve_compute_device(
    module: nn.Module,
    device_id: Optional[DeviceId],
    backend: Optional[str] = None,
    rank: int = 0,
) -> torch.device:
    """Returns the device a unit computes on.

    ``device_id`` wins when given (see :func:`parse_device_id`). Otherwise the device of the
    module's parameters is used; a module on CPU stays on CPU (this works without any
    accelerator, unlike torch FSDP1, which requires device_id for CPU) unless the group's
    backend is NCCL, which needs CUDA tensors: then the current CUDA device is used and the
    module is moved there.

    Raises:
        RuntimeError: The module's parameters are on more than one device (as torch FSDP1; a
            module partly on CPU and partly on the ``device_id`` device is accepted and moved).
        TypeError / RuntimeError / ValueError: A bad ``device_id`` (see :func:`parse_device_id`).
    """
    target = parse_device_id(device_id, rank) if device_id is not None else None
    devices = {p.device for p in module.parameters() if not p.is_meta}
    mixed_but_movable = target is not None and devices <= {torch.device("cpu"), target}
    if len(devices) > 1 and not mixed_but_movable:
        names: dict[torch.device, str] = {}
        for name, p in module.named_parameters():
            if not p.is_meta:
                names.setdefault(p.device, name)
        listing = ", ".join(f"'{n}' on {d}" for d, n in names.items())
        raise RuntimeError(
            f"fsdp: {type(module).__name__} has parameters on several devices ({listing}); move "
            f"the whole module to one device first, or pass device_id=... to choose one (a "
            f"module partly on CPU is then moved there)."
        )
    if target is not None:
        return target
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
