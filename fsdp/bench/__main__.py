"""``python -m fsdp.bench [flags]``: see :mod:`fsdp.bench` and ``docs/performance.md``.

``--device cuda`` runs the GPU benchmark instead (:mod:`fsdp.bench._cuda`, its own flags).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Optional, Sequence

from fsdp.bench._config import parse_args, parse_device
from fsdp.bench._launch import launch
from fsdp.bench._report import format_profile, format_report, summarize


def main(argv: Optional[Sequence[str]] = None) -> int:
    if parse_device(argv) == "cuda":
        from fsdp.bench._cuda import main_cuda

        return main_cuda(argv)
    cfg = parse_args(argv)
    start = time.perf_counter()
    results = launch(cfg)
    if cfg.profile:
        print(format_profile(cfg, results[0]["profile"]))
        return 0
    summary = summarize(cfg, results)
    summary["wall_s"] = time.perf_counter() - start
    print(format_report(cfg, summary))
    if cfg.json_out:
        with open(cfg.json_out, "w") as f:
            json.dump({"summary": summary, "ranks": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
