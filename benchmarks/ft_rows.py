"""A row of ft_recovery.py's tables, summarized over its runs: a recovery measure's median and
range, a throughput row's cost of a loss and the CPU share a hypervisor took from its runs."""

from __future__ import annotations

import math
import statistics


def spread_words(row: dict, key: str) -> str:
    """A recovery row's median of ``key`` and its range over the runs that measured it."""
    values = [run[key] for run in row["runs"] if key in run]
    return f"{row['median'][key]:.2f} ({min(values):.2f}-{max(values):.2f})"


def stolen_words(runs: list[dict]) -> str:
    """A row's median share stolen by a hypervisor in its undisturbed and disturbed runs; ``-``
    for rows recorded before it was measured (or without /proc/stat)."""
    shares = [
        [r["steal"][k] for r in runs if r.get("steal", {}).get(k) is not None] for k in ("undisturbed", "disturbed")
    ]
    if not all(shares):
        return "-"
    return " / ".join(f"{statistics.median(values):.1%}" for values in shares)


def cost_words(runs: list[dict]) -> str:
    """A row's median cost of a loss, with its runs' range; ``-`` for rows recorded before it was measured."""
    values = [r["loss_cost"] for r in runs if not math.isnan(r.get("loss_cost", math.nan))]
    if not values:
        return "-"
    spread = f" ({min(values):.2f}-{max(values):.2f})" if len(values) > 1 else ""
    return f"{statistics.median(values):.2f}{spread}"
