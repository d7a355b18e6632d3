"""Where an emulated cluster on this machine behaves like the cluster it stands for.

`paratrain cluster run` gives each host a CPU quota, but every host's processes still run on
this machine's cores. The simulator models each host as a machine of its own under its
quota. When the hosts' shares add up to near the machine's cores, the emulation is slower
than the cluster it describes: its processes contend for the cores, and a barrier waits
for whichever of them is off a core. This benchmark measures by how much, on the most
compute-bound run there is: `local-sgd --sync-every 10000` (no synchronization in the
run, only each epoch's loss and evaluation all-reduces) of the mlp on digits, on a grid of
host counts and shares:

- real: the run on `paratrain cluster run --hosts N --cpu S` (median of the passes);
- without quotas: the same N processes on this machine with no cluster (`paratrain train
  --workers N`): what the machine's cores alone allow;
- predicted: `paratrain simulate` of that run on N nodes at S of a core (a 10 ms quota
  period, as the cluster's), with a calibration measured here first (`--calibrate`).

    sudo python benchmarks/colocation.py [--repeats 2] [--out benchmarks/results/colocation]

Rates count from the end of epoch 1 (cluster_common.py). Root: the cluster's namespaces.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster_common import RESULTS, cluster_train, paratrain, record, steady_rate  # noqa: E402

#: hosts, CPU share of each
GRID = [(2, 0.6), (3, 0.3), (3, 0.45), (3, 0.6), (4, 0.3), (4, 0.45), (5, 0.3)]
MODEL = [
    "--model",
    "mlp",
    "--dataset",
    "digits",
    "--batch-size",
    "32",
    "--optimizer",
    "sgd",
    "--lr",
    "0.05",
    "--momentum",
    "0.9",
]
RUN = ["--strategy", "local-sgd", "--sync-every", "10000", "--epochs", "10"]


def unquoted(hosts: int, seed: int, folder: Path) -> float:
    """The N processes on this machine, no cluster: examples/s from the end of epoch 1."""
    out = folder / "plain.json"
    paratrain(
        "train",
        *RUN,
        "--workers",
        str(hosts),
        *MODEL,
        "--seed",
        str(seed),
        "--log-every",
        "0",
        "--no-progress",
        "--metrics-out",
        str(out),
    )
    return steady_rate(json.loads(out.read_text()))


def predicted(hosts: int, share: float, calibration: Path, folder: Path) -> float:
    out = folder / "prediction.json"
    paratrain(
        "simulate",
        *RUN,
        "--workers",
        str(hosts),
        *MODEL,
        "--calibration",
        str(calibration),
        "--cpu-share",
        f"{share:g}",
        "--cpu-period-ms",
        "10",
        "--json-out",
        str(out),
    )
    (row,) = json.loads(out.read_text())["results"]
    return row["examples_per_second"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS / "colocation"))
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("colocation.py runs emulated clusters: run it as root")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        calibration = folder / "calibration.json"
        paratrain("simulate", "--calibrate", str(calibration), *MODEL)
        for hosts, share in GRID:
            cluster = ["--hosts", str(hosts), "--cpu", f"{share:g}", "--link", "1gbit", "--pin", "never"]
            real = [
                cluster_train(cluster, [*RUN, "--workers", str(hosts), *MODEL, "--seed", str(seed)], folder / "m.json")
                for seed in range(args.repeats)
            ]
            row = {
                "hosts": hosts,
                "share": share,
                "real": statistics.median(m["steady_examples_per_second"] for m in real),
                "passes": [m["steady_examples_per_second"] for m in real],
                "unquoted": statistics.median(unquoted(hosts, seed, folder) for seed in range(args.repeats)),
                "predicted": predicted(hosts, share, calibration, folder),
            }
            rows.append(row)
            print(
                f"{hosts} hosts at {share:g}: real {row['real']:,.0f}, without quotas {row['unquoted']:,.0f}, "
                f"predicted {row['predicted']:,.0f}",
                flush=True,
            )
        document = {
            "cores": os.cpu_count(),
            "repeats": args.repeats,
            "rows": rows,
            "calibration": json.loads(calibration.read_text()),
        }
    lines = [
        f"# Emulated hosts on this machine's {os.cpu_count()} cores: `local-sgd --sync-every 10000`, mlp on digits",
        "",
        f"`sudo python benchmarks/colocation.py --repeats {args.repeats}`: examples/s from the end of epoch 1, "
        "medians of the passes; predicted: `paratrain simulate` with a calibration measured here first.",
        "",
        "| hosts | share | shares in all | real (cluster) | the processes without quotas | predicted | real / predicted |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['hosts']} | {r['share']:g} | {r['hosts'] * r['share']:.3g} | {r['real']:,.0f} | {r['unquoted']:,.0f} "
            f"| {r['predicted']:,.0f} | {r['real'] / r['predicted']:.2f} |"
        )
    record(Path(args.out), document, lines)


if __name__ == "__main__":
    main()
