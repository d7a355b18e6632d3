"""The step of a replica that updates its own parameters (single, allreduce, fsdp, local SGD,
DiLoCo's inner steps, fault-tolerant replicas): forward and backward over the recipe's
micro-batches, the mode's gradient reduction, clipping, the NaN policy and the update (under
fp16, the gradient scaler's)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from paratrain.strategies.recipe import StepRecipe
from paratrain.strategies.step import LossFn, StepOutput, same
from paratrain.timeline import span


class Replica(Protocol):
    """What the step asks of its strategy (base.Strategy has it all)."""

    recipe: StepRecipe
    scaler: torch.amp.GradScaler | None
    device: torch.device
    steps_taken: int

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]: ...
    def reduce_gradients(self, model: nn.Module) -> None: ...
    def clip_gradients(self, model: nn.Module) -> None: ...
    def skip_nonfinite(self, model: nn.Module, loss: torch.Tensor, finite: Callable[[], bool]) -> bool: ...
    def gradients_finite(self, optimizer: torch.optim.Optimizer) -> bool: ...
    def count_update(self, updates: int = 1) -> None: ...


def local_step(
    strategy: Replica,
    model: nn.Module,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer,
    inputs: torch.Tensor,
    targets: torch.Tensor,
) -> StepOutput:
    """One step of ``strategy``'s replica on its batch; counts it on the strategy."""
    optimizer.zero_grad(set_to_none=True)
    scaler = strategy.scaler
    loss, outputs = strategy.recipe.forward_backward(
        model,
        loss_fn,
        inputs,
        targets,
        strategy.device,
        no_sync=lambda: strategy.no_sync(model),
        scale=scaler.scale if scaler is not None else same,
    )
    strategy.reduce_gradients(model)
    strategy.steps_taken += 1
    if scaler is not None:  # fp16: the scaler skips a step whose gradient overflowed
        scaler.unscale_(optimizer)
        if strategy.recipe.clip_grad_norm:
            strategy.clip_gradients(model)
        with span("optimizer"):
            scaler.step(optimizer)
            scaler.update()
        strategy.count_update()
        return StepOutput(loss, outputs)
    if strategy.recipe.clip_grad_norm:
        strategy.clip_gradients(model)
    # Gradients are already averaged: every replica sees the same and skips alike.
    if strategy.skip_nonfinite(model, loss, lambda: strategy.gradients_finite(optimizer)):
        return StepOutput(loss, outputs, skipped=True)
    with span("optimizer"):
        optimizer.step()
    strategy.count_update()
    return StepOutput(loss, outputs)
