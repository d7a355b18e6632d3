"""Recovery from a lost replica: allreduce-ft, pipeline-ft, local-sgd-ft, diloco-ft and fsdp-ft
(the survivors go on, a replacement takes the live state) against allreduce, pipeline,
local-sgd, diloco and fsdp with a whole-run restart from the last checkpoint.

    python benchmarks/ft_recovery.py [--repeats 3] [--models mlp,cifar_cnn] [--strategies ...]
        [--parts recovery,throughput]   (rows of other models, strategies or parts recorded before stay)

Recovery: 2 replicas (pipelines: of 2 stages), replica 1 killed (SIGKILL, `--fail 1@K`:
every stage of a pipeline replica) once. Every step's log line
(`--log-every 1`) is timed as it arrives, and so is the killed process's last line, so:
- `first step after`: seconds from the kill to the next step of the run (allreduce-ft: the
  survivor's; allreduce: the restarted run's first, from its checkpoint);
- `back at step K+1`: seconds from the kill until the run's step count passes K again
  (lost progress: the restart redoes the steps since its checkpoint);
- `replacement in`: allreduce-ft only, seconds from the kill to the first step the
  replacement takes part in.

Throughput kept: a run of `--longer` (3) times the epochs killed from outside every `--every` seconds (a
random replica process, `--kills` times, wherever it is: in a step, in the all-reduce, in
a checkpoint write, starting), against the same run undisturbed: undisturbed seconds
divided by disturbed seconds, whole commands, the two the same command (the same
`--max-restarts`: only the kills differ); `--throughput-repeats N` runs N such pairs
for a row, which gives their medians and the range of what they kept; every second pair
runs its disturbed run first, so that a drift of the machine's speed within a pair does
not always fall on the same side. Several intervals (`--every 30,10 --kills 9,27`) make a
row each from sets of runs: one undisturbed run shared by one disturbed run per interval
(every second set in the reverse order; `--disturbed-first`: the first set of this command
too, to even out a record whose sets `--add` started the same way), a third less time than
a pair per row. `a loss costs`: from
the disturbed run's own step log, the seconds each loss set it back against its pace of the
5 s before (the median over its losses; over the pairs, the median and range of those), a
measure that the drift between two whole runs on this machine does not blur.
`--minutes M` sizes the runs instead of `--longer`: a first run of 8x the epochs, timed,
gives the multiple that makes an undisturbed run of about M minutes on the machine's speed
of the day (it drifts by up to 2x between days). `--add` adds the sets to the rows recorded
in `--out` with the same settings (medians over all their pairs): a row's 5 sets can be run
on different days, each pair on one.

The mlp trains on digits, cifar_cnn on digits at 3x32x32 (`cluster_common.digits32`); writes
benchmarks/results/ft_recovery.json and .md (and each pair's pace in 10 s windows there).
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster_common import RESULTS, record  # noqa: E402
from recorded_table import cpu_name  # noqa: E402

from paratrain.cpu_steal import cpu_times, stolen_share  # noqa: E402
from paratrain.testing import run_processes  # noqa: E402

MODELS = {
    # model flags, epochs, kill step, checkpoint every (the restart's baseline)
    "mlp": (["--model", "mlp"], 40, 130, 50),
    "cifar_cnn": (
        [
            "--model",
            "cifar_cnn",
            "--dataset",
            "benchmarks.cluster_common:digits32",
            "--optimizer",
            "adam",
            "--lr",
            "0.001",
        ],
        4,
        30,
        20,
    ),
}
STRATEGIES = {
    "allreduce-ft": ["--strategy", "allreduce-ft", "--workers", "2"],
    "allreduce (restart)": ["--strategy", "allreduce", "--workers", "2"],
    "pipeline-ft": ["--strategy", "pipeline-ft", "--stages", "2", "--workers", "4"],
    "pipeline (restart)": ["--strategy", "pipeline", "--stages", "2", "--workers", "4"],
    "local-sgd-ft": ["--strategy", "local-sgd-ft", "--workers", "2", "--sync-every", "8"],
    "local-sgd (restart)": ["--strategy", "local-sgd", "--workers", "2", "--sync-every", "8"],
    "diloco-ft": ["--strategy", "diloco-ft", "--workers", "2", "--sync-every", "8"],
    "diloco (restart)": ["--strategy", "diloco", "--workers", "2", "--sync-every", "8"],
    "fsdp-ft": ["--strategy", "fsdp-ft", "--workers", "4", "--shards-per-replica", "2", "--batch-size", "16"],
    "fsdp (restart)": ["--strategy", "fsdp", "--workers", "4", "--batch-size", "16"],
}
ROOT = Path(__file__).resolve().parents[1]
STEP = re.compile(r"^(?:\[host\d+\] )?step (\d+),")
# --cluster: each replica on an emulated host of its own, one spare host (paratrain cluster run)
CLUSTER_CPU = 0.6


def cluster_command(strategy: str, folder: Path, faults: list[str]) -> list[str]:
    """``paratrain cluster run`` of ``strategy``'s replicas, one host each, and a spare host."""
    flags = STRATEGIES[strategy]
    per_replica = 2 if "--stages" in flags or "--shards-per-replica" in flags else 1
    replicas = int(flags[flags.index("--workers") + 1]) // per_replica
    return [
        sys.executable,
        "-m",
        "paratrain",
        "cluster",
        "run",
        "--hosts",
        str(replicas + 1),
        "--spares",
        "1",
        "--procs-per-host",
        str(per_replica),
        "--cpu",
        str(CLUSTER_CPU),
        "--logs",
        str(folder / "logs"),
        *faults,
        "--",
        "paratrain",
    ]


