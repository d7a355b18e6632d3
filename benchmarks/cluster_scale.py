"""How far the emulated cluster goes on this machine, and how the simulator's prediction
compares: allreduce and ps-async on the mlp (digits) on 2 to 16 emulated hosts.

The machine's cores are split evenly: with H hosts each has --budget/H of a core, and
links of --link. The simulator gets the same cluster: each host's compute per step is
measured once, by a 1-host `single` run at that CPU share (batch 32), and the link's
rate is the shaped one. ps-async puts the shard on host 0 and H-1 workers on the rest.

    sudo .venv/bin/python benchmarks/cluster_scale.py [--hosts 2,4,8,16] [--budget 1.6]

Writes benchmarks/results/cluster_scale.json and .md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from cluster_common import RESULTS, cluster_train, record

TRAIN = ["--model", "mlp", "--dataset", "digits", "--timeout", "300"]
LAYOUTS = {  # strategy -> (training flags for H hosts, simulator flags for H hosts)
    "allreduce": (lambda h: ["--strategy", "allreduce", "--workers", str(h)], lambda h: ["--workers", str(h)]),
    "ps-async": (lambda h: ["--strategy", "ps-async", "--workers", str(h - 1)], lambda h: ["--workers", str(h - 1)]),
}


def _link_gbps(link: str) -> float:
    units = {"kbit": 1e-6, "mbit": 1e-3, "gbit": 1.0}
    for unit, scale in units.items():
        if link.endswith(unit):
            return float(link.removesuffix(unit)) * scale
    raise SystemExit(f"--link {link}: expected a rate in kbit, mbit or gbit")


def simulated(strategy: str, hosts: int, compute_ms: float, args: argparse.Namespace, folder: Path) -> float:
    out = folder / "sim.json"
    command = [
        sys.executable, "-m", "paratrain", "simulate", "--strategy", strategy, *LAYOUTS[strategy][1](hosts),
        "--compute-ms", f"{compute_ms:.4f}", "--model", "mlp", "--bandwidth-gbps", f"{_link_gbps(args.link):g}",
        "--steps", "400", "--json-out", str(out),
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True)
    return json.loads(out.read_text())["results"][0]["examples_per_second"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", default="2,4,8,16")
    parser.add_argument("--budget", type=float, default=1.6, help="cores shared by all hosts")
    parser.add_argument("--link", default="1gbit")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--out", default=str(RESULTS / "cluster_scale"))
    args = parser.parse_args()
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
                predicted = simulated(strategy, hosts, compute_ms, args, Path(tmp))
                row = {
                    "hosts": hosts,
                    "cpu": cpu,
                    "strategy": strategy,
                    "compute_ms": compute_ms,
                    "examples_per_second": metrics["steady_examples_per_second"],
                    "simulated": predicted,
                    "error": predicted / metrics["steady_examples_per_second"] - 1,
                    "test_accuracy": metrics["test_accuracy"],
                }
                rows.append(row)
                print(f"{hosts:3} hosts at {cpu:.3f} {strategy:9} {row['examples_per_second']:8.0f} examples/s, "
                      f"simulated {predicted:8.0f} ({row['error']:+.0%}), accuracy {row['test_accuracy']:.3f}",
                      flush=True)  # fmt: skip
    lines = [
        f"# Scale on emulated hosts: the mlp on digits, {args.budget:g} cores shared evenly, {args.link} links",
        "",
        f"{args.epochs} epochs, batch 32 per worker (`sudo python benchmarks/cluster_scale.py`). Rates count from "
        "the end of epoch 1. The simulator gets each host's compute per step (a 1-host `single` run at that share) "
        "and the link rate; ps-async has the shard on host 0.",
        "",
        "| hosts | CPU each | strategy | compute ms/step | examples/s | simulated | error | test accuracy |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['hosts']} | {r['cpu']:.3f} | {r['strategy']} | {r['compute_ms']:.1f} | {r['examples_per_second']:,.0f} "
            f"| {r['simulated']:,.0f} | {r['error']:+.0%} | {r['test_accuracy']:.3f} |"
        )
    record(Path(args.out), {"setup": {k: v for k, v in vars(args).items() if k != "out"}, "rows": rows}, lines)


if __name__ == "__main__":
    main()
