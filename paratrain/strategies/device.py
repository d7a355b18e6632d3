"""Which device a process trains on."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from paratrain.errors import ConfigError


def resolve_device(preference: str, local_rank: int = 0) -> torch.device:
    """``auto`` takes this process's GPU when there is one, else the CPU."""
    if preference == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        if preference == "cuda":
            raise ConfigError("--device cuda: no CUDA device is available; use --device cpu or auto")
        return torch.device("cpu")
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def default_device(device: torch.device | str) -> contextlib.AbstractContextManager[Any]:
    """``device`` as the default for tensors made without one; nothing where it already is.
    A default device is a torch function mode: every torch call of the step would go through
    Python to it, for factory calls alone to read (the mlp's steps ran visibly faster
    without it: benchmarks/tensorflow_mirrored.py)."""
    if torch.device(device) == torch.get_default_device():
        return contextlib.nullcontext()
    return torch.device(device)
