"""The result of :func:`fsdp.estimate_memory`: peak, breakdown at the peak, unit sizes."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["MemoryEstimate", "UnitEstimate", "format_bytes", "format_count"]


def format_bytes(nbytes: float) -> str:
    """``1536 -> '1.50 KiB'``."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"


def format_count(count: int) -> str:
    """A parameter count with its unit, three significant digits: ``819840 -> '0.82M'``,
    ``85_000_000 -> '85M'``, ``69_500_000_000 -> '69.5B'``; under 100,000 the exact number."""
    if count < 100_000:
        return f"{count:,}"
    for scale, unit in ((1e6, "M"), (1e9, "B")):
        text = f"{count / scale:.3g}"
        if float(text) < 1000:
            return text + unit
    return f"{count / 1e12:.3g}T"


@dataclass
class UnitEstimate:
    """One FSDP unit's FlatParameter sizes (all handles of the unit together).

    Attributes:
        name: The unit's module name.
        unpadded_unsharded_numel: Elements of the unit's parameters.
        padded_unsharded_numel: Padded to a multiple of the shard world size.
        padded_sharded_numel: Elements of one rank's shard, padding included.
        unsharded_bytes: Bytes of the gathered (compute-dtype) parameter.
        offload_params: Whether the unit keeps its shard, gradient and optimizer state on the
            host (``CPUOffload``; [Note: Fractional offload] in ``fsdp/flat_param/_policy.py``).
    """

    name: str
    unpadded_unsharded_numel: int
    padded_unsharded_numel: int
    padded_sharded_numel: int
    unsharded_bytes: int
    offload_params: bool = False


@dataclass
class MemoryEstimate:
    """Predicted memory of one training step (forward, backward, optimizer step) per rank.

    Attributes:
        peak_bytes: The busiest rank's peak on the training device.
        cpu_peak_bytes: Peak of what lives in CPU memory because of CPU offload (sharded
            parameters, gradients, optimizer state); equal to ``peak_bytes`` when the training
            device is the CPU itself, 0 without offload.
        peak_phase: ``"forward"``, ``"backward"`` or ``"optimizer step"``.
        breakdown: What is alive at the device peak, by kind (bytes).
        units: Per unit, the flat sizes.
        world_size: Ranks planned for.
        config: The configuration in words (strategy, precision, offload, prefetch).
    """

    peak_bytes: int
    cpu_peak_bytes: int
    peak_phase: str
    breakdown: dict[str, int] = field(default_factory=dict)
    units: list[UnitEstimate] = field(default_factory=list)
    world_size: int = 1
    config: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [
            "fsdp memory estimate: "
            + ", ".join(f"{k}={v}" for k, v in self.config.items())
            + f", world_size={self.world_size}",
            f"  peak on the training device: {format_bytes(self.peak_bytes)} (during {self.peak_phase})",
        ]
        if self.cpu_peak_bytes and self.config.get("device") != "cpu":
            lines.append(f"  host memory (CPU offload): {format_bytes(self.cpu_peak_bytes)}")
        lines.append("  at the peak:")
        width = max((len(k) for k in self.breakdown), default=10)
        for name, nbytes in sorted(self.breakdown.items(), key=lambda kv: -kv[1]):
            if nbytes:
                lines.append(f"    {name:<{width}}  {format_bytes(nbytes):>12}")
        lines.append(f"  units ({len(self.units)}):")
        shown = self.units if len(self.units) <= 12 else self.units[:5] + self.units[-5:]
        name_width = max([len("unit")] + [len(u.name) for u in shown])
        lines.append(f"    {'unit':<{name_width}} {'flat numel':>14} {'padded shard':>14} {'gathered':>12}")
        for i, unit in enumerate(shown):
            if len(self.units) > 12 and i == 5:
                lines.append(f"    ... {len(self.units) - 10} more")
            lines.append(
                f"    {unit.name:<{name_width}} {unit.unpadded_unsharded_numel:>14,} "
                f"{unit.padded_sharded_numel:>14,} {format_bytes(unit.unsharded_bytes):>12}"
            )
        return "\n".join(lines)
