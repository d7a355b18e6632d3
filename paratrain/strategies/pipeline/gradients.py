"""A pipeline stage's gradients: copies of one parameter on several stages summed, the
global norm over every stage clipped, a NaN or Inf anywhere seen by all. With tensor
parallelism inside the stages (mesh.py) a gradient may be a DTensor: each process works on
its part (``local_part``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain.comm.flat import local_part
from paratrain.parallel.shared import SplitStage
from paratrain.strategies.numerics import finite_on_every_process, sharded_gradients


class TiedGradients:
    """Sums the gradients of a parameter's copies (tied weights on several stages) over the
    stages of this pipeline replica that hold one, so that every copy takes one update. In
    3-D (``tensor`` processes a stage, this one ``shard``) over the processes of those stages
    that hold the same part: the holders split the parameter alike (an embedding's and an
    output layer's vocabulary rows), so their parts line up."""

    def __init__(
        self, stage: SplitStage, replica: int, num_replicas: int, num_stages: int, tensor: int = 1, shard: int = 0
    ):
        groups: dict[tuple[int, ...], Any] = {}
        for stages in stage.shared_by:  # the same order on every rank: new_group is collective
            for r in range(num_replicas):
                for t in range(tensor):
                    group = dist.new_group([(r * num_stages + s) * tensor + t for s in stages])
                    if (r, t) == (replica, shard):
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
            first.grad = _placed_as(first, sum(grads[1:], grads[0]) if grads else torch.zeros_like(first))
            if group is not None:
                part = local_part(first.grad)
                dist.all_reduce(part, group=group)
                sent += part.numel() * part.element_size()
            for copy in copies[1:]:
                copy.grad = first.grad.clone()
        return sent


def clip_over_stages(
    params: list[nn.Parameter],
    max_norm: float,
    group: Any,
    device: torch.device,
    uncounted: set[int] = frozenset(),
    tensor_group: Any = None,
    shard: int = 0,
) -> None:
    """Scale ``params``' gradients to the global norm over every stage of this replica (one
    all-reduce of a square sum; replicas hold equal gradients after averaging): each stage
    adds its own, but a copy another stage or copy counts (``uncounted``), and scales its own.
    With tensor parallelism (``tensor_group``: the stage's processes) each process adds its
    part of a split gradient, and a whole one (replicated) only on shard 0."""
    grads = [local_part(p.grad) for p in params if p.grad is not None]
    counted = [
        local_part(p.grad)
        for p in params
        if p.grad is not None and id(p) not in uncounted and not (shard and _replicated(p.grad))
    ]
    square = (
        torch.stack([g.detach().float().pow(2).sum() for g in counted]).sum()
        if counted
        else torch.zeros((), device=device)
    )
    square = square.to(device).reshape(1)
    if tensor_group is not None:
        dist.all_reduce(square, group=tensor_group)
    dist.all_reduce(square, group=group)
    factor = torch.clamp(max_norm / (square.sqrt() + 1e-6), max=1.0)
    if grads:
        torch._foreach_mul_(grads, factor.reshape(()).to(grads[0].dtype))


def nonfinite_anywhere(optimizer: torch.optim.Optimizer, device: torch.device) -> bool:
    """Whether any stage of any replica holds a NaN or Inf gradient: each stage sees only its
    own, so every process says, in one all-reduce of a flag, and all skip alike."""
    return not finite_on_every_process(sharded_gradients(optimizer), device)


def diverged_anywhere(module: torch.nn.Module, device: torch.device) -> bool:
    """Whether any stage's parameters hold a NaN or Inf (one all-reduce, as above): every
    stage then raises DivergedError alike, instead of one raising while the others go on
    to the next step's sends."""
    return not finite_on_every_process([local_part(p) for p in module.parameters()], device)


def _replicated(grad: torch.Tensor) -> bool:
    """Whether ``grad`` is whole on every process of its mesh (a DTensor replicated there)."""
    placements = getattr(grad, "placements", None)
    return placements is not None and all(p.is_replicate() for p in placements)


def _placed_as(param: nn.Parameter, grad: torch.Tensor) -> torch.Tensor:
    """``grad`` placed as ``param`` is, where both are DTensors: an embedding split by rows
    gets its gradient whole (Replicate) from DTensor, and its holders on two stages sum
    their parts, which must line up."""
    placements = getattr(param, "placements", None)
    if placements is None or grad.placements == placements:
        return grad
    return grad.redistribute(param.device_mesh, placements)
