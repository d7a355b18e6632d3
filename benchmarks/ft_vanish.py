"""Vanished replicas: how long the survivors of a per-step fault-tolerant run wait for a
replica whose host is gone (its process stopped, its connections open, no heartbeat).

    python benchmarks/ft_vanish.py [--runs 20] [--hold 4] [--seed S]
        [--strategies allreduce-ft,pipeline-ft]

Each run is the `paratrain train` of paratrain/drills/replica_kills.py (3 replicas of the mlp on
digits for `allreduce-ft`, 2 replicas of 2 stages for `pipeline-ft`; `--timeout 20`,
`--max-restarts 1`). At a step drawn uniformly over the undisturbed run, one process of a
replica drawn at random is stopped (SIGSTOP, from outside: the moment lands in a quorum,
the forward, the all-reduce or between steps alike); `--hold` seconds later it is killed
(SIGKILL: the host is declared dead), and the launcher replaces it. Measured: the
survivors' pause (the longest time without a logged step in the 6 s after the stop: a stop
after a step's all-reduce is felt at the next step's quorum), whether the run exits 0
within its limit at the undisturbed accuracy (1 point), and how long after its last step
it exits. Writes benchmarks/results/ft_vanish.json and .md.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.recorded_table import record  # noqa: E402
from paratrain.drills.replica_kills import STRATEGIES, Replicas, Run, last_step, undisturbed, verdict  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def vanished_run(strategy: str, calm: dict, hold: float, rng: random.Random) -> dict:
    _, num_replicas, per_replica, _ = STRATEGIES[strategy]
    step = rng.randint(1, max(calm["steps"] - 1, 1))
    limit = 3 * calm["seconds"] + 60
    with tempfile.TemporaryDirectory(prefix="ft-vanish-") as tmp:
        run = Run(strategy, ["--max-restarts", "1"], Path(tmp))
        replicas = Replicas(run, num_replicas, per_replica)
        stop = None
        while run.process.poll() is None and run.now() < limit and stop is None:
            members = replicas.refresh()
            if last_step(run) >= step and len(members) == num_replicas:
                slot = rng.randrange(num_replicas)
                pid = rng.choice(members[slot])
                stop = {"kind": "vanish", "replica": slot, "at": run.now(), "step": last_step(run)}
                os.kill(pid, signal.SIGSTOP)
                time.sleep(hold)
                replicas.kill(pid)  # SIGKILL ends a stopped process too
            time.sleep(0.01)
        ended = run.wait(limit)
        metrics = run.metrics()
    return {
        "strategy": strategy,
        "kills": [stop] if stop else [],
        "pause": _pause(run, stop["at"]) if stop else None,
        "ended": ended,
        "exit": run.process.returncode,
        "seconds": run.now(),
        "exit_after_last_step": run.now() - run.steps[-1][0] if run.steps else None,
        "test_accuracy": metrics.get("test_accuracy"),
        "last_line": next((line for _, line in reversed(run.errors) if line.startswith("paratrain:")), ""),
        "stderr_tail": "\n".join(line for _, line in run.errors[-15:]),
    }


#: The window after a stop in which the survivors' longest wait for a step is their pause, in seconds.
WINDOW_S = 6.0


def _pause(run: Run, at: float) -> float | None:
    """The longest time without a logged step from ``at`` on, over the next ``WINDOW_S``
    seconds (a stop after the step's all-reduce is felt at the next step's quorum, one
    step later); None when no step came after it."""
    times = [at] + [t for t, _ in run.steps if at < t <= at + WINDOW_S]
    if len(times) < 2:
        return None
    return max(b - a for a, b in zip(times, times[1:]))


def vanish(strategy: str, runs: int, hold: float, seed: int) -> dict:
    rng = random.Random(f"{seed}-{strategy}")
    calm = undisturbed(strategy)
    print(f"{strategy}: undisturbed {calm['seconds']:.1f} s, test accuracy {calm['test_accuracy']:.3f}", flush=True)
    rows = []
    for index in range(runs):
        row = vanished_run(strategy, calm, hold, rng)
        row["ok"] = verdict(row, calm["test_accuracy"])
        rows.append(row)
        pause = "-" if row["pause"] is None else f"{row['pause']:.2f} s"
        print(
            f"  run {index + 1}: stopped at step {row['kills'][0]['step'] if row['kills'] else '-'}, pause {pause}, "
            f"exit {row['exit']}, accuracy {row['test_accuracy']}, ok {row['ok']}",
            flush=True,
        )
        if not row["ok"]:
            print(row["stderr_tail"], flush=True)
        else:
            row.pop("stderr_tail")
    pauses = [r["pause"] for r in rows if r["pause"] is not None]
    tails = [r["exit_after_last_step"] for r in rows if r["exit_after_last_step"] is not None]
    return {
        "seed": seed,
        "hold": hold,
        "runs": len(rows),
        "stopped": sum(bool(r["kills"]) for r in rows),
        "pause_median": statistics.median(pauses) if pauses else 0.0,
        "pause_max": max(pauses, default=0.0),
        "exit_after_last_step_max": max(tails, default=0.0),
        "undisturbed_accuracy": calm["test_accuracy"],
        "accuracy_min": min((r["test_accuracy"] for r in rows if r["test_accuracy"] is not None), default=0.0),
        "not_ok": sum(not r["ok"] for r in rows),
        "hangs": sum(not r["ended"] for r in rows),
        "rows": rows,
    }


def table(summary: dict) -> list[str]:
    lines = [
        "| strategy | runs | replicas stopped | pause median s | pause max s | exit after last step, max s | "
        "accuracy min (undisturbed) | not ok | hangs |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |",
    ]
    for strategy, s in summary.items():
        lines.append(
            f"| `{strategy}` | {s['runs']} | {s['stopped']} | {s['pause_median']:.2f} | {s['pause_max']:.2f} | "
            f"{s['exit_after_last_step_max']:.2f} | {s['accuracy_min']:.3f} ({s['undisturbed_accuracy']:.3f}) | "
            f"{s['not_ok']} | {s['hangs']} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="runs per strategy, one vanished replica each")
    parser.add_argument("--hold", type=float, default=4.0, help="seconds a replica stays stopped before its kill")
    parser.add_argument("--seed", type=int, default=random.SystemRandom().randrange(10**6))
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--out", default=str(RESULTS / "ft_vanish.json"))
    args = parser.parse_args()
    print(f"ft vanish seed {args.seed}", flush=True)
    summary = {name: vanish(name, args.runs, args.hold, args.seed) for name in args.strategies.split(",")}
    record(Path(args.out), summary, table(summary))


if __name__ == "__main__":
    main()
