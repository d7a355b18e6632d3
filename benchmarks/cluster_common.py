"""What the emulated-cluster benchmarks share: one `paratrain cluster run` of a training
job, and the rates and times read from its metrics file.

Rates are taken from the end of the first epoch on: a host at a small CPU share takes
many seconds to import torch, and the first step of every mode waits for the slowest
host to start. Time to accuracy counts from the same point to the end of the first epoch
whose test accuracy reaches the target.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def cluster_train(cluster: list[str], train: list[str], out: Path, timeout: float = 1800) -> dict:
    """``paratrain cluster run CLUSTER -- paratrain train TRAIN``; its metrics, with
    ``steady_examples_per_second`` (examples in applied updates after epoch 1, per
    second) and ``epoch_seconds`` (the mean epoch after the first)."""
    command = [
        sys.executable, "-m", "paratrain", "cluster", "run", *cluster, "--",
        "paratrain", "train", *train, "--no-progress", "--log-every", "0", "--metrics-out", str(out),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if result.returncode or not out.exists():
        raise SystemExit(f"{' '.join(command)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    metrics = json.loads(out.read_text())
    out.unlink()
    first, last = metrics["history"][0], metrics["history"][-1]
    seconds = last["wall_seconds"] - first["wall_seconds"]
    metrics["steady_examples_per_second"] = (last["examples_seen"] - first["examples_seen"]) / seconds
    metrics["epoch_seconds"] = seconds / (len(metrics["history"]) - 1)
    return metrics


def recorded(out: str, args: object, names: tuple[str, ...]) -> dict:
    """``--resimulate``: the document recorded at ``out`` (.json), with its setup's ``names``
    put back into ``args`` (the runs are simulated as they were measured)."""
    document = json.loads(Path(out).with_suffix(".json").read_text())
    for name in names:
        setattr(args, name, document["setup"][name])
    return document


def link_bytes_per_s(link: str) -> float:
    """A ``--link`` rate (``100mbit``, ``1gbit``) in bytes per second."""
    for unit, scale in (("kbit", 1e3), ("mbit", 1e6), ("gbit", 1e9)):
        if link.endswith(unit):
            return float(link.removesuffix(unit)) * scale / 8
    raise SystemExit(f"--link {link}: expected a rate in kbit, mbit or gbit")


def seconds_to(metrics: dict, target: float) -> float | None:
    """Seconds from the end of epoch 1 to the end of the first epoch at ``target`` test
    accuracy, or None if none reached it."""
    start = metrics["history"][0]["wall_seconds"]
    reached = [h for h in metrics["history"] if (h["test_accuracy"] or 0) >= target]
    return reached[0]["wall_seconds"] - start if reached else None


def median_or_none(values: list[float | None]) -> float | None:
    """The median of the runs that reached a target, or None when most did not."""
    reached = sorted(v for v in values if v is not None)
    return statistics.median(reached) if len(reached) * 2 > len(values) else None


def shown(value: float | None) -> str:
    return f"{value:.1f}" if value is not None else "not reached"


def record(out: Path, document: dict, lines: list[str]) -> None:
    """The results as JSON and a Markdown table beside it; the table to stdout."""
    out.with_suffix(".json").write_text(json.dumps(document, indent=2) + "\n")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
