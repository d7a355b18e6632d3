"""How one training step computes, the same under every strategy: numeric precision, gradient accumulation,
clipping, memory format.

``StepRecipe`` is handed to ``strategy.prepare``; each strategy's ``train_step`` runs its passes through
``forward_backward`` here and clips with its own notion of the global norm. Its fields: ``precision``
(``fp32``, ``bf16``, or ``fp16`` with a gradient scaler, which needs the optimizer where the gradient is
made: ``single`` and ``allreduce``); ``accumulate`` (micro-batches per optimizer step, each loss weighted by
its share, so the gradient is that of the whole batch); ``clip_grad_norm`` (over the whole model, all stages
included); ``channels_last``; ``activation_checkpointing`` (``none``, ``blocks``, ``every-K``:
``activation.py``); ``pool_before_relu`` (``pool_relu.py``); ``onednn_layers`` (None: on non-Intel x86,
True: always, False: never; ``cpu_layers.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paratrain.data.batch import call_model, map_tensors, split_batch
from paratrain.errors import ConfigError
from paratrain.strategies.activation import checkpoint_activations, checkpoint_every
from paratrain.strategies.cpu_layers import use_onednn_layers
from paratrain.strategies.pool_relu import pool_before_relu
from paratrain.timeline import span

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_step_options(mode: Any, name: str, precision: str, compile: bool, channels_last: bool) -> None:
    """ConfigError for step options the strategy class ``mode`` cannot run (``name``: its
    name): fp16's scaler needs the optimizer local, and some modes cannot be compiled or
    keep parameters in channels-last order (their class flags say)."""
    if channels_last and not mode.takes_channels_last:
        raise ConfigError(
            f"--channels-last: --strategy {name} shards parameters, which must be contiguous; leave it off"
        )
    if precision == "fp16" and mode.scaler_missing:
        raise ConfigError(f"--precision fp16 needs a gradient scaler that {mode.scaler_missing}; use --precision bf16")
    if precision == "fp16" and not mode.scales_loss:
        raise ConfigError(
            f"--precision fp16 needs a gradient scaler beside the optimizer, which --strategy {name} "
            "runs elsewhere; use --precision bf16, or --strategy single or allreduce"
        )
    if compile and not mode.compiles:
        raise ConfigError(f"--compile is not available with --strategy {name}")


@dataclass(frozen=True)
class StepRecipe:
    precision: str = "fp32"
    accumulate: int = 1
    clip_grad_norm: float | None = None
    channels_last: bool = False
    activation_checkpointing: str = "none"
    pool_before_relu: bool = True
    onednn_layers: bool | None = False

    def __post_init__(self) -> None:
        checkpoint_every(self.activation_checkpointing)
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if not isinstance(self.accumulate, int) or self.accumulate < 1:
            raise ConfigError(f"accumulate must be a whole number >= 1, got {self.accumulate!r}")
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise ConfigError(f"clip_grad_norm must be > 0, got {self.clip_grad_norm!r}")

    @property
    def scaled(self) -> bool:
        """Whether the loss is scaled (fp16): a GradScaler then owns the update."""
        return self.precision == "fp16"

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        dtype = PRECISIONS[self.precision]
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=dtype)

    def prepare_model(self, model: nn.Module) -> nn.Module:
        if self.pool_before_relu:
            pool_before_relu(model)
        if self.onednn_layers is not False:
            use_onednn_layers(model, self.onednn_layers)
        every = checkpoint_every(self.activation_checkpointing)
        if every:
            checkpoint_activations(model, every)
        if self.channels_last:
            model = model.to(memory_format=torch.channels_last)
        return model

    def prepare_inputs(self, inputs: Any) -> Any:
        if not self.channels_last:
            return inputs
        return map_tensors(inputs, _channels_last)

    def forward(self, model: nn.Module, inputs: Any, device: torch.device) -> Any:
        """The model's outputs on ``inputs`` in this precision and memory format."""
        with self.autocast(device):
            return call_model(model, self.prepare_inputs(inputs))

    def forward_backward(
        self,
        model: nn.Module,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        inputs: Any,
        targets: Any,
        device: torch.device,
        no_sync: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
        scale: Callable[[torch.Tensor], torch.Tensor] = lambda loss: loss,
    ) -> tuple[torch.Tensor, Any]:
        """Gradients of the batch's mean loss, accumulated over ``accumulate`` micro-batches;
        ``no_sync()`` wraps every backward pass but the last (DDP's all-reduce runs once).
        Returns the batch's mean loss (detached) and its outputs."""
        parts = split_batch(inputs, targets, self.accumulate)
        total = sum(n for _, _, n in parts)
        losses, outputs = [], []
        for index, (x, y, n) in enumerate(parts):
            last = index == len(parts) - 1
            with contextlib.nullcontext() if last else no_sync():
                with span("forward"):
                    out = self.forward(model, x, device)
                    loss = loss_fn(out, y)
                with span("backward"):  # under DDP: including the wait for the last bucket's all-reduce
                    scale(loss * (n / total) if len(parts) > 1 else loss).backward()
            losses.append(loss.detach().float() * (n / total) if len(parts) > 1 else loss.detach().float())
            outputs.append(out.detach() if torch.is_tensor(out) else out)
        mean = losses[0] if len(losses) == 1 else torch.stack(losses).sum()
        return mean, outputs[0] if len(outputs) == 1 else _concat(outputs)


def _channels_last(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous(memory_format=torch.channels_last) if tensor.dim() == 4 else tensor


def _concat(outputs: list[Any]) -> Any:
    if all(torch.is_tensor(o) for o in outputs):
        return torch.cat(outputs)
    return outputs


def clip_norm(parameters: Iterator[torch.Tensor] | list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over ``parameters``; the norm before clipping."""
    return torch.nn.utils.clip_grad_norm_(list(parameters), max_norm)


def slow_precision(precision: str, device: torch.device) -> str | None:
    """Why ``precision`` is slower than float32 on this CPU, or None: where the processor has
    no bfloat16 (float16) instructions oneDNN takes (AVX-512, AMX), PyTorch computes such
    convolutions and matrix products on its reference path (the plain conv net's step 16x
    float32's on an AVX2 processor: benchmarks/results/step_options_plain_cnn.md)."""
    if device.type != "cpu" or precision == "fp32":
        return None
    name = "_is_mkldnn_bf16_supported" if precision == "bf16" else "_is_mkldnn_fp16_supported"
    native = getattr(torch.ops.mkldnn, name, None)  # PyTorch's own check (its tests use it)
    if native is None or native():
        return None
    capability = torch.backends.cpu.get_cpu_capability()
    return (
        f"--precision {precision} on this CPU ({capability}, no {precision} instructions): PyTorch computes its "
        "convolutions and matrix products on a slow reference path here, several times slower than fp32"
    )


def prefers_channels_last(model: nn.Module, device: torch.device) -> bool:
    """Whether channels-last is on by default (``--channels-last``, ``Trainer(channels_last=
    None)``): for a model with 2-d convolutions on the CPU, where oneDNN's convolutions are
    faster in NHWC (the tutorial CNN here: 0.79x the step time, benchmarks/results/step_options.md)."""
    return device.type == "cpu" and any(isinstance(m, nn.Conv2d) for m in model.modules())
