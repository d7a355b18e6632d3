"""The cluster simulator against real runs on emulated hosts, with known CPU shares and links.

The 24 settings of benchmarks/simulator_validation.py (allreduce, ps-sync, ps-backup with one
backup worker, ps-async; 2, 3 and 4 workers; without and with a straggler), each process on
a host of its own: every host gets ``--cpu`` of a core and a ``--link`` link, the
straggler is the last worker's host at half that CPU (a slow machine, not a sleep). A
parameter server's shard is host 0. On loopback the same settings shared two cores, and
the real runs themselves varied by 2x; here every host's speed is fixed.

The simulator gets the real parameters, measured once per host, and models each host as
the kernel runs it (``Cluster(cpu_share=..., cpu_period_s=...)``, paratrain/simulate/quota.py):
a quota of ``--cpu`` x 10 ms of CPU in every 10 ms period, at a full core's speed until it is
spent, each host's periods at a phase of their own:

- CPU-seconds, from the hosts' own accounting (their cgroups' counters over the steady
  steps, paratrain/cluster/usage.py) in two runs on emulated hosts that are none of the 24:
  allreduce on one host (a worker's step), ps-async with one worker (a ps worker's step,
  reply included; the shard's work per push, update included); and the optimizer's update
  on the shard alone, measured on this machine (simulator_validation.py's profile);
- the link's rate as shaped;
- the CPU each message costs its receiver (a ring hop, a push at the shard, a reply at a
  worker), M: calibrated once, on the 2-worker allreduce run without a straggler (the M at
  which the simulator reproduces it): that row is the calibration, every other row a
  prediction. A ps worker's step and the shard's push are given as measured, M included;
- the straggler: its host at half the share (``fixed:W:2``: a node at 1/2 of the share).

The simulated rate is the mean over ``SEEDS`` draws of the hosts' phases.

Real throughput is examples in applied updates per second while every worker trains,
evaluation excluded, from the run's own ``--timeline`` (as simulator_validation.py reads
it); each setting's number is the median over ``--repeats`` passes, a pass running every
setting once.

    sudo .venv/bin/python benchmarks/cluster_validation.py [--cpu 0.3] [--repeats 2]
    .venv/bin/python benchmarks/cluster_validation.py --resimulate   (the recorded runs again)
    sudo .venv/bin/python benchmarks/cluster_validation.py --more --repeats 1   (a pass more)

Writes benchmarks/results/cluster_validation.json and .md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from cluster_common import RESULTS, SEEDS, calibrate, cluster_train, record, recorded, simulated_on_quota_hosts
from machine_profile import profile_strategy
from simulator_validation import STRATEGIES, setting, steady_window

from paratrain.cluster.hosts import PERIOD_US
from paratrain.cluster.usage import window

TARGET = 0.10  # relative error of throughput
TRAIN = ["--model", "mlp", "--dataset", "digits", "--timeout", "300", "--batch-size", "32"]
BATCH = 32


def layout(settings: dict, cpu: float, link: str) -> tuple[list[str], list[str]]:
    """``paratrain cluster run`` and ``paratrain train`` flags of one setting: one process per host."""
    strategy, workers = settings["strategy"], settings["workers"]
    backup = settings.get("backup_workers", 0)
    hosts = workers + backup + (1 if strategy.startswith("ps-") else 0)
    # every setting with the hosts sharing this machine's cores as the kernel places them
    # (on 2 cores, only the 2-host settings would be pinned by default: docs/cluster.md)
    cluster = ["--hosts", str(hosts), "--cpu", f"{cpu:g}", "--link", link, "--pin", "never"]
    if "straggler" in settings:
        cluster += ["--host", f"{hosts - 1}:cpu={cpu / 2:g}"]
    train = ["--strategy", strategy, "--workers", str(workers), *TRAIN]
    if backup:
        train += ["--backup-workers", str(backup)]
    return cluster, train


def real_run(settings: dict, cpu: float, link: str, epochs: int, folder: Path) -> dict:
    cluster, train = layout(settings, cpu, link)
    trace = folder / "timeline.json"
    metrics = cluster_train(cluster, [*train, "--epochs", str(epochs), "--timeline", str(trace)], folder / "m.json")
    timeline = json.loads(trace.read_text())
    trace.unlink()
    applied = sum(metrics["staleness"]["histogram"].values())
    share = applied / (applied + metrics["dropped_gradients"])  # ps-backup drops some
    found = steady_window(timeline["traceEvents"])
    if found is None:
        return {
            "examples_per_second": None,
            "staleness_mean": metrics["staleness"]["mean"],
            "test_accuracy": metrics["test_accuracy"],
            "hosts": [],
        }
    first, last, steps, evaluating = found
    seconds = (last - first - evaluating) / 1e6
    # Each host's CPU over the same window (wall clock: the trace's origin plus its times).
    origin = timeline["otherData"]["origin_unix_us"]
    start, end = (origin + first) / 1e6, (origin + last) / 1e6
    hosts = []
    for host in metrics["usage"]["hosts"]:
        used = window(host["samples"], start, end)
        hosts.append(
            {
                "host": host["host"],
                "cpu": host["cpu"],
                "cpu_ms_per_step": 1e3 * used.cpu_s / steps,
                "core_fraction": used.cpu_s / (end - start),
                "throttled": used.throttled_periods / max(1, used.periods),
            }
        )
    return {
        "examples_per_second": steps / seconds * BATCH * share,
        "staleness_mean": metrics["staleness"]["mean"],
        "test_accuracy": metrics["test_accuracy"],
        "hosts": hosts,
    }


def machine_profile(args: argparse.Namespace) -> dict:
    """CPU-seconds per step and per push, from the hosts' accounting in two runs on emulated
    hosts (allreduce on one host; ps-async with one worker: host 0 the shard, host 1 the
    worker); the shard's update from a profile on this machine."""
    with tempfile.TemporaryDirectory() as tmp:
        allreduce = real_run(setting("allreduce", 1, False), args.cpu, args.link, args.epochs, Path(tmp))
        ps = real_run(setting("ps-async", 1, False), args.cpu, args.link, args.epochs, Path(tmp))
    shard = next(r for r in profile_strategy("ps-async", args.epochs) if r["role"] == "ps")
    return {
        "compute_s": {
            "allreduce": allreduce["hosts"][0]["cpu_ms_per_step"] * 1e-3,
            "ps": ps["hosts"][1]["cpu_ms_per_step"] * 1e-3,
        },
        "ps_push_s": ps["hosts"][0]["cpu_ms_per_step"] * 1e-3,
        "ps_update_s": shard["update_cpu"] / shard["updates"],
    }


