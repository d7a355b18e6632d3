"""Calibrated predictions against real runs on this machine: the user's path, with no number
given by hand.

    python benchmarks/simulator_calibration.py [--repeats 2] [--model mlp] [--dataset digits]

1. ``paratrain simulate --calibrate`` measures the costs (docs/simulator.md, "Calibration");
2. each setting (strategy x workers, every process on this machine's cores) is predicted
   with that calibration and ``--host-cores`` = this machine's cores, and run for real
   (``paratrain train``, one thread a process, examples/s of training past the first epoch,
   the median of ``--repeats`` runs);
3. per worker count: whether the prediction names the fastest strategy (two within 10% of
   each other count as tied), and each prediction's error;
4. the same calibration predicts the 24 settings of benchmarks/cluster_validation.py (hosts
   at 0.3 of a core under a 10 ms CPU quota, 1 Gbit/s links, with and without a host at half
   that), with the flags that describe those hosts, against the real runs recorded there
   (benchmarks/results/cluster_validation.json: recorded at an earlier commit, not rerun).

Writes benchmarks/results/simulator_calibration.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cluster_common import fastest  # noqa: E402
from benchmarks.recorded_table import record  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SETTINGS = [("allreduce", 2), ("ps-sync", 2), ("ps-async", 2), ("allreduce", 3), ("ps-sync", 1), ("ps-async", 1)]
ENV = {**os.environ, "PARATRAIN_THREADS_PER_WORKER": "1", "OMP_NUM_THREADS": "1"}


def paratrain(*args: str) -> subprocess.CompletedProcess:
    run = subprocess.run([sys.executable, "-m", "paratrain", *args], capture_output=True, text=True, env=ENV, cwd=ROOT)
    if run.returncode:
        raise SystemExit(f"paratrain {' '.join(args)} failed:\n{run.stderr[-2000:]}")
    return run


def real_rate(strategy: str, workers: int, model: str, dataset: str, epochs: int) -> float:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "m.json"
        paratrain(
            "train",
            "--strategy",
            strategy,
            "--workers",
            str(workers),
            "--model",
            model,
            "--dataset",
            dataset,
            "--epochs",
            str(epochs),
            "--no-progress",
            "--log-every",
            "0",
            "--metrics-out",
            str(out),
        )
        history = json.loads(out.read_text())["history"]
    first, last = history[0], history[-1]
    return (last["examples_seen"] - first["examples_seen"]) / (last["wall_seconds"] - first["wall_seconds"])


def predicted_rate(strategy: str, workers: int, calibration: Path, model: str, dataset: str) -> float:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "sim.json"
        paratrain(
            "simulate",
            "--calibration",
            str(calibration),
            "--strategy",
            strategy,
            "--workers",
            str(workers),
            "--model",
            model,
            "--dataset",
            dataset,
            "--host-cores",
            str(os.cpu_count()),
            "--steps",
            "400",
            "--json-out",
            str(out),
        )
        rows = json.loads(out.read_text())["results"]
    return next(r["examples_per_second"] for r in rows if r["workers"] == workers)


def predicted_on_hosts(settings: dict, setup: dict, calibration: Path, model: str, dataset: str) -> float:
    """A recorded emulated-host setting, predicted through the CLI with the calibration."""
    flags = [
        "--strategy",
        settings["strategy"],
        "--workers",
        str(settings["workers"]),
        "--cpu-share",
        str(setup["cpu"]),
        "--cpu-period-ms",
        "10",
        "--bandwidth-gbps",
        str(float(setup["link"][:-4])),
        "--latency-us",
        "0",
    ]
    if settings.get("backup_workers"):
        flags += ["--backup-workers", str(settings["backup_workers"])]
    if settings.get("straggler"):
        flags += ["--straggler", "fixed:" + settings["straggler"]]
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "sim.json"
        paratrain(
            "simulate",
            "--calibration",
            str(calibration),
            *flags,
            "--model",
            model,
            "--dataset",
            dataset,
            "--steps",
            "400",
            "--json-out",
            str(out),
        )
        rows = json.loads(out.read_text())["results"]
    return next(r["examples_per_second"] for r in rows if r["workers"] == settings["workers"])


def emulated_hosts(calibration: Path, model: str, dataset: str) -> dict:
    """The recorded emulated-host runs against the calibrated predictions; the fastest named
    per worker count, with and without the slow host."""
    recorded = json.loads((RESULTS / "cluster_validation.json").read_text())
    rows = []
    for row in recorded["rows"]:
        predicted = predicted_on_hosts(row["settings"], recorded["setup"], calibration, model, dataset)
        rows.append(
            {
                **row["settings"],
                "real": row["examples_per_second"],
                "predicted": predicted,
                "error": predicted / row["examples_per_second"] - 1,
            }
        )
    picks = []
    for workers in sorted({r["workers"] for r in rows}):
        for slow in (False, True):
            group = [r for r in rows if r["workers"] == workers and bool(r.get("straggler")) == slow]
            named = max(group, key=lambda r: r["predicted"])["strategy"]
            real = fastest({r["strategy"]: r["real"] for r in group})
            picks.append(
                {"workers": workers, "straggler": slow, "named": named, "fastest": sorted(real), "right": named in real}
            )
    errors = [abs(r["error"]) for r in rows]
    return {"setup": recorded["setup"], "rows": rows, "picks": picks, "median_abs_error": statistics.median(errors)}


def host_lines(hosts: dict) -> list[str]:
    setup, picks = hosts["setup"], hosts["picks"]
    named = ", ".join(
        f"{p['workers']}{' slow' if p['straggler'] else ''}: `{p['named']}` for {'/'.join(p['fastest'])}" for p in picks
    )
    return [
        "",
        f"The same calibration on the emulated hosts of benchmarks/cluster_validation.py ({setup['cpu']} of a core "
        f"a host, {setup['link']} links; the real runs as recorded there), predicted with `--cpu-share`, "
        "`--cpu-period-ms 10`, `--bandwidth-gbps`, `--latency-us 0` and `--straggler fixed:W:2`:",
        "",
        "| strategy | workers | slow host | real examples/s | predicted | error |",
        "| --- | ---: | --- | ---: | ---: | ---: |",
        *(
            f"| `{r['strategy']}` | {r['workers']} | {r.get('straggler', 'none')} | {r['real']:.0f} | "
            f"{r['predicted']:.0f} | {r['error']:+.0%} |"
            for r in hosts["rows"]
        ),
        "",
        f"Median absolute error {hosts['median_abs_error']:.0%}; the fastest named (within 10%) in "
        f"{sum(p['right'] for p in picks)} of {len(picks)} groups ({named}).",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--out", default=str(RESULTS / "simulator_calibration.json"))
    args = parser.parse_args()
    calibration = Path(tempfile.mkdtemp()) / "calibration.json"
    paratrain(
        "simulate",
        "--calibrate",
        str(calibration),
        "--model",
        args.model,
        "--dataset",
        args.dataset,
        "--workers",
        "1",
        "--steps",
        "10",
    )
    rows = []
    for strategy, workers in SETTINGS:
        real = [real_rate(strategy, workers, args.model, args.dataset, args.epochs) for _ in range(args.repeats)]
        predicted = predicted_rate(strategy, workers, calibration, args.model, args.dataset)
        row = {
            "strategy": strategy,
            "workers": workers,
            "real": statistics.median(real),
            "real_runs": real,
            "predicted": predicted,
        }
        row["error"] = predicted / row["real"] - 1
        rows.append(row)
        print(
            f"{strategy} x{workers}: real {row['real']:.0f} ({', '.join(f'{r:.0f}' for r in real)}), "
            f"predicted {predicted:.0f} ({row['error']:+.0%})",
            flush=True,
        )
    picks = []
    for workers in sorted({w for _, w in SETTINGS}):
        real = {r["strategy"]: r["real"] for r in rows if r["workers"] == workers}
        predicted = {r["strategy"]: r["predicted"] for r in rows if r["workers"] == workers}
        if len(real) > 1:
            named = max(predicted, key=predicted.get)
            picks.append(
                {"workers": workers, "named": named, "fastest": sorted(fastest(real)), "right": named in fastest(real)}
            )
    hosts = emulated_hosts(calibration, args.model, args.dataset)
    document = {
        "calibration": json.loads(calibration.read_text()),
        "rows": rows,
        "picks": picks,
        "cores": os.cpu_count(),
        "repeats": args.repeats,
        "emulated_hosts": hosts,
    }
    costs = document["calibration"]["costs"]
    lines = [
        f"Calibrated on this machine ({os.cpu_count()} cores): compute {costs['compute_ms']:.3f} ms a step, a ring "
        f"step {costs['ring_step_us']:.0f} us, a push {costs['ps_push_us']:.0f} us, an update "
        f"{costs['ps_update_us']:.0f} us; real runs: the median of {args.repeats}, {args.model} on {args.dataset}, "
        f"{args.epochs} epochs, one thread a process (`python benchmarks/simulator_calibration.py`).",
        "",
        "| strategy | workers | real examples/s | predicted | error |",
        "| --- | ---: | ---: | ---: | ---: |",
        *(
            f"| `{r['strategy']}` | {r['workers']} | {r['real']:.0f} | {r['predicted']:.0f} | {r['error']:+.0%} |"
            for r in rows
        ),
        "",
        *(
            f"- {p['workers']} workers: predicted fastest `{p['named']}`; measured fastest (within 10%): "
            f"{', '.join(f'`{s}`' for s in p['fastest'])}: {'right' if p['right'] else 'wrong'}"
            for p in picks
        ),
        *host_lines(hosts),
    ]
    record(Path(args.out), document, lines)


if __name__ == "__main__":
    main()
