"""``python -m fsdp.torch_alias SCRIPT [ARGS...]``: run a script with fsdp standing in for torch's FSDP1."""

from __future__ import annotations

import os
import runpy
import sys
from typing import List

from fsdp.torch_alias import redirect_torch_fsdp


def _run_main(argv: List[str]) -> None:
    """``python -m fsdp.torch_alias SCRIPT [ARGS...]`` or ``... -m MODULE [ARGS...]``.

    Installs the redirect, then runs the script (or module) as ``__main__`` with ``sys.argv``
    set to it and its arguments, as ``python SCRIPT ARGS`` would: the script itself is not
    changed. Launchers put it in front of the script, e.g. ``torchrun --nproc_per_node 2 -m
    fsdp.torch_alias train.py`` or ``accelerate launch -m fsdp.torch_alias train.py``.
    """
    usage = "usage: python -m fsdp.torch_alias SCRIPT [ARGS...] | -m MODULE [ARGS...]"
    if not argv or argv[0] in ("-h", "--help"):
        print(usage + "\n\nRuns SCRIPT (or MODULE) with fsdp standing in for torch's FSDP1.")
        raise SystemExit(0 if argv else 2)
    redirect_torch_fsdp()
    if argv[0] == "-m":
        if len(argv) < 2:
            raise SystemExit(usage)
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        # As ``python SCRIPT``: the script's folder comes first on the import path.
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    _run_main(sys.argv[1:])