def simulated(settings: dict, machine: dict, cpu: float, link: str, message_cpu_s: float) -> dict:
    """The simulator's throughput and staleness for one setting on hosts at ``cpu`` of a core."""
    from paratrain.simulate.cluster import parse_straggler

    strategy = settings["strategy"]
    straggler = settings.get("straggler")
    # the simulator adds M to a ps worker's step (the reply) and to each push at the shard
    ps = strategy.startswith("ps-")
    compute = machine["compute_s"]["ps"] - message_cpu_s if ps else machine["compute_s"]["allreduce"]
    return simulated_on_quota_hosts(
        strategy,
        settings["workers"],
        cpu,
        max(compute, 0.0),
        link,
        message_cpu_s,
        ps_message_s=max(machine["ps_push_s"] - message_cpu_s - machine["ps_update_s"], 0.0),
        ps_update_s=machine["ps_update_s"],
        straggler=parse_straggler("fixed:" + straggler if straggler else None),
        backup=settings.get("backup_workers", 0),
    )


def measure(
    args: argparse.Namespace, settings: list[dict], repeats: int, runs: list[list[dict]] | None = None
) -> list[dict]:
    """``repeats`` passes over ``settings``, after the ``runs`` already made of each."""
    runs = runs or [[] for _ in settings]
    done = min(len(found) for found in runs)
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(done, done + repeats):
            for index, one in enumerate(settings):
                run = real_run(one, args.cpu, args.link, args.epochs, Path(tmp))
                runs[index].append(run)
                hosts = " ".join(f"{h['core_fraction']:.2f}/{h['throttled']:.0%}" for h in run["hosts"])
                print(
                    f"pass {repeat + 1}: {_name(one):36} {run['examples_per_second'] or 0:8.0f} examples/s, "
                    f"staleness {run['staleness_mean']:.2f}, accuracy {run['test_accuracy']:.3f}, "
                    f"hosts' cores/throttled {hosts}",
                    flush=True,
                )
    rows = []
    for one, found in zip(settings, runs, strict=True):
        rates = [r["examples_per_second"] for r in found if r["examples_per_second"] is not None]
        rows.append(
            {
                "settings": one,
                "examples_per_second": statistics.median(rates),
                "range": [min(rates), max(rates)],
                "staleness_mean": statistics.median(r["staleness_mean"] for r in found),
                "runs": found,
            }
        )
    return rows


def _pace(row: dict) -> str:
    """The pace-setting host's CPU over the passes, min-max: a shard's per push, else the
    slowest host's per step of its own."""
    s = row["settings"]
    if s["strategy"].startswith("ps-"):
        values = [run["hosts"][0]["cpu_ms_per_step"] for run in row["runs"] if run["hosts"]]
    else:
        values = [max(h["cpu_ms_per_step"] for h in run["hosts"]) * s["workers"] for run in row["runs"] if run["hosts"]]
    return f"{min(values):.2f}-{max(values):.2f}" if values else ""


