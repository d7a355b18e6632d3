"""Evaluation of one batch, the defaults of every strategy (``Strategy.forward`` and
``Strategy.score``): the model's outputs, then the loss and each metric of them. A mode
overrides them where its outputs are held elsewhere (a pipeline's last stage) or come
otherwise (tensor's logits split by vocabulary: the loss takes them split, the metrics whole)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import nn

from paratrain.strategies.recipe import StepRecipe
from paratrain.strategies.step import LossFn


class Evaluated(Protocol):
    """What evaluation asks of its strategy (base.Strategy has it all)."""

    recipe: StepRecipe
    device: torch.device

    def forward(self, model: nn.Module, inputs: Any) -> Any: ...


def forward(strategy: Evaluated, model: nn.Module, inputs: Any) -> Any:
    """Evaluation's forward pass on ``model`` (unwrapped): the logits, or None on a process
    that holds none (pipeline stages before the last, which pass activations on)."""
    return strategy.recipe.forward(model, inputs, strategy.device)


def score(
    strategy: Evaluated, model: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn, metrics: Sequence[LossFn]
) -> list[torch.Tensor] | None:
    """``[loss, *metrics]`` of the batch's outputs (0-d tensors, the batch's means), or None
    where ``strategy.forward`` gives none."""
    outputs = strategy.forward(model, inputs)
    if outputs is None:
        return None
    return [loss_fn(outputs, targets), *(metric(outputs, targets) for metric in metrics)]
