"""A process's random-number generators, saved with a checkpoint and restored on resume."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    """This process's random-number generators: Python's, NumPy's, torch's CPU and CUDA ones."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": _numpy_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _numpy_state() -> tuple[Any, ...]:
    # As a tensor: a checkpoint holds tensors and plain values only (weights_only loads).
    kind, keys, position, has_gauss, cached = np.random.get_state()
    return kind, torch.from_numpy(keys.copy()), position, has_gauss, cached


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore ``rng_state()``'s generators; its tensors may come back on a GPU (a checkpoint
    loaded onto the training device), the generators take them from host memory."""
    random.setstate(state["python"])
    kind, keys, position, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.cpu().numpy(), position, has_gauss, cached))
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
