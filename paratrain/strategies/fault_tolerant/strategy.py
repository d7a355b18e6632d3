"""``allreduce-ft``: synchronous data parallelism that keeps training through a lost replica.

Each replica is its own process and its own torchft replica group: before every step the live replicas form
a quorum through a Lighthouse, and the gradient is summed over that quorum only. A dead replica is dropped
(at once inside the all-reduce, after ``--replica-heartbeat-timeout`` otherwise) and the survivors go on; a
replacement rejoins by fetching the model, optimizer and loop position from a live peer
(``comm/live_state.py``), no checkpoint read. Every committed step is exactly one step of the global batch
(``batch_size x workers``) whoever took part: each participant computes its share's gradient, weighted by
that share; a step that did not commit is redone with the same batch. torchft gives the quorum, the heal and
the group's reconfiguration; paratrain adds the global-batch semantics, a reduction that never raises out of
``backward()``, safe loading of a peer's state and a launcher that replaces only the dead. With
``--checkpoint-dir`` the quorum's first replica writes checkpoints (checkpoint.py). See
docs/fault_tolerance.md.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim import Optimizer

from paratrain.checkpoints.files import RunCheckpoints, StateWriter
from paratrain.data.batch import map_tensors, num_examples
from paratrain.errors import ConfigError
from paratrain.session.incarnation import restart_count
from paratrain.strategies.base import DEFAULT_TIMEOUT_S, Strategy
from paratrain.strategies.device import resolve_device
from paratrain.strategies.evaluation import SumsOf
from paratrain.strategies.fault_tolerant.checkpoint import QuorumState
from paratrain.strategies.fault_tolerant.evaluation import evaluation_sums
from paratrain.strategies.fault_tolerant.membership import ReplicaGroup
from paratrain.strategies.fault_tolerant.options import check_compression, session_options
from paratrain.strategies.fault_tolerant.replicas import ReplicaGroups, one_process_group, replica_slot, torchft_modules
from paratrain.strategies.fault_tolerant.session import FaultTolerantSession
from paratrain.strategies.roles import FitLoop
from paratrain.strategies.step import LossFn, StepOutput
from paratrain.strategies.topology import Topology

if TYPE_CHECKING:
    from paratrain.config import TrainConfig


class FaultTolerantAllReduceStrategy(Strategy):
    """One process per replica, composed with a fault-tolerant session (session.py)."""

    name = "allreduce-ft"
    # fp16's scaler skips steps on its own; replicas must agree on every commit.
    scales_loss = False
    takes_compression = True

    def __init__(
        self, device: str = "auto", timeout: float = DEFAULT_TIMEOUT_S, workers: int | None = None, **session: Any
    ):
        """``session``: ``lighthouse``, ``min_replicas``, ``heartbeat_timeout`` and
        ``compression``, the options of the fault-tolerant session (session.py)."""
        super().__init__(device=device, timeout=timeout, workers=workers)
        self.session = FaultTolerantSession(self, leaves_on_sigterm=True, **session)
        """The quorum, the heal, the record and the step loop of this replica (session.py)."""

    @classmethod
    def topology_of(cls, num_replicas: int) -> Topology:
        return ReplicaGroups(num_replicas=num_replicas)

    @classmethod
    def check_config(cls, config: TrainConfig) -> None:
        check_compression(cls.name, config.codec.compression)
        if config.ft.min_replicas > config.workers:
            raise ConfigError(
                f"--min-replicas {config.ft.min_replicas} is more than --workers {config.workers}: no step could commit"
            )

    @classmethod
    def from_config(cls, config: TrainConfig) -> FaultTolerantAllReduceStrategy:
        return cls(**session_options(config))

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), **self.session.describe()}

    # ----- process -----------------------------------------------------------------------
    def setup(self) -> None:
        """One replica: no process group to join (the Manager forms one per quorum)."""
        if not self._ready:
            torchft_modules()
            self.device = resolve_device(self.device_preference)
            self.session.incarnation = restart_count()
            replicas = self.workers or int(os.environ.get("NUM_REPLICA_GROUPS", "1"))
            self.topology = self.topology_of(replicas)
            # A replica beyond --workers joins a running job: the global batch stays
            # batch_size x workers, split over more replicas.
            self.process_rank = replica_slot()
        super().setup()

    @property
    def is_chief(self) -> bool:
        """The first replica of the current quorum (the lowest alive), else replica 0."""
        return self.session.first_in_quorum(self.process_rank == 0)

    @property
    def stands_in_for_chief(self) -> bool:
        return True  # every replica trained the same committed steps

    def teardown(self) -> None:
        self.session.stop()
        super().teardown()

    def begin_fit(self, trainer: FitLoop) -> None:
        self.session.begin(trainer, self._replica_group)

    def state_writer(self, files: RunCheckpoints, loop: FitLoop) -> StateWriter:
        """One replica, the first of the step's quorum, writes the run's checkpoint (checkpoint.py)."""
        return QuorumState(files, loop, self.session)

    def _replica_group(self, host: str) -> ReplicaGroup:
        """Where this replica's processes meet (a store's host and port) and this process's
        rank among them, of how many: one process, and a store of its own, the launcher's if
        it hosts one (the gradient group of a quorum meets in its first member's)."""
        group, self._store = one_process_group(self.timeout, host)
        return group

    # ----- data and step -----------------------------------------------------------------
    def train_step(
        self, model: nn.Module, loss_fn: LossFn, optimizer: Optimizer, inputs: Any, targets: Any
    ) -> StepOutput:
        """One committed step of the global batch ``(inputs, targets)`` (session.py)."""
        return self.session.step(model, optimizer, lambda step: self._gradient(model, loss_fn, inputs, targets, step))

    def _gradient(self, model: nn.Module, loss_fn: LossFn, inputs: Any, targets: Any, step: int) -> tuple[Any, Any]:
        """This participant's part of the global batch: its gradient and loss, weighted by the
        part's share and summed over the quorum."""
        total = num_examples(targets)
        piece = self.session.part(total)
        x, y = map_tensors(inputs, lambda t: t[piece]), map_tensors(targets, lambda t: t[piece])
        loss, outputs = self.recipe.forward_backward(model, loss_fn, x, y, self.device)
        params = [p for p in self.unwrap(model).parameters() if p.requires_grad]
        share = (piece.stop - piece.start) / total
        return self.session.sum_over_quorum(params, loss, share, step, targets), outputs

    def evaluation_sums(self, data: object, batch_size: int, sums_of: SumsOf) -> torch.Tensor:
        """Each replica of the last step's quorum scores its part of ``data`` (evaluation.py)."""
        return evaluation_sums(self.session, data, batch_size, sums_of)

    # ----- accounting ----------------------------------------------------------------------
    def step_counters(self) -> dict[str, float]:
        return self.session.step_counters(self._steps, self.wait_seconds)

    def stats(self) -> dict[str, Any]:
        return self.session.stats(self.session.step_bytes)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), **self.session.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.session.load_state_dict(state)
