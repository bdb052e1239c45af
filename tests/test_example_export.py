"""The export example (examples/export_weights.py): an engine fed by the stream, then by deltas,
holds exactly the trainer's weights in bf16."""

from __future__ import annotations

from tests._harness import RankPool


def _demo() -> bool:
    from examples.export_weights import export_demo

    return export_demo(steps=2)


def test_export_example(pool2: RankPool) -> None:
    assert pool2.run(_demo) == [True, True]
