"""The point-to-point link between a parameter-server shard and one worker.

The workers a run starts with are ranks of the run's process group (``WorldLink``). A
worker that joins a running ps-async or ps-backup run (joining.py) is no rank of it: a
Gloo group cannot grow. It meets each shard in a two-process Gloo group of its own
(``PairLink``) made through the run's store. Both send and receive the same messages,
with the same tags; the shard and the worker never ask which kind they hold.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


class WorldLink:
    """``peer`` is a rank of the default process group."""

    def __init__(self, peer: int):
        self.peer = peer

    def isend(self, tensor: torch.Tensor, tag: int) -> Any:
        return dist.isend(tensor, dst=self.peer, tag=tag)

    def irecv(self, tensor: torch.Tensor, tag: int) -> Any:
        return dist.irecv(tensor, src=self.peer, tag=tag)


class PairLink:
    """A two-process Gloo group, this process rank ``rank`` of it (the shard 0, the
    joined worker 1), met under ``prefix`` in ``store``; blocks until both are there or
    ``timeout`` seconds pass (RuntimeError)."""

    def __init__(self, store: Any, prefix: str, rank: int, timeout: float):
        self.peer = 1 - rank
        self.group = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, 2, timedelta(seconds=timeout))

    def isend(self, tensor: torch.Tensor, tag: int) -> Any:
        return self.group.send([tensor], self.peer, tag)

    def irecv(self, tensor: torch.Tensor, tag: int) -> Any:
        return self.group.recv([tensor], self.peer, tag)
