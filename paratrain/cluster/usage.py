"""What each emulated host's CPU did during a run: CPU-seconds used, and how often its quota ran out (the
kernel's accounting of the host's cgroups, read every ``INTERVAL`` s).

A host whose quota runs out in most periods is CPU-bound; one that rarely does waits on others or its link.
Samples carry wall-clock times, so a benchmark can take any window (a ``--timeline``'s ``origin_unix_us`` too).
``paratrain cluster run`` writes ``usage.json`` to ``--logs`` and prints one line per host at the end::

    {"interval_s": 0.25, "period_s": 0.01,
     "hosts": [{"host": "host0", "cpu": 0.3,
                "samples": [[unix_s, cpu_s, periods, throttled_periods, throttled_s], ...]}]}
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from paratrain.periodic import Periodic

INTERVAL = 0.25  # seconds between samples
#: The CFS period each host's CPU quota is enforced over (hosts.py writes it, the counters
#: count its periods). 10 ms: a share is enforced within a fraction of a step.
PERIOD_US = 10_000


@dataclass(frozen=True)
class Usage:
    """A host's counters since it was made (monotonic: differences give a window's)."""

    cpu_s: float
    """CPU time of every process of the host, kernel time for them included."""
    periods: int
    """Quota periods in which the host had something to run."""
    throttled_periods: int
    """Of those, periods in which its quota ran out."""
    throttled_s: float
    """Time its processes were ready to run but held back by the quota."""


def read_usage(cpu_cgroup: Path, cpuacct_cgroup: Path | None) -> Usage:
    """A host's counters from its cgroups: v1 ``cpu.stat`` and ``cpuacct.usage``, or v2's
    ``cpu.stat`` alone (``usage_usec``), whichever the host has."""
    stat = dict(line.split() for line in (cpu_cgroup / "cpu.stat").read_text().splitlines() if line.strip())
    if "usage_usec" in stat:  # cgroup v2
        cpu_s, throttled_s = int(stat["usage_usec"]) / 1e6, int(stat.get("throttled_usec", 0)) / 1e6
    else:
        usage = (cpuacct_cgroup or cpu_cgroup) / "cpuacct.usage"  # apart, or cpu,cpuacct joined
        cpu_s = int(usage.read_text()) / 1e9 if usage.exists() else float("nan")
        throttled_s = int(stat.get("throttled_time", 0)) / 1e9
    return Usage(cpu_s, int(stat.get("nr_periods", 0)), int(stat.get("nr_throttled", 0)), throttled_s)


class UsageRecorder:
    """Samples every host's counters on a thread of its own from ``start()`` to ``stop()``."""

    def __init__(self, cluster, interval: float = INTERVAL):
        self.cluster, self.interval = cluster, interval
        self.samples: list[list[list[float]]] = [[] for _ in cluster.hosts]
        self.throttled_at: float | None = 0.0 if cluster.throttled else None
        """When the hosts began to run at their shares (wall clock; 0.0: from the start);
        None: not yet (``paratrain cluster run --throttle-from training``)."""
        self._sampler = Periodic(self._sample, interval, "cluster-usage", first=True, last=True)

    def start(self) -> UsageRecorder:
        self._sampler.start()
        return self

    def stop(self) -> None:
        """Stop, after one last sample (before the hosts' processes are ended)."""
        self._sampler.stop()

    def _sample(self) -> None:
        now = time.time()
        for host, samples in zip(self.cluster.hosts, self.samples):
            try:
                u = self.cluster.usage(host)
            except (OSError, ValueError):  # the host's cgroup is going: nothing more to read
                continue
            samples.append([now, u.cpu_s, u.periods, u.throttled_periods, u.throttled_s])

    def document(self) -> dict:
        return {
            "interval_s": self.interval,
            "period_s": PERIOD_US / 1e6,
            "throttled_at": self.throttled_at,
            "hosts": [
                {"host": host.name, "cpu": host.spec.cpu, "samples": samples}
                for host, samples in zip(self.cluster.hosts, self.samples)
            ],
        }

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.document()) + "\n")

    def shares_began(self) -> None:
        """The cluster's hosts run at their shares from now on (EmulatedCluster.throttle was called)."""
        self.throttled_at = time.time()
        self._sample()  # the counters as the shares begin: the summary counts from here

    def summary(self) -> list[str]:
        """One line per host: its CPU over the run (since the shares began) against its
        share, and its throttling."""
        if self.throttled_at is None:
            return ["the hosts ran at the machine's speed throughout: no share began"]
        lines = []
        for host, every in zip(self.cluster.hosts, self.samples):
            samples = sorted(sample for sample in every if sample[0] >= self.throttled_at)
            if len(samples) < 2:
                continue
            (t0, cpu0, periods0, throttled0, _), (t1, cpu1, periods1, throttled1, _) = samples[0], samples[-1]
            periods = periods1 - periods0
            throttled = f"{(throttled1 - throttled0) / periods:.0%}" if periods else "none"
            lines.append(
                f"{host.name}: {cpu1 - cpu0:.1f} CPU-s in {t1 - t0:.1f} s ({(cpu1 - cpu0) / (t1 - t0):.2f} of a core; "
                f"share {host.spec.cpu:g}), quota ran out in {throttled} of its periods"
            )
        return lines


def window(samples: list[list[float]], start: float, end: float) -> Usage:
    """A host's counters over [start, end] (wall-clock seconds), each counter interpolated
    linearly between the samples around each end."""

    def at(t: float) -> list[float]:
        before = max((s for s in samples if s[0] <= t), key=lambda s: s[0], default=samples[0])
        after = min((s for s in samples if s[0] >= t), key=lambda s: s[0], default=samples[-1])
        if after[0] == before[0]:
            return before[1:]
        f = (t - before[0]) / (after[0] - before[0])
        return [b + f * (a - b) for b, a in zip(before[1:], after[1:], strict=True)]

    first, last = at(start), at(end)
    cpu_s, periods, throttled_periods, throttled_s = (b - a for a, b in zip(first, last, strict=True))
    return Usage(cpu_s, round(periods), round(throttled_periods), throttled_s)
