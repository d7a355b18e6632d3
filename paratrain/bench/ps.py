"""Parameter-server training against all-reduce, and under a straggler.

Each setting is a real multi-process run on this machine, launched as ``paratrain train`` launches it, run
``repeats`` times and reported as the median. ``scaling``: the throughput of ``allreduce``, ``ps-sync``,
``ps-backup`` and ``ps-async`` for each model and worker count, and each mode's step time relative to
``allreduce`` (target: ps-sync <= 1.3x at 2 workers). ``straggler``: one of N workers slowed ``factor`` times,
the throughput of ``ps-backup`` and ``ps-async`` relative to ``ps-sync``, counting every gradient and only the
applied ones (targets: backup >= 1.5x, async >= 1.6x). With fewer cores than processes the side-by-side
ratios, not the absolute numbers, are the result.
"""

from __future__ import annotations

import json
import statistics
from typing import Any

from paratrain.config import TrainConfig
from paratrain.launch.local import run_locally


def run(repeats: int, **settings: Any) -> dict[str, Any]:
    """Median throughput of ``repeats`` runs of one configuration."""
    config = TrainConfig(progress=False, log_every=0, device="cpu", **settings)
    samples = []
    for _ in range(repeats):
        metrics = run_locally(config)
        applied = sum(metrics["staleness"]["histogram"].values()) * config.batch_size
        samples.append(
            (metrics["examples_per_second"], metrics["test_accuracy"], applied, metrics["dropped_gradients"])
        )
    rate = statistics.median(s[0] for s in samples)
    share_applied = statistics.median(s[2] / (s[2] + s[3] * config.batch_size) for s in samples)
    return {
        "examples_per_second": rate,
        "applied_examples_per_second": rate * share_applied,
        "test_accuracy": statistics.median(s[1] for s in samples),
        "dropped_gradients": statistics.median(s[3] for s in samples),
        "processes": config.topology.num_processes,
    }


def modes(workers: int) -> dict[str, dict[str, Any]]:
    """The four modes at ``workers`` worker processes each."""
    return {
        "allreduce": {"strategy": "allreduce", "workers": workers},
        "ps-sync": {"strategy": "ps-sync", "workers": workers},
        "ps-backup": {"strategy": "ps-backup", "workers": workers - 1, "backup_workers": 1},
        "ps-async": {"strategy": "ps-async", "workers": workers},
    }


def scaling(models: list[str], workers: list[int], epochs: int, repeats: int, log: Any = None) -> list[dict[str, Any]]:
    rows = []
    for model in models:
        for n in workers:
            base = None
            for name, settings in modes(n).items():
                result = run(repeats, model=model, epochs=epochs, **settings)
                base = base or result["examples_per_second"]
                rows.append(
                    {
                        "model": model,
                        "workers": n,
                        "mode": name,
                        **result,
                        "step_time_vs_allreduce": base / result["examples_per_second"],
                    }
                )
                if log:
                    log(json.dumps(rows[-1]))
    return rows


def straggler(workers: int, factor: float, epochs: int, repeats: int, log: Any = None) -> list[dict[str, Any]]:
    rows, reference = [], None
    slow = f"{workers - 1}:{factor:g}"
    for name in ("ps-sync", "ps-backup", "ps-async"):
        result = run(repeats, model="mlp", epochs=epochs, straggler=slow, **modes(workers)[name])
        reference = reference or result
        rows.append(
            {
                "mode": name,
                **result,
                "all_vs_sync": result["examples_per_second"] / reference["examples_per_second"],
                "applied_vs_sync": result["applied_examples_per_second"] / reference["applied_examples_per_second"],
            }
        )
        if log:
            log(json.dumps(rows[-1]))
    return rows


def markdown(
    scaling_rows: list[dict[str, Any]], straggler_rows: list[dict[str, Any]], workers: int, factor: float
) -> str:
    lines = [
        "| model | workers | mode | examples/s | step time vs allreduce | test accuracy |",
        "| --- | --- | --- | --- | --- | --- |",
        *(
            f"| {r['model']} | {r['workers']} | {r['mode']} | {r['examples_per_second']:.0f} | "
            f"{r['step_time_vs_allreduce']:.2f}x | {r['test_accuracy']:.3f} |"
            for r in scaling_rows
        ),
    ]
    if straggler_rows:
        lines += [
            "",
            f"One of {workers} workers slowed {factor:g}x (mlp):",
            "",
            "| mode | examples/s (all) | vs ps-sync | examples/s (applied) | vs ps-sync | dropped gradients |",
            "| --- | --- | --- | --- | --- | --- |",
            *(
                f"| {r['mode']} | {r['examples_per_second']:.0f} | {r['all_vs_sync']:.2f}x | "
                f"{r['applied_examples_per_second']:.0f} | {r['applied_vs_sync']:.2f}x | {r['dropped_gradients']:.0f} |"
                for r in straggler_rows
            ),
        ]
    return "\n".join(lines) + "\n"
