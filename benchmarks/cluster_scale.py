"""How far the emulated cluster goes on this machine, and how the simulator's prediction
compares: allreduce and ps-async on the mlp (digits) on 2 to 16 emulated hosts.

The machine's cores are split evenly: with H hosts each has --budget/H of a core, and
links of --link. The simulator gets the same cluster, each host under its CPU quota as the
kernel runs it (``Cluster(cpu_share=...)``, paratrain/simulate/quota.py): each host's CPU
per step is measured once, by a 1-host ``single`` run at that share (batch 32; its
seconds per step times the share, which is its CPU for a host that is always busy), the
shard's CPU per push and per update are cluster_validation.py's (measured on this
machine), and the link's rate is the shaped one. ps-async puts the shard on host 0 and
H-1 workers on the rest.

The CPU each message costs its receiver, M, is calibrated once: the M at which the
simulator reproduces the smallest allreduce run (2 hosts). That row is the calibration;
every other row is a prediction.

    sudo .venv/bin/python benchmarks/cluster_scale.py [--hosts 2,4,8,16] [--budget 1.6]
    .venv/bin/python benchmarks/cluster_scale.py --resimulate   (the recorded runs, simulated again)

Writes benchmarks/results/cluster_scale.json and .md.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from cluster_common import RESULTS, SEEDS, calibrate, cluster_train, record, recorded, simulated_on_quota_hosts

TRAIN = ["--model", "mlp", "--dataset", "digits", "--timeout", "300"]
LAYOUTS = {  # strategy -> workers on H hosts (ps-async: the shard on one of them)
    "allreduce": lambda h: h,
    "ps-async": lambda h: h - 1,
}


def simulated(row: dict, link: str, message_cpu_s: float, shard: dict) -> float:
    strategy, workers = row["strategy"], LAYOUTS[row["strategy"]](row["hosts"])
    compute_s = row["compute_ms"] * 1e-3 * row["cpu"]  # seconds per step at the share, times it: CPU-seconds
    return simulated_on_quota_hosts(strategy, workers, row["cpu"], compute_s, link, message_cpu_s, **shard)[
        "examples_per_second"
    ]


def simulate_rows(rows: list[dict], link: str, shard: dict) -> float:
    """Each row's simulated rate and error; returns M, calibrated on the 2-host allreduce."""
    reference = min((r for r in rows if r["strategy"] == "allreduce"), key=lambda r: r["hosts"])
    message_cpu_s = calibrate(lambda m: simulated(reference, link, m, shard), reference["examples_per_second"])
    for row in rows:
        row["simulated"] = simulated(row, link, message_cpu_s, shard)
        row["error"] = row["simulated"] / row["examples_per_second"] - 1
        row["calibration"] = row is reference
        row.pop("latency_us", None)  # the model before the CPU quota's
    return message_cpu_s


def shard_profile() -> dict:
    """The shard's CPU-seconds per push and per update, as cluster_validation.py measured them
    (its push less the M it was simulated with: the M calibrated here is added back)."""
    validation = json.loads((RESULTS / "cluster_validation.json").read_text())
    machine, message_cpu_s = validation["machine"], validation["cpu_seconds_per_message"]
    own = max(machine["ps_push_s"] - message_cpu_s - machine["ps_update_s"], 0.0)
    return {"ps_message_s": own, "ps_update_s": machine["ps_update_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", default="2,4,8,16")
    parser.add_argument("--budget", type=float, default=1.6, help="cores shared by all hosts")
    parser.add_argument("--link", default="1gbit")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--resimulate", action="store_true", help="simulate the recorded runs again; run nothing")
    parser.add_argument("--out", default=str(RESULTS / "cluster_scale"))
    args = parser.parse_args()
    if args.resimulate:  # with the shard's costs the runs were simulated with when recorded
        document = recorded(args.out, args, ("budget", "link", "epochs"))
        rows, shard = document["rows"], document["shard"]
    else:
        rows, shard = measure(args), shard_profile()
    message_cpu_s = simulate_rows(rows, args.link, shard)
    lines = [
        f"# Scale on emulated hosts: the mlp on digits, {args.budget:g} cores shared evenly, {args.link} links",
        "",
        f"{args.epochs} epochs, batch 32 per worker (`sudo python benchmarks/cluster_scale.py`). Rates count from "
        "the end of epoch 1. The simulator models each host under its CPU quota (the share x 10 ms per 10 ms "
        f"period, full speed until spent; mean of {SEEDS} draws of the hosts' phases) and gets each host's CPU per "
        "step (a 1-host `single` run at that share: its step time x the share), the shard's CPU per push "
        f"({shard['ps_message_s'] * 1e3:.3f} ms) and per update ({shard['ps_update_s'] * 1e3:.3f} ms) from "
        f"cluster_validation.json, the link rate, and M = {message_cpu_s * 1e3:.3f} ms of CPU per message received, "
        "calibrated on the 2-host allreduce run (marked: the calibration, not a prediction).",
        "",
        "| hosts | CPU each | strategy | step ms at the share | CPU ms/step | examples/s | simulated | error | test accuracy |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        error = "calibration" if r["calibration"] else f"{r['error']:+.0%}"
        lines.append(
            f"| {r['hosts']} | {r['cpu']:.3f} | {r['strategy']} | {r['compute_ms']:.1f} | {r['compute_ms'] * r['cpu']:.2f} "
            f"| {r['examples_per_second']:,.0f} | {r['simulated']:,.0f} | {error} | {r['test_accuracy']:.3f} |"
        )
    setup = {k: v for k, v in vars(args).items() if k not in ("out", "resimulate")}
    document = {"setup": setup, "shard": shard, "cpu_seconds_per_message": message_cpu_s, "rows": rows}
    record(Path(args.out), document, lines)


def measure(args: argparse.Namespace) -> list[dict]:
    """The real runs: for each host count, each host's compute at its share, then each strategy."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for hosts in [int(h) for h in args.hosts.split(",")]:
            cpu = args.budget / hosts
            # every host count with the hosts sharing the cores as the kernel places them
            one = cluster_train(
                ["--hosts", "1", "--cpu", f"{cpu:g}", "--pin", "never"],
                ["--strategy", "single", *TRAIN, "--epochs", str(args.epochs)],
                Path(tmp) / "m.json",
            )
            compute_ms = 32 / one["steady_examples_per_second"] * 1000
            for strategy, workers in LAYOUTS.items():
                flags = ["--strategy", strategy, "--workers", str(workers(hosts))]
                cluster = ["--hosts", str(hosts), "--cpu", f"{cpu:g}", "--link", args.link, "--pin", "never"]
                metrics = cluster_train(cluster, [*flags, *TRAIN, "--epochs", str(args.epochs)], Path(tmp) / "m.json")
                rows.append(
                    {
                        "hosts": hosts,
                        "cpu": cpu,
                        "strategy": strategy,
                        "compute_ms": compute_ms,
                        "examples_per_second": metrics["steady_examples_per_second"],
                        "test_accuracy": metrics["test_accuracy"],
                    }
                )
                print(
                    f"{hosts:3} hosts at {cpu:.3f} {strategy:9} {rows[-1]['examples_per_second']:8.0f} examples/s, "
                    f"accuracy {rows[-1]['test_accuracy']:.3f}",
                    flush=True,
                )
    return rows


if __name__ == "__main__":
    main()
