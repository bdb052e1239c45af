"""``no_sync``: skip gradient synchronization, accumulating unsharded gradients locally."""

from __future__ import annotations

import contextlib
from typing import Iterator

from torch import nn

from fsdp.runtime._lazy_init import require_root
from fsdp.runtime._state import check_idle


@contextlib.contextmanager
def no_sync(root: nn.Module) -> Iterator[None]:
    """``FullyShardedDataParallel.no_sync``: every unit of ``root``'s tree skips its reduction.

    Gradients accumulate unsharded on each unit (see ``UnitState.reshards_after_backward``); the
    first backward outside the context reduces them. Each unit's previous setting is restored
    on exit, even after an exception.

    Raises:
        RuntimeError: ``root`` is a nested unit.
        ValueError: A unit of the tree is in forward, backward or ``summon_full_params``
            (torch FSDP1's type).
    """
    state = require_root(
        root,
        "no_sync()",
        torch_message="`no_sync()` on inner FSDP instances is not supported. Please call "
        "`no_sync()` on root FSDP module.",
    )
    check_idle(root, "no_sync()", error=ValueError)  # torch FSDP1's type
    assert state.ctx is not None
    previous = [(unit, unit.sync_gradients) for unit in state.ctx.states]
    for unit, _ in previous:
        unit.sync_gradients = False
    try:
        yield
    finally:
        for unit, flag in previous:
            unit.sync_gradients = flag
