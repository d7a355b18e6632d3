"""Who is who in a pipeline run, from its configuration alone: replicas of ``--stages``
processes, and which of them is the chief and writes which checkpoint part."""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.strategies.topology import Topology, replicas_of


@dataclass(frozen=True)
class PipelineTopology(Topology):
    """``num_replicas`` pipeline replicas of ``num_stages`` processes; global rank
    ``replica * num_stages + stage``. The chief is the last stage of replica 0 (it holds
    the loss and the logits). Every process writes its own checkpoint part, model included."""

    num_stages: int = 2

    @classmethod
    def of(cls, workers: int | None, num_stages: int) -> PipelineTopology:
        """The topology of ``workers`` processes (None or 1: one pipeline) in ``num_stages``
        stages: the one place it is computed, from the options or from a strategy."""
        return cls(num_replicas=replicas_of(workers, num_stages, "--stages"), num_stages=num_stages)

    @property
    def num_processes(self) -> int:
        return self.num_replicas * self.num_stages

    @property
    def chief_rank(self) -> int:
        return self.num_stages - 1

    def replica(self, rank: int) -> int:
        return rank // self.num_stages

    def stage(self, rank: int) -> int:
        return rank % self.num_stages

    def rank_name(self, rank: int) -> str:
        replica, stage = divmod(rank, self.num_stages)
        return f"stage {stage} of replica {replica}" if self.num_replicas > 1 else f"stage {stage}"

    def model_part(self, rank: int) -> str | None:
        return self.checkpoint_part(rank)
