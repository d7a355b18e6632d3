"""Who is who in a tensor-parallel run, from its configuration alone: replicas of
``--tensor-parallel`` processes that split each layer between them."""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.strategies.topology import Topology, replicas_of


@dataclass(frozen=True)
class TensorTopology(Topology):
    """``num_replicas`` data-parallel replicas of ``tensor`` processes each; global rank
    ``replica * tensor + shard``: the processes of one replica are neighbours, as on a
    machine whose devices are joined by its fastest links (the device mesh (replica,
    shard) of torchtitan). Every process reads its replica's slice of each global batch
    and writes its own checkpoint part; the model goes to the checkpoint's DCP files
    (strategies/sharded_files.py), read through rank 0's part."""

    tensor: int = 2

    @classmethod
    def of(cls, workers: int | None, tensor: int) -> TensorTopology:
        """The topology of ``workers`` processes (None or 1: one replica) split ``tensor`` ways."""
        return cls(num_replicas=replicas_of(workers, tensor, "--tensor-parallel"), tensor=tensor)

    @property
    def num_processes(self) -> int:
        return self.num_replicas * self.tensor

    def replica(self, rank: int) -> int:
        return rank // self.tensor

    def rank_name(self, rank: int) -> str:
        replica, shard = divmod(rank, self.tensor)
        return f"tensor shard {shard} of replica {replica}" if self.num_replicas > 1 else f"tensor shard {shard}"
