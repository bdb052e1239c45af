"""Which dtypes one handle computes and communicates in (pure: no tensors, no process groups).

[Note: Mixed precision dtypes]
A handle keeps its sharded FlatParameter (what the optimizer updates) in the parameters'
original, *full* precision. With ``MixedPrecision``:

- ``param_dtype``: the unsharded parameter that forward and backward use, and so the dtype of
  the all-gather (the local shard is cast first, halving the bytes gathered). Autograd produces
  the unsharded gradient in this dtype.
- ``reduce_dtype``: the dtype gradients travel in; by default ``param_dtype``. The unsharded
  gradient is cast to it before the pre-divide and the reduce-scatter; the reduced shard is
  post-divided in it, then cast back to full precision.
- ``keep_low_precision_grads``: the sharded ``.grad`` the optimizer sees is cast to
  ``param_dtype`` at the end of backward (accumulation still happens in full precision).

Unset fields mean "the parameters' own dtype", so a handle without mixed precision has
``param_dtype == reduce_dtype == full_dtype`` and none of the casts happen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from fsdp.api import MixedPrecision

__all__ = ["HandlePrecision"]


@dataclass(frozen=True)
class HandlePrecision:
    """The resolved dtypes of one handle (see [Note: Mixed precision dtypes]).

    Attributes:
        full_dtype: The original parameters' dtype: the local shard and the optimizer state.
        param_dtype: The unsharded parameter's dtype in forward and backward.
        reduce_dtype: The dtype gradients are reduced in.
        keep_low_precision_grads: Leave the sharded gradient in ``param_dtype``.
    """

    full_dtype: torch.dtype
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    keep_low_precision_grads: bool = False

    @staticmethod
    def resolve(mixed_precision: Optional[MixedPrecision], full_dtype: torch.dtype) -> "HandlePrecision":
        """Applies torch FSDP1's defaults: reduce_dtype falls back to param_dtype, then full."""
        if mixed_precision is None:
            return HandlePrecision(full_dtype, full_dtype, full_dtype)
        param_dtype = mixed_precision.param_dtype or full_dtype
        reduce_dtype = mixed_precision.reduce_dtype or param_dtype
        return HandlePrecision(
            full_dtype, param_dtype, reduce_dtype, bool(mixed_precision.keep_low_precision_grads)
        )

    @property
    def low_precision_params(self) -> bool:
        """Forward and backward use a copy of the parameter in another dtype."""
        return self.param_dtype != self.full_dtype

    @property
    def grad_dtype(self) -> torch.dtype:
        """The dtype of the sharded ``.grad`` after backward."""
        return self.param_dtype if self.keep_low_precision_grads else self.full_dtype
