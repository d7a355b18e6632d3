"""``--schedule wavefront``: a stacked LSTM pipelined one layer per stage over chunks of its
sequence (parallel/wavefront.py), inside the pipeline strategy: the same stages, replicas,
gradient averaging, clipping and checkpoints; ``--microbatches`` chunks along time instead
of along the batch. The model says how it splits (``wavefront_parts()``: the built-in LSTM
classifier does, with ``--lstm-layers`` equal to ``--stages``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paratrain.errors import ConfigError
from paratrain.parallel.wavefront import WavefrontParts, WavefrontStage, check_lstm, layer_of
from paratrain.strategies.pipeline.stages import keep_stage_parameters


def wavefront_parts(model: nn.Module, num_stages: int) -> WavefrontParts:
    """``model``'s parts for the wavefront; ConfigError when it has none, or another number of
    layers than stages."""
    parts = getattr(model, "wavefront_parts", None)
    if parts is None:
        raise ConfigError(
            f"--schedule wavefront pipelines a stacked LSTM one layer a stage; {type(model).__name__} has no "
            "wavefront_parts() (the built-in lstm model has: --model lstm --lstm-layers N)"
        )
    parts = parts()
    check_lstm(parts.lstm)
    if parts.lstm.num_layers != num_stages:
        raise ConfigError(
            f"--schedule wavefront puts one LSTM layer on each stage: the model has {parts.lstm.num_layers} "
            f"layers, --stages is {num_stages} (--lstm-layers {num_stages} for the built-in lstm)"
        )
    return parts


class WavefrontSchedule:
    """Stage ``stage`` of ``num_stages`` (global ranks ``first_rank + k``) of ``model``, over
    ``chunks`` chunks of each sequence; ``module`` holds this stage's parameters."""

    def __init__(self, model: nn.Module, stage: int, num_stages: int, first_rank: int, chunks: int, group: Any):
        self.parts = wavefront_parts(model, num_stages)
        ranks = [first_rank + k for k in range(num_stages)]
        self.wave = WavefrontStage(layer_of(self.parts.lstm, stage), stage, ranks, chunks, group)
        held = [*(self.parts.front_modules if stage == 0 else []), self.wave.layer]
        held += self.parts.back_modules if stage == num_stages - 1 else []
        self.module = nn.ModuleList(held)

    @classmethod
    def of(cls, strategy: Any, model: nn.Module) -> WavefrontSchedule:
        """The schedule of the pipeline ``strategy``'s stage (``--microbatches`` chunks)."""
        args = (strategy.stage, strategy.num_stages, strategy.first_rank, strategy.num_microbatches)
        return cls(model, *args, strategy._pipeline_group)

    def keep(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer made for the whole model keeps this stage's parameters alone."""
        keep_stage_parameters(optimizer, {id(p): [p] for p in self.module.parameters()})
        return optimizer

    def train_step(self, strategy: Any, loss_fn: Any, optimizer: torch.optim.Optimizer, inputs: Any, targets: Any):
        """One step of the pipeline ``strategy`` (strategy.py) on this stage: the waves, then
        its step's common end (averaging over replicas, clipping, a non-finite step skipped)."""
        inputs = strategy.recipe.prepare_inputs(inputs)
        optimizer.zero_grad(set_to_none=True)
        sent = self.wave.bytes_sent
        with strategy.recipe.autocast(strategy.device):
            loss, logits = self.step(loss_fn, inputs, targets)
        strategy._bytes_sent += self.wave.bytes_sent - sent
        return strategy.finish_step(optimizer, loss, logits)

    def _forward(self, inputs: torch.Tensor) -> torch.Tensor | None:
        features = self.parts.front(inputs) if self.wave.is_first else None
        return self.wave.forward(features, len(inputs), self.parts.length(inputs))

    def step(self, loss_fn: Any, inputs: torch.Tensor, targets: Any) -> tuple[torch.Tensor | None, Any]:
        """Forward and backward waves of one batch; the loss (batch mean) and logits on the
        last stage, (None, None) elsewhere."""
        outputs = self._forward(inputs)
        if not self.wave.is_last:
            self.wave.backward()
            return None, None
        leaf = outputs.detach().requires_grad_(True)
        logits = self.parts.back(leaf)
        loss = loss_fn(logits, targets)
        loss.backward()
        self.wave.backward(leaf.grad)
        return loss.detach(), logits

    def forward(self, inputs: torch.Tensor) -> Any:
        """Evaluation: the forward wave alone; the logits on the last stage, None elsewhere."""
        with torch.no_grad():
            outputs = self._forward(inputs)
            return self.parts.back(outputs) if self.wave.is_last else None
