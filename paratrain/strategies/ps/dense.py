"""The dense part of a model with tables, all-reduced among the workers (``--dense
allreduce``): PERSIA's hybrid. The shards hold only the tables (by rows); every worker
keeps its own copy of the rest of the model, sums its gradient with the others' over a
process group of the workers alone (sum, then divide: Gloo's AVG has an open
correctness report) and steps the user's optimizer itself, so the dense part is
synchronous whatever the tables' mode: in ps-async the rows are applied as they come and
the dense layers in lockstep.

Made by every process of the run (a process group is made by all ranks), used by the
workers."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from paratrain.comm.flat import mean_gradients


class DenseAllReduce:
    def __init__(self, num_shards: int, num_workers: int):
        self.num_workers = num_workers
        self.first = num_shards  # the chief's rank: every worker starts from its copy
        self.group = dist.new_group(list(range(num_shards, num_shards + num_workers)))
        self.bytes_sent = 0

    def prepare(self, model: nn.Module) -> None:
        """Every worker starts from the chief's dense parameters (a script may seed workers apart)."""
        for param in model.parameters():
            dist.broadcast(param.data, src=self.first, group=self.group)

    def begin_step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=False)

    def reduce(self, model: nn.Module) -> bool:
        """Average the dense gradient over the workers (each worker's batch is the same size);
        False when it holds a NaN or Inf, on every worker alike."""
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            return True
        handed = mean_gradients(params, self.group, self.num_workers)
        # a ring all-reduce sends 2 (N - 1) / N of the buffer from each process
        self.bytes_sent += int(2 * (self.num_workers - 1) / self.num_workers * handed)
        return all(bool(torch.isfinite(p.grad).all()) for p in params)

    def set_learning_rate(self, optimizer: torch.optim.Optimizer, lr: float) -> None:
        for group in optimizer.param_groups:
            group["lr"] = lr
