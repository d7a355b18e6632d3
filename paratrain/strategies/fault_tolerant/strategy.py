"""``allreduce-ft``: synchronous data parallelism that keeps training through a lost replica.

Each replica is its own process and its own replica group of torchft (``torchft.Manager``):
before every step the replicas alive form a quorum through a Lighthouse, and the step's
gradient is summed over that quorum only. A replica killed at any moment is dropped (at
once when it dies inside the all-reduce, after ``--replica-heartbeat-timeout`` otherwise)
and the survivors go on at the next step; none of them restarts. A replacement (local
``--max-restarts``, or a new ``torchrun`` node) rejoins at its first quorum by fetching
the model, the optimizer and the loop's position from a live peer over HTTP
(``comm/live_state.py``): no checkpoint is read.

The global batch does not change when replicas are lost: every replica reads the whole
global batch of the step (``batch_size x workers`` examples, the same as ``allreduce``)
and, once the quorum is known, computes the gradient of its own part of it, the
``p``-th of ``P`` near-equal slices for participant ``p`` of ``P``. Each part's gradient is
weighted by its share of the global batch before the sum, so every committed step is
exactly one step of the global batch's mean loss whoever took part: with ``P`` replicas
left, each computes ``N/P`` times its usual share. A step that did not commit (a peer
died during it) is done again with the same batch, so no example is lost or seen twice,
and the learning-rate schedule follows committed steps.

Why torchft and not c10d alone: the per-step quorum (who is alive, agreed by all), the
heal (who is behind, who sends it the state) and the reconfiguration of the gradient
group after each membership change are what torchft's Lighthouse and Manager do and
are tested for; paratrain adds what they leave to the user (global-batch semantics,
a reduction that never raises out of ``backward()``, safe loading of a peer's state,
the launcher that replaces only the dead). See docs/reliability.md.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from paratrain.comm.transport import host_store
from paratrain.data.batch import map_tensors, num_examples
from paratrain.data.sharding import ShardedBatches
from paratrain.errors import ConfigError, ReplicaLeft, WorkerLost
from paratrain.session.incarnation import restart_count
from paratrain.session.leaving import LeaveOnSigterm
from paratrain.session.watchdog import Watchdog
from paratrain.strategies.accounting import staleness_summary
from paratrain.strategies.base import DEFAULT_TIMEOUT_S, Strategy
from paratrain.strategies.device import resolve_device
from paratrain.strategies.fault_tolerant.live import live_state, load_live_state
from paratrain.strategies.fault_tolerant.membership import Membership, ReplicaGroup
from paratrain.strategies.fault_tolerant.record import RunRecord
from paratrain.strategies.fault_tolerant.reduce import sum_over_quorum
from paratrain.strategies.fault_tolerant.replicas import (
    REPLICA_STORE_ENV,
    ReplicaGroups,
    part_of,
    replica_slot,
    torchft_modules,
    wait_for_all_first_replicas,
)
from paratrain.strategies.roles import FitLoop
from paratrain.strategies.step import LossFn, StepOutput
from paratrain.strategies.topology import Topology
from paratrain.timeline import span

if TYPE_CHECKING:
    from paratrain.config import TrainConfig


#: What the watchdog allows a wait beyond its own deadline (``--timeout``) and the time the
#: Lighthouse takes to drop a silent replica (``--replica-heartbeat-timeout``).
WATCHDOG_SLACK_S = 5.0


class FaultTolerantAllReduceStrategy(Strategy):
    name = "allreduce-ft"
    # fp16's scaler skips steps on its own; replicas must agree on every commit.
    scales_loss = False
    takes_compression = True
    leaves_on_sigterm: ClassVar[bool] = True
    """SIGTERM makes the replica leave after its step (one process: it can leave alone)."""
    #: Codecs whose payloads add up: the Manager's one all-reduce sums them (in 16 bits).
    WIRE_DTYPES: ClassVar[dict[str, torch.dtype | None]] = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}

    def __init__(
        self,
        device: str = "auto",
        timeout: float = DEFAULT_TIMEOUT_S,
        workers: int | None = None,
        lighthouse: str | None = None,
        min_replicas: int = 1,
        heartbeat_timeout: float = 1.0,
        compression: str = "none",
    ):
        super().__init__(device=device, timeout=timeout, workers=workers)
        self.check_compression(compression)
        self.compression = compression
        self._wire_dtype = self.WIRE_DTYPES[compression]
        self.lighthouse = lighthouse
        self.min_replicas = min_replicas
        self.heartbeat_timeout = heartbeat_timeout
        """Seconds of silence before a local launch's Lighthouse drops a replica."""
        self.record = RunRecord()
        """The run's committed steps and heals, as far as this replica knows (record.py)."""
        self.membership = Membership(self.name, min_replicas, timeout, lighthouse, self.record, heartbeat_timeout)
        """This replica's torchft Manager and quorums (membership.py)."""
        self.watchdog = Watchdog(
            timeout + heartbeat_timeout + WATCHDOG_SLACK_S,
            f"--timeout {timeout:g} s, --replica-heartbeat-timeout {heartbeat_timeout:g} s and {WATCHDOG_SLACK_S:g} s",
        )
        """Ends the replica with a line when a quorum, an all-reduce or a commit outlives its deadline."""
        self.incarnation = 0
        self.trainer: FitLoop | None = None
        self._sigterm = LeaveOnSigterm()  # asked: leave after the step
        self._quorum_ready = False  # begin_fit formed the quorum of the first step already
        self.joined_state: dict[str, Any] | None = None
        """The loop's position that a peer's live state brought (live.py), until begin_fit takes it."""
        self.last_loss = 0.0
        """The last committed step's loss (what a step taken from a peer reports)."""
        self._grad_bytes = 0
        self.uncommitted_steps = 0
        self.behind_heals = 0

    @classmethod
    def topology_of(cls, num_replicas: int) -> Topology:
        return ReplicaGroups(num_replicas=num_replicas)

    @classmethod
    def check_compression(cls, compression: str) -> None:
        if compression not in cls.WIRE_DTYPES:
            raise ConfigError(
                f"--strategy {cls.name} sums each step's gradient in one all-reduce: --compression must be "
                f"one of {', '.join(cls.WIRE_DTYPES)} (payloads that add up), got {compression!r}"
            )

    @classmethod
    def check_config(cls, config: TrainConfig) -> None:
        cls.check_compression(config.codec.compression)
        if config.checkpoint_dir is not None:
            raise ConfigError(
                "--strategy allreduce-ft recovers from live peers, not checkpoints: drop --checkpoint-dir "
                "(or use --strategy allreduce, which restarts the run from its checkpoints)"
            )
        if config.ft.min_replicas > config.workers:
            raise ConfigError(
                f"--min-replicas {config.ft.min_replicas} is more than --workers {config.workers}: no step could commit"
            )

    @classmethod
    def from_config(cls, config: TrainConfig) -> FaultTolerantAllReduceStrategy:
        return cls(
            device=config.device,
            timeout=config.timeout,
            workers=config.workers,
            lighthouse=config.ft.lighthouse,
            min_replicas=config.ft.min_replicas,
            heartbeat_timeout=config.ft.replica_heartbeat_timeout,
            compression=config.codec.compression,
        )

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "compression": self.compression,
            "fault_tolerance": "per-step",
            "min_replicas": self.min_replicas,
        }

    # ----- process -----------------------------------------------------------------------
    def setup(self) -> None:
        """One replica: no process group to join (the Manager forms one per quorum)."""
        if not self._ready:
            torchft_modules()
            self.device = resolve_device(self.device_preference)
            self.incarnation = restart_count()
            replicas = self.workers or int(os.environ.get("NUM_REPLICA_GROUPS", "1"))
            self.topology = self.topology_of(replicas)
            # A replica beyond --workers joins a running job: the global batch stays
            # batch_size x workers, split over more replicas.
            self.process_rank = replica_slot()
        super().setup()

    @property
    def is_chief(self) -> bool:
        """The first replica of the current quorum (the lowest alive), else replica 0."""
        if self.manager is None or self.manager.participating_rank() is None:
            return self.process_rank == 0
        return self.manager.participating_rank() == 0

    @property
    def stands_in_for_chief(self) -> bool:
        return True  # every replica trained the same committed steps

    @property
    def manager(self) -> Any:
        """torchft's Manager of this replica (None before ``begin_fit`` and after teardown)."""
        return self.membership.manager

    @manager.setter
    def manager(self, manager: Any) -> None:
        self.membership.manager = manager

    def teardown(self) -> None:
        self.watchdog.stop()
        self.membership.stop()
        super().teardown()

    def prepare(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, recipe: Any = None
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        model, optimizer = super().prepare(model, optimizer, recipe)
        size = None if self._wire_dtype is None else torch.empty(0, dtype=self._wire_dtype).element_size()
        self._grad_bytes = sum(p.numel() * (size or p.element_size()) for p in model.parameters() if p.requires_grad)
        return model, optimizer

    def begin_fit(self, trainer: FitLoop) -> None:
        """Join the run: the Manager starts (last, so that the Lighthouse never waits on a
        replica still building its model), then the first quorum; a replacement takes the
        live state from a peer there and the loop goes on from the peer's position."""
        self.trainer = trainer
        if self.leaves_on_sigterm:
            self._sigterm.install()
        self.watchdog.worker = self.process_rank
        if self.manager is None:
            host = os.environ.get("PARATRAIN_REPLICA_HOST", "127.0.0.1")
            self.membership.start(
                replica=self.rank,
                worker=self.process_rank,
                incarnation=self.incarnation,
                num_replicas=self.num_replicas,
                group=self._replica_group(host),
                host=host,
                state_dict=lambda: live_state(self),
                load_state_dict=lambda state: load_live_state(self, state),
            )
            wait_for_all_first_replicas(self.incarnation, self.topology.num_processes, self.timeout)
        with self.watchdog.phase("first quorum", self.manager.current_step() + 1):
            self.membership.form_quorum()
        self._quorum_ready = True
        if self.joined_state is not None:
            state, self.joined_state = self.joined_state, None
            trainer.load_state_dict(state)
            heal = self.record.recoveries[-1]
            print(
                f"paratrain: worker {self.process_rank} joined the run at step {heal['to_step']} with a live "
                f"peer's state ({heal['seconds']:.2f} s from its first quorum)",
                file=sys.stderr,
                flush=True,
            )
        elif self.manager.errored() is not None:
            raise WorkerLost(
                f"worker {self.process_rank} could not take the live state from a peer: "
                f"{str(self.manager.errored().original_exception).splitlines()[0]}"
            )
        elif self.incarnation > 0 and self.manager.num_participants() < 2 and self.num_replicas > 1:
            # Alone at step 0, a replacement would train the run again from the start.
            raise WorkerLost(
                f"worker {self.process_rank}'s replacement found no live replica to take the state from "
                "(the others are gone or done)"
            )

    def _leave(self, step: int) -> None:
        self.membership.stop()
        raise ReplicaLeft(f"worker {self.process_rank} left the run after step {step} (SIGTERM); the others go on")

    def _replica_group(self, host: str) -> ReplicaGroup:
        """Where this replica's processes meet (a store's host and port) and this process's
        rank among them, of how many: one process, and a store of its own, the launcher's if
        it hosts one (the gradient group of a quorum meets in its first member's)."""
        hosted = os.environ.get(REPLICA_STORE_ENV)
        if hosted:
            store_host, _, port = hosted.rpartition(":")
            return store_host, int(port), 0, 1
        self._store = host_store(self.timeout, host)
        return host, self._store.port, 0, 1

    # ----- data and step -----------------------------------------------------------------
    def distribute(
        self, dataset: object, batch_size: int, *, shuffle: bool = True, drop_last: bool = True, seed: int = 0
    ) -> ShardedBatches:
        """Every replica reads whole global batches (``batch_size`` per replica times the
        run's replicas): its part is chosen once the step's quorum is known."""
        self.setup()
        return ShardedBatches(
            dataset,
            batch_size * self.num_replicas,
            num_replicas=1,
            rank=0,
            shuffle=shuffle,
            drop_last=drop_last,
            seed=seed,
            device=self.device,
        )

    def train_step(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        optimizer: torch.optim.Optimizer,
        inputs: Any,
        targets: Any,
    ) -> StepOutput:
        """One committed step of the global batch ``(inputs, targets)``: done again until the
        quorum commits it, or taken from a peer that committed it while this replica could not."""
        step = self.manager.current_step() + 1
        if self._sigterm.asked:  # asked between steps
            self._leave(step - 1)
        while True:
            if not self._quorum_ready:
                with self.watchdog.phase("quorum", step):
                    self.membership.form_quorum()
            self._quorum_ready = False
            done = self.manager.current_step()
            if done >= step:
                # Healed from a peer that committed steps this replica was not in: the quorum
                # that healed it is its peers' next step, whose all-reduce they are in already,
                # so this replica's next step takes part in it without forming another quorum
                # (they would wait out the timeout for it).
                self.behind_heals += 1
                self._steps += done - step + 1  # the peer's record, taken with its state, holds them
                self._quorum_ready = True
                position, self.joined_state = self.joined_state, None
                loss = torch.tensor(self.last_loss, device=self.device)
                if done == step:  # one step behind: the loop's own next batch is the peers' next
                    return StepOutput(loss, None)
                # Left out of several quorums (a stall longer than the Lighthouse's join
                # timeout): the loop goes on from the peer's position, never from a wrong one.
                if position is None or int(position["global_step"]) != done:
                    raise WorkerLost(f"worker {self.process_rank} fell {done - step + 1} steps behind its peers")
                return StepOutput(loss, None, position=position)
            loss, outputs = self._gradient(model, loss_fn, optimizer, inputs, targets, step)
            self.steps_taken += 1
            if self.recipe.clip_grad_norm:
                self.clip_gradients(model)
            skip = self.skip_nonfinite(self.unwrap(model), loss, lambda: self.gradients_finite(optimizer))
            with self.watchdog.phase("commit", step):
                commit = self.manager.should_commit()
            if commit:
                if not skip:
                    with span("optimizer"):
                        optimizer.step()
                self.last_loss = float(loss)
                self._steps += 1
                self.record.count_step(step, self.manager.num_participants())
                if self._sigterm.asked:
                    self._leave(step)
                return StepOutput(loss, outputs, skipped=skip)
            self.uncommitted_steps += 1

    def _gradient(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        optimizer: torch.optim.Optimizer,
        inputs: Any,
        targets: Any,
        step: int,
    ) -> tuple[torch.Tensor, Any]:
        """This participant's part of the global batch: its gradient, weighted by the part's
        share, summed over the quorum in one flat all-reduce (with the loss) that never
        raises: a peer lost during it makes the step uncommitted instead."""
        optimizer.zero_grad(set_to_none=True)
        total = num_examples(targets)
        piece = part_of(total, self.manager.participating_rank(), self.manager.num_participants())
        x, y = map_tensors(inputs, lambda t: t[piece]), map_tensors(targets, lambda t: t[piece])
        loss, outputs = self.recipe.forward_backward(model, loss_fn, x, y, self.device)
        params = [p for p in self.unwrap(model).parameters() if p.requires_grad]
        return self._sum_over_quorum(params, loss, (piece.stop - piece.start) / total, step, targets), outputs

    def _sum_over_quorum(
        self, params: list[nn.Parameter], loss: torch.Tensor, share: float, step: int, targets: Any
    ) -> torch.Tensor:
        """This participant's weighted gradient and loss summed over the quorum (reduce.py)."""
        with self.watchdog.phase("all-reduce", step):
            return sum_over_quorum(
                self.manager, params, loss, share, self._wire_dtype, step, targets, worker=self.process_rank
            )

    # ----- accounting ----------------------------------------------------------------------
    def step_counters(self) -> dict[str, float]:
        return {"bytes_sent": self._grad_bytes * self._steps, "wait_seconds": self.wait_seconds, "staleness": 0}

    def stats(self) -> dict[str, Any]:
        """This replica's view of the run: every committed step's participants (the same on
        every replica that took part), the steps that had to be done again, and the heals."""
        return {
            "bytes_sent": self._grad_bytes * self.record.participations(),
            "dropped_gradients": 0,
            "staleness": staleness_summary({0: self.record.steps}),
            "participants": self.record.summary(),
            "uncommitted_steps": self.uncommitted_steps,
            "quorums": self.membership.quorums,
            "recoveries": list(self.record.recoveries),
        }

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "participants": {str(p): c for p, c in self.record.participants.items()}}
