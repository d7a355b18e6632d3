"""Helpers to test distributed code on the CPU: N Gloo processes on loopback.

    def check(k):                       # module level, so spawned processes can import it
        strategy = paratrain.AllReduceStrategy(device="cpu")
        ...
        return result

    results = run_distributed(check, 5, world_size=2)   # [rank 0's result, rank 1's result]

The processes are started by the same elastic launcher as ``paratrain train --workers N``;
a failure in any of them raises WorkerFailed instead of hanging the test.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from paratrain.launch.torchrun import launch


def run_distributed(fn: Callable[..., Any], *args: Any, world_size: int = 2) -> list[Any]:
    """``fn(*args)`` on ``world_size`` processes; their results by rank."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return launch(fn, *args, num_processes=world_size)


def flat_parameters(module: torch.nn.Module) -> torch.Tensor:
    """All parameters of ``module`` as one detached CPU vector (to compare runs)."""
    return torch.cat([p.detach().cpu().reshape(-1) for p in module.parameters()])


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` in the 2-norm."""
    return float((a - b).norm() / b.norm().clamp_min(1e-30))
