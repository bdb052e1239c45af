"""Memory planning: predict each rank's peak memory before training (see docs/memory.md).

``estimate_memory`` plans the units with the wrapper's own code, traces one forward and
backward on fake tensors and replays FSDP's schedule on it; ``python -m fsdp.plan`` prints
estimates and searches configurations that fit a memory budget.
"""

from fsdp.plan._api import estimate_memory
from fsdp.plan._estimate import MemoryEstimate, UnitEstimate

__all__ = ["estimate_memory", "MemoryEstimate", "UnitEstimate"]