def _name(settings: dict) -> str:
    straggler = settings.get("straggler", "none")
    return f"{settings['strategy']} x{settings['workers']} straggler {straggler}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="2,3,4")
    parser.add_argument("--cpu", type=float, default=0.3, help="CPU share of every host (the straggler's: half)")
    parser.add_argument("--link", default="1gbit")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--resimulate", action="store_true", help="simulate the recorded runs again; run nothing")
    parser.add_argument(
        "--more", action="store_true", help="add --repeats passes to the recorded ones (the same machine profile)"
    )
    parser.add_argument("--out", default=str(RESULTS / "cluster_validation"))
    args = parser.parse_args()
    if args.resimulate or args.more:
        more = args.repeats  # recorded() puts back the recorded passes' count
        document = recorded(args.out, args, ("cpu", "link", "epochs", "repeats"))
        rows, machine = document["rows"], document["machine"]
        if args.more:
            rows = measure(args, [r["settings"] for r in rows], more, [r["runs"] for r in rows])
            args.repeats = len(rows[0]["runs"])
    else:
        settings = [
            setting(strategy, int(workers), straggler)
            for straggler in (False, True)
            for workers in args.workers.split(",")
            for strategy in STRATEGIES
        ]
        machine = machine_profile(args)
        rows = measure(args, settings, args.repeats)
    reference = next(r for r in rows if r["settings"] == setting("allreduce", 2, False))
    message_cpu_s = calibrate(
        lambda m: simulated(reference["settings"], machine, args.cpu, args.link, m)["examples_per_second"],
        reference["examples_per_second"],
    )
    for row in rows:
        row.update(
            simulated=simulated(row["settings"], machine, args.cpu, args.link, message_cpu_s),
            calibration=row is reference,
        )
        row["error"] = row["simulated"]["examples_per_second"] / row["examples_per_second"] - 1
        if row["settings"]["strategy"] == "ps-async":
            row["staleness_error"] = row["simulated"]["staleness_mean"] / row["staleness_mean"] - 1
    predictions = [r for r in rows if not r["calibration"]]
    within = sum(abs(r["error"]) <= TARGET for r in predictions)
    median_error = statistics.median(abs(r["error"]) for r in predictions)
    c = machine["compute_s"]
    lines = [
        f"# The simulator against emulated hosts: {args.cpu:g} of a core per host, {args.link} links",
        "",
        f"mlp on digits, batch {BATCH} per worker, {args.epochs} epochs, one process per host (a parameter server's "
        f"shard on host 0), the straggler the last worker's host at {args.cpu / 2:g} of a core; real = median of "
        f"{args.repeats} passes (`sudo python benchmarks/cluster_validation.py`). The simulator models each host "
        f"under its CPU quota ({args.cpu:g} x {PERIOD_US // 1000} ms per {PERIOD_US // 1000} ms period, full speed until "
        f"spent; mean of {SEEDS} draws of the hosts' phases) and is given CPU-seconds measured by the hosts' own "
        f"accounting in two runs that are none of these (allreduce on 1 host, ps-async with 1 worker): "
        f"{c['allreduce'] * 1e3:.3f} ms per allreduce step, {c['ps'] * 1e3:.3f} ms per ps worker step, "
        f"{machine['ps_push_s'] * 1e3:.3f} ms per push at the shard (of it {machine['ps_update_s'] * 1e3:.3f} ms "
        f"per update, measured alone); the link's rate; M = {message_cpu_s * 1e3:.3f} ms of CPU per message received (a ring hop, a push, a reply), calibrated "
        f"on allreduce with 2 workers and no straggler (marked).",
        "",
        "The last column is the CPU of the host that sets the pace, from its accounting in each pass (min-max): "
        "under a parameter server the shard's per push (its quota ran out in most periods in most runs), under "
        "allreduce the slowest host's per step of its own.",
        "",
        "| strategy | workers | straggler | real examples/s (min-max) | simulated | error | real staleness | simulated "
        "| pace-setting CPU, ms |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        s, sim = r["settings"], r["simulated"]
        error = "calibration" if r["calibration"] else f"{r['error']:+.0%}"
        staleness = f"{r['staleness_mean']:.2f} | {sim['staleness_mean']:.2f}" if s["strategy"] == "ps-async" else " | "
        workers = s["workers"] + s.get("backup_workers", 0)
        lines.append(
            f"| {s['strategy']} | {workers} | {s.get('straggler', 'none')} | {r['examples_per_second']:,.0f} "
            f"({r['range'][0]:,.0f}-{r['range'][1]:,.0f}) | {sim['examples_per_second']:,.0f} | {error} | {staleness} "
            f"| {_pace(r)} |"
        )
    lines += [
        "",
        f"Throughput within {TARGET:.0%}: {within} of {len(predictions)} predictions (median absolute error "
        f"{median_error:.0%}).",
    ]
    setup = {k: v for k, v in vars(args).items() if k not in ("out", "resimulate")}
    document = {"setup": setup, "machine": machine, "cpu_seconds_per_message": message_cpu_s, "rows": rows}
    document["within_target"], document["predictions"] = within, len(predictions)
    record(Path(args.out), document, lines)


if __name__ == "__main__":
    main()
