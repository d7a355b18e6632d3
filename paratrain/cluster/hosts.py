"""Emulated hosts on one Linux machine: a network namespace per host, joined by veth pairs to one bridge, each
host's link shaped by a token bucket (``tc tbf``), each host's processes in a CPU cgroup with a fixed share
of the cores (CFS quota over a short period, so a share is smooth at a training step's scale).

Host ``i`` of cluster ``c`` is ``198.18.c.(i+1)/24`` (the range reserved for benchmarking); every name carries
a per-cluster prefix, ``close()`` removes them all and ``leftovers()`` lists any that remain. Hosts are pinned
to cores of their own where they fit (``pin="auto"``; ``"always"``, ``"never"``); where hosts must share cores,
pinning queues a host's wake-ups behind its neighbour's, so they are left to the kernel (docs/cluster.md).
Without netem a link has a rate, not a propagation delay.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from paratrain.cluster.usage import PERIOD_US, Usage, read_usage
from paratrain.errors import ConfigError

CGROUP_CPU = Path("/sys/fs/cgroup/cpu")  # cgroup v1 CPU controller
CGROUP_CPUACCT = Path("/sys/fs/cgroup/cpuacct")  # v1 CPU accounting, where mounted apart from cpu
CGROUP_V2 = Path("/sys/fs/cgroup")
PIN_MODES = ("auto", "always", "never")


@dataclass
class HostSpec:
    cpu: float = 1.0
    """Cores' worth of CPU time this host may use (0.5: half of one core)."""
    link: str | None = None
    """Rate of the host's link in tc's units (``1gbit``, ``100mbit``); None: unshaped."""


@dataclass
class Host:
    index: int
    spec: HostSpec
    namespace: str
    veth: str
    address: str
    cgroup: Path
    accounting: Path | None = None
    """The host's cpuacct cgroup (v1, where it is a hierarchy of its own): its CPU time."""
    cores: list[int] | None = None
    """The machine's cores its processes run on (None: any)."""
    pids: list[int] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"host{self.index}"


def threads_per_process(host: Host, procs: int) -> str:
    """Each process computes with its share of the host's CPU quota (the quota's cgroup
    files are not visible inside the namespace, where /sys is mounted anew)."""
    return str(max(1, math.ceil(host.spec.cpu / procs)))


def check_support() -> None:
    """ConfigError (exit 2) naming what this machine lacks to emulate hosts."""
    if os.geteuid() != 0:
        raise ConfigError("paratrain cluster needs root: network namespaces, tc and cgroups are root's")
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("taskset", "util-linux")):
        if shutil.which(tool) is None:
            raise ConfigError(f"paratrain cluster needs the {tool!r} command ({package}); install {package}")
    if not (CGROUP_CPU / "cpu.cfs_quota_us").exists() and not (CGROUP_V2 / "cgroup.controllers").exists():
        raise ConfigError("paratrain cluster needs the cgroup CPU controller (v1 cpu or v2 cpu.max); none is mounted")
    if not Path("/var/run/netns").exists() and subprocess.run(["ip", "netns", "list"], capture_output=True).returncode:
        raise ConfigError("paratrain cluster needs network namespaces (ip netns); this kernel or container has none")


def _run(*command: str) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"{' '.join(command)}: {result.stderr.strip() or result.stdout.strip()}")


