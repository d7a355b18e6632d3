"""Which device a process trains on."""

from __future__ import annotations

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
