"""Whether a step's numbers are finite: the checks behind ``--on-nan`` (skip an update whose
gradient is NaN or Inf; stop when the parameters themselves are), one host sync each."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from paratrain.comm.flat import local_part


def finite_parameters(model: nn.Module) -> bool:
    return bool(torch.isfinite(torch.stack(torch._foreach_norm([p.detach() for p in model.parameters()])).sum()))


def finite_gradients(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every gradient the optimizer would apply is finite (one host sync)."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not grads:
        return True
    return bool(torch.isfinite(torch.stack(torch._foreach_norm(grads)).sum()))


def sharded_gradients(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """This process's parts of the gradients the optimizer would apply (DTensors' local parts)."""
    grads = (p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None)
    return [part for part in map(local_part, grads) if part.numel()]


def sharded_parameters(model: nn.Module) -> list[torch.Tensor]:
    return [part for part in (local_part(p.detach()) for p in model.parameters()) if part.numel()]


def finite_on_every_process(parts: list[torch.Tensor], device: torch.device) -> bool:
    """Whether every process's ``parts`` are finite: one all-reduce, the same answer everywhere."""
    bad = torch.zeros(1, device=device)
    if parts:
        bad += (~torch.isfinite(torch.stack(torch._foreach_norm(parts)).sum())).float()
    dist.all_reduce(bad)
    return not bool(bad.item())
