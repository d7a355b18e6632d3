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

from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class DenseAllReduce:
    def __init__(self, num_shards: int, num_workers: int):
        self.num_workers = num_workers
        self.first = num_shards  # the chief's rank: every worker starts from its copy
        self.group = dist.new_group(list(range(num_shards, num_shards + num_workers)))
        self.bytes_sent = 0

    def prepare(self, model: nn.Module) -> None:
        """Every worker starts from the chief's dense parameters (a script may seed workers apart)."""
        flat = self._flat([p.detach() for p in model.parameters()])
        dist.broadcast(flat, src=self.first, group=self.group)
        self._unflat(flat, [p.data for p in model.parameters()])

    def begin_step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=False)

    def reduce(self, model: nn.Module) -> bool:
        """Average the dense gradient over the workers (each worker's batch is the same size);
        False when it holds a NaN or Inf, on every worker alike."""
        params = [p for p in model.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = self._flat(grads)
        dist.all_reduce(flat, group=self.group)
        flat.div_(self.num_workers)
        for p, g in zip(params, self._views(flat, grads)):
            p.grad = g
        # a ring all-reduce sends 2 (N - 1) / N of the buffer from each process
        self.bytes_sent += int(2 * (self.num_workers - 1) / self.num_workers * flat.numel() * flat.element_size())
        return bool(torch.isfinite(flat).all())

    def set_learning_rate(self, optimizer: torch.optim.Optimizer, lr: float) -> None:
        for group in optimizer.param_groups:
            group["lr"] = lr

    @staticmethod
    def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.zeros(0)

    @staticmethod
    def _views(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
        out, at = [], 0
        for t in like:
            out.append(flat[at : at + t.numel()].view_as(t))
            at += t.numel()
        return out

    def _unflat(self, flat: torch.Tensor, into: list[Any]) -> None:
        for t, v in zip(into, self._views(flat, into)):
            t.copy_(v)
