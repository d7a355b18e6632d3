"""The cluster simulator against real multi-process runs on this machine.

What it does (from the repository root):

    .venv/bin/python benchmarks/simulator_validation.py [--workers 2,3,4] [--epochs 6] [--repeats 3]

1. Profiles this machine (machine_profile.py) before every pass over the settings (the
   simulation takes each number's median over those profiles), each number measured by a
   short run of the real code:
   - a worker's compute per step: CPU seconds (every thread of the process) per training
     step, evaluation excluded, in a 1-worker run of the strategy (``allreduce``: one
     process; ``ps-async``: one shard and one worker, no core shared);
   - the shard's work: CPU seconds of the shard process per push, and of its optimizer
     step per update (``ShardServer._apply``), in the same 1-worker ``ps-async`` run;
   - loopback latency and bandwidth: the mean one-way time of Gloo send/recv ping-pongs
     between two processes, of 4 bytes (latency) and of 4 MiB (bandwidth), each message
     after 1 ms of CPU work, as in training;
   - the ring all-reduce step as training meets it: the mean step of a 2-worker
     ``allreduce`` run (evaluation excluded) less its compute and the bytes' time, over the
     ring's two steps. The all-reduce of a ping-pong benchmark is recorded beside it
     (``pingpong_ring_latency_s``); it misses what training adds (DDP's bucket copies, the
     tail of a peer's late wake-up), so allreduce at 2 workers without a straggler is the
     calibration of this one number, and every other allreduce row a prediction;
   - the host's cores: ``os.sched_getaffinity``, and how much work k processes do at once
     (``host_speedup``: mlp steps per second of k processes over one's, k = 1 up to the
     most processes a setting runs), since two virtual cores are not two free cores.
2. Runs every setting for real, through ``paratrain.launch`` exactly as ``paratrain train
   --strategy S --workers N`` does (Gloo on loopback): allreduce, ps-sync, ps-backup
   (``--backup-workers 1``, so N + 1 workers), ps-async, at each worker count, without and
   with a straggler (``--straggler W:2``, W the last worker). Each real number is the median
   over ``--repeats`` passes; a pass runs every setting once, so drift of the shared
   machine hits them all. Throughput is examples in applied updates per second while
   every worker trains, read from the run's own ``--timeline`` (the processes start
   seconds apart on a loaded machine, and a parameter server's dynamic sharding lets the
   first ones take whole epochs alone); the CPU that other tenants of the machine used
   meanwhile is recorded too (``Background``).
3. Simulates the same settings with simulate/host.py (every process on one host of those
   cores; the straggler as ``sleep:W:2``, which is what ``--straggler`` does), and records
   the relative error of throughput and of the mean staleness (ps-async). Each run is
   simulated with the profile and the share of the cores the other tenants left it
   (``left_to_us``); the medians of the real and of the simulated runs are compared. A
   core's speed measured just before a run (it moves by up to 2x on a shared virtual
   machine) and a link measured then were tried as well: they did not say how the run
   itself found the machine, and made the predictions worse.

Writes benchmarks/results/simulator_validation.json and .md, and prints the table.
``--strategies local-sgd,diloco,fsdp --out benchmarks/results/simulator_validation_more.json``
validates the other data-parallel modes the same way, each with the compute of its own
1-worker run (fsdp's hooks and copies count as compute there).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's paratrain, also in the spawned processes

from machine_profile import MORE_STRATEGIES, median_profile, profile  # noqa: E402  (after the path)

STRATEGIES = ("allreduce", "ps-sync", "ps-backup", "ps-async")
#: fsdp's units on the mlp: its two Linear layers (the root holds no parameters of its own).
FSDP_UNITS = 2
TARGET = 0.20  # relative error of throughput and of mean staleness


# ----- 2. real runs -------------------------------------------------------------------------------
class Background:
    """Cores that other tenants of this machine used while a run went on: every core's busy
    time (/proc/stat: user, nice, system, irq, softirq, steal) less this process's and its
    children's CPU time, per second of wall time. The machine is shared; its cores minus
    this are what the run had (its processes run at nice 10, below the others' nice 0)."""

    def __enter__(self) -> Background:
        self.start = (self._busy(), _own_cpu(), time.perf_counter())
        return self

    def __exit__(self, *exc: object) -> None:
        busy, own, wall = (b - a for a, b in zip(self.start, (self._busy(), _own_cpu(), time.perf_counter())))
        self.cores = max(busy - own, 0.0) / wall

    @staticmethod
    def _busy() -> float:
        with open("/proc/stat") as handle:
            fields = [int(x) for x in handle.readline().split()[1:]]
        user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def wait_for_quiet(below: float, patience: float) -> float:
    """Wait until the other tenants use fewer than ``below`` cores (over 2 s), at most
    ``patience`` seconds; returns their last use."""
    deadline = time.monotonic() + patience
    while True:
        with Background() as background:
            time.sleep(2.0)
        if background.cores < below or time.monotonic() > deadline:
            return background.cores
        time.sleep(3.0)


def _own_cpu() -> float:
    import resource

    self_, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return self_.ru_utime + self_.ru_stime + children.ru_utime + children.ru_stime


def setting(strategy: str, workers: int, straggler: bool) -> dict:
    """The TrainConfig fields of one setting; the straggler is the last worker."""
    settings = {"strategy": strategy, "workers": workers}
    if strategy == "ps-backup":
        settings["backup_workers"] = 1
    if straggler:
        settings["straggler"] = f"{workers + settings.get('backup_workers', 0) - 1}:2"
    return settings


def real_run(settings: dict, epochs: int, folder: Path) -> dict:
    from paratrain.config import TrainConfig
    from paratrain.launch.local import run_locally

    trace = folder / "timeline.json"
    config = TrainConfig(epochs=epochs, progress=False, log_every=0, device="cpu", timeline=str(trace), **settings)
    with Background() as background:
        metrics = run_locally(config)
    applied = sum(metrics["staleness"]["histogram"].values())
    share = applied / (applied + metrics["dropped_gradients"])  # ps-backup drops some
    events = json.loads(trace.read_text())["traceEvents"]
    steps_per_second = steady_steps_per_second(events)
    training_only = steady_steps_per_second(events, exclude_evaluation=True)
    return {
        "examples_per_second": None if steps_per_second is None else steps_per_second * config.batch_size * share,
        "training_examples_per_second": (None if training_only is None else training_only * config.batch_size * share),
        "whole_run_examples_per_second": metrics["examples_per_second"],
        "staleness_mean": metrics["staleness"]["mean"],
        "dropped_gradients": metrics["dropped_gradients"],
        "global_steps": metrics["global_steps"],
        "processes": config.topology.num_processes,
        "background_cores": background.cores,
    }


def steady_steps_per_second(events: list[dict], skip: int = 2, exclude_evaluation: bool = False) -> float | None:
    """Worker steps per second, all workers together, while every worker trains: from the
    moment the last worker to start has done ``skip`` steps to the moment the first worker
    to finish does its last (a step ends with its backward pass). Evaluation pauses count,
    unless ``exclude_evaluation``: then the workers' mean time in ``evaluate`` spans within
    that window is taken out of it (the simulator does not evaluate). None when no worker
    overlaps the others that long (one started after another ended)."""
    found = steady_window(events, skip)
    if found is None:
        return None
    first, last, steps, evaluating = found
    return steps / ((last - first - (evaluating if exclude_evaluation else 0.0)) / 1e6)


def steady_window(events: list[dict], skip: int = 2) -> tuple[float, float, int, float] | None:
    """The window of steady_steps_per_second: its start and end (the trace's microseconds),
    the worker steps in it, and the workers' mean time evaluating within it; None as there."""
    ends: dict[int, list[float]] = {}
    evaluations: dict[int, list[tuple[float, float]]] = {}
    for e in events:
        if e.get("ph") == "X" and e["name"] == "backward":
            ends.setdefault(e["pid"], []).append(e["ts"] + e["dur"])
        elif e.get("ph") == "X" and e["name"] == "evaluate":
            evaluations.setdefault(e["pid"], []).append((e["ts"], e["ts"] + e["dur"]))
    workers = [sorted(v) for v in ends.values()]
    if not workers or min(len(w) for w in workers) <= skip:
        return None
    first, last = max(w[skip] for w in workers), min(w[-1] for w in workers)
    if last <= first:
        return None
    steps = sum(sum(1 for t in w if first < t <= last) for w in workers)
    inside = [
        sum(max(0.0, min(end, last) - max(start, first)) for start, end in evaluations.get(pid, [])) for pid in ends
    ]
    return first, last, steps, statistics.mean(inside)


# ----- 3. simulation ------------------------------------------------------------------------------
def simulate_setting(settings: dict, machine: dict, model_bytes: float, batch_size: int, steps: int) -> dict:
    from paratrain.simulate.cluster import Cluster, parse_straggler
    from paratrain.simulate.simulator import simulate

    strategy = settings["strategy"]
    straggler = settings.get("straggler")
    cluster = Cluster(
        workers=settings["workers"],
        compute_s=machine["compute_s"].get(
            strategy, machine["compute_s"]["ps" if strategy.startswith("ps-") else "allreduce"]
        ),
        model_bytes=model_bytes,
        bandwidth=machine["bandwidth_bytes_per_s"],
        latency=machine["latency_s"],
        ring_latency=machine["ring_latency_s"],
        ps_message_s=machine["ps_message_s"],
        ps_update_s=machine["ps_update_s"],
        host_cores=machine["cores"],
        host_speedup=tuple(machine["host_speedup"]),
        straggler=parse_straggler("sleep:" + straggler if straggler else None),
    )
    outcome = simulate(strategy, cluster, steps, backup=settings.get("backup_workers", 0), units=FSDP_UNITS)
    summary = outcome.summary(batch_size)
    return {"examples_per_second": summary["examples_per_second"], "staleness_mean": summary["staleness"]["mean"]}


def as_run_found(machine: dict, run: dict) -> dict:
    """The profile with the cores that the other tenants of the machine left the run."""
    return {**machine, "host_speedup": left_to_us(machine["host_speedup"], machine["cores"], run["background_cores"])}


def left_to_us(speedup: list[float], cores: int, background: float) -> list[float]:
    """The host's speedup curve as a run found it, with ``background`` cores' worth of other
    tenants' processes busy too: k of ours and the others together do speedup(k + b), the
    others keep their b, and we never get less than a nice-10 process keeps against one
    nice-0 process on each core (CFS weights 110 and 1024)."""

    def capacity(x: float) -> float:  # speedup at a fractional count, 0 at 0, flat past the last
        points = [0.0, *speedup]
        x = min(x, len(speedup))
        low = int(x)
        return points[low] + (x - low) * (points[min(low + 1, len(speedup))] - points[low])

    floor = 110 / (110 + 1024)
    return [max(capacity(k + background) - background, min(k, cores) * floor) for k in range(1, len(speedup) + 1)]


def relative_error(predicted: float, measured: float) -> float | None:
    return (predicted - measured) / measured if measured else None


# ----- report -------------------------------------------------------------------------------------
def markdown(document: dict) -> str:
    m = document["machine"]
    lines = [
        f"Simulator (simulate/host.py) against real runs: mlp on digits, batch {document['batch_size']} per worker, "
        f"Gloo on loopback, {m['cores']} cores; real = median of {document['repeats']} runs of {document['epochs']} "
        f"epochs (throughput while every worker trains"
        f"{', evaluation pauses taken out' if document.get('exclude_evaluation') else ''}). Measured: compute {m['compute_s']['allreduce'] * 1e3:.3f} ms "
        f"(allreduce) / {m['compute_s']['ps'] * 1e3:.3f} ms (ps worker)"
        + "".join(f" / {v * 1e3:.3f} ms ({k})" for k, v in m["compute_s"].items() if k in MORE_STRATEGIES)
        + f" per step, shard {m['ps_message_s'] * 1e3:.3f} ms "
        f"per push + {m['ps_update_s'] * 1e3:.3f} ms per update, latency {m['latency_s'] * 1e6:.0f} us, "
        f"bandwidth {m['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s (medians of 3 ping-pong runs), "
        f"ring step {m['ring_latency_s'] * 1e6:.0f} us (from a 2-worker allreduce profiling run's mean step "
        f"of {m['allreduce_step2_s'] * 1e3:.3f} ms: allreduce at 2 workers without a straggler is the calibration, "
        f"not a prediction), host speedup for 1, 2, ... processes {', '.join(f'{x:.2f}' for x in m['host_speedup'])}. "
        f"Target: errors within {TARGET:.0%}.",
        "",
        "| strategy | workers | processes | straggler | other load (cores) "
        "| real examples/s (min-max) | simulated | error | real staleness | simulated | error |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in document["rows"]:
        stale = r["strategy"] == "ps-async"
        lines.append(
            f"| {r['strategy']} | {r['workers']} | {r['processes']} | {r.get('straggler') or 'none'} "
            f"| {r['real']['background_cores']:.2f} "
            f"| {r['real']['examples_per_second']:.0f} ({min(r['real_runs']):.0f}-{max(r['real_runs']):.0f}) "
            f"| {r['simulated']['examples_per_second']:.0f} | {r['throughput_error']:+.0%} "
            + (
                f"| {r['real']['staleness_mean']:.2f} | {r['simulated']['staleness_mean']:.2f} | {r['staleness_error']:+.0%} |"
                if stale
                else "| | | |"
            )
        )
    s = document["summary"]
    lines += [
        "",
        f"Throughput within {TARGET:.0%}: {s['throughput_within_target']} of {s['settings']} settings "
        f"(median absolute error {s['throughput_median_abs_error']:.0%}); "
        f"{s['undersubscribed_within_target']} of {s['undersubscribed']} with no more processes than cores. "
        f"Mean staleness within {TARGET:.0%}: {s['staleness_within_target']} of {s['staleness_settings']}.",
    ]
    return "\n".join(lines) + "\n"


def summarise(rows: list[dict], cores: int) -> dict:
    errors = [abs(r["throughput_error"]) for r in rows]
    under = [r for r in rows if r["processes"] <= cores]
    stale = [r for r in rows if r["staleness_error"] is not None]
    return {
        "settings": len(rows),
        "throughput_within_target": sum(e <= TARGET for e in errors),
        "throughput_median_abs_error": statistics.median(errors),
        "undersubscribed": len(under),
        "undersubscribed_within_target": sum(abs(r["throughput_error"]) <= TARGET for r in under),
        "staleness_settings": len(stale),
        "staleness_within_target": sum(abs(r["staleness_error"]) <= TARGET for r in stale),
    }


def resimulate(out: Path, steps: int) -> int:
    """The recorded real runs of ``out`` against the simulator as it is now: each run is
    simulated with the profile and the run's recorded other load (runs recorded before
    ``real_background`` existed: the setting's median)."""
    document = json.loads(out.read_text())
    machine = document["machine"]
    for row in document["rows"]:
        setting_only = {k: row[k] for k in ("strategy", "workers", "backup_workers", "straggler") if k in row}
        loads = row.get("real_background") or [row["real"]["background_cores"]] * len(row["real_runs"])
        sims = [
            simulate_setting(
                setting_only,
                as_run_found(machine, {"background_cores": load}),
                document["model_bytes"],
                document["batch_size"],
                steps,
            )
            for load in loads
        ]
        row["simulated_runs"] = [x["examples_per_second"] for x in sims]
        row["simulated"] = {key: statistics.median(x[key] for x in sims) for key in sims[0]}
        row["throughput_error"] = relative_error(
            row["simulated"]["examples_per_second"], row["real"]["examples_per_second"]
        )
        if row["staleness_error"] is not None:
            row["staleness_error"] = relative_error(row["simulated"]["staleness_mean"], row["real"]["staleness_mean"])
    document["summary"] = summarise(document["rows"], machine["cores"])
    document["resimulated"] = True
    out.write_text(json.dumps(document, indent=2) + "\n")
    table = markdown(document)
    out.with_suffix(".md").write_text(table)
    print(table, end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="2,3,4")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--epochs", type=int, default=6, help="epochs per real run (44 steps of 32 examples each)")
    parser.add_argument("--repeats", type=int, default=3, help="passes over every setting; the median is reported")
    parser.add_argument("--profile-epochs", type=int, default=8)
    parser.add_argument("--pings", type=int, default=200, help="ping-pongs per message size")
    parser.add_argument("--sim-steps", type=int, default=400)
    parser.add_argument(
        "--quiet-below",
        type=float,
        default=0.3,
        help="before each run, wait until other tenants use fewer cores than this...",
    )
    parser.add_argument("--patience", type=float, default=120, help="...but at most this many seconds")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/simulator_validation.json"))
    parser.add_argument(
        "--exclude-evaluation",
        action="store_true",
        help="compare the real runs' throughput with their evaluation pauses taken out",
    )
    parser.add_argument(
        "--resimulate",
        action="store_true",
        help="simulate the real runs recorded in --out again with the simulator as it is now (no real runs)",
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.resimulate:
        return resimulate(Path(args.out), args.sim_steps)

    import torch

    from paratrain.data.datasets import load_digits
    from paratrain.models import build_model

    model = build_model("mlp", load_digits().spec)
    model_bytes = 4.0 * sum(p.numel() for p in model.parameters())
    wait_for_quiet(args.quiet_below, args.patience)
    strategies = args.strategies.split(",")
    settings = [
        setting(s, n, straggler)
        for straggler in (False, True)
        for n in map(int, args.workers.split(","))
        for s in strategies
    ]
    most = max(
        one["workers"] + one.get("backup_workers", 0) + (1 if one["strategy"].startswith("ps-") else 0)
        for one in settings
    )
    profiles = []

    runs: list[list[dict]] = [[] for _ in settings]
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(args.repeats):
            # A profile before every pass: on a shared machine one profile is a snapshot of
            # its neighbours' load; the simulation takes the median of them all.
            profiles.append(profile(args.profile_epochs, args.pings, int(model_bytes), most, strategies))
            print(json.dumps({"machine": profiles[-1]}), flush=True)
            for i, one in enumerate(settings):
                before = wait_for_quiet(args.quiet_below, args.patience)
                run = {**real_run(one, args.epochs, Path(folder)), "background_cores_before": before}
                if args.exclude_evaluation:  # the simulator does not evaluate
                    run["examples_per_second_with_evaluation"] = run["examples_per_second"]
                    run["examples_per_second"] = run["training_examples_per_second"]
                print(json.dumps({**one, **run}), flush=True)
                if run["examples_per_second"] is not None:
                    runs[i].append(run)

    machine = median_profile(profiles)
    rows = []
    for one, samples in zip(settings, runs):
        if not samples:
            continue  # no run in which the workers overlapped (reported in the log above)
        keys = (
            "examples_per_second",
            "whole_run_examples_per_second",
            "staleness_mean",
            "dropped_gradients",
            "background_cores",
        )
        real = {key: statistics.median(s[key] for s in samples) for key in keys}
        # Each run is simulated with the cores the other tenants left it.
        sims = [simulate_setting(one, as_run_found(machine, s), model_bytes, 32, args.sim_steps) for s in samples]
        simulated = {key: statistics.median(x[key] for x in sims) for key in sims[0]}
        rows.append(
            {
                **one,
                "processes": samples[0]["processes"],
                "real": real,
                "real_runs": [s["examples_per_second"] for s in samples],
                "real_background": [s["background_cores"] for s in samples],
                "simulated_runs": [x["examples_per_second"] for x in sims],
                "simulated": simulated,
                "throughput_error": relative_error(simulated["examples_per_second"], real["examples_per_second"]),
                "staleness_error": (
                    relative_error(simulated["staleness_mean"], real["staleness_mean"])
                    if one["strategy"] == "ps-async"
                    else None
                ),
            }
        )
    document = {
        "command": " ".join(
            ["python", "benchmarks/simulator_validation.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "epochs": args.epochs,
        "repeats": args.repeats,
        "exclude_evaluation": args.exclude_evaluation,
        "batch_size": 32,
        "model_bytes": model_bytes,
        "machine": machine,
        "profiles": profiles,
        "rows": rows,
        "summary": summarise(rows, machine["cores"]),
        "environment": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
            "load_average_1min_at_end": round(os.getloadavg()[0], 2),
        },
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=2) + "\n")
    table = markdown(document)
    out.with_suffix(".md").write_text(table)
    print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
