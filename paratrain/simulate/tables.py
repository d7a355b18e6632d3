"""What ``paratrain simulate`` prints: the sweep's table and a virtual training run's progress."""

from __future__ import annotations

import shutil
from typing import Any

from rich.console import Console
from rich.table import Table

from paratrain.console import console


def print_table(rows: list[dict[str, Any]], compute_s: float) -> None:
    table = Table(title=f"simulated: {compute_s * 1e3:.3g} ms compute per step")
    held = any("parameter_bytes_per_process" in r for r in rows)  # tensor's meshes
    names = ["strategy", "workers", "step ms", "examples/s", "scaling", "comm", "stale mean/max", "dropped"]
    label = max((len(r["strategy"]) for r in rows), default=8)  # a mesh's whole name: "pipeline S=2 x T=2"
    for name in names + ["params MB/process"] * held:
        first = name == "strategy"
        table.add_column(name, justify="left" if first else "right", no_wrap=True, min_width=label if first else None)
    for r in rows:
        cells = [
            r["strategy"],
            str(r["workers"]),
            f"{r['step_seconds'] * 1e3:.3f}",
            f"{r['examples_per_second']:.0f}" + _over_rounds(r.get("examples_per_second_range"), "{:.0f}"),
            f"{r['scaling_efficiency']:.3f}",
            f"{r['comm_share']:.3f}",
            f"{r['staleness']['mean']:.2f}/{r['staleness']['max']}",
            str(r["dropped_gradients"]),
        ]
        if held:
            part = r.get("parameter_bytes_per_process")
            cells.append("-" if part is None else f"{part / 1e6:.3g}")
        table.add_row(*cells)
    Console(highlight=False, width=max(shutil.get_terminal_size().columns, 130 if held else 110)).print(table)
    console.print("scaling: examples/s over workers x one worker's; comm: share of the step not computing")


def print_training(result: dict[str, Any]) -> None:
    for point in result["history"]:
        console.print(
            f"simulated {point['sim_seconds']:.3f} s  update {point['updates']}  test_accuracy {point['test_accuracy']:.4f}"
        )
    console.print(
        f"done: test_accuracy {result['test_accuracy']:.4f} after {result['updates']} updates, "
        f"{result['sim_seconds']:.3f} simulated seconds ({result['strategy']}, {result['workers']} workers)"
    )


def print_targets(rows: list[dict[str, Any]], args: Any, workers: int) -> None:
    """``--target-*``: each strategy's simulated seconds to the target, fastest first."""
    from paratrain.simulate.target import target_words

    table = Table(title=f"simulated time to {target_words(args)}, {workers} workers, {args.seeds} seeds")
    for name in ("strategy", "median s", "each seed s", "final accuracy"):
        table.add_column(name, justify="left" if name == "strategy" else "right", no_wrap=True)
    for r in rows:
        median = "-" if r["median_seconds"] is None else f"{r['median_seconds']:.3g}"
        seeds = " ".join("-" if s is None else f"{s:.3g}" for s in r["seconds"])
        table.add_row(r["strategy"], median, seeds, f"{r['final_accuracy']:.4f}")
    Console(highlight=False, width=max(shutil.get_terminal_size().columns, 110)).print(table)


def print_candidates(rows: list[dict[str, Any]]) -> None:
    """``--recommend``: every candidate's examples/s (and time to the target), fastest first;
    with a calibration's rounds, each one's range over them in brackets."""
    table = Table(title="candidates on the described hosts")
    targeted = any("median_seconds" in r for r in rows)
    names = ["candidate", "workers", "examples/s", "same updates as SGD", *(["to target, median s"] * targeted)]
    for name in names:
        table.add_column(name, justify="left" if name == "candidate" else "right", no_wrap=True)
    for r in sorted(rows, key=lambda r: -r["examples_per_second"]):
        cells = [
            r["candidate"],
            str(r["workers"]),
            f"{r['examples_per_second']:,.0f}" + _over_rounds(r.get("examples_per_second_range"), "{:,.0f}"),
            "yes" if r["same_updates"] else "no",
        ]
        if targeted:
            seconds = r["median_seconds"]
            cells.append("-" if seconds is None else f"{seconds:.3g}" + _over_rounds(r.get("seconds_range"), "{:.3g}"))
        table.add_row(*cells)
    Console(highlight=False, width=max(shutil.get_terminal_size().columns, 110)).print(table)


def _over_rounds(spread: list[float] | None, words: str) -> str:
    """`` (low-high)`` of a value's range over a calibration's rounds; nothing without one."""
    return f" ({words.format(spread[0])}-{words.format(spread[1])})" if spread else ""
