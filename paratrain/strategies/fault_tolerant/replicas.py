"""Who the replicas of a fault-tolerant run are, and what they share before any quorum:
the topology (each replica its own group, lost and replaced alone), torchft itself, a
process's replica slot, the first replicas' wait for each other, and which part of a
global batch a participant computes."""

from __future__ import annotations

import logging
import os
import zlib
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed import TCPStore
from torch.utils._pytree import tree_leaves

from paratrain.errors import ConfigError, WorkerLost
from paratrain.strategies.topology import Topology

if TYPE_CHECKING:
    from paratrain.comm.transport import ClusterEnv

#: ``host:port`` of a replica's group store that its launcher hosts (it outlives the replica);
#: unset, the replica hosts its own.
REPLICA_STORE_ENV = "PARATRAIN_REPLICA_STORE"

INSTALL_HINT = "pip install 'paratrain[ft]' (torchft: Linux x86_64, Python 3.10-3.13)"


@dataclass(frozen=True)
class ReplicaGroups(Topology):
    """``num_replicas`` replicas, one process each, each its own group: none is needed by
    the others, and a lost one is replaced alone (``launch/replacing.py``)."""

    replaces_lost = True
    whole_batches = True

    def checkpoint_parts(self) -> list[str]:
        """Every replica holds the same committed state: one of them writes it (checkpoint.py)."""
        return ["rank-0"]

    def checkpoint_part(self, rank: int) -> str | None:
        return "rank-0"

    def check_cluster(self, cluster: ClusterEnv, strategy: str) -> None:
        check_replica_job(cluster, strategy, 1, "of one process: --nnodes 1 --nproc-per-node 1")


def check_replica_job(cluster: ClusterEnv, strategy: str, processes: int, form: str) -> None:
    """Under torchrun, each fault-tolerant replica is its own job of ``processes`` processes
    (``form`` says how), so that a lost one is replaced alone."""
    if cluster.world_size != processes:
        raise ConfigError(
            f"--strategy {strategy} runs one torchrun job per replica, {form} (REPLICA_GROUP_ID set, "
            f"--lighthouse given), got a job of {cluster.world_size} processes"
        )


def torchft_modules() -> Any:
    """``torchft``, imported quietly (its Rust side logs every quorum at INFO); ConfigError
    when it is not installed."""
    os.environ.setdefault("RUST_LOG", "warn")
    os.environ.setdefault("TOKIO_WORKER_THREADS", "1")
    try:
        import torchft
    except ImportError:
        raise ConfigError(
            f"per-step fault tolerance (allreduce-ft, pipeline-ft) needs torchft: {INSTALL_HINT}"
        ) from None
    # One warning per reconfiguration on builds without NCCL's flight recorder.
    logging.getLogger("torchft.manager").setLevel(logging.ERROR)
    return torchft


def one_process_group(timeout: float, host: str) -> tuple[tuple[str, int, int, int], Any]:
    """Where a replica of one process meets its own Manager: the store its launcher hosts for
    it (it outlives the replica), else one it hosts itself; rank 0 of 1. The store this
    process hosts, if any, which it must keep alive."""
    hosted = os.environ.get(REPLICA_STORE_ENV)
    if hosted:
        store_host, _, port = hosted.rpartition(":")
        return (store_host, int(port), 0, 1), None
    from paratrain.comm.transport import host_store

    store = host_store(timeout, host)
    return (host, store.port, 0, 1), store


def replica_slot() -> int:
    """This process's replica: ``REPLICA_GROUP_ID`` (torchft's name, set by the launcher or by
    the user for each torchrun job)."""
    text = os.environ.get("REPLICA_GROUP_ID", "0")
    if not text.isdigit():
        raise ConfigError(f"REPLICA_GROUP_ID must be a replica index 0, 1, ..., got {text!r}")
    return int(text)


def place_of_process(workers: int | None, per_replica: int, world: int, rank: int, flag: str) -> tuple[int, int]:
    """A process of a replica of ``per_replica`` processes (their own process group: ``world``
    processes, ``rank`` its rank there; ``flag`` sets their number): the run's replicas (from
    ``workers`` processes; else, under torchrun, ``NUM_REPLICA_GROUPS``) and its rank in the run."""
    if world != per_replica:
        raise ConfigError(f"a replica has {world} processes, not {flag} {per_replica}")
    processes = workers if workers and workers > 1 else None
    replicas = processes // per_replica if processes else int(os.environ.get("NUM_REPLICA_GROUPS", "1"))
    return replicas, replica_slot() * per_replica + rank


def first_store(timeout: float) -> TCPStore | None:
    """The store a launcher hosts for the whole run (``PARATRAIN_FT_STORE``: it outlives
    every replica), None without one (replicas started by hand under torchrun)."""
    address = os.environ.get("PARATRAIN_FT_STORE")
    if not address:
        return None
    host, _, port = address.rpartition(":")
    return TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout))


def wait_for_all_first_replicas(store: TCPStore | None, incarnation: int, replicas: int) -> None:
    """A local launch's first replicas wait for each other's Managers before their first
    quorum, so that it holds them all (not whichever replica imported torch first, the
    others then taking its state); a replacement joins whatever quorum there is."""
    if store is None:
        return
    # A replacement counts for the replica it replaces, lost before it got here.
    if store.add("ready", 1) >= replicas:
        store.set("all-ready", "1")
    if incarnation > 0:
        return
    try:
        store.wait(["all-ready"])
    except RuntimeError:  # the store's timeout (DistStoreError)
        timeout = store.timeout.total_seconds()
        raise WorkerLost(f"the {replicas} replicas did not all start within --timeout {timeout:g} s") from None


#: Set in the first store when a replica first commits a step: from then on the run's state
#: lives in its replicas (and checkpoints) alone, and replacements that meet at step 0 with
#: no replica that has it would train the run again from its start.
STEPPED = "stepped"


def mark_stepped(store: TCPStore | None) -> bool:
    """Say in ``store`` that the run has committed a step; whether there was a store to say it in."""
    if store is None:
        return False
    store.set(STEPPED, "1")
    return True


def has_stepped(store: TCPStore | None) -> bool:
    """Whether a replica of the run has committed a step (False without a store)."""
    return store is not None and store.check([STEPPED])


def batch_mark(step: int, targets: Any) -> int:
    """A 16-bit fingerprint of ``step`` and its batch's targets: the participants of a step
    sum theirs, which must then be P times each one's."""
    mark = zlib.crc32(step.to_bytes(8, "little"))
    for leaf in tree_leaves(targets):
        if torch.is_tensor(leaf):
            mark = zlib.crc32(leaf.detach().cpu().contiguous().numpy().tobytes(), mark)
    return mark % 65536
