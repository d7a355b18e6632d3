"""``paratrain simulate --target-accuracy A`` (or ``--target-loss L``): which strategy reaches the target first
on the simulated cluster.

Examples a second is not what a user chooses on: local SGD, DiLoCo and asynchronous updates make different
progress per example. So each strategy trains the real model on its simulated schedule (virtual.py), and its
time to the target is the simulated time of the first epoch end whose evaluation reaches it. Over
``--seeds`` seeds, strategies are ranked by the median time, a seed that misses the target within
``--epochs`` counting as later than any that reaches it.
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
from typing import Any

from paratrain.simulate.simulator import simulate
from paratrain.simulate.virtual import replay


def reaches(point: dict[str, float], args: argparse.Namespace) -> bool:
    if args.target_accuracy is not None:
        return point["test_accuracy"] >= args.target_accuracy
    return point["test_loss"] <= args.target_loss


def target_words(args: argparse.Namespace) -> str:
    if args.target_accuracy is not None:
        return f"test accuracy {args.target_accuracy:g}"
    return f"test loss {args.target_loss:g}"


def time_to_target(
    args: argparse.Namespace,
    strategies: list[str],
    cluster: Any,
    model: Any,
    splits: Any,
    options: dict[str, Any],
) -> list[dict[str, Any]]:
    """Each strategy's seconds to the target on ``cluster`` in each seed (None: not within
    ``--epochs``), ranked."""
    rows = []
    for strategy in strategies:
        seconds, finals = [], []
        for seed in range(args.seed, args.seed + args.seeds):
            steps = max(args.epochs * (len(splits.train) // (args.batch_size * cluster.workers)), 1)
            outcome = simulate(strategy, cluster, steps, seed=seed, record=True, **options)
            result = replay(
                outcome,
                copy.deepcopy(model),
                splits.train,
                splits.test,
                batch=args.batch_size,
                lr=args.lr,
                momentum=args.momentum,
                optimizer=args.optimizer,
                weight_decay=args.weight_decay,
                seed=seed,
                evals=None,
            )
            seconds.append(next((p["sim_seconds"] for p in result["history"] if reaches(p, args)), None))
            finals.append(result["test_accuracy"])
        reached = [s for s in seconds if s is not None]
        rows.append(
            {
                "strategy": strategy,
                "seconds": seconds,
                "median_seconds": censored_median(seconds),
                "reached": len(reached),
                "final_accuracy": statistics.median(finals),
            }
        )
    return sorted(rows, key=lambda r: (r["median_seconds"] is None, r["median_seconds"] or 0.0, -r["reached"]))


def censored_median(seconds: list[float | None]) -> float | None:
    """The median time to the target, a seed that missed it (None) counting as later than any
    that reached it; None when half of the seeds or more missed it."""
    median = statistics.median([math.inf if s is None else s for s in seconds])
    return None if math.isinf(median) else median


def recommendation(rows: list[dict[str, Any]], args: argparse.Namespace, workers: int) -> str:
    """The one line: every strategy's median time to the target, fastest first."""
    parts = []
    for row in rows:
        if row["median_seconds"] is None:
            parts.append(
                f"{row['strategy']} not in most seeds within {args.epochs} epochs "
                f"({row['reached']} of {len(row['seconds'])})"
            )
            continue
        spread = [s for s in row["seconds"] if s is not None]
        missed = f"; {row['reached']} of {len(row['seconds'])} seeds" if len(spread) < len(row["seconds"]) else ""
        parts.append(
            f"{row['strategy']} in {row['median_seconds']:.3g} s ({min(spread):.3g}-{max(spread):.3g}{missed})"
        )
    return f"on this cluster, {workers} workers, to {target_words(args)}: " + ", ".join(parts)
