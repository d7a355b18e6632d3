"""Who is who in a pipeline run, from its configuration alone: replicas of ``--stages``
processes (of ``--tensor-parallel`` processes each, in 3-D), and which of them is the chief
and writes which checkpoint part."""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.strategies.topology import Topology, replicas_of


@dataclass(frozen=True)
class PipelineTopology(Topology):
    """``num_replicas`` pipeline replicas of ``num_stages`` stages of ``tensor`` processes;
    global rank ``(replica * num_stages + stage) * tensor + shard``: the processes of one
    stage are neighbours, as the GPUs of one machine joined by its fastest links (the
    device mesh (dp, pp, tp) of torchtitan); with ``tensor`` 1, ``replica * num_stages +
    stage``. The chief is the last stage of replica 0 (shard 0: it holds the loss and the
    logits). Every process writes its own checkpoint part, model included."""

    num_stages: int = 2
    tensor: int = 1

    @classmethod
    def of(cls, workers: int | None, num_stages: int, tensor: int = 1) -> PipelineTopology:
        """The topology of ``workers`` processes (None or 1: one pipeline) in ``num_stages``
        stages of ``tensor`` processes: the one place it is computed, from the options or
        from a strategy."""
        flag = "--stages" if tensor == 1 else "--stages x --tensor-parallel"
        replicas = replicas_of(workers, num_stages * tensor, flag)
        return cls(num_replicas=replicas, num_stages=num_stages, tensor=tensor)

    @property
    def num_processes(self) -> int:
        return self.num_replicas * self.num_stages * self.tensor

    @property
    def chief_rank(self) -> int:
        return (self.num_stages - 1) * self.tensor

    def replica(self, rank: int) -> int:
        return rank // (self.num_stages * self.tensor)

    def stage(self, rank: int) -> int:
        return rank // self.tensor % self.num_stages

    def shard(self, rank: int) -> int:
        """Which part of its stage's split layers ``rank`` holds (0 without tensor parallelism)."""
        return rank % self.tensor

    def rank_name(self, rank: int) -> str:
        name = f"stage {self.stage(rank)}"
        if self.tensor > 1:
            name = f"tensor shard {self.shard(rank)} of {name}"
        return f"{name} of replica {self.replica(rank)}" if self.num_replicas > 1 else name

    def model_part(self, rank: int) -> str | None:
        return self.checkpoint_part(rank)

    def groups(self) -> dict[str, list[list[int]]]:
        """The ranks of each group of the mesh: ``tp`` (a stage's processes, which split its
        layers), ``pp`` (one shard of each stage of a replica: the activations flow there)
        and ``dp`` (one stage's shard in every replica: its gradients are averaged there)."""
        replicas = self.num_replicas
        stages = self.num_stages
        tensor = self.tensor

        def rank(replica: int, stage: int, shard: int) -> int:
            return (replica * stages + stage) * tensor + shard

        return {
            "tp": [[rank(r, s, t) for t in range(tensor)] for r in range(replicas) for s in range(stages)],
            "pp": [[rank(r, s, t) for s in range(stages)] for r in range(replicas) for t in range(tensor)],
            "dp": [[rank(r, s, t) for r in range(replicas)] for s in range(stages) for t in range(tensor)],
        }
