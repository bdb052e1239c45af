"""``python -m fsdp.bench``: fsdp against torch FSDP1, torch FSDP2, DDP and a local baseline.

One run spawns ``--world-size`` local CPU ranks (gloo, file rendezvous in a temporary folder)
and drives the same model, data, wrap policy and sharding strategy through every
implementation, alternating between them for several rounds (the reported step time is the
median over rounds of the slowest rank's mean step time). See ``docs/performance.md`` for what
each metric means and how memory is measured.

Modules:
    _config: :class:`BenchConfig` (the command-line flags) and the implementation names.
    _model: the model, the data, and how each implementation wraps it.
    _comm: counting collective calls and bytes by patching ``torch.distributed``.
    _memory: peak live CPU tensor bytes from the profiler's allocator events.
    _worker: what each rank runs.
    _report: the table, the ratios and the targets.

Torch's FSDP is imported only inside the functions that build the torch competitors, so
``import fsdp`` (and ``import fsdp.bench``) never loads torch's FSDP package.
"""

from fsdp.bench._config import IMPLEMENTATIONS, BenchConfig

__all__ = ["BenchConfig", "IMPLEMENTATIONS"]