class EmulatedCluster:
    """``with EmulatedCluster([HostSpec(...), ...]) as cluster:`` hosts that exist inside
    the block and are gone after it, whatever happened in it."""

    def __init__(self, specs: list[HostSpec], cluster_id: int | None = None, pin: str = "auto", throttled: bool = True):
        if not 1 <= len(specs) <= 250:
            raise ConfigError(f"--hosts must be 1..250, got {len(specs)}")
        if pin not in PIN_MODES:
            raise ConfigError(f"--pin must be one of {', '.join(PIN_MODES)}; got {pin!r}")
        available = sorted(os.sched_getaffinity(0))
        fits = sum(_cores_wanted(spec) for spec in specs) <= len(available)
        pinned = pin == "always" or (pin == "auto" and fits)
        cores = host_cores(specs, available) if pinned else [None] * len(specs)
        if cluster_id is None:
            check_support()  # finding a free id asks ip: a machine without it hears what it lacks
        self.id = cluster_id if cluster_id is not None else free_cluster_id()
        self.throttled = throttled
        """Whether the hosts run at their CPU shares (False: at the machine's speed until ``throttle()``)."""
        self.prefix = f"pt{self.id}"
        self.bridge = f"{self.prefix}br"
        self.hosts = [
            Host(
                index=i,
                spec=spec,
                namespace=f"{self.prefix}h{i}",
                veth=f"{self.prefix}v{i}",
                address=f"198.18.{self.id}.{i + 1}",
                cgroup=CGROUP_CPU / f"paratrain-{self.id}-h{i}",
                accounting=_accounting(f"paratrain-{self.id}-h{i}"),
                cores=cores[i],
            )
            for i, spec in enumerate(specs)
        ]

    @property
    def words(self) -> str:
        """Which namespaces, links and cgroups are this cluster's, in words."""
        return f"cluster {self.id}: hosts {self.prefix}h0-{len(self.hosts) - 1} on 198.18.{self.id}.0/24"

    @property
    def head_address(self) -> str:
        """The runner's address on the hosts' bridge: what it hosts for them listens there."""
        return f"198.18.{self.id}.254"

    def __enter__(self) -> EmulatedCluster:
        check_support()
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----- making the hosts -------------------------------------------------------------------
    def _create(self) -> None:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "link", "set", self.bridge, "up")
        # The runner's own address on the hosts' network (a fault-tolerant run's head node).
        _run("ip", "addr", "add", f"{self.head_address}/24", "dev", self.bridge)
        for host in self.hosts:
            _run("ip", "netns", "add", host.namespace)
            _run("ip", "link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", host.namespace)
            _run("ip", "link", "set", host.veth, "master", self.bridge)
            _run("ip", "link", "set", host.veth, "up")
            _run("ip", "-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _run("ip", "-n", host.namespace, "link", "set", "eth0", "up")
            _run("ip", "-n", host.namespace, "link", "set", "lo", "up")
            if host.spec.link:
                # Both directions: the host's sends (its eth0) and what reaches it (the bridge port).
                for where in (["ip", "netns", "exec", host.namespace], []):
                    device = "eth0" if where else host.veth
                    _run(
                        *where,
                        "tc",
                        "qdisc",
                        "add",
                        "dev",
                        device,
                        "root",
                        "tbf",
                        "rate",
                        host.spec.link,
                        "burst",
                        "64kb",
                        "latency",
                        "100ms",
                    )
            host.cgroup.mkdir(exist_ok=True)
            (host.cgroup / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (host.cgroup / "cpu.cfs_quota_us").write_text(str(_quota_us(host.spec) if self.throttled else -1))
            if host.accounting is not None:
                host.accounting.mkdir(exist_ok=True)

    def throttle(self) -> None:
        """Every host at its CPU share from now on."""
        for host in self.hosts:
            (host.cgroup / "cpu.cfs_quota_us").write_text(str(_quota_us(host.spec)))
        self.throttled = True

    def command(self, host: Host, argv: list[str], hostname: str | None = None) -> list[str]:
        """``argv`` run on ``host``: in its namespace and its CPU cgroup. With a ``hostname``
        (a SLURM node's slurmd), that is its hostname, and it keeps the machine's cgroup
        mount, which a slurmd needs for its jobs."""
        # The cgroup first: `ip netns exec` mounts a sysfs of its own, without the cgroup tree.
        groups = [host.cgroup] + ([host.accounting] if host.accounting is not None else [])
        join = " && ".join(f"echo $$ > {group / 'cgroup.procs'}" for group in groups)
        pin = f"taskset -c {','.join(map(str, host.cores))} " if host.cores is not None else ""
        if hostname is not None:
            named = f"""unshare --uts sh -c 'hostname "$0" && exec "$@"' {hostname}"""
            enter = f'{join} && exec {pin}nsenter --net=/var/run/netns/{host.namespace} {named} "$@"'
        else:
            enter = f'{join} && exec {pin}ip netns exec {host.namespace} "$@"'
        return ["sh", "-c", enter, "paratrain-host", *argv]

    # ----- faults -------------------------------------------------------------------------------
    def kill(self, host: Host) -> None:
        """Every process of ``host``, at once (SIGKILL): a machine that dies."""
        for pid in self.processes(host):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def cut(self, host: Host) -> None:
        """``host``'s link goes down: its processes run on, unreachable."""
        _run("ip", "link", "set", host.veth, "down")

    def usage(self, host: Host) -> Usage:
        """``host``'s CPU counters since it was made (usage.py)."""
        return read_usage(host.cgroup, host.accounting)

    def processes(self, host: Host) -> list[int]:
        try:
            return [int(p) for p in (host.cgroup / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    # ----- removing them ------------------------------------------------------------------------
    def close(self) -> None:
        """Kill what runs on the hosts and remove every namespace, link, qdisc and cgroup."""
        for host in self.hosts:
            self.kill(host)
        deadline = time.monotonic() + 10
        for host in self.hosts:
            while self.processes(host) and time.monotonic() < deadline:
                time.sleep(0.05)
            for group in (host.cgroup, host.accounting):
                if group is not None and group.exists():
                    try:
                        group.rmdir()
                    except OSError:
                        pass
            subprocess.run(["ip", "link", "del", host.veth], capture_output=True)  # its qdisc goes with it
            subprocess.run(["ip", "netns", "del", host.namespace], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    def leftovers(self) -> list[str]:
        return leftovers(self.id)


def free_cluster_id() -> int:
    """A cluster number no emulated cluster on this machine uses (its names and its /24 are
    its own): this process's id modulo 250, or the next free one after it, so that runners
    started together (tests in parallel) rarely try the same one."""
    start = os.getpid() % 250
    taken = {_cluster_of(entry) for entry in leftovers()}
    return next((start + k) % 250 for k in range(250) if (start + k) % 250 not in taken)


def leftovers(cluster_id: int | None = None) -> list[str]:
    """Namespaces, links and cgroups of emulated clusters still on this machine (of cluster
    ``cluster_id`` alone where given: its names all start ``pt<cluster_id>``)."""
    prefix = "pt" if cluster_id is None else f"pt{cluster_id}"
    found = []
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    found += [f"netns {n}" for n in namespaces if _ours(n, prefix)]
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout.splitlines()
    for line in links:
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if _ours(name, prefix):
            found.append(f"link {name}")
    group = f"paratrain-{cluster_id}-" if cluster_id is not None else "paratrain-"
    for hierarchy in (CGROUP_CPU, CGROUP_CPUACCT):
        if hierarchy.exists():
            found += [f"cgroup {p}" for p in hierarchy.glob(f"{group}*")]
    return found


def remove_leftovers(cluster_id: int | None = None) -> list[str]:
    """Remove what emulated clusters (or cluster ``cluster_id`` alone) left on this machine
    (a runner killed with SIGKILL cannot clean up after itself): their processes, cgroups,
    links and namespaces."""
    found = leftovers(cluster_id)
    for entry in found:
        kind, name = entry.split(" ", 1)
        if kind == "cgroup":
            for pid in (Path(name) / "cgroup.procs").read_text().split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
    deadline = time.monotonic() + 10
    for entry in found:
        kind, name = entry.split(" ", 1)
        if kind == "cgroup":
            while (Path(name) / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
                time.sleep(0.05)
            Path(name).rmdir()
        elif kind == "link":
            subprocess.run(["ip", "link", "del", name], capture_output=True)
        else:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return found


def host_cores(specs: list[HostSpec], available: list[int]) -> list[list[int]]:
    """Each host's cores: host after host, ceil(its share) of ``available`` (at least one, at
    most all) in turn, round ``available`` again when they run out."""
    out, start = [], 0
    for spec in specs:
        count = min(len(available), _cores_wanted(spec))
        out.append([available[(start + j) % len(available)] for j in range(count)])
        start += count
    return out


def _quota_us(spec: HostSpec) -> int:
    """A host's CPU time in each CFS period: its share of one core's (1 ms at least)."""
    return max(1000, int(spec.cpu * PERIOD_US))


def _cores_wanted(spec: HostSpec) -> int:
    """Cores a host of ``spec`` is pinned to where the machine has them: ceil(its share)."""
    return max(1, math.ceil(spec.cpu))


def _accounting(name: str) -> Path | None:
    """A host's cpuacct cgroup where v1 mounts CPU accounting apart from the cpu controller
    (there, cpu.stat has no usage); None where cpu.stat counts it (v2, or cpu,cpuacct joined)."""
    separate = CGROUP_CPUACCT.exists() and not CGROUP_CPUACCT.samefile(CGROUP_CPU)
    return CGROUP_CPUACCT / name if separate and (CGROUP_CPUACCT / "cpuacct.usage").exists() else None


def _ours(name: str, prefix: str) -> bool:
    """``name`` is an emulated cluster's (``prefix`` "pt": any cluster's; "pt<c>": cluster
    c's, whose names go on with a letter, so that pt1 is not pt12)."""
    rest = name.removeprefix(prefix)
    return name.startswith(prefix) and (rest[:1].isdigit() if prefix == "pt" else rest[:1].isalpha())


def _cluster_of(entry: str) -> int:
    """The cluster number in a ``leftovers()`` entry (``netns pt12h0``, ``cgroup .../paratrain-12-h0``)."""
    return int(re.search(r"(?:/paratrain-|\bpt)(\d+)", entry).group(1))
