"""``paratrain simulate --calibrate FILE --across-hosts --recommend --hosts N ...``: the
described cluster's hosts, emulated here (``paratrain cluster``), each computing a step of the
model at once, as they will in any strategy's run.

A step's CPU is measured once on a whole core (``compute_ms``). On a host under a CPU quota
the same work costs more: each time the quota runs out the process is put off the core, and
it comes back to cold caches; and where the hosts are emulated on one machine, they take
turns on its cores. Measured on the mlp with 4 emulated hosts at once (one thread each), a
step's CPU was 1.7 to 2 times a whole core's (benchmarks/results/quota_cpu.md). So the
calibration runs ``single`` on every host of the cluster at once, each at its own CPU share,
and keeps what a step takes there: its wall clock (``wall_ms``) and its CPU (``cpu_ms``).
``calibration.py`` turns each host's into a factor on the work it does: the quota-seconds a
step used (its wall clock times its share, a whole core's at most) over ``compute_ms``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from paratrain.errors import ConfigError

#: Steps each host's run takes, about (whole epochs, at least 2: the first is left out).
RUN_STEPS = 400


def described_specs(args: argparse.Namespace) -> list:
    """The hosts ``--hosts``, ``--cpu``, ``--link`` and ``--host`` describe (a host's own
    ``calibration=FILE`` left aside: it is no setting of the host)."""
    from paratrain.cluster.run import host_specs  # deferred: the emulated cluster's parser

    kept = []
    for text in args.host:
        index, _, settings = text.partition(":")
        rest = [s for s in settings.split(",") if s.partition("=")[0] != "calibration"]
        if rest:
            kept.append(f"{index}:{','.join(rest)}")
    return host_specs(argparse.Namespace(hosts=args.hosts, cpu=args.cpu, link=args.link, host=kept))


def measure(args: Any, splits: Any, training_flags: list[str]) -> dict[str, Any]:
    """Each described host's step, all of them computing at once: ``{"hosts": [{"cpu",
    "wall_ms", "cpu_ms"}, ...], "cluster": paratrain cluster's words for where}``."""
    from paratrain.cluster.hosts import EmulatedCluster  # deferred: root's namespaces and cgroups

    specs = described_specs(args)
    per_epoch = max(len(splits.train) // args.batch_size, 1)
    epochs = max(2, math.ceil(RUN_STEPS / per_epoch))
    with tempfile.TemporaryDirectory(prefix="paratrain-busy-") as folder, EmulatedCluster(specs) as cluster:
        outs = [Path(folder) / f"host{host.index}.json" for host in cluster.hosts]
        running = []
        for host, out in zip(cluster.hosts, outs):
            command = [sys.executable, "-m", "paratrain", "train", "--strategy", "single", *training_flags,
                       "--epochs", str(epochs), "--no-progress", "--log-every", "0", "--metrics-out", str(out)]  # fmt: skip
            threads = str(max(1, math.ceil(host.spec.cpu)))
            env = {**os.environ, "PARATRAIN_THREADS_PER_WORKER": threads, "OMP_NUM_THREADS": threads}
            running.append(subprocess.Popen(cluster.command(host, command), env=env, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.PIPE, text=True))  # fmt: skip
        errors = [process.communicate(timeout=3600)[1] for process in running]
        where = f"cluster {cluster.id}: hosts {cluster.prefix}h0-{len(specs) - 1} on 198.18.{cluster.id}.0/24"
        hosts = []
        for spec, process, error, out in zip(specs, running, errors, outs):
            if process.returncode != 0 or not out.exists():
                last = (error.strip().splitlines() or ["no output"])[-1]
                raise ConfigError(f"--calibrate: a host's run of paratrain train --strategy single failed: {last}")
            wall, cpu = step_seconds(json.loads(out.read_text()), args.batch_size)
            hosts.append({"cpu": spec.cpu, "wall_ms": wall * 1e3, "cpu_ms": cpu * 1e3})
    return {"hosts": hosts, "cluster": where}


def combined(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """``measure``'s findings of a calibration's rounds as one: each host's median wall clock
    and CPU a step, and each round's wall clocks (``rounds``: a prediction's range)."""
    hosts = [
        {"cpu": host["cpu"], "wall_ms": statistics.median(r["hosts"][i]["wall_ms"] for r in rounds),
         "cpu_ms": statistics.median(r["hosts"][i]["cpu_ms"] for r in rounds)}
        for i, host in enumerate(rounds[0]["hosts"])
    ]  # fmt: skip
    walls = [[host["wall_ms"] for host in r["hosts"]] for r in rounds]
    return {"hosts": hosts, "cluster": rounds[0]["cluster"], "rounds": walls}


def step_seconds(metrics: dict[str, Any], batch_size: int, workers: int = 1) -> tuple[float, float]:
    """Seconds a step of a run took, and CPU-seconds its first process spent a step (every
    thread), over its epochs past the first (their steps alone: ``train_seconds``)."""
    history = metrics["history"]
    first, last = history[0], history[-1]
    steps = (last["examples_seen"] - first["examples_seen"]) / (batch_size * workers)
    training = sum(epoch["train_seconds"] for epoch in history[1:])
    return training / steps, (last["cpu_seconds"] - first["cpu_seconds"]) / steps


def factors(busy: dict[str, Any], compute_ms: float, walls: list[float] | None = None) -> list[float]:
    """Each host's factor on the work it does: the quota-seconds a step took it (its wall
    clock, the median's or one round's ``walls``, times its share, one core's at most: a
    measuring run computes with one thread a core) over a step's CPU on a whole core."""
    walls = walls or [h["wall_ms"] for h in busy["hosts"]]
    return [wall * min(h["cpu"], 1.0) / compute_ms for wall, h in zip(walls, busy["hosts"])]


def matches(busy: dict[str, Any], args: argparse.Namespace) -> bool:
    """Whether the hosts ``busy`` measured are the ones this prediction describes (as many,
    each at the same share)."""
    specs = described_specs(args)
    shares = [h["cpu"] for h in busy["hosts"]]
    return len(shares) == len(specs) and all(math.isclose(a, s.cpu) for a, s in zip(shares, specs))


def check(busy: Any, named: str) -> None:
    """ConfigError (one line) unless ``busy`` is a calibration's measured hosts."""
    hosts = busy.get("hosts") if isinstance(busy, dict) else None
    if not isinstance(hosts, list) or not hosts or not all(_measured(host) for host in hosts):
        raise ConfigError(f"{named}: its busy_hosts must list hosts, each with numbers > 0 for cpu, wall_ms, cpu_ms")
    rounds = busy.get("rounds", [])
    if not isinstance(rounds, list) or not all(
        isinstance(r, list) and len(r) == len(hosts) and all(isinstance(w, (int, float)) and w > 0 for w in r)
        for r in rounds
    ):
        raise ConfigError(f"{named}: its busy_hosts' rounds must each list a wall clock > 0 a host")


def _measured(host: Any) -> bool:
    return isinstance(host, dict) and all(
        isinstance(host.get(name), (int, float)) and host[name] > 0 for name in ("cpu", "wall_ms", "cpu_ms")
    )
