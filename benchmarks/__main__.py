"""``python -m benchmarks [flags]``: see :mod:`benchmarks` and ``docs/performance.md``.

``--device cuda`` runs the GPU benchmark instead (:mod:`benchmarks.cuda`, its own flags).
"""

from __future__ import annotations

import datetime
import json
import sys
import time
from typing import Optional, Sequence

from benchmarks.config import parse_args, parse_device
from benchmarks.cpu import launch
from benchmarks.report import format_profile, format_report, summarize


def main(argv: Optional[Sequence[str]] = None) -> int:
    if parse_device(argv) == "cuda":
        from benchmarks.cuda import main_cuda

        return main_cuda(argv)
    cfg = parse_args(argv)
    start = time.perf_counter()
    print(f"benchmarks: starting {cfg.world_size} local ranks ({', '.join(cfg.only)})", file=sys.stderr, flush=True)
    results = launch(cfg)
    if cfg.profile:
        print(format_profile(cfg, results[0]["profile"]))
        return 0
    summary = summarize(cfg, results)
    summary["wall_s"] = time.perf_counter() - start
    print(format_report(cfg, summary))
    if cfg.json_out:
        with open(cfg.json_out, "w") as f:
            targets = [
                {"target": t.get("description", t.get("key")), "value": t.get("value"),
                 "status": "met" if t.get("met") else "NOT met"}
                for t in summary.get("targets", [])
            ]
            date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
            json.dump({"date": date, "targets": targets, "summary": summary, "ranks": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
