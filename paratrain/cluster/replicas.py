"""``paratrain cluster run`` of a fault-tolerant run, as on a cluster with spare machines.

Each replica of a fault-tolerant run is one torchrun job on a host of its own, with ``REPLICA_GROUP_ID`` set
(the multi-machine recipe of docs/fault_tolerance.md). The runner is the head node: the Lighthouse and the
stores listen on the hosts' bridge (``198.18.<c>.254``), outside every host's CPU share. The last
``--spares`` hosts stand by with a warm spare (session/warm_spare.py; ``--cold-spares``: nothing runs there).
When a replica's host dies or its job fails, the replica goes on on an idle spare and takes the live state
from a peer, so its start-up takes the spare's CPU, not the survivors'. A host that died does not come back;
once a replica has finished, a lost one is not replaced. A job exiting 2 or 3 ends the run with its code.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from paratrain.cluster.hosts import EmulatedCluster, Host, threads_per_process
from paratrain.errors import ConfigError
from paratrain.session.incarnation import INCARNATION_ENV
from paratrain.session.warm_spare import WARM_SPARE_ENV
from paratrain.strategies.fault_tolerant.config import FTConfig


def flag_value(argv: list[str], flag: str) -> str | None:
    """The value of ``flag`` in ``argv`` (``--flag V`` or ``--flag=V``), the last one given."""
    found = None
    for item, following in zip(argv, argv[1:] + [""]):
        if item == flag:
            found = following
        elif item.startswith(flag + "="):
            found = item.partition("=")[2]
    return found


def flag_number(argv: list[str], flag: str, default: float) -> float:
    """``flag``'s value in ``argv`` as a positive number (``default`` where it is absent); a
    ConfigError naming it otherwise."""
    text = flag_value(argv, flag)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigError(f"{flag} {text}: expected a number > 0")
    return value


def is_fault_tolerant(command: list[str]) -> bool:
    """Whether ``command`` (what torchrun runs: ``-m paratrain train ...``) is a
    fault-tolerant run, by the strategy its command line names."""
    if command[:3] != ["-m", "paratrain", "train"]:
        return False
    return "--fault-tolerant" in command or flag_value(command, "--strategy") in FTConfig.strategies


def replicas_command(command: list[str], hosts: int, spares: int, procs: int) -> tuple[list[str], int]:
    """A fault-tolerant run's command with its processes counted (``--workers``, as each
    replica's job needs it), and its replicas: ``hosts`` less ``spares``; a ConfigError where
    its command says otherwise."""
    replicas = hosts - spares
    if replicas < 1:
        raise ConfigError(f"--spares {spares} leaves no host for a replica: --hosts must be more than --spares")
    workers = flag_value(command, "--workers")
    if workers is not None and workers != str(replicas * procs):
        raise ConfigError(
            f"--workers {workers}: {hosts} hosts less {spares} spare run {replicas} replicas of --procs-per-host "
            f"{procs} process(es), {replicas * procs} in all; give --workers {replicas * procs} or leave it out"
        )
    if flag_value(command, "--lighthouse") is not None:
        raise ConfigError("--lighthouse: paratrain cluster run hosts the run's Lighthouse itself; leave it out")
    for flag in ("--replica-heartbeat-timeout", "--timeout", "--min-replicas"):  # what the head node takes
        flag_number(command, flag, 1.0)
    return (command if workers else [*command, "--workers", str(replicas * procs)]), replicas


class HeadNode:
    """What the runner hosts for the replicas, on the bridge's address: the Lighthouse, the
    store where the first replicas wait for each other, each one-process replica's group
    store (it outlives the replica, as under the local launcher: launch/replacing.py)."""

    def __init__(self, address: str, command: list[str], replicas: int, procs: int):
        from paratrain.comm.transport import host_store
        from paratrain.strategies.fault_tolerant.replicas import REPLICA_STORE_ENV, torchft_modules

        torchft_modules()
        from torchft.coordination import LighthouseServer

        self.address = address
        heartbeat = flag_number(command, "--replica-heartbeat-timeout", FTConfig.replica_heartbeat_timeout)
        timeout = flag_number(command, "--timeout", 60.0)
        self.lighthouse = LighthouseServer(
            bind=f"{address}:0",
            min_replicas=int(flag_number(command, "--min-replicas", 1)),
            join_timeout_ms=1000,
            quorum_tick_ms=20,
            heartbeat_timeout_ms=int(heartbeat * 1000),
        )
        port = self.lighthouse.address().rpartition(":")[2]
        self.first = host_store(timeout, address)
        self.groups = [host_store(timeout, address) for _ in range(replicas)] if procs == 1 else []
        self.env = {
            "NUM_REPLICA_GROUPS": str(replicas),
            "TORCHFT_LIGHTHOUSE": f"http://{address}:{port}",
            "PARATRAIN_FT_STORE": f"{address}:{self.first.port}",
        }
        self.store_env = REPLICA_STORE_ENV

    def replica_env(self, slot: int, host: Host, incarnation: int) -> dict[str, str]:
        """Replica ``slot``'s variables on ``host``; a replacement (``incarnation`` > 0) takes
        the live state from a peer, and with nobody left to take it from, fails."""
        group = {self.store_env: f"{self.address}:{self.groups[slot].port}"} if self.groups else {}
        return {
            **self.env,
            **group,
            "REPLICA_GROUP_ID": str(slot),
            "PARATRAIN_REPLICA_HOST": host.address,
            INCARNATION_ENV: str(incarnation),
        }

    def warm_spare_env(self, host: Host, key: str) -> dict[str, str]:
        """A warm spare's variables on ``host``: it waits for ``key`` in the head's store."""
        return {
            **self.env,
            "PARATRAIN_REPLICA_HOST": host.address,
            WARM_SPARE_ENV: f"{self.address}:{self.first.port}/{key}",
        }

    def assign(self, key: str, variables: dict[str, str]) -> None:
        """The warm spare waiting for ``key`` becomes the replica of ``variables``."""
        self.first.set(key, json.dumps(variables))

    def close(self) -> None:
        self.lighthouse.shutdown()


def replica_job(cluster: EmulatedCluster, host: Host, procs: int, command: list[str]) -> list[str]:
    """One replica's torchrun job on ``host``: its processes meet on the host itself, and a
    lost one is the runner's to replace, on a spare (``--max-restarts 0``)."""
    return cluster.command(
        host,
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(procs),
            "--max-restarts",
            "0",
            "--local-addr",
            host.address,
            *command,
        ],
    )


