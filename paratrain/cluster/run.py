"""``paratrain cluster run``: a real multi-host run on emulated hosts (``hosts.py``).

Each host runs torchrun with ``--nnodes H --node-rank i`` and the rendezvous on host 0, exactly as on a real
cluster; the command after ``--`` is ``paratrain ARGS`` or ``python SCRIPT ARGS``. Host ``i`` holds ranks
``i*P .. i*P+P-1``, so under a parameter server host 0 holds the shards. Every host's output streams here
prefixed with its host and to ``--logs``; each host's cgroup CPU use goes to ``usage.json`` (usage.py).
Faults: ``--fail host2@30s`` kills a host's processes, ``--cut host1@20s`` takes its link down, and
``@step40`` places a fault by progress (each process records its step in ``PARATRAIN_PROGRESS``) so it lands
mid-training however slow start-up is. ``--throttle-from training`` runs hosts at full speed until every
process has stepped. Everything is torn down on exit, error and Ctrl-C. Fault-tolerant runs go through
replicas.py. See docs/cluster.md.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from paratrain.cluster.hosts import (
    PIN_MODES,
    EmulatedCluster,
    Host,
    HostSpec,
    check_support,
    remove_leftovers,
    threads_per_process,
)
from paratrain.cluster.replicas import is_fault_tolerant, replicas_command, run_replicas
from paratrain.cluster.watch import Fault, Watch, faults
from paratrain.errors import ConfigError
from paratrain.train.faults import new_progress, read_progress

PORT = 29500
#: When a run's hosts begin to run at their CPU shares (``--throttle-from``).
THROTTLE_FROM = ("start", "training")
SETTLE_SECONDS = 5.0
FAILURE_GRACE_SECONDS = 10.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hosts", type=int, default=2, help="emulated hosts (default 2)")
    parser.add_argument("--procs-per-host", type=int, default=1, help="processes per host (default 1)")
    parser.add_argument("--cpu", type=float, default=1.0, help="cores' worth of CPU per host (default 1.0)")
    parser.add_argument(
        "--link", default=None, help="each host's link rate, tc units: 1gbit, 100mbit (default: unshaped)"
    )
    parser.add_argument(
        "--host",
        action="append",
        default=[],
        metavar="I:cpu=X[,link=R]",
        help="one host's own share or link, e.g. 3:cpu=0.2 (a straggler); repeatable",
    )
    parser.add_argument(
        "--fail",
        action="append",
        default=[],
        metavar="hostI@Ts|hostI@stepN",
        help="kill host I at T seconds, or once the run has finished step N",
    )
    parser.add_argument(
        "--cut",
        action="append",
        default=[],
        metavar="hostI@Ts|hostI@stepN",
        help="cut host I's link at T seconds, or once the run has finished step N",
    )
    parser.add_argument(
        "--spares",
        type=int,
        default=0,
        help="a fault-tolerant run's last N hosts stand by: a lost replica starts again on one (default 0)",
    )
    parser.add_argument(
        "--cold-spares",
        action="store_true",
        help="spare hosts run nothing until a replica is lost (default: each runs a warm spare with torch loaded)",
    )
    parser.add_argument(
        "--throttle-from",
        default="start",
        choices=THROTTLE_FROM,
        help="when the hosts' CPU shares begin: start (default: start-up runs at each host's share too) or "
        "training (once every process has finished a step: start-up at the machine's speed, then the shares)",
    )
    parser.add_argument("--logs", default=None, metavar="DIR", help="folder for each host's output")
    parser.add_argument(
        "--pin",
        default="auto",
        choices=PIN_MODES,
        help="each host's processes on ceil(its cpu) cores of its own: auto (where every host's fit), always, never",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- paratrain train ... (or -- python script.py ...)")


def host_specs(args: argparse.Namespace) -> list[HostSpec]:
    if args.hosts < 1:
        raise ConfigError(f"--hosts must be >= 1, got {args.hosts}")
    if not args.cpu > 0:
        raise ConfigError(f"--cpu must be > 0, got {args.cpu}")
    specs = [HostSpec(cpu=args.cpu, link=args.link) for _ in range(args.hosts)]
    for text in args.host:
        index, _, settings = text.partition(":")
        if not index.isdigit() or int(index) >= args.hosts or not settings:
            raise ConfigError(f"--host {text}: expected I:cpu=X[,link=R] with I < --hosts {args.hosts}")
        for setting in settings.split(","):
            key, _, value = setting.partition("=")
            if key == "cpu":
                try:
                    specs[int(index)].cpu = float(value)
                except ValueError:
                    raise ConfigError(f"--host {text}: cpu must be a number, got {value!r}") from None
            elif key == "link" and value:
                specs[int(index)].link = value
            else:
                raise ConfigError(f"--host {text}: unknown setting {key!r}; valid: cpu=X, link=RATE")
    return specs


def user_command(argv: list[str]) -> list[str]:
    """What torchrun runs on each host: ``-m paratrain ARGS`` or ``SCRIPT ARGS``."""
    argv = argv[1:] if argv[:1] == ["--"] else argv
    if not argv:
        raise ConfigError("paratrain cluster run needs a command after --: -- paratrain train ...")
    if Path(argv[0]).name == "paratrain":
        return ["-m", "paratrain", *argv[1:]]
    if Path(argv[0]).name.startswith("python") and len(argv) > 1:
        return argv[1:]
    raise ConfigError(
        f"paratrain cluster run: the command must be `paratrain ...` or `python SCRIPT ...`, got {argv[0]!r}"
    )


def torchrun(cluster: EmulatedCluster, host: Host, procs: int, command: list[str]) -> list[str]:
    master = cluster.hosts[0].address
    return cluster.command(
        host,
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            str(len(cluster.hosts)),
            "--nproc-per-node",
            str(procs),
            "--node-rank",
            str(host.index),
            "--master-addr",
            master,
            "--master-port",
            str(PORT),
            "--local-addr",
            host.address,
            *command,
        ],
    )


def _relay(process: subprocess.Popen, host: Host, logs: Path, name: str | None = None) -> None:
    """Each line of a host's output to its log (``name``.log: the host's, or one job's of
    it) and, prefixed with the host, to this terminal (torchrun's own chatter about sockets
    stays in the log)."""
    with open(logs / f"{name or host.name}.log", "w") as log:
        for line in process.stdout:  # type: ignore[union-attr]
            log.write(line)
            if "socket.cpp" not in line:
                print(f"[{host.name}] {line}", end="", flush=True)


def clean_command(args: argparse.Namespace) -> int:
    """``paratrain cluster clean``: remove what a runner killed with SIGKILL left behind."""
    check_support()
    removed = remove_leftovers()
    print(f"paratrain cluster clean: removed {len(removed)}" + "".join(f"\n  {entry}" for entry in removed))
    return 0


def cluster_command(args: argparse.Namespace) -> int:
    specs = host_specs(args)
    events = faults(args.fail, "fail", args.hosts) + faults(args.cut, "cut", args.hosts)
    command = user_command(args.command)
    if args.procs_per_host < 1:
        raise ConfigError(f"--procs-per-host must be >= 1, got {args.procs_per_host}")
    fault_tolerant = is_fault_tolerant(command)
    if args.cold_spares and not args.spares:
        raise ConfigError("--cold-spares says how --spares hosts stand by; give --spares N too")
    if args.spares < 0 or (args.spares and not fault_tolerant):
        raise ConfigError(
            f"--spares {args.spares}: spare hosts stand by for a fault-tolerant run's lost replicas (paratrain train "
            "--strategy allreduce-ft, pipeline-ft, fsdp-ft, local-sgd-ft, diloco-ft or --fault-tolerant); give 0 or more"
        )
    if fault_tolerant and args.throttle_from != "start":
        raise ConfigError(
            f"--throttle-from {args.throttle_from}: a fault-tolerant run's replicas start and start again apart, each "
            "at its host's share; give --throttle-from start"
        )
    if fault_tolerant:
        command, replicas = replicas_command(command, args.hosts, args.spares, args.procs_per_host)
    logs = Path(args.logs or tempfile.mkdtemp(prefix="paratrain-cluster-"))
    logs.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        # Every process's last finished step, for faults placed by step (the hosts share this
        # machine's file system); the processes also mark there that they joined the group.
        with tempfile.TemporaryDirectory(prefix="paratrain-progress-") as scratch:
            progress = Path(scratch) / "progress"
            new_progress(progress, args.hosts * args.procs_per_host)
            with EmulatedCluster(specs, pin=args.pin, throttled=args.throttle_from == "start") as cluster:
                # Which namespaces, links and cgroups are this run's (`ip netns exec pt<c>h0 ...`).
                print(f"paratrain cluster: {cluster.words}", file=sys.stderr, flush=True)
                if fault_tolerant:
                    watch = Watch(cluster, events, progress, stop)
                    env = _host_env(progress)
                    return watch.report(
                        run_replicas(
                            cluster,
                            args.procs_per_host,
                            command,
                            replicas,
                            env,
                            watch,
                            _relay,
                            logs,
                            not args.cold_spares,
                        ),
                        logs,
                    )
                return _run(cluster, args.procs_per_host, command, events, logs, progress, stop)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _host_env(progress: Path) -> dict[str, str]:
    """What every host's processes run with: the hosts' interface, one thread unless told,
    the runner's progress beacon."""
    return {
        **os.environ,
        "GLOO_SOCKET_IFNAME": "eth0",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "PARATRAIN_PROGRESS": str(progress),
    }


