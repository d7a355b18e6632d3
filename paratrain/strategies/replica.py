"""Data parallelism with one replica per process, all in the default process group: the
common part of allreduce, local-sgd, diloco and fsdp."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from paratrain.comm.transport import cluster_from_env, default_backend
from paratrain.strategies.base import Strategy
from paratrain.strategies.device import resolve_device

if TYPE_CHECKING:
    from paratrain.comm.codecs import Codec


class ReplicaStrategy(Strategy):
    """Data parallelism with one replica per process, all in the default process group
    (allreduce, local-sgd, diloco, fsdp): joining it, sums over the replicas, and the
    codec (``self.codec``) in the metrics file's description."""

    codec: Codec

    def setup(self) -> None:
        """Join as one of the run's replicas: the local rank decides the device, the device
        the backend."""
        if not self._ready:
            cluster = cluster_from_env()
            self.device = resolve_device(self.device_preference, cluster.local_rank if cluster else 0)
            self._join_group(default_backend(self.device))
            self.process_rank = dist.get_rank()
            self.topology = self.topology_of(dist.get_world_size())
        super().setup()

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "compression": self.codec.name}

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor
