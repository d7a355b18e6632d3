"""The cluster simulator against real multi-process runs on this machine.

What it does (from the repository root):

    .venv/bin/python benchmarks/simulator_validation.py [--workers 2,3,4] [--epochs 6] [--repeats 3]

1. Profiles this machine before every pass over the settings (the simulation takes each
   number's median over those profiles), each number measured by a short run of the real code:
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

STRATEGIES = ("allreduce", "ps-sync", "ps-backup", "ps-async")
#: Also validated (``--strategies local-sgd,diloco,fsdp``): at the default --sync-every 8.
MORE_STRATEGIES = ("local-sgd", "diloco", "fsdp")
#: fsdp's units on the mlp: its two Linear layers (the root holds no parameters of its own).
FSDP_UNITS = 2
TARGET = 0.20  # relative error of throughput and of mean staleness


# ----- 1. profile -------------------------------------------------------------------------------
def _process_cpu() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def profiled_job(config) -> dict:
    """One process of a profiling run: ``job.run`` with the process's CPU time counted over
    training (``Trainer.fit`` less evaluation) or serving (a shard's fit), and per update."""
    from paratrain.strategies.ps.protocol.server import ShardServer
    from paratrain.train import job
    from paratrain.train.trainer import Trainer

    counts = {
        "cpu": 0.0,
        "eval_cpu": 0.0,
        "wall": 0.0,
        "eval_wall": 0.0,
        "steps": 0,
        "updates": 0,
        "update_cpu": 0.0,
        "pushes": 0,
    }
    fit, evaluate, apply, on_push = Trainer.fit, Trainer.evaluate, ShardServer._apply, ShardServer._on_push

    def timed_fit(self, *args, **kwargs):
        start, wall = _process_cpu(), time.perf_counter()
        try:
            return fit(self, *args, **kwargs)
        finally:
            counts["cpu"] += _process_cpu() - start
            counts["wall"] += time.perf_counter() - wall
            counts["steps"] = self.global_step

    def timed_evaluate(self, *args, **kwargs):
        start, wall = _process_cpu(), time.perf_counter()
        try:
            return evaluate(self, *args, **kwargs)
        finally:
            counts["eval_cpu"] += _process_cpu() - start
            counts["eval_wall"] += time.perf_counter() - wall

    def timed_apply(self, *args, **kwargs):
        start = time.thread_time()  # the receiver thread's own CPU
        try:
            return apply(self, *args, **kwargs)
        finally:
            counts["update_cpu"] += time.thread_time() - start
            counts["updates"] += 1

    def counted_push(self, *args, **kwargs):
        counts["pushes"] += 1
        return on_push(self, *args, **kwargs)

    Trainer.fit, Trainer.evaluate, ShardServer._apply, ShardServer._on_push = (
        timed_fit,
        timed_evaluate,
        timed_apply,
        counted_push,
    )
    metrics = job.run(config)
    return {**counts, "role": metrics.get("role", "worker")}


def profile_strategy(strategy: str, epochs: int, workers: int = 1) -> list[dict]:
    from paratrain.config import TrainConfig
    from paratrain.launch.local import launch

    config = TrainConfig(strategy=strategy, workers=workers, epochs=epochs, progress=False, log_every=0, device="cpu")
    return launch(profiled_job, config, topology=config.topology)


def _busy(seconds: float) -> None:
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        pass


def ping_pong(sizes: list[int], repeats: int, gap_s: float, reduce_bytes: int) -> dict | None:
    """Rank 0: mean seconds of Gloo transfers, with ``gap_s`` of CPU work before each message
    (a training step's compute: the receiver has been waiting that long, as in training):
    one way of a send/recv ping-pong per message size (bytes), and an all-reduce of
    ``reduce_bytes`` (a model's gradient)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, out = dist.get_rank(), {}
    for size in sizes:
        message = torch.zeros(max(size // 4, 1))
        times = []
        for i in range(repeats + 10):
            start = time.perf_counter()
            if rank == 0:
                _busy(gap_s)
                dist.send(message, 1)
                dist.recv(message, 1)
            else:
                dist.recv(message, 0)
                _busy(gap_s)
                dist.send(message, 0)
            if i >= 10:  # warm-up: connections, buffers
                times.append((time.perf_counter() - start - 2 * gap_s) / 2)
        out[size] = statistics.mean(times)
    scalar, times = torch.zeros(max(reduce_bytes // 4, 1)), []
    for i in range(repeats + 10):
        _busy(gap_s)
        start = time.perf_counter()
        dist.all_reduce(scalar)
        if i >= 10:
            times.append(time.perf_counter() - start)
    out["all_reduce"] = statistics.mean(times)
    dist.destroy_process_group()
    return out if rank == 0 else None


def _steps_per_second(seconds: float, barrier, queue) -> None:
    """In a fresh process: mlp steps per second over ``seconds``, all processes at once."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    from paratrain.data.datasets import load_digits
    from paratrain.models import build_model

    torch.set_num_threads(1)
    data = load_digits()
    inputs, targets = data.train.tensors[0][:32], data.train.tensors[1][:32]
    model = build_model("mlp", data.spec)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(inputs), targets).backward()
        optimizer.step()

    for _ in range(50):  # warm-up
        step()
    barrier.wait()  # every process imported and warm: start together
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        step()
        steps += 1
    queue.put(steps / (time.perf_counter() - start))