def train(
    model: str,
    strategy: str,
    extra: list[str],
    folder: Path,
    kill_every: float = 0,
    kills: int = 0,
    longer: int = 1,
    cluster: list[str] | None = None,
) -> dict:
    """One run (``longer`` times the model's epochs; with ``cluster``, its faults, on
    emulated hosts); its step lines and stderr lines with their arrival times, its metrics.
    ``X (plain)``: the command of ``X (restart)`` without its checkpoints."""
    flags, epochs, _, every = MODELS[model]
    epochs *= longer
    checkpoints = (  # -ft: recovers from live peers; (plain): the run a user who meets no fault makes
        ["--checkpoint-dir", str(folder / "ckpt"), "--checkpoint-every", str(every)]
        if strategy.endswith(" (restart)")
        else []
    )
    launcher = (
        cluster_command(strategy, folder, cluster) if cluster is not None else [sys.executable, "-m", "paratrain"]
    )
    command = [
        *launcher,
        "train",
        *STRATEGIES[strategy.replace(" (plain)", " (restart)")],
        *flags,
        "--epochs",
        str(epochs),
        "--log-every",
        "1",
        "--progress",
        "--metrics-out",
        str(folder / "m.json"),
        *checkpoints,
        *extra,
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PARATRAIN_THREADS_PER_WORKER": "1"}
    began, cpu_before = time.monotonic(), cpu_times()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    steps: list[tuple[float, int]] = []
    errors: list[tuple[float, str]] = []

    def read_errors() -> None:
        for line in process.stderr:
            errors.append((time.monotonic() - began, line.rstrip()))

    reader = threading.Thread(target=read_errors, daemon=True)
    reader.start()
    killer = None
    if kills:
        target, on = (kill_hosts, errors) if cluster is not None else (kill_repeatedly, process)
        killer = threading.Thread(target=target, args=(on, kill_every, kills), daemon=True)
        killer.start()
    for line in process.stdout:
        match = STEP.match(line)
        if match:
            steps.append((time.monotonic() - began, int(match.group(1))))
    process.wait()
    reader.join()
    seconds = time.monotonic() - began
    if process.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n" + "\n".join(line for _, line in errors[-30:]))
    metrics = json.loads((folder / "m.json").read_text())
    steal = stolen_share(cpu_before, cpu_times())
    return {"steps": steps, "errors": errors, "metrics": metrics, "seconds": seconds, "steal": steal}


def recovery(model: str, strategy: str, cluster: list[str] | None = None) -> dict:
    _, _, kill_step, _ = MODELS[model]
    with tempfile.TemporaryDirectory() as tmp:
        if cluster is not None:  # host 1 dies; its replica goes on on the spare host
            # a cold replacement: 4x the epochs, time to start torch on its share of a core
            longer = 4 if "--cold-spares" in cluster else 1
            faults = [*cluster, "--fail", f"host1@step{kill_step}"]
            run = train(model, strategy, [], Path(tmp), longer=longer, cluster=faults)
            line = next(line for _, line in run["errors"] if "paratrain cluster: fail host1 at" in line)
            kill_step = int(re.search(r"at step (\d+)", line).group(1))
        else:
            run = train(model, strategy, ["--fail", f"1@{kill_step}", "--max-restarts", "1"], Path(tmp))
    killed = next(t for t, line in run["errors"] if "injected failure" in line or "paratrain cluster: fail" in line)
    # Lines of the last steps before the kill may arrive just after its line (two pipes).
    after = [(t, s) for t, s in run["steps"] if t > killed and not kill_step - 2 <= s <= kill_step]
    before = [t for t, s in run["steps"] if t < killed]
    result = {
        "first_step_after": after[0][0] - killed,
        "back_past_kill": next(t for t, s in after if s > kill_step) - killed,
        # the run's own pace just before the kill: what a step takes undisturbed
        "step_before": statistics.median(b - a for a, b in zip(before[-21:], before[-20:])),
    }
    spans = run["metrics"].get("participants", {}).get("per_step", [])
    flags = STRATEGIES[strategy]
    # local-sgd-ft's and diloco-ft's records count synchronizations: one every H steps
    per_record = int(flags[flags.index("--sync-every") + 1]) if "--sync-every" in flags else 1
    if len(spans) >= 3:  # 2 -> 1 -> 2: the replacement's first step
        rejoined = (spans[2][0] - 1) * per_record + 1
        result["replacement_in"] = next(t for t, s in after if s >= rejoined) - killed
    elif len(spans) == 1 and spans[0][2] == 2 and strategy.endswith("-ft"):
        # 2 throughout: the replacement was in the first synchronization after the kill
        # (a step's under per-step quorums), logged with that step
        synchronized = (kill_step // per_record + 1) * per_record
        result["replacement_in"] = next(t for t, s in after if s >= synchronized) - killed
    result["longest_pause"] = longest_pause(after, killed, result.get("replacement_in", result["back_past_kill"]))
    return result


def sized(model: str, strategy: str, minutes: float, cluster: list[str] | None) -> int:
    """``--minutes``: the model's epochs times this make an undisturbed run of ``minutes`` today."""
    with tempfile.TemporaryDirectory() as tmp:
        run = train(model, strategy, [], Path(tmp), longer=PROBE, cluster=cluster)
    longer = longer_for(minutes, run["seconds"], run["metrics"]["wall_seconds"])
    print(
        f"{model} {strategy}: --minutes {minutes:g}: {longer}x the model's epochs ({PROBE}x took "
        f"{run['seconds']:.1f} s, {run['metrics']['wall_seconds']:.1f} s of it training)",
        flush=True,
    )
    return longer


def throughput_kept(
    model: str,
    strategy: str,
    intervals: list[tuple[float, int]],
    longer: int = 3,
    cluster: list[str] | None = None,
    disturbed_first: bool = False,
) -> list[dict]:
    """One undisturbed run and one disturbed run per ``(every, kills)`` of ``intervals``: a
    pair per interval, all sharing the undisturbed run (``disturbed_first``: the disturbed
    runs first, so that sets alternating it cancel this machine's drift over a set)."""
    restarts = [] if cluster is not None else ["--max-restarts", str(max(k for _, k in intervals))]
    order: list[tuple[float, int]] = [(0, 0), *intervals]  # (0, 0): undisturbed
    runs = {}
    for every, kills in order[::-1] if disturbed_first else order:
        with tempfile.TemporaryDirectory() as tmp:
            # every run the same command (the same --max-restarts): only the kills differ
            runs[every, kills] = train(
                model, strategy, restarts, Path(tmp), kill_every=every, kills=kills, longer=longer, cluster=cluster
            )
    here = cpu_name()  # a virtual machine's processor differs from day to day
    return [
        pair(runs[0, 0], runs[interval])
        | {
            "every": interval[0],
            "kills": interval[1],
            "longer": longer,
            "processor": here,
            "disturbed_first": disturbed_first,
        }
        for interval in intervals
    ]


def tables(
    rows: list[dict], repeats: int, every: float, kills: int, length: str | None = None, cluster: bool = False
) -> list[str]:
    """The recovery table and one throughput table per interval between kills (a row recorded
    before rows carried their interval has the file's ``every`` and ``kills``); ``length``:
    the runs' length in words (``length_words`` of the record; None: its default)."""
    where = (
        [
            f"On emulated hosts (`paratrain cluster run`): each replica on a host of its own at {CLUSTER_CPU} of a core "
            "(a pipeline's or a sharded replica's 2 processes on one host), one spare host that the lost replica starts "
            "again on (its standby takes the lost replica's place; `(cold spare)`: a new job starts there). A kill "
            "takes a whole host: host 1 once the run has finished step K (the step it lands at may be a few later), "
            "and in the second table the host of a random replica, which then stands by again. Each recovery run is "
            "the model's epochs (4x with cold spares); the restart rows are the local benchmark's (ft_recovery.md). "
            "This machine has 2 cores.",
            "",
        ]
        if cluster
        else []
    )
    lines = [
        *where,
        "# Recovery from a lost replica (2 replicas, SIGKILL of replica 1 at step K)",
        "",
        "| model | strategy | kill at step | runs | a step before (s) | first step after (s) "
        "| longest pause (s) | back past step K (s) | replacement in (s) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in (r for r in rows if r["kind"] == "recovery"):
        median = row["median"]
        rejoin = spread_words(row, "replacement_in") if "replacement_in" in median else "-"
        before = spread_words(row, "step_before") if "step_before" in median else "-"
        longest = spread_words(row, "longest_pause") if "longest_pause" in median else "-"
        lines.append(
            f"| {row['model']} | {row['strategy']} | {MODELS[row['model']][2]} | {len(row['runs'])} | "
            f"{before} | {spread_words(row, 'first_step_after')} | {longest} | {spread_words(row, 'back_past_kill')} "
            f"| {rejoin} |"
        )
    lines += [
        "",
        "Medians of the runs (their lowest and highest in brackets). A step before: the median interval "
        "of the 20 logged steps before the kill (a step's own time, which the first step after includes). "
        "Longest pause: the longest time without a logged step from the kill to the replacement's first "
        "step (a restart: to its first step past the kill). "
        + (
            ""
            if cluster
            else f"The restart's checkpoints: every {MODELS['mlp'][3]} steps (mlp), "
            f"{MODELS['cifar_cnn'][3]} (cifar_cnn). "
        )
        + "Pipelines: 2 replicas of 2 stages (4 processes); `--fail 1@K` kills both stages of replica 1.",
    ]
    kept_rows = [r for r in rows if r["kind"] == "throughput"]
    intervals = sorted({(r.get("every", every), r.get("kills", kills)) for r in kept_rows} or {(every, kills)})
    for interval in intervals[::-1]:  # the longest interval first
        lines += [
            "",
            f"# Throughput kept: {'the host of a random replica' if cluster else 'a random replica process'} "
            f"killed every {interval[0]:g} s, {interval[1]} times (runs of {length or length_words({})})",
            "",
            "| model | strategy | runs | undisturbed s | disturbed s | kept | losses | a loss costs (s) "
            "| test accuracy (undisturbed) | stolen (undisturbed / disturbed) | steps/s (undisturbed / disturbed) |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |",
        ]
        lines += [throughput_line(r) for r in kept_rows if (r.get("every", every), r.get("kills", kills)) == interval]
    lines += [
        "",
        "Stolen: the share of the machine's CPU time a hypervisor gave to other machines during the "
        "undisturbed and the disturbed runs (/proc/stat's steal; the median over the pairs): a pair whose two "
        "runs lost different shares compares two machines. Steps/s: the steps a run made over its whole "
        "command's seconds (the median over the pairs; `-`: pairs recorded before their step logs were kept), "
        "so that rows of one machine and day compare in absolute speed: a restart's undisturbed run pays for "
        "its checkpoints, a fault-tolerant one writes none, and each row's kept is against its own.",
    ]
    lines += processor_lines(kept_rows, every)
    if len(intervals) > 1:
        lines += [
            "",
            "The rows of one model and strategy share their undisturbed runs: each set of runs is one "
            "undisturbed run and one disturbed run per interval, every second set of a command in the reverse order.",
        ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument(
        "--every",
        default="6",
        help="throughput kept: seconds between kills; several, comma-separated (30,10), share the undisturbed runs",
    )
    parser.add_argument("--kills", default="4", help="kills per disturbed run, one per --every")
    parser.add_argument(
        "--throughput-repeats", type=int, default=1, help="throughput kept: pairs of runs per row (medians, spread)"
    )
    parser.add_argument(
        "--parts",
        default="recovery,throughput",
        help="which measurements to run: recovery, throughput; or tables: only write the tables of the record in "
        "--out again (its settings given as for --add)",
    )
    parser.add_argument(
        "--longer", type=int, default=3, help="throughput kept: the run's length in the model's epochs above"
    )
    parser.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="throughput kept: runs of about this long undisturbed, sized by a first run of "
        f"{PROBE}x the epochs on this machine's speed of the day (instead of --longer)",
    )
    parser.add_argument(
        "--disturbed-first",
        action="store_true",
        help="the first set runs its disturbed runs first (the sets after it alternate): with --add, to even out "
        "a record whose sets ran the undisturbed run first",
    )
    parser.add_argument(
        "--add",
        action="store_true",
        help="throughput kept: the sets join the rows recorded before in --out (the same settings)",
    )
    parser.add_argument(
        "--cluster",
        action="store_true",
        help=f"each replica on an emulated host of {CLUSTER_CPU} of a core, a spare host for the replacement "
        "(fault-tolerant strategies only; root); recorded in ft_cluster",
    )
    parser.add_argument("--cold-spares", action="store_true", help="--cluster: no standby on the spare host")
    parser.add_argument("--out", default=None, help="results' path less its suffix (default: results/ft_recovery)")
    args = parser.parse_args()
    if args.minutes is not None and not args.minutes > 0:
        parser.error(f"--minutes must be > 0, got {args.minutes:g}")
    intervals = intervals_of(parser, args.every, args.kills)
    every, kills = intervals[0] if len(intervals) == 1 else ([i[0] for i in intervals], [i[1] for i in intervals])
    args.out = args.out or str(RESULTS / ("ft_cluster" if args.cluster else "ft_recovery"))
    on = (["--cold-spares"] if args.cold_spares else []) if args.cluster else None
    label = " (cold spare)" if args.cold_spares else ""
    out = Path(args.out)
    document = {
        "every": every,
        "kills": kills,
        "longer": None if args.minutes else args.longer,
        "minutes": args.minutes,
    }
    # rows of other models, strategies and intervals recorded before with the same settings stay
    earlier = json.loads(out.with_suffix(".json").read_text()) if out.with_suffix(".json").exists() else None
    rows, parts = [], args.parts.split(",")
    if not set(parts) <= {"recovery", "throughput"} and parts != ["tables"]:
        parser.error(f"--parts {args.parts}: give recovery and/or throughput, or tables alone")
    if parts == ["tables"] and earlier is None:
        parser.error(f"--parts tables: no record at {out.with_suffix('.json')} to write the tables of")
    args.add = args.add or parts == ["tables"]  # its rows all stay, and settings that differ are refused
    check_add(earlier, document, args.add)
    models, strategies = args.models.split(","), args.strategies.split(",")
    for model in models if "recovery" in parts else []:
        for strategy in strategies:
            runs = [recovery(model, strategy, on) for _ in range(args.repeats)]
            median = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
            rows.append(
                {"kind": "recovery", "model": model, "strategy": strategy + label, "runs": runs, "median": median}
            )
            print(tables(rows[-1:], args.repeats, *intervals[0])[4], flush=True)  # its row
    for model in models if "throughput" in parts else []:
        for strategy in strategies:
            sets: list[list[dict]] = []
            longer = sized(model, strategy, args.minutes, on) if args.minutes else args.longer
            for _ in range(args.throughput_repeats):
                backwards = (len(sets) + args.disturbed_first) % 2 == 1  # sets alternate which runs come first
                sets.append(throughput_kept(model, strategy, intervals, longer, on, backwards))
                for got in sets[-1]:
                    print(
                        f"{model} {strategy}: every {got['every']:g} s, set {len(sets)}: "
                        f"{got['undisturbed_seconds']:.1f} s, {got['disturbed_seconds']:.1f} s, "
                        f"kept {got['kept']:.0%}, a loss {got['loss_cost']:.2f} s",
                        flush=True,
                    )
            for index, interval in enumerate(intervals):
                # the pairs' medians of their numbers (each pair's pace and steal stay in "runs")
                rows.append(row_of(model, strategy + label, interval, [pairs[index] for pairs in sets]))
                print(throughput_line(rows[-1]), flush=True)
    rows = merged(rows, earlier, document, args.add)
    order = {name: index for index, name in enumerate(STRATEGIES)}
    rows.sort(
        key=lambda r: (
            r["kind"] != "recovery",
            list(MODELS).index(r["model"]),
            order[r["strategy"].removesuffix(" (cold spare)")],
            r["strategy"],
        )
    )
    record(
        out, {"rows": rows, **document}, tables(rows, args.repeats, *intervals[0], length_words(document), args.cluster)
    )


# --- Killing a run from outside while it trains: the choices seeded, the same in every run ---

CGROUPS = Path("/sys/fs/cgroup/cpu")


def kill_repeatedly(process: subprocess.Popen, every: float, kills: int) -> None:
    """Every ``every`` s, ``kills`` times, a random process of the run (a kill due before the
    launcher has started any waits for the first)."""
    rng = random.Random(0)
    for _ in range(kills):
        time.sleep(every)
        while not (replicas := run_processes(process.pid)) and process.poll() is None:
            time.sleep(0.05)
        if process.poll() is not None:
            return
        try:
            os.kill(rng.choice(replicas), signal.SIGKILL)
        except ProcessLookupError:
            pass


def kill_hosts(errors: list[tuple[float, str]], every: float, kills: int) -> None:
    """Every ``every`` s, ``kills`` times, every process of the host of a random replica: its
    machine dies, comes back and stands by."""
    rng = random.Random(0)
    for _ in range(kills):
        time.sleep(every)
        lines = [line for _, line in list(errors)]
        made = next(
            (m.group(1) for m in map(re.compile(r"paratrain cluster: cluster (\d+): ").search, lines) if m), None
        )
        if made is None:
            return
        hosts = sorted(CGROUPS.glob(f"paratrain-{made}-h*"), key=lambda g: int(g.name.rpartition("h")[2]))
        where = {replica: replica for replica in range(len(hosts) - 1)}  # the last host: the spare
        for moved in map(re.compile(r"replica (\d+) on host\d+ lost .* on host(\d+)").search, lines):
            if moved:
                where[int(moved.group(1))] = int(moved.group(2))
        try:
            pids = (hosts[where[rng.choice(sorted(where))]] / "cgroup.procs").read_text().split()
        except (IndexError, OSError):  # the run is over: its hosts are gone
            return
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


# --- What each loss cost a run, read from its own step log ---

#: A launcher's line that says a replica (or, restarting, the run) was lost.
LOSS = re.compile(r"was lost|restarting the run|paratrain cluster: replica")


def loss_costs(steps: list[tuple[float, int]], losses: list[float], window: float = 10.0) -> list[float]:
    """What each loss cost the run, in seconds, from its own step log (so not from two runs'
    difference, which this machine's drift between runs blurs by several percent): the time
    from the loss over the next ``window`` s (less where the next loss or the run's end comes
    sooner), less the time the steps made meanwhile take at the run's pace of the 5 s before
    the loss (after the previous loss's first ``window / 2`` s). A restart's redone steps count
    as lost: progress is the highest step reached."""
    costs = []
    at = _progress(steps)
    for k, lost in enumerate(losses):
        end = min([lost + window, steps[-1][0], *(t - 0.3 for t in losses[k + 1 :])])
        start = max(lost - 5.0, steps[0][0], *(t + window / 2 for t in losses[:k]))
        if end - lost < 2.0 or lost - 0.3 - start < 2.0:  # too close to another loss or the run's ends
            continue
        pace = (at(lost - 0.3) - at(start)) / (lost - 0.3 - start)
        if pace > 0:
            costs.append((end - lost) - (at(end) - at(lost)) / pace)
    return costs


def longest_pause(after: list[tuple[float, int]], killed: float, until: float) -> float:
    """The longest time the run logged no step from the kill on, up to its first step
    ``until`` seconds after the kill (the replacement's first, or the restart's past the
    kill): a survivor of a periodic strategy steps on alone at once and waits at the next
    synchronization, and one under per-step quorums may wait again as the replacement
    takes the live state, which the first step after the kill does not show."""
    times = [killed, *(t for t, _ in after if t - killed <= until + 1e-9)]
    return max(b - a for a, b in zip(times, times[1:]))


def pace(steps: list[tuple[float, int]], width: float = 10.0) -> list[float]:
    """The run's steps per second in each ``width`` s from its start (progress: the highest
    step reached), to see where in a run its time went: around each loss, or spread over it."""
    if not steps:
        return []
    at = _progress(steps)
    return [(at((k + 1) * width) - at(k * width)) / width for k in range(math.ceil(steps[-1][0] / width))]


def _progress(steps: list[tuple[float, int]]) -> Callable[[float], int]:
    """The highest step a run's log (``(seconds, step)`` lines) had reached by a time: a
    restart's redone steps are not progress."""
    times = [t for t, _ in steps]
    reached = list(itertools.accumulate((s for _, s in steps), max))

    def at(t: float) -> int:
        index = bisect.bisect_right(times, t)
        return reached[index - 1] if index else 0

    return at


# --- A row of the tables: a pair of runs' numbers, a row's line ---


def spread_words(row: dict, key: str) -> str:
    """A recovery row's median of ``key`` and its range over the runs that measured it."""
    values = [run[key] for run in row["runs"] if key in run]
    return f"{row['median'][key]:.2f} ({min(values):.2f}-{max(values):.2f})"


def stolen_words(runs: list[dict]) -> str:
    """A row's median share stolen by a hypervisor in its undisturbed and disturbed runs; ``-``
    for rows recorded before it was measured (or without /proc/stat)."""
    shares = [
        [r["steal"][k] for r in runs if r.get("steal", {}).get(k) is not None] for k in ("undisturbed", "disturbed")
    ]
    if not all(shares):
        return "-"
    return " / ".join(f"{statistics.median(values):.1%}" for values in shares)


def processor_lines(rows: list[dict], every: float) -> list[str]:
    """Where throughput rows' sets ran (each set's ``processor``, from recorded_table.cpu_name), for the
    rows whose sets say, and in which order where recorded: a set's two runs share one
    machine, a row's sets may not (``every``: the file's interval, for a row recorded before
    rows carried theirs)."""
    said = []
    for row in rows:
        runs = row.get("runs", [row])
        named = [r["processor"] for r in runs if "processor" in r]
        if not named:
            continue
        counts = ", ".join(f"{name} {named.count(name)}" for name in sorted(set(named)))
        unnamed = f", {len(runs) - len(named)} not recorded" if len(named) < len(runs) else ""
        first = [r for r in runs if "disturbed_first" in r]  # kept since --add could start either way
        order = f", disturbed runs first in {sum(r['disturbed_first'] for r in first)} of {len(first)}" if first else ""
        said.append(f"{row['model']} {row['strategy']} every {row.get('every', every):g} s: {counts}{unnamed}{order}")
    if not said:
        return []
    return [
        "",
        "The sets' processors (model name and PyTorch's CPU capability; sets recorded before it was "
        "kept: not recorded) and, where recorded, how many ran their disturbed runs first: " + "; ".join(said) + ".",
    ]


def cost_words(runs: list[dict]) -> str:
    """A row's median cost of a loss, with its runs' range; ``-`` for rows recorded before it was measured."""
    values = [r["loss_cost"] for r in runs if not math.isnan(r.get("loss_cost", math.nan))]
    if not values:
        return "-"
    spread = f" ({min(values):.2f}-{max(values):.2f})" if len(values) > 1 else ""
    return f"{statistics.median(values):.2f}{spread}"


#: Seconds a window of a pair's recorded pace spans.
PACE_WIDTH = 10.0


def speed_words(runs: list[dict]) -> str:
    """A row's median steps per second over its undisturbed and its disturbed runs' whole
    commands, from the pace each pair recorded (its windows' steps add up to the run's);
    ``-`` for rows recorded before it was."""
    paced = [r for r in runs if "pace" in r]
    if not paced:
        return "-"
    rates = [
        statistics.median(sum(r["pace"][k]) * PACE_WIDTH / r[f"{k}_seconds"] for r in paced)
        for k in ("undisturbed", "disturbed")
    ]
    return f"{rates[0]:.2f} / {rates[1]:.2f}"


def pair(calm: dict, hit: dict) -> dict:
    """What a disturbed run kept of the undisturbed one's speed, and what its losses cost."""
    losses = [t for t, line in hit["errors"] if LOSS.search(line)]
    costs = loss_costs(hit["steps"], losses)
    return {
        "undisturbed_seconds": calm["seconds"],
        "disturbed_seconds": hit["seconds"],
        "kept": calm["seconds"] / hit["seconds"],
        "losses_reported": len(losses),
        "loss_cost": statistics.median(costs) if costs else float("nan"),
        "test_accuracy": hit["metrics"]["test_accuracy"],
        "undisturbed_test_accuracy": calm["metrics"]["test_accuracy"],
        # the share of the machine's CPU time a hypervisor gave to other machines in each run
        "steal": {"undisturbed": calm["steal"], "disturbed": hit["steal"]},
        # steps/s in each 10 s of each run, and the losses' moments: where the time went
        "pace": {
            "undisturbed": pace(calm["steps"], PACE_WIDTH),
            "disturbed": pace(hit["steps"], PACE_WIDTH),
            "losses_at": losses,
        },
    }


def throughput_line(kept: dict) -> str:
    """A throughput row: the medians of its pairs, what they kept and its range."""
    runs = kept.get("runs", [kept])
    spread = f" ({min(r['kept'] for r in runs):.0%}-{max(r['kept'] for r in runs):.0%})" if len(runs) > 1 else ""
    return (
        f"| {kept['model']} | {kept['strategy']} | {len(runs)} | {kept['undisturbed_seconds']:.1f} "
        f"| {kept['disturbed_seconds']:.1f} | {kept['kept']:.0%}{spread} | {kept['losses_reported']:g} "
        f"| {cost_words(runs)} | {kept['test_accuracy']:.3f} ({kept['undisturbed_test_accuracy']:.3f}) "
        f"| {stolen_words(runs)} | {speed_words(runs)} |"
    )


# --- Throughput rows over sets of runs; runs sized to minutes on the day's speed ---

#: The run that sizes a strategy's runs for ``--minutes``: this many times the model's epochs.
PROBE = 8
#: A pair's fields that say how it was run, not what it measured: never a row's median.
SETTINGS = ("every", "kills", "longer")


def intervals_of(parser: argparse.ArgumentParser, every: str, kills: str) -> list[tuple[float, int]]:
    """``--every 30,10 --kills 9,27`` as (seconds between kills, kills) per interval; one
    line and exit 2 (``parser.error``) where the counts differ."""
    seconds, counts = every.split(","), kills.split(",")
    if len(seconds) != len(counts):
        parser.error(f"--every {every} and --kills {kills}: give one kill count per interval")
    return list(zip(map(float, seconds), map(int, counts), strict=True))


def longer_for(minutes: float, seconds: float, training_seconds: float) -> int:
    """How many times the model's epochs make an undisturbed run of ``minutes``, from a run of
    ``PROBE`` times them that took ``seconds``, ``training_seconds`` of it in the training
    loop (the rest: starting the processes and the data, evaluation at the end)."""
    if training_seconds <= 0 or seconds < training_seconds:
        raise SystemExit(
            f"--minutes: the sizing run's times make no sense ({seconds:.1f} s, training {training_seconds:.1f} s)"
        )
    start = seconds - training_seconds
    return max(1, round((60 * minutes - start) * PROBE / training_seconds))


def row_of(model: str, strategy: str, interval: tuple[float, int], runs: list[dict]) -> dict:
    """The row of ``runs`` (pairs, each from a set of runs): the medians of their numbers."""
    numbers = [k for k, v in runs[0].items() if isinstance(v, (int, float)) and k not in SETTINGS]
    medians = {key: statistics.median(r[key] for r in runs) for key in numbers}
    return {
        "kind": "throughput",
        "model": model,
        "strategy": strategy,
        **medians,
        "every": interval[0],
        "kills": interval[1],
        "runs": runs,
    }


def settings(document: dict) -> tuple:
    """What a record's runs must share with new ones for their rows to stand in one file:
    the intervals and kills, and the length (minutes, else the epochs' multiple)."""
    minutes = document.get("minutes")
    return document.get("every"), document.get("kills"), minutes, None if minutes else document.get("longer", 3)


def merged(rows: list[dict], earlier: dict | None, now: dict, add: bool) -> list[dict]:
    """``rows`` with the rows of ``earlier`` (a record's document) of other models, strategies,
    kinds or intervals; with ``add``, a throughput row recorded before for the same model,
    strategy and interval takes in the new row's pairs (its medians made again), else the new
    row replaces it. A record of other settings (``settings``) is replaced whole, or refused
    with ``add`` (``check_add`` says so before any run)."""
    if earlier is None:
        return rows
    if settings(earlier) != settings(now):
        check_add(earlier, now, add)
        return rows

    single = earlier.get("every") if not isinstance(earlier.get("every"), list) else None

    def key(row: dict) -> tuple:  # a row recorded before rows carried their interval: the file's one
        return row["kind"], row["model"], row["strategy"], row.get("every", single)

    before = {key(r): r for r in earlier["rows"]}
    joined = []
    for row in rows:
        old = before.pop(key(row), None)
        if add and old is not None and row["kind"] == "throughput":
            row = row_of(row["model"], row["strategy"], (row["every"], row["kills"]), old["runs"] + row["runs"])
        joined.append(row)
    return list(before.values()) + joined


def check_add(earlier: dict | None, now: dict, add: bool) -> None:
    """``--add`` to a record of other settings (``settings``) stops with a line saying both."""
    if add and earlier is not None and settings(earlier) != settings(now):
        raise SystemExit(
            f"--add: the record's runs had --every {earlier.get('every')} --kills {earlier.get('kills')} "
            f"and {length_words(earlier)}, these {length_words(now)} with --every {now.get('every')} "
            f"--kills {now.get('kills')}: add with the same settings"
        )


def length_words(document: dict) -> str:
    """A record's run length, as its table headings say it."""
    if document.get("minutes"):
        return f"about {document['minutes']:g} minutes undisturbed"
    return f"{document.get('longer', 3)}x the model's epochs"


if __name__ == "__main__":
    main()
