"""Process groups over torch.distributed, and where a process finds its peers.

A process learns its place in a run from, in order: torchrun's variables (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK``), a TensorFlow-style
``TF_CONFIG``, or SLURM's ``srun`` (one task per process: slurm.py)::

    {"cluster": {"ps": ["h0:2222"], "chief": ["h1:2222"], "worker": ["h2:2222", "h3:2222"]},
     "task": {"type": "worker", "index": 0}}

In a TF_CONFIG the ranks follow the job order ps, chief, worker (parameter-server
shards first, as in every paratrain run), and rank 0's address is the rendezvous point.
"""

from __future__ import annotations

import json
import os
import random
import socket
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from paratrain.comm.ports import PORT_RANGE_ENV, port_range
from paratrain.comm.slurm import slurm_place, under_srun
from paratrain.errors import ConfigError, WorkerLost

TF_JOB_ORDER = ("ps", "chief", "worker")


@dataclass(frozen=True)
class ClusterEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    num_ps: int = 0
    source: str = "torchrun"
    local_world_size: int = 1
    """Processes of the run on this machine."""


def cluster_from_env(environ: dict[str, str] | None = None) -> ClusterEnv | None:
    """This process's place in a multi-process run, or None when it runs alone."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        try:
            return ClusterEnv(
                rank=int(env["RANK"]),
                world_size=int(env["WORLD_SIZE"]),
                local_rank=int(env.get("LOCAL_RANK", "0")),
                master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
                master_port=int(env.get("MASTER_PORT", "29500")),
                num_ps=int(env.get("PARATRAIN_PS_SHARDS", "0")),
                local_world_size=int(env.get("LOCAL_WORLD_SIZE", "1")),
            )
        except ValueError as error:
            raise ConfigError(f"bad torchrun environment variable: {error}") from None
    if env.get("TF_CONFIG"):
        return parse_tf_config(env["TF_CONFIG"])
    if under_srun(env):
        return ClusterEnv(**slurm_place(env), num_ps=int(env.get("PARATRAIN_PS_SHARDS", "0")), source="slurm")
    return None


def parse_tf_config(text: str) -> ClusterEnv:
    """Translate a TF_CONFIG JSON document into this process's ClusterEnv."""
    try:
        doc = json.loads(text)
        cluster, task = doc["cluster"], doc["task"]
        kind, index = task["type"], int(task["index"])
    except (ValueError, KeyError, TypeError) as error:
        raise ConfigError(f"TF_CONFIG must be JSON with 'cluster' and 'task': {{'type', 'index'}} ({error})") from None
    unknown = set(cluster) - set(TF_JOB_ORDER)
    if unknown or kind not in TF_JOB_ORDER:
        raise ConfigError(f"TF_CONFIG: unknown job {sorted(unknown) or kind!r}; valid jobs: {', '.join(TF_JOB_ORDER)}")
    addresses = [(job, addr) for job in TF_JOB_ORDER for addr in cluster.get(job, [])]
    if len(cluster.get("chief", [])) > 1:
        raise ConfigError("TF_CONFIG: at most one chief task")
    if not 0 <= index < len(cluster.get(kind, [])):
        raise ConfigError(f"TF_CONFIG: task index {index} is not in job {kind!r} of the cluster")
    rank = sum(len(cluster.get(job, [])) for job in TF_JOB_ORDER[: TF_JOB_ORDER.index(kind)]) + index
    hosts = [_split_address(addr)[0] for _, addr in addresses]
    master_host, master_port = _split_address(addresses[0][1])
    return ClusterEnv(
        rank=rank,
        world_size=len(addresses),
        local_rank=hosts[:rank].count(hosts[rank]),
        master_addr=master_host,
        master_port=master_port,
        num_ps=len(cluster.get("ps", [])),
        source="TF_CONFIG",
        local_world_size=hosts.count(hosts[rank]),
    )


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = str(address).rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"TF_CONFIG: address {address!r} must be host:port")
    return host, int(port)


