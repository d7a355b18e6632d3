"""A pipeline stage's gradients: copies of one parameter on several stages summed, the
global norm over every stage clipped, a NaN or Inf anywhere seen by all."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain.parallel.shared import SplitStage
from paratrain.strategies.numerics import finite_gradients


class TiedGradients:
    """Sums the gradients of a parameter's copies (tied weights on several stages) over the
    stages of this pipeline replica that hold one, so that every copy takes one update."""

    def __init__(self, stage: SplitStage, replica: int, num_replicas: int, num_stages: int):
        groups: dict[tuple[int, ...], Any] = {}
        for stages in stage.shared_by:  # the same order on every rank: new_group is collective
            for r in range(num_replicas):
                group = dist.new_group([r * num_stages + s for s in stages])
                if r == replica:
                    groups[stages] = group
        self.entries = [(copies, groups.get(stages)) for copies, stages in stage.tied]
        # A norm counts each parameter once: at the first copy of the first stage holding it.
        self.uncounted = {id(c) for copies, stages in stage.tied for c in copies[1:]}
        self.uncounted |= {id(c) for copies, stages in stage.tied if stage.index != stages[0] for c in copies}

    def __call__(self) -> int:
        """Sum now (after the backward passes of a step); the bytes this process sent."""
        sent = 0
        for copies, group in self.entries:
            first = copies[0]
            grads = [c.grad for c in copies if c.grad is not None]
            first.grad = torch.stack(grads).sum(0) if grads else torch.zeros_like(first)
            if group is not None:
                dist.all_reduce(first.grad, group=group)
                sent += first.grad.numel() * first.grad.element_size()
            for copy in copies[1:]:
                copy.grad = first.grad.clone()
        return sent


def clip_over_stages(
    params: list[nn.Parameter], max_norm: float, group: Any, device: torch.device, uncounted: set[int] = frozenset()
) -> None:
    """Scale ``params``' gradients to the global norm over every stage of this replica (one
    all-reduce of a square sum; replicas hold equal gradients after averaging): each stage
    adds its own, but a copy another stage or copy counts (``uncounted``), and scales its own."""
    grads = [p.grad for p in params if p.grad is not None]
    counted = [p.grad for p in params if p.grad is not None and id(p) not in uncounted]
    square = (
        torch.stack([g.detach().float().pow(2).sum() for g in counted]).sum()
        if counted
        else torch.zeros((), device=device)
    )
    square = square.to(device).reshape(1)
    dist.all_reduce(square, group=group)
    factor = torch.clamp(max_norm / (square.sqrt() + 1e-6), max=1.0)
    if grads:
        torch._foreach_mul_(grads, factor.reshape(()).to(grads[0].dtype))


def nonfinite_anywhere(optimizer: torch.optim.Optimizer, device: torch.device) -> bool:
    """Whether any stage of any replica holds a NaN or Inf gradient: each stage sees only its
    own, so every process says, in one all-reduce of a flag, and all skip alike."""
    flag = torch.tensor([0.0 if finite_gradients(optimizer) else 1.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
