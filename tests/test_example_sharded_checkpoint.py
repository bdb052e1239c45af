"""The README's flat-shard checkpoint example runs: saves at 2 ranks (synchronously, and
asynchronously with a step trained during the write), resumes bit-exactly at 3 (at 1 after
the asynchronous save: fewer processes to start)."""

from __future__ import annotations

from typing import Any


def test_example_sharded_checkpoint(tmp_path: Any, capfd: Any) -> None:
    from examples.sharded_checkpoint import main

    assert main(["--save-ranks", "2", "--load-ranks", "3", "--steps", "2", "--dir", str(tmp_path)]) == 0
    out = capfd.readouterr().out
    assert "saved after 2 steps at 2 ranks" in out
    assert "resumed at 3 ranks, state bit-exact" in out


def test_example_async_sharded_checkpoint(tmp_path: Any, capfd: Any) -> None:
    from examples.sharded_checkpoint import main

    args = ["--save-ranks", "2", "--load-ranks", "1", "--steps", "2", "--dir", str(tmp_path), "--async-save"]
    assert main(args) == 0
    out = capfd.readouterr().out
    assert "async-saved (one more step trained during the write) after 2 steps at 2 ranks" in out
    assert "resumed at 1 ranks, state bit-exact" in out
