"""How ft_recovery.py kills a run from outside while it trains: a random process of the run's
replicas, or every process of the emulated host of a random replica (``paratrain cluster run``),
every so many seconds, so many times (the choices seeded: the same in every run)."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path

from paratrain.testing import run_processes

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
