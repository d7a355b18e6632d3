"""``fsdp-ft`` (``--strategy fsdp --fault-tolerant``): sharded replicas that keep training through a lost replica
(HSDP: FSDP2 inside a replica, fault-tolerant data parallelism across replicas, as torchft's).

Each replica is ``--shards-per-replica K`` processes over which FSDP2 shards the model, its collectives staying
inside the replica; across replicas it is one torchft replica group of K ranks (``pipeline-ft``'s design):
shard ``k``'s gradient is summed with shard ``k`` of the other replicas in the quorum, and the shards commit
together or not at all. A replica drops out and is replaced as a unit, each new shard taking its state from
the same shard of a live replica. The global batch stays ``batch-size x workers`` whoever is alive, each
loss scaled by its slice's share, so without a loss it is ``fsdp`` (tested). The quorum's first replica
writes checkpoints through DCP (``--checkpoint-async`` too), which resume on any layout. A shard does not
leave on SIGTERM alone: its replica is replaced or dropped.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from paratrain.checkpoints.files import RunCheckpoints, StateWriter
from paratrain.comm.transport import cluster_from_env, default_backend
from paratrain.data.batch import map_tensors, num_examples, part_of
from paratrain.errors import ConfigError
from paratrain.parallel.local_state import LocalParts, hold_local_parts
from paratrain.session.incarnation import restart_count
from paratrain.strategies.base import DEFAULT_TIMEOUT_S, Strategy
from paratrain.strategies.device import resolve_device
from paratrain.strategies.evaluation import SumsOf
from paratrain.strategies.fault_tolerant.checkpoint import QuorumState
from paratrain.strategies.fault_tolerant.evaluation import evaluation_sums
from paratrain.strategies.fault_tolerant.membership import ReplicaGroup
from paratrain.strategies.fault_tolerant.options import check_quorum_options, session_options
from paratrain.strategies.fault_tolerant.replicas import (
    check_replica_job,
    one_process_group,
    place_of_process,
    torchft_modules,
)
from paratrain.strategies.fault_tolerant.session import FaultTolerantSession
from paratrain.strategies.fsdp.strategy import FSDPStrategy
from paratrain.strategies.recipe import StepRecipe
from paratrain.strategies.roles import FitLoop
from paratrain.strategies.sharded_files import ShardedModelFiles
from paratrain.strategies.step import LossFn, StepOutput
from paratrain.strategies.topology import Topology, replicas_of

if TYPE_CHECKING:
    from paratrain.comm.transport import ClusterEnv
    from paratrain.config import TrainConfig


@dataclass(frozen=True)
class ShardedReplicaGroups(Topology):
    """``num_replicas`` replicas of ``shards`` processes; each replica is its own process group
    and replica group, lost and replaced as a unit. Rank ``replica * shards + shard``."""

    shards: int = 1

    replaces_lost = True
    whole_batches = True

    @property
    def num_processes(self) -> int:
        return self.num_replicas * self.shards

    @property
    def batches_per_step(self) -> int:
        """``--workers`` counts processes: the global batch is one batch per shard."""
        return self.num_processes

    def replica(self, rank: int) -> int:
        return rank // self.shards

    def rank_name(self, rank: int) -> str:
        if self.shards == 1:
            return f"worker {rank}"
        return f"shard {rank % self.shards} of replica {self.replica(rank)}"

    def checkpoint_parts(self) -> list[str]:
        """Every replica holds the same committed state: the first replica's shards write it,
        each its own part (checkpoint.py)."""
        return [f"shard-{shard}" for shard in range(self.shards)]

    def checkpoint_part(self, rank: int) -> str | None:
        return f"shard-{rank % self.shards}"

    def model_part(self, rank: int) -> str | None:
        return self.checkpoint_part(rank)

    def check_cluster(self, cluster: ClusterEnv, strategy: str) -> None:
        check_replica_job(cluster, strategy, self.shards, f"of --shards-per-replica {self.shards} processes")


class ReplicaShardFiles:
    """The model files of a replica whose state dicts hold each shard's local part (what a
    peer heals a replacement's same shard with): fsdp's DCP files, read and written from the
    DTensors themselves, so that another layout can read them."""

    def __init__(self, parts: LocalParts):
        self.parts = parts
        self.files = ShardedModelFiles()

    def save_model(self, module: nn.Module, optimizer: Optimizer, folder: Path) -> list[str]:
        with self.parts.whole():
            return self.files.save_model(module, optimizer, folder)

    def start_save(self, module: nn.Module, optimizer: Optimizer, folder: Path, group: Any) -> Callable[[], list[str]]:
        with self.parts.whole():  # DCP copies the state to host memory before this returns
            return self.files.start_save(module, optimizer, folder, group)

    def load_model(self, module: nn.Module, optimizer: Optimizer, folder: Path) -> None:
        with self.parts.whole():
            self.files.load_model(module, optimizer, folder)


class FaultTolerantFSDPStrategy(FSDPStrategy):
    """An ``fsdp`` replica of ``shards`` processes (its sharding, finiteness checks and
    accounting are fsdp's) composed with a fault-tolerant session per process."""

    name = "fsdp-ft"
    scales_loss = False  # replicas must agree on every commit
    reshards = True

    def __init__(
        self,
        shards: int = 1,
        device: str = "auto",
        timeout: float = DEFAULT_TIMEOUT_S,
        reshard_after_forward: bool = True,
        workers: int | None = None,
        **session: Any,
    ):
        """``workers`` counts processes: replicas x ``shards``. ``session``: the options of the
        fault-tolerant session (``compression`` is also the reduce-scatter's type)."""
        if not isinstance(shards, int) or shards < 1:
            raise ConfigError(f"--shards-per-replica must be a whole number >= 1, got {shards!r}")
        compression = session.get("compression", "none")
        super().__init__(device, timeout, reshard_after_forward, compression, workers)
        self.shards = shards
        # A shard cannot leave alone on SIGTERM: a replica is lost or kept whole.
        self.session = FaultTolerantSession(self, leaves_on_sigterm=False, **session)
        """The quorum, the heal, the record and the step loop of this shard's replica (session.py)."""
        self._local_parts = LocalParts()  # prepare() hooks the model's and optimizer's state dicts

    # ----- configuration -------------------------------------------------------------------
    @classmethod
    def topology_for(cls, config: TrainConfig) -> Topology:
        shards = config.fsdp.shards_per_replica
        return ShardedReplicaGroups(replicas_of(config.workers, shards, "--shards-per-replica"), shards)

    def planned_topology(self) -> Topology:
        return ShardedReplicaGroups(replicas_of(self.workers, self.shards, "shards"), self.shards)

    @classmethod
    def check_config(cls, config: TrainConfig) -> None:
        super().check_config(config)
        counted = f"replicas (--workers {config.workers} / --shards-per-replica {config.fsdp.shards_per_replica})"
        check_quorum_options(cls.name, config, cls.topology_for(config).num_replicas, counted)

    @classmethod
    def from_config(cls, config: TrainConfig) -> FaultTolerantFSDPStrategy:
        return cls(
            shards=config.fsdp.shards_per_replica,
            reshard_after_forward=config.fsdp.reshard_after_forward,
            **session_options(config),
        )

    def describe(self) -> dict[str, Any]:
        # --workers counts processes (replicas x shards), as the pipeline's and tensor's do
        return {
            **super().describe(),
            **self.session.describe(),
            "workers": self.topology.num_processes,
            "replicas": self.num_replicas,
            "shards_per_replica": self.shards,
        }

    # ----- process -------------------------------------------------------------------------
    def setup(self) -> None:
        """One shard of one replica: the replica's own process group (its shards, which FSDP2
        shards over), and the run's place of it (``REPLICA_GROUP_ID``)."""
        if not self._ready:
            torchft_modules()
            cluster = cluster_from_env()
            if cluster is None and self.shards > 1:
                raise ConfigError(
                    "--strategy fsdp-ft runs as `paratrain train`, under `paratrain.launch`, or under torchrun as "
                    "one job of --shards-per-replica processes per replica"
                )
            self.session.incarnation = restart_count()
            self.device = resolve_device(self.device_preference, cluster.local_rank if cluster else 0)
            self._join_group(default_backend(self.device))
            world, rank = dist.get_world_size(), dist.get_rank()
            replicas, self.process_rank = place_of_process(
                self.workers, self.shards, world, rank, "--shards-per-replica"
            )
            self.topology = ShardedReplicaGroups(num_replicas=replicas, shards=self.shards)
        Strategy.setup(self)  # the replica's group is joined above: ReplicaStrategy's own join is not this one

    def _replica_group(self, host: str) -> ReplicaGroup:
        """The replica's shards meet in their process group's store; this shard is its rank (a
        replica of one process meets as allreduce-ft's do)."""
        if self.shards == 1:
            group, self._store = one_process_group(self.timeout, host)
            return group
        return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), dist.get_rank(), self.shards

    @property
    def is_chief(self) -> bool:
        """Shard 0 of the quorum's first replica."""
        return dist.get_rank() == 0 and self.session.first_in_quorum(self.rank == 0)

    @property
    def stands_in_for_chief(self) -> bool:
        return dist.get_rank() == 0

    def begin_fit(self, trainer: FitLoop) -> None:
        self.session.begin(trainer, self._replica_group)

    def teardown(self) -> None:
        self.session.stop()
        super().teardown()

    # ----- model and data --------------------------------------------------------------------
    def prepare(
        self, model: nn.Module, optimizer: Optimizer, recipe: StepRecipe | None = None
    ) -> tuple[nn.Module, Optimizer]:
        """fsdp's sharding over the replica; the model's and optimizer's state dicts hold each
        shard's own part (what a joiner's same shard takes from a peer)."""
        model, optimizer = super().prepare(model, optimizer, recipe)
        self._local_parts = hold_local_parts(model, optimizer)
        # this shard's part of the gradient, on the wire between replicas
        self.session.step_bytes = self.session.wire_bytes(p for p in model.parameters() if p.requires_grad)
        return model, optimizer

    @property
    def model_files(self) -> ReplicaShardFiles:
        """fsdp's sharded files, written by the shards of one replica (checkpoint.py says which)."""
        return ReplicaShardFiles(self._local_parts)

    def state_writer(self, files: RunCheckpoints, loop: FitLoop) -> StateWriter:
        """The shards of the step's first replica write the run's checkpoint (checkpoint.py)."""
        return QuorumState(files, loop, self.session)

    def distribute(self, dataset: object, batch_size: int, **options: Any) -> Any:
        """The whole global batch of ``batch_size`` per process (fault-tolerant replicas split it
        once the quorum is known)."""
        return super().distribute(dataset, batch_size * self.shards, **options)

    def evaluation_sums(self, data: object, batch_size: int, sums_of: SumsOf) -> torch.Tensor:
        """Each replica of the last step's quorum scores its part of ``data`` (evaluation.py), each shard
        its part of that."""
        return evaluation_sums(self.session, data, batch_size, sums_of, (self.shards, dist.get_rank()))

    # ----- the step ---------------------------------------------------------------------------
    def train_step(
        self, model: nn.Module, loss_fn: LossFn, optimizer: Optimizer, inputs: Any, targets: Any
    ) -> StepOutput:
        """One committed step of the global batch on this shard (session.py)."""
        return self.session.step(model, optimizer, lambda step: self._gradient(model, loss_fn, inputs, targets, step))

    def _gradient(self, model: nn.Module, loss_fn: LossFn, inputs: Any, targets: Any, step: int) -> tuple[Any, Any]:
        """This shard's slice of its replica's part: the backward pass (the replica's
        reduce-scatter leaves this shard the part's mean gradient of its parameters), then
        that shard weighted by the part's share and summed with the same shard of the quorum."""
        total = num_examples(targets)
        part = self.session.part(total)
        size = part.stop - part.start
        mine = part_of(size, dist.get_rank(), self.shards)
        rows = slice(part.start + mine.start, part.start + mine.stop)
        x, y = map_tensors(inputs, lambda t: t[rows]), map_tensors(targets, lambda t: t[rows])
        weight = (rows.stop - rows.start) / size
        loss, outputs = self.recipe.forward_backward(
            model,
            loss_fn,
            x,
            y,
            self.device,
            no_sync=lambda: self.no_sync(model),
            scale=lambda value: value * (weight * self.shards),
        )
        part_loss = (loss.detach() * weight).to(torch.float32)
        dist.all_reduce(part_loss)  # the replica's part's mean loss
        params = [p for p in model.parameters() if p.requires_grad]
        return self.session.sum_over_quorum(params, part_loss, size / total, step, targets), outputs

    # ----- accounting and state -------------------------------------------------------------
    def step_counters(self) -> dict[str, float]:
        return self.session.step_counters(self._steps, self.wait_seconds)

    def stats(self) -> dict[str, Any]:
        """The session's view of the run, with every shard's gradient bytes between replicas."""
        return {**self.session.group_stats(self.device), "shards_per_replica": self.shards}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), **self.session.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.session.load_state_dict(state)
