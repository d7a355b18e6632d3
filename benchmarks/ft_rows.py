"""A row of ft_recovery.py's tables: a pair of runs' numbers, a row's line, a recovery measure's median and
range, a throughput row's cost of a loss and the CPU share a hypervisor took from its runs."""

from __future__ import annotations

import math
import statistics

from loss_cost import LOSS, loss_costs, pace


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


def processor_lines(rows: list[dict], every: float) -> list[str]:
    """Where throughput rows' sets ran (each set's ``processor``, from processor.py), for the
    rows whose sets say, and in which order where recorded: a set's two runs share one
    machine, a row's sets may not (``every``: the file's interval, for a row recorded before
    rows carried theirs)."""
    said = []
    for row in rows:
        runs = row.get("runs", [row])
        named = [r["processor"] for r in runs if "processor" in r]
        if not named:
            continue
        counts = ", ".join(f"{name} {named.count(name)}" for name in sorted(set(named)))
        unnamed = f", {len(runs) - len(named)} not recorded" if len(named) < len(runs) else ""
        first = [r for r in runs if "disturbed_first" in r]  # kept since --add could start either way
        order = f", disturbed runs first in {sum(r['disturbed_first'] for r in first)} of {len(first)}" if first else ""
        said.append(f"{row['model']} {row['strategy']} every {row.get('every', every):g} s: {counts}{unnamed}{order}")
    if not said:
        return []
    return [
        "",
        "The sets' processors (model name and PyTorch's CPU capability; sets recorded before it was "
        "kept: not recorded) and, where recorded, how many ran their disturbed runs first: " + "; ".join(said) + ".",
    ]


def cost_words(runs: list[dict]) -> str:
    """A row's median cost of a loss, with its runs' range; ``-`` for rows recorded before it was measured."""
    values = [r["loss_cost"] for r in runs if not math.isnan(r.get("loss_cost", math.nan))]
    if not values:
        return "-"
    spread = f" ({min(values):.2f}-{max(values):.2f})" if len(values) > 1 else ""
    return f"{statistics.median(values):.2f}{spread}"


#: Seconds a window of a pair's recorded pace spans.
PACE_WIDTH = 10.0


def speed_words(runs: list[dict]) -> str:
    """A row's median steps per second over its undisturbed and its disturbed runs' whole
    commands, from the pace each pair recorded (its windows' steps add up to the run's);
    ``-`` for rows recorded before it was."""
    paced = [r for r in runs if "pace" in r]
    if not paced:
        return "-"
    rates = [
        statistics.median(sum(r["pace"][k]) * PACE_WIDTH / r[f"{k}_seconds"] for r in paced)
        for k in ("undisturbed", "disturbed")
    ]
    return f"{rates[0]:.2f} / {rates[1]:.2f}"


def pair(calm: dict, hit: dict) -> dict:
    """What a disturbed run kept of the undisturbed one's speed, and what its losses cost."""
    losses = [t for t, line in hit["errors"] if LOSS.search(line)]
    costs = loss_costs(hit["steps"], losses)
    return {
        "undisturbed_seconds": calm["seconds"],
        "disturbed_seconds": hit["seconds"],
        "kept": calm["seconds"] / hit["seconds"],
        "losses_reported": len(losses),
        "loss_cost": statistics.median(costs) if costs else float("nan"),
        "test_accuracy": hit["metrics"]["test_accuracy"],
        "undisturbed_test_accuracy": calm["metrics"]["test_accuracy"],
        # the share of the machine's CPU time a hypervisor gave to other machines in each run
        "steal": {"undisturbed": calm["steal"], "disturbed": hit["steal"]},
        # steps/s in each 10 s of each run, and the losses' moments: where the time went
        "pace": {
            "undisturbed": pace(calm["steps"], PACE_WIDTH),
            "disturbed": pace(hit["steps"], PACE_WIDTH),
            "losses_at": losses,
        },
    }


def throughput_line(kept: dict) -> str:
    """A throughput row: the medians of its pairs, what they kept and its range."""
    runs = kept.get("runs", [kept])
    spread = f" ({min(r['kept'] for r in runs):.0%}-{max(r['kept'] for r in runs):.0%})" if len(runs) > 1 else ""
    return (
        f"| {kept['model']} | {kept['strategy']} | {len(runs)} | {kept['undisturbed_seconds']:.1f} "
        f"| {kept['disturbed_seconds']:.1f} | {kept['kept']:.0%}{spread} | {kept['losses_reported']:g} "
        f"| {cost_words(runs)} | {kept['test_accuracy']:.3f} ({kept['undisturbed_test_accuracy']:.3f}) "
        f"| {stolen_words(runs)} | {speed_words(runs)} |"
    )
