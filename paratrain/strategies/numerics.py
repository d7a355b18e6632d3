"""Whether a step's numbers are finite: the checks behind ``--on-nan`` (skip an update whose
gradient is NaN or Inf; stop when the parameters themselves are), one host sync each."""

from __future__ import annotations

import torch
from torch import nn


def finite_parameters(model: nn.Module) -> bool:
    return bool(torch.isfinite(torch.stack(torch._foreach_norm([p.detach() for p in model.parameters()])).sum()))


def finite_gradients(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every gradient the optimizer would apply is finite (one host sync)."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not grads:
        return True
    return bool(torch.isfinite(torch.stack(torch._foreach_norm(grads)).sum()))
