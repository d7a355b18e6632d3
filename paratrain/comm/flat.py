"""Gradients as one flat buffer: one collective for a whole model (or stage) instead of one
per tensor, as DDP's buckets do. Used where paratrain reduces gradients itself: a pipeline
stage across replicas, local SGD's first steps, a fault-tolerant quorum's sum, a
tensor-parallel process's part across replicas.

Gloo's ``ReduceOp.AVG`` has an open silent-correctness report (pytorch #162338): a mean is
a sum divided here. Parameters that are DTensors (split by tensor parallelism) are reduced
by their local parts: each process's part, over the processes holding the same one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of a DTensor (a plain tensor is its own)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def flat_gradients(params: Sequence[nn.Parameter]) -> torch.Tensor:
    """A new flat tensor of ``params``' gradients in order (zeros for one without a gradient)."""
    grads = (p.grad if p.grad is not None else torch.zeros_like(p) for p in params)
    return torch.cat([local_part(g).reshape(-1) for g in grads])


def write_gradients(params: Sequence[nn.Parameter], flat: torch.Tensor) -> None:
    """``flat`` (laid out as ``flat_gradients`` lays it) copied into ``params``' gradients,
    made where a parameter has none."""
    offset = 0
    for p in params:
        if p.grad is None:
            p.grad = torch.empty_like(p)
        grad = local_part(p.grad)
        n = grad.numel()
        grad.copy_(flat[offset : offset + n].view_as(grad))
        offset += n


def mean_gradients(params: Sequence[nn.Parameter], group: dist.ProcessGroup | None, size: int) -> int:
    """Each gradient of ``params`` replaced by its mean over the ``size`` processes of
    ``group``, in one all-reduce; the bytes this process handed to it."""
    flat = flat_gradients(params)
    dist.all_reduce(flat, group=group)
    flat /= size
    write_gradients(params, flat)
    return flat.numel() * flat.element_size()
