"""A replica's membership in a fault-tolerant run, on torchft: its Manager (heartbeats to
the Lighthouse, a quorum before every step, the heal that hands a replica that is behind
a live peer's state) and leaving it. The strategy owns one and asks it for each step's
quorum; the step loop itself (who computes what, commit or redo) stays the strategy's."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from paratrain.comm.transport import load_compiler
from paratrain.errors import ConfigError, WorkerLost
from paratrain.strategies.fault_tolerant.peers import PeerWatch
from paratrain.strategies.fault_tolerant.quorum_group import quorum_group, rendezvous_timeout, sum_in_quorum
from paratrain.strategies.fault_tolerant.record import RunRecord
from paratrain.strategies.fault_tolerant.replicas import torchft_modules
from paratrain.timeline import span

#: Where a replica's processes meet: a store's host and port, this process's rank among
#: them, and how many they are.
ReplicaGroup = tuple[str, int, int, int]

#: Heartbeats a replica's Manager sends within ``--replica-heartbeat-timeout``: the Lighthouse
#: drops a replica only after this many in a row went missing (docs/fault_tolerance.md).
HEARTBEATS_PER_TIMEOUT = 5


class Membership:
    def __init__(
        self,
        strategy: str,
        min_replicas: int,
        timeout: float,
        lighthouse: str | None,
        record: RunRecord,
        heartbeat_timeout: float = 1.0,
        shared_memory: bool = True,
    ):
        self.strategy = strategy
        self.min_replicas = min_replicas
        self.timeout = timeout
        self.heartbeat_timeout = heartbeat_timeout
        """How long the Lighthouse waits for a silent replica: a quorum group's rendezvous waits
        little more (quorum_group.py)."""
        self.lighthouse = lighthouse
        self.shared_memory = shared_memory
        """Whether a quorum of this machine's processes may sum through /dev/shm (on the CPU)."""
        self.record = record
        """Where each heal is written down (the run's record, record.py)."""
        self.manager: Any = None
        """torchft's Manager once ``start`` made it; None before and after."""
        self.group: Any = None
        """The Manager's gradient group (quorum_group.py)."""
        self.peers: PeerWatch | None = None
        """Which members of the current quorum the Lighthouse no longer hears (peers.py)."""
        self.quorums = 0
        self.worker = 0  # this process's rank in the run, for messages and the record
        self.incarnation = 0

    def start(
        self,
        replica: int,
        worker: int,
        incarnation: int,
        num_replicas: int,
        group: ReplicaGroup,
        host: str,
        on_cpu: bool,
        state_dict: Callable[[], dict[str, Any]],
        load_state_dict: Callable[[dict[str, Any]], None],
    ) -> Any:
        """Make the Manager of replica ``replica`` (its processes meet in ``group``; ``host``
        is where peers reach this one; ``on_cpu``: its sums are of CPU tensors): it serves
        ``state_dict()`` to replicas that heal from this one and hands a heal's state to
        ``load_state_dict``."""
        torchft = torchft_modules()

        from paratrain.comm.live_state import LiveStateTransport  # deferred: imports torchft (optional extra)

        self.worker, self.incarnation = worker, incarnation
        lighthouse = self.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
        if not lighthouse:
            raise ConfigError(f"--strategy {self.strategy} under torchrun needs --lighthouse http://HOST:PORT")
        wait = timedelta(seconds=self.timeout)
        store_host, store_port, group_rank, group_size = group
        load_compiler()
        rendezvous = rendezvous_timeout(self.timeout, self.heartbeat_timeout)
        self.group = quorum_group(wait, rendezvous, shared_memory=self.shared_memory and on_cpu)
        self.manager = torchft.Manager(
            pg=self.group,
            load_state_dict=load_state_dict,
            state_dict=state_dict,
            min_replica_size=self.min_replicas,
            use_async_quorum=False,  # the quorum (and a heal) completes before the step's forward
            timeout=wait,
            quorum_timeout=wait,
            connect_timeout=wait,
            rank=group_rank,
            world_size=group_size,
            store_addr=store_host,
            store_port=store_port,
            lighthouse_addr=lighthouse,
            replica_id=f"replica_{replica}",
            hostname=host,
            checkpoint_transport=LiveStateTransport(wait, host),
            init_sync=False,  # every replica builds the same initial model from --seed
            max_retries=max(3, num_replicas * 2),  # then a replica that cannot commit leaves
            # Five heartbeats a timeout: a replica is dropped after five missed in a row.
            heartbeat_interval=timedelta(seconds=self.heartbeat_timeout / HEARTBEATS_PER_TIMEOUT),
        )
        self.peers = PeerWatch(lighthouse, self.heartbeat_timeout)
        self.peers.follow(self.manager)
        return self.manager

    def stop(self) -> None:
        """Leave the quorums: the heartbeats stop, and the Lighthouse drops this replica."""
        if self.manager is not None:
            with contextlib.suppress(Exception):
                self.manager.shutdown(wait=False)
            self.manager = None

    def sum(self, tensors: list[Any], step: int) -> None:
        """Sum ``tensors`` over the current quorum, in place; a lost member (one the
        Lighthouse no longer hears included) leaves the step uncommitted."""
        sum_in_quorum(self.manager, self.group, tensors, self.peers, step)

    def via(self) -> dict[str, int]:
        """How many of this replica's quorum groups summed through shared memory, and how
        many over Gloo."""
        return dict(self.group.via) if self.group is not None else {}

    def form_quorum(self) -> None:
        """The quorum of the next step: who takes part, and a heal if this replica is behind
        (written down in the record)."""
        started = time.perf_counter()
        step = self.manager.current_step()
        with span("quorum"):
            try:
                self.manager.start_quorum()
            except TimeoutError:
                raise WorkerLost(
                    f"worker {self.worker}: no quorum of --min-replicas {self.min_replicas} formed "
                    f"within --timeout {self.timeout:g} s (the Lighthouse or the other replicas are gone)"
                ) from None
        self.quorums += 1
        if self.manager.current_step() > step:  # healed: took a peer's state
            self.record.recoveries.append(
                {
                    "worker": self.worker,
                    "incarnation": self.incarnation,
                    "from_step": step,
                    "to_step": self.manager.current_step(),
                    "seconds": time.perf_counter() - started,
                }
            )
