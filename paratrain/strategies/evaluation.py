"""Evaluation, the defaults of every strategy (``Strategy.forward``, ``Strategy.score`` and
``Strategy.evaluation_sums``): of one batch, the model's outputs, then the loss and each
metric of them; of a data set, each replica's part, summed over the replicas. A mode
overrides them where its outputs are held elsewhere (a pipeline's last stage) or come
otherwise (tensor's logits split by vocabulary: the loss takes them split, the metrics
whole), or where its replicas change while it runs (fault-tolerant modes split the data by
the quorum: fault_tolerant/evaluation.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
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
    def distribute(self, dataset: object, batch_size: int, **options: Any) -> Iterable[Any]: ...
    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor: ...


#: ``sums_of(batches)``: a process's evaluation sums over ``batches`` (the trainer's: the
#: examples, then the loss and each metric times the examples).
SumsOf = Callable[[Iterable[Any]], torch.Tensor]


def evaluation_sums(strategy: Evaluated, data: object, batch_size: int, sums_of: SumsOf) -> torch.Tensor:
    """``sums_of`` this replica's part of ``data`` (``batch_size`` examples a batch), summed
    over the replicas: every example counted once."""
    batches = strategy.distribute(data, batch_size, shuffle=False, drop_last=False)
    return strategy.all_reduce_sum(sums_of(batches))


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
