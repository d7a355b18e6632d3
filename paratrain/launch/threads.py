"""How many CPU threads each process of a run computes with, and whether a conv net runs in
channels-last memory order: the defaults ``paratrain train`` picks from the machine.

A process's compute threads share the cores with the other processes of the run on the
same machine: by default each takes the cores it may use (its CPU affinity, and its cgroup's
CPU quota where one is set) divided by the processes on this machine (``LOCAL_WORLD_SIZE``,
which torchrun and ``paratrain train --workers N`` set; a TF_CONFIG's tasks on this host; an
srun step's tasks on this node), at least one. Two workers on a
16-core host compute with 8 threads each instead of one. ``--threads-per-worker`` or
``$PARATRAIN_THREADS_PER_WORKER`` choose otherwise (``OMP_NUM_THREADS``, which torchrun sets
to 1 for every multi-process run, is not read). A run also shares the cores with the other
runs on the machine: ``share_cores`` lists the process where every paratrain process looks
(host_share.py), and a process on the default follows its share as runs start and end.
"""

from __future__ import annotations

import atexit
import math
import os
from pathlib import Path

import torch

from paratrain.comm.transport import cluster_from_env
from paratrain.launch.host_share import HostShare


def usable_cores() -> int:
    """Cores this process may run on: its affinity, capped by a cgroup CPU quota (v2
    ``cpu.max`` or v1 ``cpu.cfs_quota_us``) rounded up."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = _cgroup_quota()
    return max(1, min(cores, math.ceil(quota))) if quota else cores


def _cgroup_quota() -> float | None:
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        try:
            if controllers == "":  # cgroup v2
                quota, period = (Path("/sys/fs/cgroup") / path.lstrip("/") / "cpu.max").read_text().split()
                if quota != "max":
                    return int(quota) / int(period)
            elif "cpu" in controllers.split(","):  # cgroup v1
                folder = Path("/sys/fs/cgroup/cpu") / path.lstrip("/")
                quota = int((folder / "cpu.cfs_quota_us").read_text())
                if quota > 0:
                    return quota / int((folder / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
    return None


def local_processes(environ: dict[str, str] | None = None) -> int:
    """The processes of this run on this machine, as the cluster says: torchrun's
    ``LOCAL_WORLD_SIZE``, a TF_CONFIG's tasks on this host, an srun step's tasks on this node."""
    environ = os.environ if environ is None else environ
    cluster = cluster_from_env(environ)
    local = cluster.local_world_size if cluster is not None else int(environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, local)


def default_threads(environ: dict[str, str] | None = None) -> int:
    """The usable cores divided by the processes of the run on this machine, at least one."""
    return max(1, usable_cores() // local_processes(environ))


def chosen_threads(requested: int | None) -> int | None:
    """``requested``, else ``$PARATRAIN_THREADS_PER_WORKER`` (the emulated cluster sets it from
    each host's CPU share); None: the default."""
    from_env = os.environ.get("PARATRAIN_THREADS_PER_WORKER", "")
    return requested or (int(from_env) if from_env.isdigit() and int(from_env) > 0 else None)


def set_threads(requested: int | None) -> int:
    """Set this process's compute threads: ``requested``, else ``$PARATRAIN_THREADS_PER_WORKER``,
    else the default; returns them."""
    threads = chosen_threads(requested) or default_threads()
    torch.set_num_threads(threads)
    return threads


def share_cores(requested: int | None) -> HostShare:
    """Set this process's compute threads as ``set_threads`` does and list it among the
    machine's paratrain processes; on the default it takes its share of the cores with the
    other runs' processes. The process's one share (a Trainer made again asks again: the
    same request keeps it, another replaces it), to follow between steps
    (``HostShare.apply``); ``leave_cores`` takes the process off the list (at exit too)."""
    global _share
    fixed = chosen_threads(requested)
    if _share is not None and _share.pid == os.getpid():  # a forked child starts a list of its own
        if fixed == (_share.threads if _share.fixed else None):
            return _share
        _share.leave()
    threads = set_threads(requested)
    _share = HostShare(threads, fixed is not None, usable_cores(), local_processes()).join()
    return _share


def leave_cores() -> None:
    """This process off the machine's list of paratrain processes (launch/host_share.py)."""
    global _share
    if _share is not None and _share.pid == os.getpid():
        _share.leave()
    _share = None


_share: HostShare | None = None
atexit.register(leave_cores)