def host_speedup(max_processes: int, seconds: float = 2.0) -> list[float]:
    """Throughput of k processes running mlp steps at once, relative to one, k = 1..max:
    the host's cores as the simulator's ``host_speedup`` curve."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    rates = []
    for k in range(1, max_processes + 1):
        queue, barrier = context.Queue(), context.Barrier(k)
        processes = [context.Process(target=_steps_per_second, args=(seconds, barrier, queue)) for _ in range(k)]
        for process in processes:
            process.start()
        rates.append(sum(queue.get() for _ in range(k)))
        for process in processes:
            process.join()
    return [r / rates[0] for r in rates]


SMALL, LARGE = 4, 4 * 2**20  # bytes of the ping-pongs for latency and for bandwidth


GAP_S = 1e-3  # CPU work between messages: about a digits step


def measure_link(pings: int, model_bytes: int) -> dict:
    """Loopback latency (s), bandwidth (bytes/s) and ring all-reduce step (s) from one launch."""
    from paratrain.launch.local import launch

    one_way = launch(ping_pong, [SMALL, LARGE], pings, GAP_S, model_bytes, num_processes=2)[0]
    latency = one_way[SMALL]
    bandwidth = (LARGE - SMALL) / max(one_way[LARGE] - latency, 1e-9)
    return {
        "latency_s": latency,
        "bandwidth_bytes_per_s": bandwidth,
        # at n = 2 a ring all-reduce is bytes / B plus 2 (n - 1) = 2 steps
        "pingpong_ring_latency_s": max(one_way["all_reduce"] - model_bytes / bandwidth, 0.0) / 2,
    }


def profile(epochs: int, pings: int, model_bytes: int, max_processes: int, strategies: list[str]) -> dict:
    links = [measure_link(pings, model_bytes) for _ in range(3)]
    # local-sgd, diloco, fsdp: their own 1-worker step (fsdp's hooks and copies are compute here).
    own = {}
    for strategy in (s for s in strategies if s in MORE_STRATEGIES):
        run = next(r for r in profile_strategy(strategy, epochs) if r["role"] == "worker")
        own[strategy] = (run["cpu"] - run["eval_cpu"]) / run["steps"]
    speedup = host_speedup(max_processes)
    allreduce = next(r for r in profile_strategy("allreduce", epochs) if r["role"] == "worker")
    pair = profile_strategy("allreduce", epochs, workers=2)
    ps = profile_strategy("ps-async", epochs)
    shard = next(r for r in ps if r["role"] == "ps")
    worker = next(r for r in ps if r["role"] == "worker")
    update_s = shard["update_cpu"] / shard["updates"]
    compute = (allreduce["cpu"] - allreduce["eval_cpu"]) / allreduce["steps"]
    link = {key: statistics.median(x[key] for x in links) for key in links[0]}
    # The ring step as training meets it: a 2-worker allreduce run's mean step (evaluation
    # excluded), less its compute on two processes sharing the host, less the bytes' time,
    # over the ring's 2 (n - 1) = 2 steps. A ping-pong all-reduce misses what training adds
    # (DDP's bucket copies, a peer's late wake-up); it stays in ``links`` for comparison.
    step2 = statistics.mean((r["wall"] - r["eval_wall"]) / r["steps"] for r in pair)
    shared = compute * 2 / min(speedup[1], 2.0) if len(speedup) > 1 else compute
    ring = max(step2 - shared - model_bytes / link["bandwidth_bytes_per_s"], 0.0) / 2
    return {
        "cores": len(os.sched_getaffinity(0)),
        **link,
        "ring_latency_s": ring,
        "allreduce_step2_s": step2,
        "compute_s": {"allreduce": compute, "ps": (worker["cpu"] - worker["eval_cpu"]) / worker["steps"], **own},
        "ps_message_s": (shard["cpu"] - shard["updates"] * update_s) / shard["pushes"],
        "ps_update_s": update_s,
        "links": links,
        "host_speedup": speedup,
    }


def median_profile(profiles: list[dict]) -> dict:
    """Every measured number's median over the profiles (the host speedup curve point by point)."""

    def median(values: list) -> object:
        first = values[0]
        if isinstance(first, dict):
            return {key: median([v[key] for v in values]) for key in first}
        if isinstance(first, list) and first and not isinstance(first[0], dict):
            return [statistics.median(column) for column in zip(*values)]
        if isinstance(first, (int, float)):
            return statistics.median(values)
        return first

    return median(profiles)


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
            simulate_setting(setting_only, as_run_found(machine, {"background_cores": load}),
                             document["model_bytes"], document["batch_size"], steps)
            for load in loads
        ]  # fmt: skip
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
