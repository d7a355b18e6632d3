"""Fault-tolerance stress: many kills in each run of a per-step fault-tolerant strategy,
to find the races between a loss, a replacement's join and the survivors' next step.

    python benchmarks/ft_stress.py [--kills 100] [--kills-per-run 4] [--seed S]
        [--strategies allreduce-ft,pipeline-ft,fsdp-ft,local-sgd-ft,diloco-ft] [--fork-server-kills 3]

Each run is a local `paratrain train` of the mlp on digits (3 replicas for `allreduce-ft`,
`local-sgd-ft` and `diloco-ft`; 2 replicas of 2 stages or shards for `pipeline-ft` and
`fsdp-ft`) with `--max-restarts` 2 x its kills + 2. Its kills (SIGKILL) come at steps drawn
uniformly over the undisturbed run's steps (the second before the first step included), and
go to each replica in turn (the first one included; a replica's process at random); every
third kill instead waits for the replacement that the previous kill brought and kills it
0-1.5 s after it started: while it starts, forms its first quorum or takes the live state.
Uniform moments land in a quorum, inside the all-reduce, between steps and in the last epoch
alike. A run is ok when it exits 0 within its limit (its undisturbed length x 3 + 60 s) with
a test accuracy within 1 point of the undisturbed run's (2 for local SGD and DiLoCo, whose
outer steps a loss changes: undisturbed, seeds 0-5 span 1.1 and 1.4 points); a run still
alive at its limit is a hang (its processes are then killed). `--fork-server-kills` runs a
strategy kill the launcher's fork server (every replica is its child): the run must end,
finishing or failing with a line that names a loss, never hang.

The runs, kills and verdicts are paratrain/drills/replica_kills.py's (which
tests/distributed/test_ft_stress.py runs with three kills a strategy). Measured per run: the survivors' pause after each kill (from the kill to the next step the
run logs, `--log-every 1`) and the recoveries (`joined the run` lines). The seed is
printed; `--seed S --strategies X` repeats. Writes benchmarks/results/ft_stress.json and
.md.
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.recorded_table import record  # noqa: E402
from paratrain.drills import drill_seed  # noqa: E402
from paratrain.drills.replica_kills import STRATEGIES, stressed_run, undisturbed, verdict  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def table(summary: dict) -> list[str]:
    lines = [
        "| strategy | runs | kills | of a replacement | recoveries | pause median s | pause max s | "
        "accuracy (undisturbed) | not ok | hangs | fork-server kills: hangs |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | --- |",
    ]
    for strategy, s in summary.items():
        lines.append(
            f"| `{strategy}` | {s['runs']} | {s['kills']} | {s['replacement_kills']} | {s['recoveries']} | "
            f"{s['pause_median']:.2f} | {s['pause_max']:.2f} | {s['accuracy_min']:.3f}-{s['accuracy_max']:.3f} "
            f"({s['undisturbed_accuracy']:.3f}) | {s['not_ok']} | {s['hangs']} | "
            f"{s['fork_server_runs']} runs: {s['fork_server_hangs']} |"
        )
    return lines


def stress(strategy: str, kills: int, per_run: int, fork_server_kills: int, seed: int, log=print) -> dict:
    rng = random.Random(f"{seed}-{strategy}")
    calm = undisturbed(strategy)
    log(
        f"{strategy}: undisturbed {calm['seconds']:.1f} s (steps from {calm['first_step']:.1f} s to "
        f"{calm['last_step']:.1f} s), test accuracy {calm['test_accuracy']:.3f}"
    )
    rows = []
    while sum(len(r["kills"]) for r in rows) < kills:
        row = stressed_run(strategy, calm, per_run, rng)
        row["ok"] = verdict(row, calm["test_accuracy"])
        rows.append(row)
        log(
            f"  run {len(rows)}: {len(row['kills'])} kills at steps {[k['step'] for k in row['kills']]}, "
            f"exit {row['exit']}, {row['seconds']:.0f} s, accuracy {row['test_accuracy']}, ok {row['ok']}"
        )
        if not row["ok"]:
            log(row["stderr_tail"])
    forks = []
    for _ in range(fork_server_kills):
        row = stressed_run(strategy, calm, 1, rng, fork_server=True)
        row["ok"] = verdict(row, calm["test_accuracy"])
        forks.append(row)
        log(
            f"  fork server killed at step {row['kills'][0]['step'] if row['kills'] else '-'}: exit {row['exit']}, "
            f"{row['seconds']:.0f} s: {row['last_line']}"
        )
    pauses = [k["pause"] for r in rows for k in r["kills"] if k.get("pause") is not None]
    accuracies = [r["test_accuracy"] for r in rows if r["test_accuracy"] is not None]
    return {
        "seed": seed,
        "runs": len(rows),
        "kills": sum(len(r["kills"]) for r in rows),
        "replacement_kills": sum(k["kind"] == "replacement" for r in rows for k in r["kills"]),
        "recoveries": sum(r["recoveries"] for r in rows),
        "pause_median": statistics.median(pauses) if pauses else 0.0,
        "pause_max": max(pauses, default=0.0),
        "accuracy_min": min(accuracies, default=0.0),
        "accuracy_max": max(accuracies, default=0.0),
        "undisturbed_accuracy": calm["test_accuracy"],
        "undisturbed_seconds": calm["seconds"],
        "not_ok": sum(not r["ok"] for r in rows),
        "hangs": sum(not r["ended"] for r in rows),
        "fork_server_runs": len(forks),
        "fork_server_hangs": sum(not r["ended"] for r in forks),
        "rows": rows + forks,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=100, help="kills per strategy, at least")
    parser.add_argument("--kills-per-run", type=int, default=4)
    parser.add_argument("--fork-server-kills", type=int, default=3)
    parser.add_argument("--seed", type=int, default=None, help="default: PARATRAIN_DRILL_SEED, else a fresh one")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--out", default=str(RESULTS / "ft_stress.json"))
    args = parser.parse_args()
    args.seed = args.seed if args.seed is not None else drill_seed()
    print(f"ft stress seed {args.seed}", flush=True)
    log = functools.partial(print, flush=True)
    summary = {
        name: stress(name, args.kills, args.kills_per_run, args.fork_server_kills, args.seed, log=log)
        for name in args.strategies.split(",")
    }
    for result in summary.values():  # the output of the runs that went wrong only
        for row in result["rows"]:
            if row["ok"]:
                row.pop("stderr_tail")
    record(Path(args.out), summary, table(summary))


if __name__ == "__main__":
    main()
