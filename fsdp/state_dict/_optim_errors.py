"""Exception types and deprecation warnings of the optimizer state-dict APIs.

[Note: Optimizer state dict exception types]
torch FSDP1 is the contract for *which* exception type a user mistake raises, so that code that
catches torch's types keeps working; our messages stay ours (they name the parameter, the rank
and the remedy). Where torch raises ``ValueError``/``RuntimeError``/``TypeError`` we raise the
same. Where torch fails with a lookup error for the same mistake (a ``KeyError`` from a dict of
names, an ``IndexError`` from a list of IDs), an ``AttributeError`` or an ``AssertionError``, we raise a class that is
*both* that type and ``ValueError``: ``except KeyError`` (torch) and ``except ValueError`` (ours
since the first release) both catch it, and its message is printed as written (a plain
``KeyError`` would print its message quoted).
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

__all__ = [
    "refuse_tensor_parallel",
    "OptimStateKeyError",
    "OptimStateIndexError",
    "OptimStateAssertionError",
    "OptimStateAttributeError",
    "warn_optim_input",
    "warn_legacy_api",
]


class OptimStateKeyError(ValueError, KeyError):
    """A name that is not where it must be; torch FSDP1 raises ``KeyError`` for the same mistake."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class OptimStateIndexError(ValueError, IndexError):
    """An ID or index out of range; torch FSDP1 raises ``IndexError`` for the same mistake."""


class OptimStateAssertionError(ValueError, AssertionError):
    """An argument torch FSDP1 rejects with an ``AssertionError``."""


class OptimStateAttributeError(ValueError, AttributeError):
    """A key of the wrong kind; torch FSDP1 fails with an ``AttributeError`` on it."""


_FSDP_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _user_stacklevel() -> int:
    """The ``stacklevel`` that attributes a warning to the first caller outside ``fsdp``.

    Counted for a ``warnings.warn`` call made by the caller of this function.
    """
    frame = sys._getframe(1)  # the function that calls warnings.warn
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_FSDP_DIR + os.sep):
        frame = frame.f_back
        level += 1
    return level


def warn_optim_input(optim_input: object) -> None:
    """Warns (``FutureWarning``, as torch FSDP1) when the deprecated ``optim_input`` is passed."""
    if optim_input is None:
        return
    warnings.warn(
        "fsdp: the `optim_input` argument is deprecated (as in torch FSDP1) and will be "
        "removed. Pass the optimizer as `optim=` instead, or drop `optim_input` when the "
        "optimizer was built from model.parameters() in their order.",
        FutureWarning,
        stacklevel=_user_stacklevel(),
    )


def warn_legacy_api(current: str, replacement: str) -> None:
    """Warns (``FutureWarning``, as torch FSDP1) that a legacy optimizer state-dict API is used."""
    warnings.warn(
        f"fsdp: FullyShardedDataParallel.{current} is deprecated (as in torch FSDP1); "
        f"use FullyShardedDataParallel.{replacement} with FullyShardedDataParallel.state_dict_type "
        f"instead.",
        FutureWarning,
        stacklevel=_user_stacklevel(),
    )


def refuse_tensor_parallel(handles: Any, api: str) -> None:
    """Raises before anything moves if a unit holds tensor-parallel (DTensor) parameters.

    Optimizer state dicts of such units are not supported yet: torch FSDP1 gives their state as
    DTensors (tp DTensors when full, 2-D when sharded); fsdp would give plain local pieces.

    Raises:
        NotImplementedError: Naming the first DTensor parameter and what works instead.
    """
    for handle in handles:
        for info in handle.param_infos:
            if info.dtensor_spec is not None:
                raise NotImplementedError(
                    f"fsdp: {api} does not support tensor-parallel (DTensor) parameters yet: "
                    f"parameter '{info.fqn}' of FSDP unit '{handle.unit_name}' is a DTensor "
                    f"(placements {list(info.dtensor_spec.placements)}). Model state dicts "
                    f"(FULL and SHARDED, through torch.distributed.checkpoint too) work; save "
                    f"the optimizer with optim.state_dict() per rank, or use torch FSDP1 for "
                    f"this model's optimizer checkpoints."
                )
