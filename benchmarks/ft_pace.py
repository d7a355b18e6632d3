"""Where a fault-tolerant run's time goes around its losses: its steps per second and each of
its processes' CPU, window by window, in one run killed every ``--every`` s (a random replica
process, SIGKILL, as ft_recovery.py kills), and each loss's cost read from the run's own
step log. So that a run's deficit can be told apart: a pause after each loss, a replacement
slower than the process it replaces, CPU taken from the survivors (by the launcher, the fork
server, a replacement starting), or a pace that varies as much without any loss.

    python benchmarks/ft_pace.py --model mlp --strategy allreduce-ft --longer 30 --every 20 --kills 3

Processes are named by their role: the launcher, the fork server, and the replicas' processes
in the order they started (``p1``, ``p2``, ... a replacement takes the next number). CPU is
a share of one core over the window (from /proc/PID/stat), so a run of 2 single-threaded
replicas on 2 cores can use 200%.

With ``--phases`` the run also records its timeline (``--timeline``), and a second table gives
each rank's steps per second in each window and its milliseconds per step in each phase: the
quorum, the all-reduce (the wait for the other replicas within it), compute (forward,
backward, optimizer) and the rest (the next batch, the step's log line, evaluation). A
rank's phases come from its last process alone (a killed process writes no part of the
timeline).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster_common import RESULTS, record  # noqa: E402
from ft_recovery import MODELS, STRATEGIES, train  # noqa: E402
from loss_cost import LOSS, loss_costs, pace  # noqa: E402

from paratrain.proc_stat import stat_fields  # noqa: E402
from paratrain.testing import descendants  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def process(pid: int) -> tuple[float, int, bytes] | None:
    """A process's user and system CPU seconds so far, its parent and its command line; None
    once it is gone."""
    try:
        fields = stat_fields(pid)
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
        return (int(fields[11]) + int(fields[12])) / TICKS, int(fields[1]), command
    except (OSError, ValueError, IndexError):
        return None


class Sampler:
    """Every ``every`` s, the CPU seconds of every process under this one, by role."""

    def __init__(self, every: float = 1.0):
        self.every, self.samples = every, []
        self.roles: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self.began = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _role(self, pid: int, parent: int, command: bytes) -> str:
        """The launcher (this process's child), its resource tracker and fork server, and the
        fork server's children: the replicas' processes, numbered as they start."""
        if pid not in self.roles:
            parents = self.roles.get(parent)
            if parent == os.getpid():
                role = "launcher"
            elif b"resource_tracker" in command:
                role = "resource tracker"
            elif parents == "launcher" and b"forkserver" in command:
                role = "fork server"
            elif parents == "fork server":
                role = f"p{sum(r.startswith('p') for r in self.roles.values()) + 1}"
            else:
                role = f"other ({parents or parent})"
            self.roles[pid] = role
        return self.roles[pid]

    def _run(self) -> None:
        while not self._stop.is_set():
            now, row = time.monotonic() - self.began, {}
            for pid in descendants(os.getpid()):  # oldest first: a parent's role before its children's
                found = process(pid)
                if found is not None:
                    row[self._role(pid, found[1], found[2])] = found[0]
            self.samples.append((now, row))
            self._stop.wait(self.every)


def windows(samples: list[tuple[float, dict]], steps: list[tuple[float, int]], width: float) -> list[dict]:
    """Steps per second and each role's CPU share (of one core) in each ``width`` s; a process
    that died in a window counts up to its last sample."""
    rates = pace(steps, width)
    out, last = [], {}
    for k, rate in enumerate(rates):
        inside = [(t, row) for t, row in samples if k * width <= t < (k + 1) * width]
        if not inside:
            continue
        cpu = {}
        for _, row in inside:
            for role, seconds in row.items():
                before = last.get(role, 0.0)  # a forked process starts at 0
                cpu[role] = cpu.get(role, 0.0) + (seconds - before)
                last[role] = seconds
        out.append({"at": k * width, "steps_per_s": rate, "cpu": {r: round(s / width, 3) for r, s in cpu.items()}})
    return out


#: Seconds a run takes to settle after a loss (and after its first step): ``between`` counts from
#: there, and the calm seconds of the table's summary are further than this from any loss.
SETTLE = 6


def between(seconds: list[float], losses: list[float]) -> list[float]:
    """The run's mean steps per second (``seconds``: one-second windows) before its first loss
    and between each two, from ``SETTLE`` s after the start or the loss to the second before
    the next (the last: to the run's last whole second): a replacement slower than the process
    it replaced, or survivors slowed for good by a loss, would show as a fall after the first."""
    begin = next((k for k, rate in enumerate(seconds) if rate > 0), len(seconds)) + SETTLE
    bounds = [(begin, math.floor(losses[0]) if losses else len(seconds) - 1)]
    bounds += [
        (math.ceil(lost) + SETTLE, math.floor(after) if after else len(seconds) - 1)
        for lost, after in zip(losses, [*losses[1:], None])
    ]
    return [sum(seconds[a:b]) / (b - a) for a, b in bounds if b > a]


#: The columns of the phases table: a phase and the timeline spans it sums.
PHASES = {
    "quorum": ("quorum",),
    "all-reduce": ("allreduce",),
    "compute": ("forward", "backward", "optimizer"),
    "rest": ("data", "evaluate"),
}


def phases(trace: dict, began_unix: float, width: float) -> list[dict]:
    """Each rank's steps per second in each ``width`` s (from ``began_unix``, a wall-clock
    time) and its milliseconds per step in each of ``PHASES``, from a merged timeline
    (paratrain/timeline.py); a span counts in the window it starts in, a step is an optimizer
    span (an applied update)."""
    origin = trace["otherData"]["origin_unix_us"] / 1e6 - began_unix
    names = {span: phase for phase, spans in PHASES.items() for span in spans}
    sums: dict[int, dict[int, dict[str, float]]] = {}
    for event in trace["traceEvents"]:
        if event.get("ph") != "X" or event.get("tid", 0) != 0 or event["name"] not in names:
            continue
        window = int((origin + event["ts"] / 1e6) // width)
        rank = sums.setdefault(window, {}).setdefault(event["pid"], dict.fromkeys([*PHASES, "steps"], 0.0))
        rank[names[event["name"]]] += event["dur"] / 1e3
        rank["steps"] += event["name"] == "optimizer"
    return [
        {
            "at": k * width,
            "ranks": {
                r: {
                    "steps_per_s": round(row["steps"] / width, 1),
                    **{p: round(row[p] / row["steps"], 3) for p in PHASES},
                }
                for r, row in sorted(sums[k].items())
                if row["steps"]
            },
        }
        for k in sorted(sums)
        if k >= 0
    ]


def phase_lines(table: list[dict]) -> list[str]:
    ranks = sorted({r for w in table for r in w["ranks"]})
    heads = [f"rank {r} {c}" for r in ranks for c in ("steps/s", *PHASES)]
    lines = [f"| from (s) | {' | '.join(heads)} |", f"| ---: | {' | '.join('---:' for _ in heads)} |"]
    for w in table:
        cells = []
        for r in ranks:
            row = w["ranks"].get(r)
            cells += (
                [f"{row['steps_per_s']:.0f}", *(f"{row[p]:.2f}" for p in PHASES)] if row else [""] * (1 + len(PHASES))
            )
        lines.append(f"| {w['at']:g} | {' | '.join(cells)} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mlp", choices=sorted(MODELS))
    parser.add_argument("--strategy", default="allreduce-ft", choices=[s for s in STRATEGIES if s.endswith("-ft")])
    parser.add_argument("--longer", type=int, default=30, help="times the model's epochs (mlp: 30 is ~90 s)")
    parser.add_argument("--every", type=float, default=20.0, help="seconds between kills")
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--window", type=float, default=5.0, help="seconds a window of the table spans")
    parser.add_argument("--phases", action="store_true", help="also each rank's time in each phase (a timeline)")
    parser.add_argument("--out", default=str(RESULTS / "ft_pace"))
    args = parser.parse_args()
    restarts = ["--max-restarts", str(args.kills)]
    with tempfile.TemporaryDirectory() as tmp, Sampler() as sampler:
        timeline = Path(tmp) / "timeline.json"
        extra = [*restarts, "--timeline", str(timeline)] if args.phases else restarts
        began_unix = time.time()
        run = train(
            args.model, args.strategy, extra, Path(tmp), kill_every=args.every, kills=args.kills, longer=args.longer
        )
        trace = json.loads(timeline.read_text()) if args.phases else None
    losses = [t for t, line in run["errors"] if LOSS.search(line)]
    table = windows(sampler.samples, run["steps"], args.window)
    seconds = pace(run["steps"], 1.0)
    calm = [rate for k, rate in enumerate(seconds[1:-1], 1) if all(abs(k + 0.5 - t) > SETTLE for t in losses)]
    costs = loss_costs(run["steps"], losses)
    stretches = between(seconds, losses)
    document = {
        "setup": vars(args),
        "losses_at": losses,
        "loss_costs": costs,
        "seconds": run["seconds"],
        "windows": table,
        "pace_per_second": seconds,
        "between_losses": stretches,
    }
    roles = sorted({r for w in table for r in w["cpu"]}, key=lambda r: (r[0] == "p", len(r), r))
    lines = [
        f"# Pace and CPU of `{args.strategy}` on the {args.model}, a random replica process killed every "
        f"{args.every:g} s ({len(losses)} losses, at {', '.join(f'{t:.0f}' for t in losses)} s)",
        "",
        f"| from (s) | steps/s | run CPU | {' | '.join(roles)} |",
        f"| ---: | ---: | ---: | {' | '.join('---:' for _ in roles)} |",
    ]
    for w in table:
        shares = [f"{w['cpu'][r]:.0%}" if r in w["cpu"] else "" for r in roles]
        lines.append(f"| {w['at']:g} | {w['steps_per_s']:.0f} | {sum(w['cpu'].values()):.0%} | {' | '.join(shares)} |")
    quartiles = statistics.quantiles(calm, n=4) if len(calm) >= 4 else [float("nan")] * 3
    lines += [
        "",
        f"Seconds more than {SETTLE} s from any loss: {statistics.median(calm):.0f} steps/s at the median "
        f"(quartiles {quartiles[0]:.0f}-{quartiles[2]:.0f}, over {len(calm)} one-second windows). "
        f"A loss costs {', '.join(f'{c:.2f}' for c in costs)} s (the run's own log over the 10 s after "
        f'each, against its pace of the 5 s before: ft_recovery.py\'s "a loss costs"). The run took '
        f"{run['seconds']:.1f} s. CPU: a share of one core over the window (this machine has "
        f"{os.cpu_count()} cores); p1, p2: the first replicas' processes, p3 on: the replacements.",
        "",
        f"Steps per second before the first loss and between losses (from {SETTLE} s after the start "
        f"and after each loss): {', '.join(f'{r:.2f}' for r in stretches)}.",
    ]
    if trace is not None:
        document["phases"] = phases(trace, began_unix, args.window)
        lines += [
            "",
            "Each rank's steps per second (applied updates) and milliseconds per step in each phase "
            "(`--phases`: the run's timeline; a rank's from its last process on):",
            "",
            *phase_lines(document["phases"]),
        ]
    record(Path(args.out), document, lines)


if __name__ == "__main__":
    main()
