"""Measuring a CPU process's peak memory, to check the planner against reality.

[Note: Measuring peak RSS]
On CPU torch keeps no allocator statistics, so the measured figure is the process's resident
set: the peak RSS (``VmHWM`` in ``/proc/self/status``) above a baseline taken before the model
is built. Two things make that a measure of live tensors rather than of the allocator's cache:

- glibc's mmap threshold is fixed at 64 KiB (``mallopt(M_MMAP_THRESHOLD, 65536)``, what
  ``MALLOC_MMAP_THRESHOLD_=65536`` does at start-up; set at run time here because rank
  processes are forked from a server started before any test could set the variable). Every
  tensor above 64 KiB is then its own mapping and goes back to the OS when freed.
- the high-water mark is reset (``echo 5 > /proc/self/clear_refs``) after the warm-up step, so
  model construction (the whole model exists before FSDP shards it) and the first step's
  one-off allocations (optimizer state creation, lazy init) do not count.

What RSS includes that the planner does not: small tensors (< 64 KiB) and Python objects kept
in glibc's heap, page rounding of each mapping, gloo's internal buffers and threads' stacks.
On the test's models that is well under a megabyte (see docs/memory.md).

[Note: One-time kernel state]
The first call of a CPU kernel for a dtype and shape can leave memory resident for the rest of
the process: oneDNN JIT-compiles and caches its primitives (about 15 MiB for the first bf16
steps of the test's GPT, on AMX and on AVX512-BF16 CPUs alike; what it is depends on the CPU's
ISA), and ``torch.utils.checkpoint``'s first use keeps a few MiB. None of it is allocated by
later steps, so it is no part of a step's peak, and a baseline taken before it exists counts it
as if it were. A measurement therefore trains the same configuration once in the same process
before it takes its baseline, as ``tests/test_plan_measure.py`` does per configuration.
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["set_mmap_threshold", "rss_bytes", "peak_rss_bytes", "reset_peak_rss"]

_M_MMAP_THRESHOLD = -3


def set_mmap_threshold(nbytes: int = 65536) -> bool:
    """Makes glibc serve allocations of ``nbytes`` or more with their own mapping; True if set."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, nbytes))
    except (OSError, AttributeError):
        return False


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"fsdp.plan: /proc/self/status has no {field} (not Linux?)")


def rss_bytes() -> int:
    """The process's resident set now."""
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """The process's peak resident set since start or the last :func:`reset_peak_rss`."""
    return _status_kib("VmHWM") * 1024


def reset_peak_rss() -> None:
    """Resets the peak resident set to the current one (Linux ``clear_refs`` value 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
