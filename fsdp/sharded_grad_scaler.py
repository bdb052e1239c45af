"""``ShardedGradScaler``: loss scaling for fp16 training of sharded models.

A plain ``torch.amp.GradScaler`` decides per rank whether a step overflowed. With sharded
gradients each rank sees only its shard: one rank can find an inf that the others do not, skip
its step and halve its scale while they step, and the replicas silently diverge. This scaler
agrees across ranks: after unscaling, the per-rank "found inf" flags are summed over the
process group (one all-reduce per optimizer, however many devices the gradients live on, so a
rank with no local gradients cannot leave the others waiting), and every rank skips or steps
together. It also accepts fp16 gradients (``keep_low_precision_grads``) and CPU tensors.

[Note: Host copies of the scale]
With ``CPUOffload`` the sharded gradients live in host memory while the scale lives on the GPU.
``GradScaler._unscale_grads_`` serves each device its copy of ``inv_scale`` and ``found_inf``
through ``.to(device, non_blocking=True)``: a device-to-host copy that returns before the GPU has
written the host tensor. The CPU kernel that unscales the gradients runs at once, on no stream,
so it can read the scale before the copy lands (gradients multiplied by garbage), and the copy
can land after the kernel set ``found_inf`` (an overflow forgotten, the step taken). torch
FSDP1's scaler inherits that race. Here a device other than the scale's gets blocking copies:
one scalar each way per step, against gradients that are read there in full anyway.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Optional, Union, overload

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import GradScaler, OptState

from fsdp._comm import _collectives as comm
from fsdp._comm._phase import collective_phase

__all__ = ["ShardedGradScaler"]


class ShardedGradScaler(GradScaler):
    """``GradScaler`` whose overflow decision is shared by all ranks of ``process_group``.

    Same arguments as torch FSDP1's ``ShardedGradScaler``.

    Args:
        device: ``"cuda"`` or ``"cpu"`` (where the scale lives).
        init_scale: Initial scale factor.
        backoff_factor: Multiplies the scale when a step overflowed.
        growth_factor: Multiplies the scale after ``growth_interval`` clean steps.
        growth_interval: Clean steps between growths.
        enabled: False makes every method a no-op (``scale`` returns its input).
        process_group: The group to agree over (default: the default group).
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        backoff_factor: float = 0.5,
        growth_factor: float = 2.0,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: Optional[dist.ProcessGroup] = dist.group.WORLD,
    ) -> None:
        super().__init__(
            device,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )
        self.process_group = process_group

    @overload
    def scale(self, outputs: torch.Tensor) -> torch.Tensor: ...

    @overload
    def scale(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]: ...

    @overload
    def scale(self, outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]: ...

    @overload
    def scale(self, outputs: Iterable[torch.Tensor]) -> Iterable[torch.Tensor]: ...

    def scale(self, outputs: Union[torch.Tensor, Iterable[torch.Tensor]]) -> Union[torch.Tensor, Iterable[torch.Tensor]]:
        """Multiplies ``outputs`` (a tensor or an iterable of tensors) by the scale, keeping
        each output's dtype (an fp16 loss stays fp16)."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            return self._scale_tensor(outputs)
        scaled = [self.scale(output) for output in outputs]
        return type(outputs)(scaled) if isinstance(outputs, (list, tuple)) else iter(scaled)

    def _scale_tensor(self, output: torch.Tensor) -> torch.Tensor:
        if self._scale is None:
            self._lazy_init_scale_growth_tracker(output.device)
        assert self._scale is not None
        return (output * self._scale.to(device=output.device, non_blocking=True)).to(output.dtype)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divides the optimizer's gradients by the scale and agrees across ranks on overflow.

        Raises:
            RuntimeError: Called twice for one optimizer before ``update()``, or after ``step()``.
        """
        if not self._enabled:
            return
        self._check_scale_growth_tracker("unscale_")
        optimizer_state = self._per_optimizer_states[id(optimizer)]
        if optimizer_state["stage"] is OptState.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        if optimizer_state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        assert self._scale is not None
        inv_scale = self._scale.double().reciprocal().float()
        found_inf = torch.full((), 0.0, dtype=torch.float32, device=self._scale.device)
        # allow_fp16: sharded gradients may be fp16 (keep_low_precision_grads).
        found_per_device = self._unscale_grads_(optimizer, inv_scale, found_inf, True)
        optimizer_state["found_inf_per_device"] = self._agree_on_found_inf(found_per_device)
        optimizer_state["stage"] = OptState.UNSCALED

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        """Unscales the optimizer's gradients in place, per device and dtype; returns each
        device's overflow flag. Every device gets ``inv_scale`` and ``found_inf`` by a copy that
        has landed before its kernel runs ([Note: Host copies of the scale])."""
        grads_by_device: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(
            lambda: defaultdict(list)
        )
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is None:
                        continue
                    if not allow_fp16 and param.grad.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    if param.grad.is_sparse:
                        if param.grad.dtype is torch.float16:  # duplicates summed may overflow
                            param.grad = param.grad.coalesce()
                        grad = param.grad._values()
                    else:
                        grad = param.grad
                    grads_by_device[grad.device][grad.dtype].append(grad)
            found_per_device: dict[torch.device, torch.Tensor] = {}
            for device, grads_by_dtype in grads_by_device.items():
                device_inv_scale = inv_scale.to(device, non_blocking=False)
                device_found_inf = found_inf.to(device, non_blocking=False, copy=True)
                for grads in grads_by_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(grads, device_found_inf, device_inv_scale)
                found_per_device[device] = device_found_inf
        return found_per_device

    def _agree_on_found_inf(
        self, found_per_device: dict[torch.device, torch.Tensor]
    ) -> dict[torch.device, torch.Tensor]:
        """Sums every rank's overflow flags into one flag, the same on every rank."""
        assert self._scale is not None
        total = torch.zeros((), dtype=torch.float32, device=self._scale.device)
        for found in found_per_device.values():
            total += found.to(total.device)
        with collective_phase("ShardedGradScaler's overflow check"):  # [Note: Collective phase]
            comm.all_reduce_sum(total, self.process_group)
        if not found_per_device:  # no local gradients: still take the group's decision
            return {total.device: total}
        for found in found_per_device.values():
            found.copy_(total)
        return found_per_device