class Replicas:
    """The replicas' jobs, each on its host, and the idle spare hosts, each with a warm
    spare (session/warm_spare.py) once a replica is lost and replaced."""

    def __init__(self, cluster: EmulatedCluster, replicas: int, head: HeadNode, launch: Any, warm: bool = True):
        self.cluster = cluster
        self.head = head
        self.launch = launch
        self.warm = warm
        self.jobs: dict[int, tuple[Host, subprocess.Popen]] = {}  # slot -> its host and job
        self.warm_spares: dict[int, tuple[str, subprocess.Popen]] = {}  # host -> its warm spare's key and job
        self.idle = list(cluster.hosts[replicas:])
        self.dead: set[int] = set()  # hosts that died: never used again
        self.finished: set[int] = set()
        self.incarnations = [1] * replicas  # each slot's next
        self.spares_started = 0  # warm spares started
        for slot, host in enumerate(cluster.hosts[:replicas]):
            self.jobs[slot] = (host, launch(host, head.replica_env(slot, host, 0), f"replica{slot}"))
        self._start_warm_spares()

    def host_died(self, index: int) -> None:
        self.dead.add(index)

    def stop(self) -> None:
        """Every job and warm spare ends (a host's every process: SIGKILL)."""
        for host, job in [*self.jobs.values(), *((self.cluster.hosts[i], j) for i, (_, j) in self.warm_spares.items())]:
            self.cluster.kill(host)
            job.wait()

    def _start_warm_spares(self) -> None:
        """A warm spare on every idle live host without one (none once a replica has
        finished: nobody would be left to take the state from; none with cold spares)."""
        for host in self.idle if self.warm else []:
            if self.finished or host.index in self.warm_spares or host.index in self.dead:
                continue
            key = f"spare-{self.spares_started}"
            job = self.launch(host, self.head.warm_spare_env(host, key), f"spare{self.spares_started}")
            self.warm_spares[host.index] = (key, job)
            self.spares_started += 1

    def _replace(self, slot: int, host: Host, why: str) -> str:
        """Replica ``slot``, lost from ``host``, on an idle spare (one with a warm spare first);
        the line that says where."""
        live = [h for h in self.idle if h.index not in self.dead] if not self.finished else []
        spare = next((h for h in live if h.index in self.warm_spares), live[0] if live else None)
        if spare is None:
            return f"replica {slot} on {host.name} lost ({why}); no spare host takes it"
        self.idle.remove(spare)
        incarnation, self.incarnations[slot] = self.incarnations[slot], self.incarnations[slot] + 1
        variables = self.head.replica_env(slot, spare, incarnation)
        if spare.index in self.warm_spares:
            key, job = self.warm_spares.pop(spare.index)
            self.head.assign(key, variables)
            self.jobs[slot] = (spare, job)
            return f"replica {slot} on {host.name} lost ({why}); the warm spare on {spare.name} takes its place"
        self.jobs[slot] = (spare, self.launch(spare, variables, f"replica{slot}.{incarnation}"))
        return f"replica {slot} on {host.name} lost ({why}); its replacement starts on {spare.name}"

    def check(self, lost: list[str]) -> int | None:
        """Reap the jobs that ended and replace lost replicas; the run's exit code once it is
        over (None while it runs). ``lost`` gets a line for each replica lost."""
        for index, (_, job) in list(self.warm_spares.items()):
            if job.poll() is not None:  # killed, or failed: its host, if it lives, gets another
                del self.warm_spares[index]
        for slot, (host, job) in list(self.jobs.items()):
            code = job.poll()
            if code is None:
                continue
            del self.jobs[slot]
            if host.index not in self.dead:
                self.idle.append(host)  # a live machine: it stands by again
            if code == 0:
                self.finished.add(slot)
            elif code in (2, 3):
                return code
            else:
                lost.append(self._replace(slot, host, "killed" if code < 0 else f"exit {code}"))
        self._start_warm_spares()
        if self.jobs:
            return None
        return 0 if self.finished else 1