def _run(
    cluster: EmulatedCluster,
    procs: int,
    command: list[str],
    events: list[Fault],
    logs: Path,
    progress: Path,
    stop: threading.Event,
) -> int:
    num_processes = len(cluster.hosts) * procs
    env = _host_env(progress)
    running: list[subprocess.Popen] = []
    readers = []
    for host in cluster.hosts:
        process = subprocess.Popen(
            torchrun(cluster, host, procs, command),
            env={**env, "PARATRAIN_THREADS_PER_WORKER": threads_per_process(host, procs)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
        running.append(process)
        readers.append(threading.Thread(target=_relay, args=(process, host, logs), daemon=True))
        readers[-1].start()
    watch = Watch(cluster, events, progress, stop)
    idle_since: float | None = None
    failed_at: float | None = None
    started_hosts: set[int] = set()

    def over() -> bool:
        """Whether the run is over: every host done, one failed and the others had time to
        follow, or torchrun's agents left waiting for each other at exit."""
        nonlocal idle_since, failed_at
        now = watch.now()
        if all(p.poll() is not None for p in running):
            return True
        failed_now = [i for i, p in enumerate(running) if i not in watch.killed and p.poll() not in (None, 0)]
        if failed_now and failed_at is None:
            failed_at = now
        if failed_at is not None and now - failed_at > FAILURE_GRACE_SECONDS:
            # A host failed: the others have had time to fail alike; one cut off from the
            # rendezvous store may block in TCP for minutes.
            return True
        # torchrun's agents wait for each other at exit (300 s, not configurable), a dead
        # host's agent forever: once every host has started its training processes and
        # none has one left, give the live agents a moment to pass their barrier, then
        # end them. An agent reaches that barrier only when its processes succeeded. A
        # host on a small CPU share takes many seconds to start torch: until each has,
        # no host is idle.
        training = [
            i
            for i, (h, p) in enumerate(zip(cluster.hosts, running))
            if p.poll() is None and set(cluster.processes(h)) - {p.pid}
        ]
        started_hosts.update(training)
        started_hosts.update(i for i, p in enumerate(running) if p.poll() is not None)
        if training or len(started_hosts | watch.killed) < len(running):
            idle_since = None
        elif idle_since is None:
            idle_since = now
        elif now - idle_since > SETTLE_SECONDS:
            return True
        return False

    def tick() -> bool:
        if not cluster.throttled and min(read_progress(progress, num_processes)) >= 1:
            cluster.throttle()
            watch.usage.shares_began()
            print(
                f"paratrain cluster: every process has finished a step at {watch.now():.1f} s: the hosts run at "
                "their CPU shares from now",
                file=sys.stderr,
                flush=True,
            )
        return over()

    try:
        stopped = watch(num_processes, lambda index: None, tick)
    finally:
        # host 0's agent holds the rendezvous store: the others go first, so none of them
        # reports the store's connection closing under it. A host's every process goes (a
        # training process cut off from the others may outlive its agent, and holds the
        # output its reader waits on).
        for host, process in reversed(list(zip(cluster.hosts, running))):
            if process.poll() is None:
                cluster.kill(host)
            process.wait()
        for reader in readers:
            reader.join(timeout=5)
    if stopped == 130:
        return stopped
    watch.report(0, logs)
    if stopped is not None:
        return stopped
    codes = {
        h.index: p.returncode
        for h, p in zip(cluster.hosts, running)
        if h.index not in watch.killed and p.returncode != -signal.SIGKILL
    }
    failed = [i for i, code in codes.items() if code]
    for index in failed:
        log = logs / f"{cluster.hosts[index].name}.log"
        print(f"paratrain cluster: host{index} exited with {codes[index]} (its output: {log})", file=sys.stderr)
    return (codes[failed[0]] if codes[failed[0]] > 0 else 1) if failed else 0
