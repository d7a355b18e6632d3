"""What the metrics document says of a run's gradients, in the same form for every strategy."""

from __future__ import annotations

from typing import Any


def staleness_summary(histogram: dict[int, int]) -> dict[str, Any]:
    """``{"mean", "max", "histogram"}`` from counts of gradients by staleness."""
    total = sum(histogram.values())
    used = {s: c for s, c in sorted(histogram.items()) if c}
    return {
        "mean": (sum(s * c for s, c in used.items()) / total) if total else 0.0,
        "max": max(used, default=0),
        "histogram": {str(s): c for s, c in used.items()},
    }
