"""Gradients as one flat buffer: one collective for a whole model (or stage) instead of one
per tensor, as DDP's buckets do. Used where paratrain reduces gradients itself: a pipeline
stage across replicas, local SGD's first steps, a fault-tolerant quorum's sum.

Gloo's ``ReduceOp.AVG`` has an open silent-correctness report (pytorch #162338): a mean is
a sum divided here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn


def flat_gradients(params: Sequence[nn.Parameter]) -> torch.Tensor:
    """A new flat tensor of ``params``' gradients in order (zeros for one without a gradient)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])


def write_gradients(params: Sequence[nn.Parameter], flat: torch.Tensor) -> None:
    """``flat`` (laid out as ``flat_gradients`` lays it) copied into ``params``' gradients,
    made where a parameter has none."""
    offset = 0
    for p in params:
        n = p.numel()
        if p.grad is None:
            p.grad = torch.empty_like(p)
        p.grad.copy_(flat[offset : offset + n].view_as(p))
        offset += n


def mean_gradients(params: Sequence[nn.Parameter], group: dist.ProcessGroup | None, size: int) -> int:
    """Each gradient of ``params`` replaced by its mean over the ``size`` processes of
    ``group``, in one all-reduce; the bytes this process handed to it."""
    flat = flat_gradients(params)
    dist.all_reduce(flat, group=group)
    flat /= size
    write_gradients(params, flat)
    return flat.numel() * flat.element_size()
