"""Local multi-process launch with torchrun's environment (RANK, WORLD_SIZE,
MASTER_ADDR, ...), on loopback: ``launch(fn, *args, num_processes=N)``, or
``launch(fn, *args, strategy=...)`` to start the processes a strategy needs (shards,
workers, stages) and run ``fn`` inside its scope on each.

The processes are started and watched by ``launch/supervisor.py`` rather than by
PyTorch's elastic agent: the agent does not report a process killed by a signal
(``kill -9``, the OOM killer) among its failures, so it would blame the peer that
failed a moment later on the broken connection; and it stops every process on any
failure, where ps-async and ps-backup go on without a lost worker. Under torchrun
itself the agent is torchrun's, and paratrain joins its cluster.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from paratrain.errors import WorkerLost
from paratrain.launch.replacing import supervise_replacing
from paratrain.launch.supervisor import supervise
from paratrain.strategies.base import DEFAULT_TIMEOUT_S
from paratrain.train import job
from paratrain.train.metrics import write_json_atomic

if TYPE_CHECKING:
    from paratrain.config import TrainConfig
    from paratrain.strategies.base import Strategy
    from paratrain.strategies.topology import Topology


def launch(
    fn: Callable[..., Any],
    *args: Any,
    num_processes: int | None = None,
    max_restarts: int = 0,
    expendable: frozenset[int] = frozenset(),
    rank_names: list[str] | None = None,
    checkpoint_dir: str | None = None,
    topology: Topology | None = None,
    strategy: Strategy | None = None,
    min_replicas: int = 1,
    heartbeat_timeout: float = 1.0,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> list[Any]:
    """Run ``fn(*args)`` on ``num_processes`` local processes; their return values by rank.

    With ``strategy`` the processes are those it needs, each running ``fn`` inside ``strategy.scope()`` (a
    ``Trainer`` made there uses it; a parameter-server shard serves until the workers are done). ``fn`` must be
    importable (processes are spawned). When a process fails the others are stopped at once and WorkerFailed
    names the rank, its exit code or signal and its error; ranks in ``expendable`` may die without ending the
    run (their results are None). ``max_restarts`` restarts a failed run from the newest checkpoint in
    ``checkpoint_dir``; ``rank_names`` name ranks in messages; a ``topology`` gives the process count, names and
    expendable ranks at once. Topologies whose replicas are replaced alone run under ``launch/replacing.py``,
    where ``min_replicas`` must stay alive, a replica silent ``heartbeat_timeout`` seconds is dropped, and the
    run stops when no replica steps for ``timeout`` seconds.
    """
    if strategy is not None:
        topology = strategy.planned_topology()
        fn, args = _in_scope, (strategy, fn, *args)
        min_replicas = getattr(strategy, "min_replicas", min_replicas)
        heartbeat_timeout = getattr(strategy, "heartbeat_timeout", heartbeat_timeout)
        timeout = strategy.timeout
    if topology is not None:
        num_processes = topology.num_processes
        expendable, rank_names = topology.expendable_ranks, topology.rank_names()
    if num_processes is None:
        raise TypeError("launch() needs num_processes or a topology")
    # Traffic stays on loopback: Gloo binds to the interface named here, not to
    # whatever the host name resolves to.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    names = rank_names or [f"worker {rank}" for rank in range(num_processes)]
    if topology is not None and topology.replaces_lost:
        replicas = topology.num_replicas
        return supervise_replacing(
            fn, args, replicas, names, max_restarts, min_replicas, heartbeat_timeout, timeout, num_processes // replicas
        )
    return supervise(fn, args, num_processes, expendable, names, max_restarts, checkpoint_dir)


def _in_scope(strategy: Strategy, fn: Callable[..., Any], *args: Any) -> Any:
    """In each process of ``launch(fn, strategy=...)``: ``fn(*args)`` in the strategy's scope."""
    try:
        with strategy.scope():
            return fn(*args)
    finally:
        strategy.teardown()


def run_locally(config: TrainConfig) -> dict[str, Any]:
    """``paratrain train`` for ``config`` on this machine: its topology's processes (this one
    alone when it has one and no restarts), and the chief's metrics document."""
    topology = config.topology
    if topology.num_processes == 1 and not config.max_restarts:
        return job.run(config)
    results = launch(
        job.run,
        config,
        topology=topology,
        max_restarts=config.max_restarts,
        checkpoint_dir=config.checkpoint_dir,
        min_replicas=config.ft.min_replicas,
        heartbeat_timeout=config.ft.replica_heartbeat_timeout,
        timeout=config.timeout,
    )
    # The chief's document: rank 0's, or (allreduce-ft) the replica that led the last quorum.
    documents = [r for r in results if isinstance(r, dict) and "global_steps" in r]
    if documents:
        return documents[0]
    # A fault-tolerant run whose chief was lost after the last step: the replica that took
    # the most steps reports the run (every replica that took part saw the same steps).
    stand_ins = [r for r in results if isinstance(r, dict) and "document" in r]
    if stand_ins:
        document = max(stand_ins, key=lambda r: r["steps"])["document"]
        if config.metrics_out:
            write_json_atomic(config.metrics_out, document)
        return document
    if results[topology.chief_rank] is None:
        raise WorkerLost(f"the run ended, but {topology.rank_name(topology.chief_rank)}, which reports it, was lost")
    return results[topology.chief_rank]
