"""The export example (examples/export_weights.py): an engine fed by the stream, then by deltas,
holds exactly the trainer's weights in bf16; its safetensors files load into a plain model."""

from __future__ import annotations

from typing import Any

import pytest

from tests._harness import RankPool


def _demo() -> bool:
    from examples.export_weights import export_demo

    return export_demo(steps=2)


def test_export_example(pool2: RankPool) -> None:
    assert pool2.run(_demo) == [True, True]


def _safetensors_demo(folder: str) -> bool:
    from examples.export_weights import safetensors_demo

    return safetensors_demo(folder)


def test_export_example_safetensors(pool2: RankPool, tmp_path: Any) -> None:
    """The example's safetensors files load into a plain model bit for bit (bf16)."""
    pytest.importorskip("safetensors", reason="safetensors is not installed (pip install -e '.[stacks]' installs it)")
    assert pool2.run(_safetensors_demo, str(tmp_path)) == [True, True]
