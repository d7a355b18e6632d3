"""Kill drills at random moments: for each strategy, SIGKILL one process of a local run
(any worker, shard, stage or the chief; the launcher itself too) at a random moment from
launch to exit, and check that the run ends within --timeout in one of four ways:
finishing, going on without the process, restarting from its checkpoint, or failing with
one `paratrain:` line that names who died; and that no process of the run is left (with
the launcher killed: none 10 s after it).

    python benchmarks/kill_anytime.py [--drills 20] [--seed 0] [--strategies allreduce,ps-sync]

The drill is paratrain/drills/random_kill.py's (which tests/distributed/test_kill_anytime.py
runs once a strategy). The seed is printed; a drill is repeated with `--seed S --strategies X
--drills N`.
Writes benchmarks/results/kill_anytime.json and .md (a repeat of one test's drill, with
--length, writes nothing unless --out).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.recorded_table import record  # noqa: E402
from paratrain.drills import drill_seed  # noqa: E402
from paratrain.drills.random_kill import STRATEGIES, TIMEOUT_S, run_drills  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def table(rows: list[dict]) -> list[str]:
    lines = [
        "| strategy | seed | drills | finished | went on | restarted | failed, named | launcher killed | not ok "
        "| longest s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for strategy in dict.fromkeys(r["strategy"] for r in rows):
        mine = [r for r in rows if r["strategy"] == strategy]

        def count(prefix: str) -> int:
            return sum(r["outcome"].startswith(prefix) and r["ok"] for r in mine)  # noqa: B023

        lines.append(
            f"| {strategy} | {mine[0]['seed']} | {len(mine)} | {count('finished')} | {count('went on')} | {count('restarted')} "
            f"| {count('failed')} | {count('launcher')} | {sum(not r['ok'] for r in mine)} "
            f"| {max(r['seconds'] for r in mine):.0f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=None, help="default: a fresh one, printed")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--length", type=float, default=None, help="the run's seconds (default: measured)")
    parser.add_argument(
        "--out", default=None, help="files' stem (default: the recorded results; none with --length, a repeat)"
    )
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else drill_seed()
    print(f"seed {seed}", flush=True)
    strategies = args.strategies.split(",")
    rows = []
    for strategy in strategies:
        rows += run_drills(strategy, args.drills, seed, log=lambda line: print(line, flush=True), length=args.length)
    lines = table(rows)
    if args.out is None and args.length is not None:  # a test's drill repeated: the records stay as they are
        print("\n".join(lines))
        return
    out = Path(args.out or RESULTS / "kill_anytime")
    if out.with_suffix(".json").exists() and args.length is None:
        # drills of other strategies recorded before stay: one table for every strategy
        earlier = json.loads(out.with_suffix(".json").read_text())["rows"]
        rows = [r for r in earlier if r["strategy"] not in strategies] + rows
        rows.sort(key=lambda r: list(STRATEGIES).index(r["strategy"]))
    lines = table(rows)
    heading = [f"# Kill drills at random moments (--timeout {TIMEOUT_S})", ""]
    document = {"timeout": TIMEOUT_S, "rows": rows}
    record(out, document, lines, heading)


if __name__ == "__main__":
    main()
