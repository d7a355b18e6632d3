"""The runner's loop over a run on emulated hosts: its faults (``--fail``, ``--cut``) struck
when due, by the clock or by the run's progress, each host's CPU sampled, Ctrl-C and SIGTERM."""

from __future__ import annotations

import re
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paratrain.cluster.hosts import EmulatedCluster
from paratrain.cluster.usage import UsageRecorder
from paratrain.errors import ConfigError
from paratrain.train.faults import read_progress

_FAULT = re.compile(r"host(\d+)@(?:(\d+(?:\.\d+)?)s|step(\d+))")
FAULT_FORM = "hostI@Ts or hostI@stepN (e.g. host1@20s, host1@step40)"


@dataclass(frozen=True)
class Fault:
    """One fault: ``kind`` (fail, cut) strikes host ``host`` at ``seconds`` into the run,
    or once the run has finished step ``step``."""

    kind: str
    host: int
    seconds: float | None = None
    step: int | None = None

    def due(self, now: float, step: int) -> bool:
        return now >= self.seconds if self.seconds is not None else step >= self.step  # type: ignore[operator]


def faults(texts: list[str], kind: str, hosts: int) -> list[Fault]:
    out = []
    for text in texts:
        match = _FAULT.fullmatch(text)
        if match is None or int(match.group(1)) >= hosts:
            raise ConfigError(f"--{kind} {text}: expected {FAULT_FORM} with I < --hosts {hosts}")
        host, seconds, step = match.groups()
        if step is not None and int(step) < 1:
            raise ConfigError(f"--{kind} {text}: the step must be >= 1")
        out.append(Fault(kind, int(host), float(seconds) if seconds else None, int(step) if step else None))
    return out


class Watch:
    """The runner's loop over a run: its faults struck when due, the hosts' CPU sampled,
    Ctrl-C and SIGTERM."""

    def __init__(self, cluster: EmulatedCluster, events: list[Fault], progress: Path, stop: threading.Event):
        self.cluster = cluster
        self.events = events
        self.progress = progress
        self.stop = stop
        self.started = time.monotonic()
        self.killed: set[int] = set()
        self.usage = UsageRecorder(cluster).start()

    def now(self) -> float:
        return time.monotonic() - self.started

    def strike(self, processes: int) -> list[int]:
        """The faults due now (the run's ``processes`` record their steps), struck; the hosts killed."""
        now = self.now()
        step = max(read_progress(self.progress, processes)) if self.events else 0
        killed = []
        for fault in [fault for fault in self.events if fault.due(now, step)]:
            self.events.remove(fault)
            host = self.cluster.hosts[fault.host]
            when = f"step {step}, {now:.1f} s" if fault.step is not None else f"{now:.1f} s"
            print(f"paratrain cluster: {fault.kind} {host.name} at {when}", file=sys.stderr, flush=True)
            if fault.kind == "fail":
                self.killed.add(fault.host)
                killed.append(fault.host)
                self.cluster.kill(host)
            else:
                self.cluster.cut(host)
        return killed

    def __call__(self, processes: int, host_died: Any, tick: Any) -> int | None:
        """Strike faults (``host_died`` hears of each host killed) and ``tick()`` until it
        says the run is over (None), or the run is stopped (its exit code)."""
        try:
            while not self.stop.is_set():
                for index in self.strike(processes):
                    host_died(index)
                if tick():
                    return None
                time.sleep(0.05)
            return 143
        except KeyboardInterrupt:
            print("paratrain cluster: interrupted; removing the hosts", file=sys.stderr)
            return 130
        finally:
            self.usage.stop()

    def report(self, code: int, logs: Path) -> int:
        """The hosts' CPU use, written and summed up; ``code``."""
        self.usage.write(logs / "usage.json")
        for line in self.usage.summary():
            print(f"paratrain cluster: {line}", file=sys.stderr)
        return code
