"""What a strategy's training step takes and returns, whatever the mode."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class StepOutput:
    """What one training step returns, detached from the graph."""

    loss: torch.Tensor
    """Mean loss over this replica's batch (a 0-d tensor on the device)."""
    logits: torch.Tensor
    """Model outputs for this replica's batch (under tensor's loss parallel, the logits split
    by vocabulary: DTensors, ``full_tensor()`` makes them whole)."""
    skipped: bool = False
    """The update was skipped: a NaN or Inf loss or gradient, with ``on_nan = "skip"``."""
    position: dict[str, Any] | None = None
    """Where the loop goes on instead of after this step (a ``Trainer.state_dict``): a
    fault-tolerant replica that healed from a peer several steps ahead takes the peer's."""


def uncompiled(model: nn.Module) -> nn.Module:
    """The module ``torch.compile`` wrapped, or ``model`` itself."""
    return getattr(model, "_orig_mod", model)


def same(loss: torch.Tensor) -> torch.Tensor:
    return loss