_REMEMBERED = 64
_picked: list[int] = []  # the ports this process handed out last, never handed out twice in a row


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago: from ``PARATRAIN_PORT_RANGE`` if
    set, else one the kernel picks. A range below the kernel's ephemeral ports is never
    taken meanwhile by the outgoing connections of another run on the machine."""
    span = port_range(os.environ)
    if span is None:
        with socket.socket() as sock:
            sock.bind((host, 0))
            return sock.getsockname()[1]
    low, high = span
    rng = random.Random()
    for _ in range(4 * (high - low + 1)):
        port = rng.randint(low, high)
        if port in _picked and high - low + 1 > 2 * _REMEMBERED:  # its server may not have bound it yet
            continue
        # Without SO_REUSEADDR the probe fails on a port whose earlier connections linger in
        # TIME_WAIT too, where a server's listen may fail (EADDRINUSE).
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        _picked.append(port)
        del _picked[:-_REMEMBERED]
        return port
    raise ConfigError(f"no free port on {host} in {PORT_RANGE_ENV}={low}-{high}")


def host_store(timeout: float = 60.0, host: str = "127.0.0.1") -> dist.TCPStore:
    """A store this process hosts, on a port its own bind picks (port 0: no other process can
    take the port between a pick and the bind)."""
    return dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout))


def host_rendezvous(timeout: float = 60.0) -> tuple[dist.TCPStore, dict[str, str]]:
    """A store for a local run's processes to meet in, hosted by their launcher, and the
    variables that send them there, as torchrun's agent does (``TORCHELASTIC_USE_AGENT_STORE``).

    The store binds port 0: the kernel picks the port as the store listens, so no other
    process can take it in between, as it could a port probed free here and bound later by
    rank 0 (EADDRINUSE, seen in a loaded test run). The caller keeps the store alive for as
    long as its processes run."""
    store = host_store(timeout)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    return store, env


def ensure_process_group(backend: str, timeout: float) -> ClusterEnv:
    """Join (or create) the default process group; returns this process's place in it.

    With no cluster in the environment the process forms a group of one on loopback,
    so a distributed strategy also runs, unchanged, in a plain single-process script.
    """
    cluster = cluster_from_env()
    if dist.is_initialized():
        return cluster or ClusterEnv(dist.get_rank(), dist.get_world_size(), 0, "127.0.0.1", 0)
    load_compiler()
    wait = timedelta(seconds=timeout)
    options: dict[str, Any]
    if cluster is None:  # a group of one, with a store of its own on a port it holds
        alone = host_store(timeout)
        cluster = ClusterEnv(0, 1, 0, "127.0.0.1", alone.port, source="local")
        options = {"store": alone}
    # Under torchrun, env:// reuses the elastic agent's store; elsewhere rank 0 hosts one.
    init = "env://" if cluster.source == "torchrun" else f"tcp://{_url_host(cluster.master_addr)}:{cluster.master_port}"
    if cluster.source == "torchrun" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # The agent's store (torchrun's, or paratrain's launcher's: launch.supervisor) outlives
        # a restart (--max-restarts): each attempt needs keys of its own, or Gloo would dial
        # the addresses of the dead attempt.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        agent = dist.TCPStore(cluster.master_addr, cluster.master_port, cluster.world_size, False, timeout=wait)
        options = {"store": dist.PrefixStore(f"paratrain/attempt-{attempt}/", agent)}
    elif cluster.source != "local":
        options = {"init_method": init}
    try:
        dist.init_process_group(backend, rank=cluster.rank, world_size=cluster.world_size, timeout=wait, **options)
    except (RuntimeError, ValueError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise WorkerLost(
            f"rank {cluster.rank} could not join the process group at {init} ({cluster.world_size} processes, "
            f"backend {backend}, --timeout {timeout:g} s): a process of the run did not come or died while "
            f"the group formed ({first})"
        ) from error
    mark_joined(cluster.rank)
    return cluster


def load_compiler() -> None:
    """Import torch._dynamo before this process makes any process group.

    Importing it while a group exists (the first optimizer a script builds does) leaves
    references to the group that ``destroy_process_group`` cannot drop (torch 2.13): the
    group and its Gloo threads then live until the interpreter ends, and a thread that
    frees a finished collective's tensor during shutdown aborts the process ("terminate
    called without an active exception"). Imported first, it holds none."""
    import torch._dynamo  # noqa: F401


def mark_joined(rank: int) -> None:
    """Under paratrain's local launcher: tell it this process is in the group (a process
    lost before that is fatal, since the others cannot form the group without it)."""
    progress = os.environ.get("PARATRAIN_PROGRESS")
    if progress:
        (Path(progress).parent / f"joined-{rank}").touch()


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def wire_device(device: torch.device | str, group: Any = None) -> torch.device:
    """Where a tensor handed to ``group``'s collectives must be: ``device`` under NCCL;
    host memory under Gloo (paratrain's own small messages, and what crosses pipeline
    stages, whose sends and receives Gloo takes from the CPU only)."""
    return torch.device(device) if dist.get_backend(group) == "nccl" else torch.device("cpu")


def default_backend(device: torch.device, environ: dict[str, str] | None = None) -> str:
    """NCCL between GPUs where each process on this machine has a GPU of its own; Gloo on
    the CPU, and where processes share a GPU (NCCL refuses two ranks on one device; Gloo
    all-reduces, broadcasts and all-gathers CUDA tensors through host memory)."""
    if device.type != "cuda":
        return "gloo"
    cluster = cluster_from_env(environ)  # torchrun's LOCAL_WORLD_SIZE, or TF_CONFIG's tasks on this host
    local_processes = cluster.local_world_size if cluster is not None else 1
    return "nccl" if local_processes <= torch.cuda.device_count() else "gloo"
