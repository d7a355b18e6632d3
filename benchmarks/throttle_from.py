"""Emulated hosts throttled from the start against throttled from training on
(``paratrain cluster run --throttle-from start|training``): the same runs, their steady
examples/s and the wall time of the whole command.

    sudo .venv/bin/python benchmarks/throttle_from.py [--repeats 2]

Each setting (the mlp on digits, batch 32 a worker, as benchmarks/simulator_recommend.py
runs it) runs under each mode in every pass, the order of the two modes flipped from one
pass to the next so that drift of the machine hits both; a row gives the medians over the
passes. Rates count from the end of epoch 1 (cluster_common.steady_rate): if the hosts'
shares hold from step 1 on, the two modes' rates agree within the runs' noise, and only the
wall time differs (start-up at the machine's speed instead of at the hosts' shares).

Writes benchmarks/results/throttle_from.json and .md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's paratrain

from cluster_common import RESULTS, cluster_train, record  # noqa: E402  (after the path)

MODES = ("start", "training")
SETTINGS = {
    "4 hosts at 0.3, 1gbit, allreduce": (
        ["--hosts", "4", "--cpu", "0.3", "--link", "1gbit"],
        ["--strategy", "allreduce"],
    ),
    "4 hosts at 0.3, 1gbit, ps-async": (
        ["--hosts", "4", "--cpu", "0.3", "--link", "1gbit"],
        ["--strategy", "ps-async"],
    ),
    "3 hosts at 0.6, 20mbit, host 2 at 0.3, local-sgd": (
        ["--hosts", "3", "--cpu", "0.6", "--link", "20mbit", "--host", "2:cpu=0.3"],
        ["--strategy", "local-sgd", "--sync-every", "8"],
    ),
}
TRAIN = ["--model", "mlp", "--dataset", "digits", "--batch-size", "32", "--epochs", "10", "--timeout", "300"]


def one_run(cluster: list[str], train: list[str], mode: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="paratrain-throttle-") as folder:
        start = time.perf_counter()
        hosts = [*cluster, "--pin", "never", "--throttle-from", mode]  # as simulator_recommend.py's real runs
        metrics = cluster_train(hosts, [*TRAIN, *train], Path(folder) / "m.json")
        return {
            "examples_per_second": metrics["steady_examples_per_second"],
            "wall_seconds": time.perf_counter() - start,
            "first_epoch_end_s": metrics["history"][0]["wall_seconds"],
            "test_accuracy": metrics["test_accuracy"],
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS / "throttle_from.json"))
    args = parser.parse_args(argv)
    runs: dict[str, dict[str, list[dict]]] = {name: {mode: [] for mode in MODES} for name in SETTINGS}
    for index in range(args.repeats):
        for name, (cluster, train) in SETTINGS.items():
            for mode in MODES if index % 2 == 0 else tuple(reversed(MODES)):
                run = one_run(cluster, train, mode)
                runs[name][mode].append(run)
                print(f"pass {index}: {name}, --throttle-from {mode}: {run}", flush=True)
    document = {
        "command": " ".join(["python", "benchmarks/throttle_from.py", *(argv or sys.argv[1:])]),
        "train": TRAIN,
        "repeats": args.repeats,
        "runs": runs,
    }

    def median(name: str, mode: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[name][mode])

    lines = [
        "# Emulated hosts throttled from the start or from training on",
        "",
        f"`{document['command']}`: the mlp on digits (`{' '.join(TRAIN)}`), each setting under "
        "`paratrain cluster run --throttle-from start` and `--throttle-from training`, the order flipped every "
        f"pass; medians of {args.repeats} passes. Rates count from the end of epoch 1.",
        "",
        "| setting | examples/s (start) | examples/s (training) | training / start | whole run s (start) "
        "| whole run s (training) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in SETTINGS:
        rate = {mode: median(name, mode, "examples_per_second") for mode in MODES}
        wall = {mode: median(name, mode, "wall_seconds") for mode in MODES}
        lines.append(
            f"| {name} | {rate['start']:,.0f} | {rate['training']:,.0f} | {rate['training'] / rate['start']:.2f} "
            f"| {wall['start']:.1f} | {wall['training']:.1f} |"
        )
    record(Path(args.out), document, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
