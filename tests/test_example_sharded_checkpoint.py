"""The README's flat-shard checkpoint example runs: saves at 2 ranks, resumes bit-exactly at 3."""

from __future__ import annotations

from typing import Any


def test_example_sharded_checkpoint(tmp_path: Any, capfd: Any) -> None:
    from examples.sharded_checkpoint import main

    assert main(["--save-ranks", "2", "--load-ranks", "3", "--steps", "2", "--dir", str(tmp_path)]) == 0
    out = capfd.readouterr().out
    assert "saved after 2 steps at 2 ranks" in out
    assert "resumed at 3 ranks, state bit-exact" in out
