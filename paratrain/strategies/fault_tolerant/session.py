"""The fault-tolerant session a replica trains in: torchft's Manager and each step's quorum
(membership.py), the run's record (record.py), a watchdog on every wait, leaving on
SIGTERM, the live state a joiner takes from a peer (torchft's state transfer: the model,
the optimizer, the loop's position and the session's record; no checkpoint is read), and
the step loop that does a step again
until the quorum commits it, or takes it from a peer that committed it without this
replica.

A strategy composes one session around its replica: ``allreduce-ft`` around one process,
``pipeline-ft`` around one pipeline (each of its stages holds a session, and the stages
commit together). What a replica computes for its part of the global batch stays the
strategy's own: ``step`` calls its ``gradient(step)``, which sums the part's weighted
gradient over the quorum with ``sum_over_quorum``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from paratrain.comm.flat import local_part
from paratrain.comm.transport import wire_device
from paratrain.data.batch import part_of
from paratrain.errors import ReplicaLeft, StateLost, WorkerLost
from paratrain.session.leaving import LeaveOnSigterm
from paratrain.session.watchdog import Watchdog
from paratrain.strategies.accounting import staleness_summary
from paratrain.strategies.fault_tolerant.membership import Membership, ReplicaGroup
from paratrain.strategies.fault_tolerant.options import WIRE_DTYPES, check_compression
from paratrain.strategies.fault_tolerant.record import RunRecord
from paratrain.strategies.fault_tolerant.reduce import sum_over_quorum
from paratrain.strategies.fault_tolerant.replicas import (
    first_store,
    has_stepped,
    mark_stepped,
    wait_for_all_first_replicas,
)
from paratrain.strategies.recipe import StepRecipe
from paratrain.strategies.roles import FitLoop
from paratrain.strategies.step import StepOutput
from paratrain.strategies.topology import Topology
from paratrain.timeline import span

#: What the watchdog allows a wait beyond its own deadline (``--timeout``) and the time the
#: Lighthouse takes to drop a silent replica (``--replica-heartbeat-timeout``).
WATCHDOG_SLACK_S = 5.0


class Replica(Protocol):
    """What the session uses of the strategy it is composed into (one process of the replica)."""

    name: str
    process_rank: int
    timeout: float
    device: torch.device
    recipe: StepRecipe
    topology: Topology
    steps_taken: int
    skipped_updates: int

    @property
    def rank(self) -> int: ...
    @property
    def num_replicas(self) -> int: ...
    def unwrap(self, model: nn.Module) -> nn.Module: ...
    def clip_gradients(self, model: nn.Module) -> None: ...
    def gradients_finite(self, optimizer: torch.optim.Optimizer) -> bool: ...
    def skip_nonfinite(self, model: nn.Module, loss: torch.Tensor, finite: Callable[[], bool]) -> bool: ...
    def count_update(self, updates: int = 1) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...


class QuorumSchedule(Protocol):
    """When a replica's quorums come, and what that makes of the live state it serves."""

    def live_position(self, trainer: FitLoop) -> dict[str, Any]:
        """The loop's position a joiner takes, served while this replica waits in a quorum."""
        ...

    def committed_quorums(self, trainer: FitLoop) -> int:
        """The quorums a loop resumed from a checkpoint has committed (its Manager's step)."""
        ...

    def take_live_state(self, state: dict[str, Any]) -> None:
        """The rest of a peer's strategy state (beyond the session's record), taken in a heal."""
        ...


class EveryStep:
    """A quorum before every training step (allreduce-ft, pipeline-ft): the step being started
    is a joiner's first, and the Manager's step is the loop's."""

    def live_position(self, trainer: FitLoop) -> dict[str, Any]:
        """The loop's position while it waits in the quorum of the step it started: that step
        is the joiner's first, so the position is one batch back."""
        position = trainer.state_dict()
        position["batch"] = max(trainer.batch - 1, 0)
        return position

    def committed_quorums(self, trainer: FitLoop) -> int:
        return trainer.global_step

    def take_live_state(self, state: dict[str, Any]) -> None:
        """Every step's state is the model's and the optimizer's."""


