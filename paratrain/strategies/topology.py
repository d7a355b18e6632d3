"""Who is who in a run, computed from configuration alone: how many processes, the role of
each rank, its replica, the chief, how messages name it, and which ranks the run survives
losing. The launcher, the supervisor and the checkpointer read a topology before any
process exists; a strategy's runtime reads the same object once it has joined the group.

Words used the same way everywhere:

- *rank*: a process's global rank in the process group, ``0..num_processes-1``;
- *replica*: a data-parallel copy of the model, which reads its own slice of every
  global batch (a pipeline replica is several processes, one per stage);
- *worker*: a process that trains; *shard*: a parameter-server process that serves;
- *chief*: the worker that evaluates, prints and writes files.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, ClassVar

from paratrain.errors import ConfigError

if TYPE_CHECKING:
    from paratrain.comm.transport import ClusterEnv


class Role(str, Enum):
    """What a process does: train (``worker``) or serve parameters (``ps``)."""

    WORKER = "worker"
    PS = "ps"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Topology:
    """Data parallelism over ``num_replicas`` processes, one replica each (single, allreduce)."""

    num_replicas: int = 1

    replaces_lost: ClassVar[bool] = False
    """Whether a lost replica is replaced alone while the others go on (``allreduce-ft``),
    rather than the run restarting or going on without it."""

    whole_batches: ClassVar[bool] = False
    """Whether every replica reads the whole global batch and computes its part of it once
    the step's members are known (fault-tolerant replicas, whose number changes between
    steps); else replica ``r`` reads its ``r``-th slice."""

    @property
    def num_processes(self) -> int:
        return self.num_replicas

    @property
    def batches_per_step(self) -> int:
        """How many ``--batch-size`` batches one global batch is: one per replica."""
        return self.num_replicas

    @property
    def chief_rank(self) -> int:
        return 0

    @property
    def num_servers(self) -> int:
        """Processes that serve instead of training (parameter-server shards); they come
        first in rank order."""
        return 0

    @property
    def expendable_ranks(self) -> frozenset[int]:
        """Ranks whose death the run survives (the rest must all finish): every one where
        a lost replica is replaced, else none."""
        return frozenset(range(self.num_processes)) if self.replaces_lost else frozenset()

    def role(self, rank: int) -> Role:
        return Role.WORKER

    def replica(self, rank: int) -> int:
        """The replica ``rank`` belongs to (for a parameter-server shard: its shard index)."""
        return rank

    def rank_name(self, rank: int) -> str:
        """How messages name ``rank``."""
        return f"worker {rank}"

    def rank_names(self) -> list[str]:
        return [self.rank_name(rank) for rank in range(self.num_processes)]

    # ----- checkpoints: which part of a checkpoint each process writes ----------------------
    def checkpoint_parts(self) -> list[str]:
        """The parts of a complete checkpoint: one per process by default."""
        return [f"rank-{r}" for r in range(self.num_processes)]

    def checkpoint_part(self, rank: int) -> str | None:
        """The part ``rank`` writes (its position, random generators, strategy state); None
        where it writes none."""
        return f"rank-{rank}"

    def model_part(self, rank: int) -> str | None:
        """The part holding ``rank``'s model and optimizer: replicas are identical, so rank
        0's; None where the model lives elsewhere (parameter servers)."""
        return "rank-0"

    # ----- a cluster started elsewhere (torchrun, TF_CONFIG) --------------------------------
    def check_cluster(self, cluster: ClusterEnv, strategy: str) -> None:
        """ConfigError when a cluster started elsewhere does not fit this topology."""
        if cluster.num_ps:
            raise ConfigError(
                f"the cluster lists {cluster.num_ps} parameter-server tasks; strategy "
                f"{strategy} has none (use a ps-* strategy, or drop the ps job)"
            )
        if cluster.world_size != self.num_processes:
            raise ConfigError(
                f"the cluster has {cluster.world_size} processes but --strategy {strategy} "
                f"with --workers {self.num_replicas} needs {self.num_processes}"
            )


def replicas_of(workers: int | None, group: int, flag: str) -> int:
    """The replicas of a run of ``workers`` processes (None or 1: one replica) where each
    replica is ``group`` processes (``flag`` names the option that sets it)."""
    processes = workers if workers and workers > 1 else group
    if processes % group:
        raise ConfigError(f"--workers {processes} is not a multiple of {flag} {group}")
    return processes // group