def run_replicas(
    cluster: EmulatedCluster,
    procs: int,
    command: list[str],
    replicas: int,
    env: dict[str, str],
    watch: Any,
    relay: Any,
    logs: Path,
    warm: bool = True,
) -> int:
    """The fault-tolerant run on ``cluster``; ``watch(processes, host_died, tick)`` is the
    runner's loop (faults, CPU use, Ctrl-C: run.Watch), ``relay`` streams a job's output;
    ``warm``: a warm spare on each idle spare host."""
    head = HeadNode(cluster.head_address, command, replicas, procs)
    readers: list[threading.Thread] = []

    def launch(host: Host, variables: dict[str, str], name: str) -> subprocess.Popen:
        job = subprocess.Popen(
            replica_job(cluster, host, procs, command),
            env={**env, **variables, "PARATRAIN_THREADS_PER_WORKER": threads_per_process(host, procs)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
        readers.append(threading.Thread(target=relay, args=(job, host, logs, f"{host.name}-{name}"), daemon=True))
        readers[-1].start()
        return job

    outcome: list[int | None] = [None]
    jobs: Replicas | None = None

    def tick() -> bool:
        lost: list[str] = []
        outcome[0] = jobs.check(lost)  # type: ignore[union-attr]
        for line in lost:
            print(f"paratrain cluster: {line}", file=sys.stderr, flush=True)
        return outcome[0] is not None

    try:
        jobs = Replicas(cluster, replicas, head, launch, warm)
        stopped = watch(replicas * procs, jobs.host_died, tick)
    finally:
        if jobs is not None:
            jobs.stop()
        for reader in readers:
            reader.join(timeout=5)
        head.close()
    if stopped is not None:
        return stopped
    return outcome[0] if outcome[0] is not None else 1
