"""How far the emulated cluster goes on this machine, and how the simulator's prediction
compares: allreduce and ps-async on the mlp (digits) on 2 to 16 emulated hosts.

The machine's cores are split evenly: with H hosts each has --budget/H of a core, and
links of --link. The simulator gets the same cluster: each host's compute per step is
measured once, by a 1-host `single` run at that CPU share (batch 32), and the link's
rate is the shaped one. ps-async puts the shard on host 0 and H-1 workers on the rest.

A message's latency on a host with a CPU share c is mostly CPU: the framework's work for
each hop (DDP, Gloo, Python) runs at c of a core, and under a CFS quota a host that has
spent its quota waits for the next period. So the simulator gets a latency per message of
L / c, with L (CPU-seconds per hop) calibrated once: the latency at which it reproduces
the smallest allreduce run (2 hosts), times that run's share. That row is the
calibration; every other row is a prediction.

    sudo .venv/bin/python benchmarks/cluster_scale.py [--hosts 2,4,8,16] [--budget 1.6]
    .venv/bin/python benchmarks/cluster_scale.py --resimulate   (the recorded runs, simulated again)

Writes benchmarks/results/cluster_scale.json and .md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from cluster_common import RESULTS, cluster_train, link_bytes_per_s, record, recorded

TRAIN = ["--model", "mlp", "--dataset", "digits", "--timeout", "300"]
LAYOUTS = {  # strategy -> (training flags for H hosts, simulator flags for H hosts)
    "allreduce": (lambda h: ["--strategy", "allreduce", "--workers", str(h)], lambda h: ["--workers", str(h)]),
    "ps-async": (lambda h: ["--strategy", "ps-async", "--workers", str(h - 1)], lambda h: ["--workers", str(h - 1)]),
}


def simulated(strategy: str, hosts: int, compute_ms: float, link: str, latency_us: float, folder: Path) -> float:
    out = folder / "sim.json"
    command = [
        sys.executable, "-m", "paratrain", "simulate", "--strategy", strategy, *LAYOUTS[strategy][1](hosts),
        "--compute-ms", f"{compute_ms:.4f}", "--model", "mlp", "--bandwidth-gbps", f"{link_bytes_per_s(link) * 8 / 1e9:g}",
        "--latency-us", f"{latency_us:.3f}", "--steps", "400", "--json-out", str(out),
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True)
    return json.loads(out.read_text())["results"][0]["examples_per_second"]


def calibrate(row: dict, link: str, folder: Path) -> float:
    """CPU-seconds per message hop (L): the latency at which the simulator gives ``row``'s
    rate (bisection on a log scale), times the row's CPU share."""
    low, high = 1.0, 1e6  # microseconds
    for _ in range(30):
        middle = (low * high) ** 0.5
        rate = simulated(row["strategy"], row["hosts"], row["compute_ms"], link, middle, folder)
        low, high = (middle, high) if rate > row["examples_per_second"] else (low, middle)
    return (low * high) ** 0.5 * 1e-6 * row["cpu"]


def simulate_rows(rows: list[dict], link: str, folder: Path) -> float:
    """Each row's simulated rate and error, with a latency of L / share; returns L."""
    reference = min((r for r in rows if r["strategy"] == "allreduce"), key=lambda r: r["hosts"])
    hop = calibrate(reference, link, folder)
    for row in rows:
        row["latency_us"] = hop / row["cpu"] * 1e6
        row["simulated"] = simulated(row["strategy"], row["hosts"], row["compute_ms"], link, row["latency_us"], folder)
        row["error"] = row["simulated"] / row["examples_per_second"] - 1
        row["calibration"] = row is reference
    return hop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", default="2,4,8,16")
    parser.add_argument("--budget", type=float, default=1.6, help="cores shared by all hosts")
    parser.add_argument("--link", default="1gbit")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--resimulate", action="store_true", help="simulate the recorded runs again; run nothing")
    parser.add_argument("--out", default=str(RESULTS / "cluster_scale"))
    args = parser.parse_args()
    if args.resimulate:
        rows = recorded(args.out, args, ("budget", "link", "epochs"))["rows"]
    else:
        rows = measure(args)
    with tempfile.TemporaryDirectory() as tmp:
        hop = simulate_rows(rows, args.link, Path(tmp))
    lines = [
        f"# Scale on emulated hosts: the mlp on digits, {args.budget:g} cores shared evenly, {args.link} links",
        "",
        f"{args.epochs} epochs, batch 32 per worker (`sudo python benchmarks/cluster_scale.py`). Rates count from "
        "the end of epoch 1. The simulator gets each host's compute per step (a 1-host `single` run at that share), "
        f"the link rate, and a latency per message of L / share, L = {hop * 1e3:.2f} ms of CPU per hop calibrated on "
        "the 2-host allreduce run (marked: the calibration, not a prediction); ps-async has the shard on host 0, "
        "whose work per push the simulator is not given.",
        "",
        "| hosts | CPU each | strategy | compute ms/step | latency ms | examples/s | simulated | error | test accuracy |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        error = "calibration" if r["calibration"] else f"{r['error']:+.0%}"
        lines.append(
            f"| {r['hosts']} | {r['cpu']:.3f} | {r['strategy']} | {r['compute_ms']:.1f} | {r['latency_us'] / 1e3:.2f} "
            f"| {r['examples_per_second']:,.0f} | {r['simulated']:,.0f} | {error} | {r['test_accuracy']:.3f} |"
        )
    setup = {k: v for k, v in vars(args).items() if k not in ("out", "resimulate")}
    record(Path(args.out), {"setup": setup, "cpu_seconds_per_hop": hop, "rows": rows}, lines)


def measure(args: argparse.Namespace) -> list[dict]:
    """The real runs: for each host count, each host's compute at its share, then each strategy."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for hosts in [int(h) for h in args.hosts.split(",")]:
            cpu = args.budget / hosts
            one = cluster_train(["--hosts", "1", "--cpu", f"{cpu:g}"],
                                ["--strategy", "single", *TRAIN, "--epochs", str(args.epochs)], Path(tmp) / "m.json")  # fmt: skip
            compute_ms = 32 / one["steady_examples_per_second"] * 1000
            for strategy, (flags, _) in LAYOUTS.items():
                cluster = ["--hosts", str(hosts), "--cpu", f"{cpu:g}", "--link", args.link]
                metrics = cluster_train(
                    cluster, [*flags(hosts), *TRAIN, "--epochs", str(args.epochs)], Path(tmp) / "m.json"
                )
                rows.append({
                    "hosts": hosts,
                    "cpu": cpu,
                    "strategy": strategy,
                    "compute_ms": compute_ms,
                    "examples_per_second": metrics["steady_examples_per_second"],
                    "test_accuracy": metrics["test_accuracy"],
                })  # fmt: skip
                print(f"{hosts:3} hosts at {cpu:.3f} {strategy:9} {rows[-1]['examples_per_second']:8.0f} examples/s, "
                      f"accuracy {rows[-1]['test_accuracy']:.3f}", flush=True)  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
