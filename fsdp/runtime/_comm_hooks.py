"""Communication hooks: registering one (:func:`register_comm_hook`) and the default hooks.

The default hooks have the same names and signatures as torch's.

A hook replaces FSDP's gradient reduction for every unit: sharded strategies call
``hook(state, padded_unsharded_grad, sharded_grad_output)``, NO_SHARD calls
``hook(state, grad)`` (reducing in place). The hook divides by the world size itself; the
states carry torch FSDP1's pre/post-divide factors. Torch's own default hooks and states work
too; these also run on gloo with bf16 (gloo has no bf16 reductions: the values are rounded to
bf16, communicated in fp32 and rounded back, see ``fsdp._comm._collectives``).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from fsdp._common import FSDPStateAssertionError
from fsdp.flat_param._sharding import gradient_divide_factors
from fsdp._comm import _collectives as comm
from fsdp.runtime._lazy_init import require_root

__all__ = [
    "DefaultState",
    "LowPrecisionState",
    "allreduce_hook",
    "reduce_scatter_hook",
    "fp16_compress_hook",
    "bf16_compress_hook",
]


def register_comm_hook(root: nn.Module, state: object, hook: Callable[..., object]) -> None:
    """``FullyShardedDataParallel.register_comm_hook``: installs ``hook`` on every unit of the tree.

    Everything is checked before any unit changes.

    Raises:
        FSDPStateAssertionError: ``root`` is a nested unit, a hook is already registered, or a
            unit uses a hybrid strategy.
        ValueError: ``hook`` is not callable (torch FSDP1's type).
    """
    root_state = require_root(
        root,
        "register_comm_hook()",
        error=FSDPStateAssertionError,
        torch_message="register_comm_hook can only be called on a root instance.",
        anchored=True,  # torch's tests match the whole message
    )
    if not callable(hook):
        raise ValueError(
            f"fsdp: The communication hook must be callable but got {hook}: pass a function "
            f"hook(state, grad[, output]), got {type(hook).__name__}."
        )
    assert root_state.ctx is not None
    for unit in root_state.ctx.states:
        if unit.policy.is_hybrid:
            raise FSDPStateAssertionError(
                f"fsdp: Communication hook is not supported for hybrid strategies: "
                f"{unit.sharding_strategy} (unit '{unit.unit_name}'); use FULL_SHARD, "
                f"SHARD_GRAD_OP or NO_SHARD."
            )
        if unit.comm_hook is not None:
            exc = FSDPStateAssertionError("A communication hook is already registered")
            exc.add_note(  # torch's tests match the whole message; ours is a note
                f"fsdp: unit '{unit.unit_name}' already has one; register_comm_hook may be "
                f"called once per FSDP tree, before training."
            )
            raise exc
    for unit in root_state.ctx.states:
        unit.comm_hook, unit.comm_hook_state = hook, state


class DefaultState:
    """State of the default hooks: the group and the gradient divide factors.

    Args:
        process_group: The group gradients are reduced over (required, as in torch).
    """

    def __init__(self, process_group: dist.ProcessGroup) -> None:
        if process_group is None:
            raise ValueError(f"fsdp: pass an explicit ProcessGroup to {type(self).__name__}")
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.gradient_predivide_factor, self.gradient_postdivide_factor = gradient_divide_factors(
            self.world_size
        )


class LowPrecisionState(DefaultState):
    """State of the compression hooks: also the dtype gradients are restored to.

    Args:
        process_group: The group gradients are reduced over.
        parameter_type: The dtype of the parameters (gradients are cast back to it).
    """

    def __init__(self, process_group: dist.ProcessGroup, parameter_type: torch.dtype = torch.float32) -> None:
        super().__init__(process_group)
        self.parameter_type = parameter_type


def allreduce_hook(state: DefaultState, grad: torch.Tensor) -> None:
    """Averages ``grad`` over the group in place (NO_SHARD)."""
    if state.gradient_predivide_factor > 1:
        grad.div_(state.gradient_predivide_factor)
    comm.all_reduce_sum(grad, state.process_group)
    if state.gradient_postdivide_factor > 1:
        grad.div_(state.gradient_postdivide_factor)


def reduce_scatter_hook(state: DefaultState, grad: torch.Tensor, output: torch.Tensor) -> None:
    """Averages ``grad`` over the group, leaving this rank's chunk in ``output``."""
    if state.gradient_predivide_factor > 1:
        grad.div_(state.gradient_predivide_factor)
    comm.reduce_scatter_flat(output, grad, state.process_group)
    if state.gradient_postdivide_factor > 1:
        output.div_(state.gradient_postdivide_factor)


def _low_precision_hook(
    dtype: torch.dtype, state: LowPrecisionState, grad: torch.Tensor, output: Optional[torch.Tensor]
) -> None:
    if grad.dtype != dtype:
        grad.data = grad.to(dtype)
    if output is not None:
        if output.dtype != dtype:
            output.data = output.to(dtype)
        reduce_scatter_hook(state, grad, output)
        output.data = output.to(state.parameter_type)
    else:
        allreduce_hook(state, grad)
        grad.data = grad.to(state.parameter_type)


def fp16_compress_hook(state: LowPrecisionState, grad: torch.Tensor, output: Optional[torch.Tensor] = None) -> None:
    """Communicates gradients in float16, then restores ``state.parameter_type``."""
    _low_precision_hook(torch.float16, state, grad, output)


def bf16_compress_hook(state: LowPrecisionState, grad: torch.Tensor, output: Optional[torch.Tensor] = None) -> None:
    """Communicates gradients in bfloat16, then restores ``state.parameter_type``."""
    _low_precision_hook(torch.bfloat16, state, grad, output)
