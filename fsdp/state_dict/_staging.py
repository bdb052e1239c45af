"""Host staging buffers for asynchronous flat-shard saves: a snapshot of a save's tensors,
allocated once and reused ([Note: Async flat-shard saves] in ``fsdp/checkpoint.py``)."""

from __future__ import annotations

from typing import Any, Hashable

import torch

from fsdp.state_dict._flat_checkpoint import FlatShardChunks

__all__ = ["HostStaging"]


def _key(tensor: torch.Tensor) -> Hashable:
    """Which live tensor a buffer copies: its memory, layout and type. The flat shards, the
    optimizer states and the buffers keep their storage from step to step (updated in place), so
    the same key comes back at every save and finds its buffer."""
    return (
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
        tensor.device,
    )


class HostStaging:
    """Host copies of the tensors of a flat-shard state dict (:func:`flat_shard_state_dict`).

    :meth:`stage` copies every tensor a save writes (the flat shards of the units this rank
    writes, the optimizer states shaped like them, buffers and scalar states) into a host buffer
    and returns the same state dict on those buffers. A buffer is allocated at the first save
    that copies its tensor (pinned when the tensor is on an accelerator, so the copy is a DMA)
    and reused by every later save; buffers that a save did not use are released at its end
    (the model or optimizer changed), so the staging holds one snapshot at most.

    Postcondition of :meth:`stage`: the returned state dict's tensors hold the values the live
    tensors had when it was called, whatever training does afterwards; the device-to-host copies
    have completed.
    """

    def __init__(self) -> None:
        self._buffers: dict[Hashable, torch.Tensor] = {}
        self._this_save: dict[Hashable, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        """Bytes of host memory the buffers hold."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` with every tensor (and every :class:`FlatShardChunks`' source) replaced by
        its host copy; see the class docstring."""
        self._this_save = {}
        try:
            staged = self._walk(state)
            self._synchronize()
        finally:
            self._buffers = self._this_save
            self._this_save = {}
        return staged

    def _walk(self, value: Any) -> Any:
        if isinstance(value, FlatShardChunks):
            return value.on(self._copy(value.source)) if value.views else value
        if torch.is_tensor(value):
            return self._copy(value)
        if isinstance(value, dict):
            return {k: self._walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self._walk(v) for v in value]
        return value

    def _copy(self, tensor: torch.Tensor) -> torch.Tensor:
        key = _key(tensor)
        buffer = self._this_save.get(key)
        if buffer is not None:  # a second view of a staged tensor (the flat shard of a unit)
            return buffer
        buffer = self._buffers.get(key)
        if buffer is None:
            pinned = tensor.device.type != "cpu" and torch.cuda.is_available()
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pinned)
        buffer.copy_(tensor.detach(), non_blocking=buffer.is_pinned())
        self._this_save[key] = buffer
        return buffer

    def _synchronize(self) -> None:
        """Waits for the device-to-host copies (asynchronous into pinned buffers)."""
        if any(b.is_pinned() for b in self._this_save.values()):
            torch.cuda.current_stream().synchronize()
