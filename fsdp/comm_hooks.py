"""Communication hooks for ``FullyShardedDataParallel.register_comm_hook``.

``from fsdp.comm_hooks import DefaultState, reduce_scatter_hook`` and so on; see
:mod:`fsdp.runtime._comm_hooks`.
"""

from fsdp.runtime._comm_hooks import (
    DefaultState,
    LowPrecisionState,
    allreduce_hook,
    bf16_compress_hook,
    fp16_compress_hook,
    reduce_scatter_hook,
)

__all__ = [
    "DefaultState",
    "LowPrecisionState",
    "allreduce_hook",
    "reduce_scatter_hook",
    "fp16_compress_hook",
    "bf16_compress_hook",
]