class FaultTolerantSession:
    def __init__(
        self,
        replica: Replica,
        leaves_on_sigterm: bool,
        lighthouse: str | None = None,
        min_replicas: int = 1,
        heartbeat_timeout: float = 1.0,
        compression: str = "none",
        shared_memory: bool = True,
    ):
        """``shared_memory``: a quorum whose members all run on this machine sums through
        /dev/shm on the CPU (quorum_group.py)."""
        check_compression(replica.name, compression)
        self.replica = replica
        self.compression = compression
        self.wire_dtype = WIRE_DTYPES[compression]
        self.lighthouse = lighthouse
        self.min_replicas = min_replicas
        self.heartbeat_timeout = heartbeat_timeout
        """Seconds of silence before a local launch's Lighthouse drops a replica."""
        self.leaves_on_sigterm = leaves_on_sigterm
        """Whether SIGTERM makes the replica leave after its step (one process can leave
        alone; a pipeline's stage cannot: its replica is lost or kept whole)."""
        timeout = replica.timeout
        self.record = RunRecord()
        """The run's committed steps and heals, as far as this replica knows (record.py)."""
        self.membership = Membership(
            replica.name, min_replicas, timeout, lighthouse, self.record, heartbeat_timeout, shared_memory
        )
        """This replica's torchft Manager and quorums (membership.py)."""
        self.watchdog = Watchdog(
            timeout + heartbeat_timeout + WATCHDOG_SLACK_S,
            f"--timeout {timeout:g} s, --replica-heartbeat-timeout {heartbeat_timeout:g} s and {WATCHDOG_SLACK_S:g} s",
        )
        """Ends the replica with a line when a quorum, an all-reduce or a commit outlives its deadline."""
        self.incarnation = 0
        self.first_store: Any = None
        """The store its launcher hosts for the run (replicas.first_store), if any."""
        self._stepped = False  # a committed step marked in the first store
        self.trainer: FitLoop | None = None
        self._sigterm = LeaveOnSigterm()  # asked: leave after the step
        self.quorum_ready = False
        """A quorum formed for a step not taken yet (begin's, or a heal's: its peers' next step)."""
        self.joined_state: dict[str, Any] | None = None
        """The loop's position that a peer's live state brought (``_load_live_state``), until the loop takes it."""
        self.last_loss = 0.0
        """The last committed step's loss (what a step taken from a peer reports)."""
        self.uncommitted_steps = 0
        self.behind_heals = 0
        self.step_bytes = 0
        """Bytes of this process's gradient on the all-reduce's wire, per step it takes part in."""
        self.schedule: QuorumSchedule = EveryStep()
        """When this replica's quorums come, and so what a joiner takes from it (``_live_state``)."""

    @property
    def manager(self) -> Any:
        """torchft's Manager of this replica (None before ``begin`` and after ``stop``)."""
        return self.membership.manager

    @manager.setter
    def manager(self, manager: Any) -> None:
        self.membership.manager = manager

    def first_in_quorum(self, otherwise: bool) -> bool:
        """Whether this replica is the current quorum's first (``otherwise`` before any quorum)."""
        if self.manager is None or self.manager.participating_rank() is None:
            return otherwise
        return self.manager.participating_rank() == 0

    def part(self, total: int) -> slice:
        """This participant's near-equal run of ``total`` pieces of the global batch."""
        return part_of(total, self.manager.participating_rank(), self.manager.num_participants())

    def describe(self) -> dict[str, Any]:
        return {"compression": self.compression, "fault_tolerance": "per-step", "min_replicas": self.min_replicas}

    def stop(self) -> None:
        self.watchdog.stop()
        self.membership.stop()
        self._sigterm.uninstall()

    # ----- joining -----------------------------------------------------------------------
    def begin(self, trainer: FitLoop, group: Callable[[str], ReplicaGroup]) -> None:
        """Join the run: the Manager starts (last, so that the Lighthouse never waits on a
        replica still building its model; its processes meet where ``group(host)`` says),
        then the first quorum; a replacement takes the live state from a peer there and the
        loop goes on from the peer's position."""
        replica = self.replica
        self.trainer = trainer
        if self.leaves_on_sigterm:
            self._sigterm.install()
        self.watchdog.worker = replica.process_rank
        if self.manager is None:
            host = os.environ.get("PARATRAIN_REPLICA_HOST", "127.0.0.1")
            self.membership.start(
                replica=replica.rank,
                worker=replica.process_rank,
                incarnation=self.incarnation,
                num_replicas=replica.num_replicas,
                group=group(host),
                host=host,
                on_cpu=replica.device.type == "cpu",
                state_dict=self._live_state,
                load_state_dict=self._load_live_state,
            )
            self.first_store = first_store(replica.timeout)
            wait_for_all_first_replicas(self.first_store, self.incarnation, replica.topology.num_processes)
        committed = self.schedule.committed_quorums(trainer)
        if committed:  # resumed from a checkpoint (checkpoint.py): the run's step is its
            self.manager.load_state_dict({"step": committed, "batches_committed": 0})
        with self.watchdog.phase("first quorum", self.manager.current_step() + 1):
            self.membership.form_quorum()
        self.quorum_ready = True
        if self.joined_state is not None:
            state, self.joined_state = self.joined_state, None
            trainer.load_state_dict(state)
            heal = self.record.recoveries[-1]
            print(
                f"paratrain: worker {replica.process_rank} joined the run at step {trainer.global_step} with a live "
                f"peer's state ({heal['seconds']:.2f} s from its first quorum)",
                file=sys.stderr,
                flush=True,
            )
        elif self.manager.errored() is not None:
            raise WorkerLost(
                f"worker {replica.process_rank} could not take the live state from a peer: "
                f"{str(self.manager.errored().original_exception).splitlines()[0]}"
            )
        elif (
            self.incarnation > 0
            and replica.num_replicas > 1
            and not trainer.global_step
            and (self.manager.num_participants() < 2 or has_stepped(self.first_store))
        ):
            # At step 0, alone or among replacements only (the run had stepped: every
            # replica holding its state was lost), a replacement would train the run again
            # from the start (one resumed from a checkpoint goes on from it).
            raise StateLost(
                f"worker {replica.process_rank}'s replacement found no live replica to take the state from "
                "(the others are gone or done)"
            )

    def leave_if_asked(self, step: int) -> None:
        """Leave the run after ``step`` where SIGTERM asked for it (ReplicaLeft)."""
        if self._sigterm.asked:
            self._leave(step)

    def _leave(self, step: int) -> None:
        self.membership.stop()
        raise ReplicaLeft(
            f"worker {self.replica.process_rank} left the run after step {step} (SIGTERM); the others go on"
        )

    def _live_state(self) -> dict[str, Any]:
        """Served to a joiner during a quorum, while this replica's loop waits in it, at the
        position the schedule says."""
        trainer = self.trainer
        assert trainer is not None, "a replica serves state only once it trains"
        return {
            "model": trainer.module.state_dict(),
            "optimizer": trainer.optimizer.state_dict(),
            "trainer": self.schedule.live_position(trainer),
            "strategy": self.replica.state_dict(),  # its session's record and last loss with it
        }

    def _load_live_state(self, state: dict[str, Any]) -> None:
        """A peer's state into this replica; the loop's position waits in ``joined_state``
        until the loop can take it (``begin``, or the step that healed)."""
        trainer = self.trainer
        assert trainer is not None
        trainer.module.load_state_dict(state["model"])
        trainer.optimizer.load_state_dict(state["optimizer"])
        own = state["strategy"]
        self.replica.skipped_updates = int(own["skipped_updates"])
        self.load_state_dict(own)
        self.schedule.take_live_state(own)
        self.joined_state = state["trainer"]

    # ----- the step ----------------------------------------------------------------------
    def step(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        gradient: Callable[[int], tuple[torch.Tensor, Any]],
    ) -> StepOutput:
        """One committed step: ``gradient(step)`` (this participant's part, summed over the
        quorum) done again until the quorum commits it, or the step taken from a peer that
        committed it while this replica could not."""
        replica = self.replica
        step = self.manager.current_step() + 1
        if self._sigterm.asked:  # asked between steps
            self._leave(step - 1)
        while True:
            done = self.next_quorum(step)
            if done >= step:
                return self._taken_from_peer(step, done)
            optimizer.zero_grad(set_to_none=True)
            if not self.step_bytes:
                self.step_bytes = self.wire_bytes(p for p in replica.unwrap(model).parameters() if p.requires_grad)
            loss, outputs = gradient(step)
            replica.steps_taken += 1
            if replica.recipe.clip_grad_norm:
                replica.clip_gradients(model)
            skip = replica.skip_nonfinite(replica.unwrap(model), loss, lambda: replica.gradients_finite(optimizer))
            if self.commit(step):
                if not skip:
                    with span("optimizer"):
                        optimizer.step()
                self.last_loss = float(loss)
                replica.count_update()
                self.count_step(step, self.manager.num_participants())
                if self._sigterm.asked:
                    self._leave(step)
                return StepOutput(loss, outputs, skipped=skip)
            self.uncommitted_steps += 1

    def count_step(self, step: int, participants: int) -> None:
        """A step committed: in the record, and (the first time) in the run's first store."""
        self.record.count_step(step, participants)
        if not self._stepped:
            self._stepped = mark_stepped(self.first_store)

    def next_quorum(self, step: int) -> int:
        """The quorum of ``step`` (the first formed by ``begin`` already), and a heal where this
        replica is behind: the steps the run has committed, as far as the quorum knows."""
        if not self.quorum_ready:
            with self.watchdog.phase("quorum", step):
                self.membership.form_quorum()
        self.quorum_ready = False
        return self.manager.current_step()

    def commit(self, step: int) -> bool:
        """Whether every participant of ``step``'s quorum got through it (else it is done again)."""
        with self.watchdog.phase("commit", step):
            return self.manager.should_commit()

    def _taken_from_peer(self, step: int, done: int) -> StepOutput:
        """Healed from a peer that committed steps up to ``done`` without this replica. The
        quorum that healed it is its peers' next step, whose all-reduce they are in already,
        so this replica's next step takes part in it without forming another quorum (they
        would wait out the timeout for it)."""
        self.behind_heals += 1
        self.replica.count_update(done - step + 1)  # the peer's record, taken with its state, holds them
        self.quorum_ready = True
        position, self.joined_state = self.joined_state, None
        loss = torch.tensor(self.last_loss, device=self.replica.device)
        if done == step:  # one step behind: the loop's own next batch is the peers' next
            return StepOutput(loss, None)
        # Left out of several quorums (a stall longer than the Lighthouse's join timeout):
        # the loop goes on from the peer's position, never from a wrong one.
        if position is None or int(position["global_step"]) != done:
            raise WorkerLost(f"worker {self.replica.process_rank} fell {done - step + 1} steps behind its peers")
        return StepOutput(loss, None, position=position)

    def sum_over_quorum(
        self, params: list[nn.Parameter], loss: torch.Tensor, share: float, step: int, targets: Any
    ) -> torch.Tensor:
        """This participant's gradient weighted by its ``share`` of the global batch, and its
        loss, summed over the quorum in one flat all-reduce that never raises: a peer lost
        during it makes the step uncommitted instead (reduce.py)."""
        with self.watchdog.phase("all-reduce", step):
            return sum_over_quorum(
                self.membership, params, loss, share, self.wire_dtype, step, targets, worker=self.replica.process_rank
            )

    # ----- accounting --------------------------------------------------------------------
    def wire_bytes(self, tensors: Iterable[torch.Tensor]) -> int:
        """Bytes of ``tensors`` on the quorum's wire: this process's part of each (a DTensor's
        local shard) in the wire's type, or their own."""
        size = None if self.wire_dtype is None else torch.empty(0, dtype=self.wire_dtype).element_size()
        return sum(local_part(t).numel() * (size or t.element_size()) for t in tensors)

    def step_counters(self, updates: int, wait_seconds: float) -> dict[str, float]:
        return {"bytes_sent": self.step_bytes * updates, "wait_seconds": wait_seconds, "staleness": 0}

    def stats(self, step_bytes: int) -> dict[str, Any]:
        """This replica's view of the run: every committed step's participants (the same on
        every replica that took part), the steps that had to be done again, and the heals;
        ``step_bytes`` went out for each step this replica took part in."""
        return {
            "bytes_sent": step_bytes * self.record.participations(),
            "dropped_gradients": 0,
            "staleness": staleness_summary({0: self.record.steps}),
            "participants": self.record.summary(),
            "uncommitted_steps": self.uncommitted_steps,
            "quorums": self.membership.quorums,
            "quorum_sums_via": self.membership.via(),
            "recoveries": list(self.record.recoveries),
        }

    def group_stats(self, device: torch.device) -> dict[str, Any]:
        """``stats`` of a replica of several processes (pipeline-ft's stages, fsdp-ft's
        shards), with what every process of it sends between replicas: summed over the
        replica's process group (the default one; NCCL takes ``device``'s tensors only)."""
        sent = torch.tensor([float(self.step_bytes)], dtype=torch.float64, device=wire_device(device))
        dist.all_reduce(sent)
        return self.stats(int(sent.item()))

    def state_dict(self) -> dict[str, Any]:
        """The run's record and the last committed loss, which a checkpoint keeps (checkpoint.py)."""
        return {"record": self.record.state_dict(), "last_loss": self.last_loss}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "record" in state:
            self.record.load_state_dict(state["record"])
            self.last_loss = float(state["last_loss"])
