"""A slow machine among the workers, on emulated hosts: ps-sync, ps-backup and ps-async.

Host 0 holds the parameter-server shard; hosts 1..4 the four workers, each with the same
CPU share except the last, which has half of it: a machine that computes at half speed,
not a sleeping process that hands its core to the others. The model is the tutorial CNN
on digits at CIFAR's shape (cluster_common.digits32), so that a step is mostly compute, as
in the paper's Inception runs, and the optimizer is Adam (lr 0.001), with which all three
modes learn it. Runs `paratrain cluster run`
(root) for each mode, in interleaved rounds, and records the applied examples/s (the
examples in updates the shards applied, per second of training), the time to a test
accuracy and the final accuracy (benchmarks/cluster_common.py says from when they count).

    sudo .venv/bin/python benchmarks/cluster_straggler.py [--rounds 3] [--epochs 15] [--cpu 0.36]

ps-backup takes rounds of 3 of the 4 workers (`--workers 3 --backup-workers 1`, Chen et
al. 2016); ps-async applies every gradient as it arrives. Writes
benchmarks/results/cluster_straggler.json and .md.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from cluster_common import RESULTS, cluster_train, median_or_none, record, seconds_to, shown

MODES = {
    "ps-sync": ["--strategy", "ps-sync", "--workers", "4"],
    "ps-backup": ["--strategy", "ps-backup", "--workers", "3", "--backup-workers", "1"],
    "ps-async": ["--strategy", "ps-async", "--workers", "4"],
}


def run(mode: str, args: argparse.Namespace, folder: Path) -> dict:
    cluster = [
        "--hosts",
        "5",
        "--cpu",
        f"{args.cpu:g}",
        "--host",
        f"0:cpu={args.ps_cpu:g}",
        "--host",
        f"4:cpu={args.cpu * args.slow:g}",
    ]
    train = [
        *MODES[mode],
        "--model",
        args.model,
        "--dataset",
        args.dataset,
        "--epochs",
        str(args.epochs),
        "--batch-size",
        str(args.batch_size),
        "--optimizer",
        args.optimizer,
        "--lr",
        str(args.lr),
    ]
    metrics = cluster_train(cluster, train, folder / f"{mode}.json")
    metrics["seconds_to_target"] = seconds_to(metrics, args.target)
    return metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--optimizer", default="adam")
    parser.add_argument("--lr", type=float, default=0.001)
    parser.add_argument("--target", type=float, default=0.9, help="test accuracy for time to accuracy")
    parser.add_argument("--cpu", type=float, default=0.36, help="each worker host's share of a core")
    parser.add_argument("--ps-cpu", type=float, default=0.5, help="the shard's host's share")
    parser.add_argument("--slow", type=float, default=0.5, help="the slow host's share, relative to the others")
    parser.add_argument("--model", default="cifar_cnn")
    parser.add_argument("--dataset", default="benchmarks.cluster_common:digits32")
    parser.add_argument("--out", default=str(RESULTS / "cluster_straggler"))
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for mode in MODES:
                metrics = run(mode, args, Path(tmp))
                runs[mode].append(metrics)
                print(
                    f"round {round_ + 1} {mode:9} {metrics['steady_examples_per_second']:8.0f} applied examples/s "
                    f"accuracy {metrics['test_accuracy']:.3f}, {shown(metrics['seconds_to_target'])} s to "
                    f"{args.target:g}, {metrics['dropped_gradients']} dropped",
                    flush=True,
                )
    base = statistics.median(m["steady_examples_per_second"] for m in runs["ps-sync"])
    rows = []
    for mode, metrics in runs.items():
        speed = statistics.median(m["steady_examples_per_second"] for m in metrics)
        rows.append(
            {
                "mode": mode,
                "examples_per_second": speed,
                "vs_ps_sync": speed / base,
                "seconds_to_target": median_or_none([m["seconds_to_target"] for m in metrics]),
                "test_accuracy": statistics.median(m["test_accuracy"] for m in metrics),
                "dropped_gradients": statistics.median(m["dropped_gradients"] for m in metrics),
                "late_pushes": statistics.median(m.get("late_pushes", 0) for m in metrics),
                "runs": [m["steady_examples_per_second"] for m in metrics],
            }
        )
    setup = {k: v for k, v in vars(args).items() if k != "out"}
    lines = [
        f"# One slow host of four workers: {args.model} on {args.dataset.split(':')[0]}, emulated hosts",
        "",
        f"5 hosts: the shard's at {args.ps_cpu:g} of a core, 4 workers' at {args.cpu:g}, except the last "
        f"worker's at {args.cpu * args.slow:g}. Batch {args.batch_size} per worker, {args.optimizer} lr {args.lr:g}. Median of {args.rounds} interleaved "
        f"rounds of {args.epochs} epochs (`sudo python benchmarks/cluster_straggler.py`). Rates and times count "
        f"from the end of epoch 1 (every host has started); time to {args.target:g} test accuracy is to the end "
        "of the first epoch that reaches it.",
        "",
        f"| mode | applied examples/s | vs ps-sync | seconds to {args.target:g} | test accuracy | dropped gradients "
        "| of them sent as a header alone | runs |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['examples_per_second']:.0f} | {r['vs_ps_sync']:.2f}x | {shown(r['seconds_to_target'])} "
            f"| {r['test_accuracy']:.3f} | {r['dropped_gradients']:.0f} | {r['late_pushes']:.0f} "
            f"| {', '.join(f'{v:.0f}' for v in r['runs'])} |"
        )
    record(Path(args.out), {"setup": setup, "rows": rows}, lines)


if __name__ == "__main__":
    main()
