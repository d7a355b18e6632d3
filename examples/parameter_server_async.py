"""One model under ps-sync, ps-backup and ps-async, side by side, with a straggler.

The classic question of the distributed-TensorFlow tutorials: parameter servers with
synchronous updates wait for the slowest worker every step; backup workers (Chen et al.
2016, "Revisiting Distributed Synchronous SGD") drop the last gradients of each round;
asynchronous updates never wait, at the price of stale gradients. This runs the same
model, data and seed under each rule, with one of the workers slowed down, and prints
throughput, accuracy, dropped gradients and staleness for each.

    python examples/parameter_server_async.py                         # mlp on digits, 3 workers
    python examples/parameter_server_async.py --workers 4 --slowdown 3 --epochs 15
    python examples/parameter_server_async.py --model cifar_cnn --dataset cifar10 --epochs 10

Each mode is a real multi-process run on this machine: one parameter-server shard plus
the workers, started the way `paratrain train` starts them.
"""

from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.table import Table

from paratrain.config import TrainConfig
from paratrain.launch.cli import report_errors
from paratrain.launch.local import run_locally


def run_mode(strategy: str, args: argparse.Namespace) -> dict:
    workers = args.workers - 1 if strategy == "ps-backup" else args.workers
    # An option is given only to the strategy that takes it (the others refuse it, even at 0).
    backups = {"backup_workers": 1} if strategy == "ps-backup" else {}
    config = TrainConfig(
        strategy=strategy,
        workers=workers,
        **backups,
        model=args.model,
        dataset=args.dataset,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        progress=False,
        log_every=0,
        device="cpu",
        straggler=f"{args.workers - 1}:{args.slowdown:g}" if args.slowdown > 1 else None,
    )
    return run_locally(config)  # the shard and the workers, as `paratrain train` starts them


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=3, help="worker processes (ps-backup: one of them a backup)")
    parser.add_argument(
        "--slowdown", type=float, default=2.0, help="the last worker's steps take this many times longer"
    )
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.workers < 2:
        parser.error("--workers must be >= 2 (ps-backup needs a backup among them)")

    table = Table(title=f"{args.model} on {args.dataset}, {args.workers} workers, one {args.slowdown:g}x slower")
    for column in ("mode", "examples/s", "test accuracy", "updates", "dropped", "staleness mean / max"):
        table.add_column(column, justify="right" if column != "mode" else "left")
    for strategy in ("ps-sync", "ps-backup", "ps-async"):
        m = run_mode(strategy, args)
        staleness = m["staleness"]
        table.add_row(
            strategy,
            f"{m['examples_per_second']:.0f}",
            f"{m['test_accuracy']:.4f}",
            str(m["global_steps"]),
            str(m["dropped_gradients"]),
            f"{staleness['mean']:.2f} / {staleness['max']}",
        )
    Console().print(table)
    return 0


if __name__ == "__main__":
    sys.exit(report_errors(main, prog="parameter_server_async"))
