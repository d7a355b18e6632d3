"""``pipeline-ft``: pipeline replicas that keep training through a lost replica.

Each replica is one pipeline of ``--stages S`` processes with a process group of their own, and one torchft
replica group of S ranks (``allreduce-ft``'s design): the first stage takes the quorum and every stage learns
it, each stage's gradient is summed with the same stage of the other replicas, and a replica's stages commit
together or not at all. A replica drops out and is replaced as a unit (``launch/replacing.py``), each new
stage taking its state from the same stage of a live replica. The global batch stays ``batch_size x
replicas`` whoever is alive, in whole micro-batches: participant ``p`` of ``P`` runs the ``p``-th of ``P`` runs of
them (a stage's buffers keep the micro-batch's shape; the count changes, each with its schedule).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from paratrain.checkpoints.files import RunCheckpoints, StateWriter
from paratrain.comm.transport import cluster_from_env
from paratrain.data.batch import map_tensors, num_examples
from paratrain.errors import ConfigError, WorkerLost
from paratrain.parallel.pipeline import make_schedule
from paratrain.parallel.shared import SplitStage
from paratrain.parallel.split import parse_split_points
from paratrain.session.incarnation import restart_count
from paratrain.strategies.base import DEFAULT_TIMEOUT_S
from paratrain.strategies.evaluation import SumsOf
from paratrain.strategies.fault_tolerant.checkpoint import QuorumState
from paratrain.strategies.fault_tolerant.evaluation import evaluation_sums
from paratrain.strategies.fault_tolerant.membership import ReplicaGroup
from paratrain.strategies.fault_tolerant.options import check_quorum_options, session_options
from paratrain.strategies.fault_tolerant.replicas import check_replica_job, place_of_process, torchft_modules
from paratrain.strategies.fault_tolerant.session import FaultTolerantSession
from paratrain.strategies.pipeline.gradients import TiedGradients
from paratrain.strategies.pipeline.stages import MicrobatchTraffic, feed, scored, stage_loss
from paratrain.strategies.pipeline.strategy import PipelineStrategy
from paratrain.strategies.pipeline.topology import PipelineTopology
from paratrain.strategies.roles import FitLoop
from paratrain.strategies.step import LossFn, StepOutput

if TYPE_CHECKING:
    from paratrain.comm.transport import ClusterEnv
    from paratrain.config import TrainConfig


@dataclass(frozen=True)
class PipelineReplicaGroups(PipelineTopology):
    """``num_replicas`` pipelines of ``num_stages`` processes; each replica is its own
    process group and replica group, lost and replaced as a unit."""

    replaces_lost = True
    whole_batches = True

    def checkpoint_parts(self) -> list[str]:
        """Every replica holds the same committed state: the first replica's stages write it,
        each its own stage (checkpoint.py)."""
        return [f"stage-{stage}" for stage in range(self.num_stages)]

    def checkpoint_part(self, rank: int) -> str | None:
        return f"stage-{self.stage(rank)}"

    def check_cluster(self, cluster: ClusterEnv, strategy: str) -> None:
        check_replica_job(cluster, strategy, self.num_stages, f"of --stages {self.num_stages} processes")


class FaultTolerantPipelineStrategy(PipelineStrategy):
    """A pipeline (its stage, schedules and evaluation are ``pipeline``'s) composed with a
    fault-tolerant session (the quorum, the heal, the step loop and the record: session.py)."""

    name = "pipeline-ft"
    takes_compression = True  # 16-bit payloads of the quorum's all-reduce (session.py)
    topology_class = PipelineReplicaGroups  # pipeline's topology_for and planned_topology make it

    def __init__(
        self,
        num_stages: int = 2,
        num_microbatches: int = 4,
        schedule: str = "1f1b",
        split_points: list[int] | None = None,
        device: str = "auto",
        timeout: float = DEFAULT_TIMEOUT_S,
        workers: int | None = None,
        **session: Any,
    ):
        """``workers`` counts processes, as in pipeline: replicas x stages. ``session``: the
        options of the fault-tolerant session, as FaultTolerantAllReduceStrategy's."""
        super().__init__(num_stages, num_microbatches, schedule, "params", split_points, device, timeout, workers)
        # A stage cannot leave alone on SIGTERM: a replica is lost or kept whole.
        self.session = FaultTolerantSession(self, leaves_on_sigterm=False, **session)
        """The quorum, the heal, the record and the step loop of this stage's replica (session.py)."""
        self._schedules: dict[int, Any] = {}  # micro-batches of this replica's part -> its schedule

    # ----- configuration ---------------------------------------------------------------
    @classmethod
    def check_config(cls, config: TrainConfig) -> None:
        super().check_config(config)
        counted = f"pipeline replicas (--workers {config.workers} / --stages {config.pipeline.stages})"
        check_quorum_options(cls.name, config, cls.topology_for(config).num_replicas, counted)
        if config.pipeline.balance == "time":
            raise ConfigError(
                "--strategy pipeline-ft splits by --balance params or --split-points: a replacement takes its "
                "stage from a peer before any batch, when a split by time is not known yet"
            )

    @classmethod
    def from_config(cls, config: TrainConfig) -> FaultTolerantPipelineStrategy:
        options = config.pipeline
        return cls(
            num_stages=options.stages,
            num_microbatches=options.microbatches,
            schedule=options.schedule,
            split_points=parse_split_points(options.split_points) if options.split_points else None,
            **session_options(config),
        )

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), **self.session.describe()}

    # ----- process -----------------------------------------------------------------------
    def setup(self) -> None:
        """One stage of one replica: the replica's own process group (its stages), and the
        run's place of it (``REPLICA_GROUP_ID``)."""
        if not self._ready:
            torchft_modules()
            if cluster_from_env() is None:
                raise ConfigError(
                    "--strategy pipeline-ft runs as `paratrain train`, or under torchrun as one job of --stages "
                    "processes per replica"
                )
            self.session.incarnation = restart_count()
        super().setup()

    def _place(self, world: int) -> None:
        """The process group is this replica's stages; the run's replicas are the replica
        groups of torchft (the quorum's), so no group spans them."""
        replicas, self.process_rank = place_of_process(
            self.workers, self.num_stages, world, dist.get_rank(), "--stages"
        )
        self.topology = PipelineReplicaGroups(num_replicas=replicas, num_stages=self.num_stages)

    def _replica_group(self, host: str) -> ReplicaGroup:
        """The replica's stages meet in their process group's store; this stage is its rank."""
        return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), dist.get_rank(), self.num_stages

    @property
    def is_chief(self) -> bool:
        """The last stage (it holds the loss and the logits) of the quorum's first replica."""
        return self.is_last_stage and self.session.first_in_quorum(self.rank == 0)

    @property
    def stands_in_for_chief(self) -> bool:
        return self.is_last_stage  # it holds the loss and the logits

    def begin_fit(self, trainer: FitLoop) -> None:
        """A model that is traced into stages is cut here, at the first batch: before the first
        quorum, where a replacement takes its stage's state from a peer."""
        if self._module is None:
            self._build(self.recipe.prepare_inputs(trainer.example_batch()[0]))
        self.session.begin(trainer, self._replica_group)

    def state_writer(self, files: RunCheckpoints, loop: FitLoop) -> StateWriter:
        """The stages of the step's first replica write the run's checkpoint (checkpoint.py)."""
        return QuorumState(files, loop, self.session)

    def _tie(self, stage: SplitStage) -> TiedGradients:
        return TiedGradients(stage, 0, 1, self.num_stages)  # in the replica's own process group

    @property
    def batch_microbatches(self) -> int:
        return self.step_microbatches * self.num_replicas  # the global batch, over the replicas

    first_rank = 0  # the replica's process group is its stages

    def teardown(self) -> None:
        self._schedules = {}
        self.session.stop()
        super().teardown()

    # ----- data and step -----------------------------------------------------------------
    def train_step(
        self, model: nn.Module, loss_fn: LossFn, optimizer: Optimizer, inputs: Any, targets: Any
    ) -> StepOutput:
        """One committed step of the global batch on this stage (session.py)."""
        return self.session.step(model, optimizer, lambda step: self._gradient(loss_fn, inputs, targets, step))

    def _gradient(self, loss_fn: LossFn, inputs: Any, targets: Any, step: int) -> tuple[torch.Tensor, Any]:
        """This replica's run of the global batch's micro-batches through its pipeline; each
        stage's gradient weighted by the run's share and summed with the same stage of the
        other participants."""
        inputs = self.recipe.prepare_inputs(inputs)
        micro = self.batch_microbatches  # micro-batches of the global batch
        size = num_examples(targets) // micro
        run = self.session.part(micro)
        count = run.stop - run.start
        rows = slice(run.start * size, run.stop * size)
        schedule = self._schedule_of(loss_fn, count, targets)
        losses: list[torch.Tensor] = []
        with self.recipe.autocast(self.device), self._pipeline_intact():
            if self.stage == 0:
                outputs = schedule.step(*(t[rows] for t in feed(inputs)[0]))
            elif self.is_last_stage:
                outputs = schedule.step(target=map_tensors(scored(inputs, targets), lambda t: t[rows]), losses=losses)
            else:
                outputs = schedule.step()
        if self._tied is not None:
            self._bytes_sent += self._tied()
        self._bytes_sent += count * self._traffic.bytes
        # Equal micro-batches: the mean of their mean losses is the run's mean loss.
        # (A stage boundary over Gloo computes the last stage's loss in host memory.)
        loss = (
            torch.stack([l.detach() for l in losses]).mean().to(self.device)
            if losses
            else torch.zeros((), device=self.device)
        )
        params = [p for p in self._module.parameters() if p.requires_grad]
        summed = self.session.sum_over_quorum(params, loss, count / micro, step, targets)
        if self.is_last_stage:
            return summed, outputs.detach()
        return summed, torch.empty(0, device=self.device)

    def _schedule_of(self, loss_fn: LossFn, count: int, targets: Any) -> Any:
        """The schedule over ``count`` micro-batches (1F1B needs at least one per stage: fewer
        run as GPipe)."""
        if self._loss_fn is not loss_fn:
            self._loss_fn, self._schedules = loss_fn, {}
        if count not in self._schedules:
            name = "gpipe" if self.schedule_name == "1f1b" and count < self.num_stages else self.schedule_name
            loss = stage_loss(self._whole, loss_fn, targets)
            self._schedules[count] = make_schedule(
                name, self._module, self.stage, self.num_stages, self.device, None, count, loss
            )
            if self._traffic is None:
                self._traffic = MicrobatchTraffic(self._module, self.stage == 0, self.is_last_stage)
        return self._schedules[count]

    def gradients_finite(self, optimizer: torch.optim.Optimizer) -> bool:
        """Each stage sees its own gradients (summed over the quorum, so every replica's
        stage sees the same): the replica's stages agree in one all-reduce of a flag."""
        return not self._nonfinite_anywhere(optimizer)

    def forward(self, model: nn.Module, inputs: Any) -> Any:
        """Evaluation's forward pass through this replica's stages (ranks 0..S-1 of its group)."""
        with self._pipeline_intact():
            return super().forward(model, inputs)

    def evaluation_sums(self, data: object, batch_size: int, sums_of: SumsOf) -> torch.Tensor:
        """Each replica of the last step's quorum scores its part of ``data`` through its stages (evaluation.py)."""
        return evaluation_sums(self.session, data, batch_size, sums_of)

    @contextlib.contextmanager
    def _pipeline_intact(self) -> Iterator[None]:
        """A stage of this replica died (its connection closed): this stage cannot go on
        alone; it says so in one line, and the launcher replaces the replica as a unit."""
        try:
            yield
        except RuntimeError as error:
            raise WorkerLost(
                f"{self.topology.rank_name(self.process_rank)}: another stage of its replica stopped answering "
                f"({str(error).splitlines()[0][-120:]})"
            ) from None

    # ----- accounting ----------------------------------------------------------------------
    def step_counters(self) -> dict[str, float]:
        return self.session.step_counters(self._steps, self.wait_seconds)

    def stats(self) -> dict[str, Any]:
        """The session's view of the run (participants, heals), with the gradient bytes of
        every stage of the replica: what went between replicas, summed over the quorums."""
        return self.session.group_stats(self.device)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), **self.session.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.session.load_state_dict(state)
