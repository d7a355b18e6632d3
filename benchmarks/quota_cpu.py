"""What the same step costs in CPU under a CPU quota, on this machine.

The simulator's calibration measures a step's CPU on the machine's whole cores and takes a
node under a quota of S cores to do that work at full speed while its quota lasts
(simulate/quota.py): C CPU-seconds a step, C / S seconds a step when busy. This measures
whether the CPU a step costs stays C under a quota: `paratrain train --strategy single` of
the mlp (one thread) on this machine, then alone on one emulated host (`paratrain cluster
run --hosts 1 --cpu S`, a 10 ms period) at each share, then on N hosts at once at that
share (`local-sgd --sync-every 100000`: no synchronization but each epoch's). For each: the
process's CPU-seconds a step (its metrics' `cpu_seconds`, every thread) and its wall clock a
step, over the epochs past the first (the chief's, host 0's), and the CPU a step over the
whole-core run's.

    sudo python benchmarks/quota_cpu.py [--shares 1,0.6,0.3,0.15] [--hosts 4] [--out benchmarks/results/quota_cpu]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster_common import RESULTS, paratrain, record  # noqa: E402

TRAIN = [
    "--model",
    "mlp",
    "--dataset",
    "digits",
    "--batch-size",
    "32",
    "--epochs",
    "12",
    "--threads-per-worker",
    "1",
    "--no-progress",
    "--log-every",
    "0",
]


def per_step(cluster: list[str], strategy: list[str], folder: Path) -> dict:
    """Wall-clock and CPU seconds a step of the run, past its first epoch."""
    out = folder / "m.json"
    train = ["train", *strategy, *TRAIN, "--metrics-out", str(out)]
    if cluster:
        paratrain(
            "cluster", "run", *cluster, "--pin", "never", "--logs", str(folder / "logs"), "--", "paratrain", *train
        )
    else:
        paratrain(*train)
    metrics = json.loads(out.read_text())
    first, last = metrics["history"][0], metrics["history"][-1]
    steps = (last["examples_seen"] - first["examples_seen"]) / 32 / metrics.get("workers", 1)
    return {
        "wall_ms": sum(e["train_seconds"] for e in metrics["history"][1:]) / steps * 1e3,
        "cpu_ms": (last["cpu_seconds"] - first["cpu_seconds"]) / steps * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shares", default="1,0.6,0.3,0.15")
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--out", default=str(RESULTS / "quota_cpu"))
    args = parser.parse_args()
    shares = [float(s) for s in args.shares.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        bare = per_step([], ["--strategy", "single"], Path(tmp))
        rows.append({"where": "this machine, no quota", "share": None, "hosts": 0, **bare})
        for share in shares:
            alone = per_step(["--hosts", "1", "--cpu", f"{share:g}"], ["--strategy", "single"], Path(tmp))
            rows.append({"where": "1 emulated host", "share": share, "hosts": 1, **alone})
            together = per_step(
                ["--hosts", str(args.hosts), "--cpu", f"{share:g}"],
                ["--strategy", "local-sgd", "--workers", str(args.hosts), "--sync-every", "100000"],
                Path(tmp),
            )
            rows.append(
                {"where": f"{args.hosts} emulated hosts at once", "share": share, "hosts": args.hosts, **together}
            )
        again = per_step([], ["--strategy", "single"], Path(tmp))
        rows.append({"where": "this machine, no quota, again", "share": None, "hosts": 0, **again})
    base = (bare["cpu_ms"] + again["cpu_ms"]) / 2
    lines = [
        "# The CPU a step of the mlp costs under a CPU quota (one thread a process)",
        "",
        f"`python benchmarks/quota_cpu.py --shares {args.shares} --hosts {args.hosts}`: the chief's CPU-seconds "
        "and wall clock a step past epoch 1; `x whole cores`: its CPU a step over the mean of the two runs without a "
        "quota.",
        "",
        "| where | share of a core | wall ms a step | CPU ms a step | x whole cores |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        share = "-" if row["share"] is None else f"{row['share']:g}"
        lines.append(
            f"| {row['where']} | {share} | {row['wall_ms']:.2f} | {row['cpu_ms']:.2f} | {row['cpu_ms'] / base:.2f} |"
        )
    record(Path(args.out), {"setup": vars(args), "rows": rows}, lines)


if __name__ == "__main__":
    main()
