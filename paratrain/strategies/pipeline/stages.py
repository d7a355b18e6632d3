"""How a pipeline process makes its stage of the user's model, and what a stage takes of a batch.

An ``nn.Sequential`` is cut into consecutive layers (parallel/split.py) and the stage holds the user's own
layers; any other model is traced on the first micro-batch and cut before named modules (parallel/traced.py),
and since the traced graph keeps its shapes, every batch is fed in micro-batches of that shape. Stage 0 is fed
a tensor batch's inputs or a dict batch's tensors but ``labels`` (an all-ones ``attention_mask`` left out); the
last stage scores with the run's loss, or for a dict batch with the model's own ``loss_function``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain.comm.transport import wire_device
from paratrain.errors import ConfigError
from paratrain.parallel.split import balanced_bounds, layer_costs

#: The key of a dict batch that holds the targets; what the model's loss function takes.
LABELS = "labels"


def is_layered(model: nn.Module, split_points: list[int] | list[str] | None) -> bool:
    """Whether ``model`` is cut into its layers (an nn.Sequential, split at indices if any)."""
    return isinstance(model, nn.Sequential) and not (split_points and isinstance(split_points[0], str))


def keep_stage_parameters(optimizer: torch.optim.Optimizer, copies: dict[int, list[nn.Parameter]]) -> None:
    """The optimizer was made for the whole model: keep the stage's copies of its parameters
    (same class, same groups and hyperparameters)."""
    for group in optimizer.param_groups:
        group["params"] = [copy for p in group["params"] for copy in copies.get(id(p), [])]


def feed(inputs: Any) -> tuple[tuple[torch.Tensor, ...], tuple[str, ...]]:
    """What stage 0 is fed of a batch's inputs, and by which keywords (none: positionally)."""
    if torch.is_tensor(inputs):
        return (inputs,), ()
    if isinstance(inputs, Mapping):
        mask = inputs.get("attention_mask")
        if mask is not None and not bool((mask == 1).all()):
            raise ConfigError(
                "--strategy pipeline traces the model without an attention mask: this batch's attention_mask "
                "masks positions (padding); pack sequences to one length without padding"
            )
        keys = tuple(k for k, v in inputs.items() if torch.is_tensor(v) and k not in (LABELS, "attention_mask"))
        return tuple(inputs[k] for k in keys), keys
    if isinstance(inputs, (tuple, list)) and all(torch.is_tensor(x) for x in inputs):
        return tuple(inputs), ()
    raise ConfigError(f"--strategy pipeline feeds stage 0 tensors; this batch's inputs are a {type(inputs).__name__}")


def scored(inputs: Any, targets: Any) -> torch.Tensor:
    """What the last stage scores the outputs against: the targets, or a dict batch's labels."""
    if isinstance(targets, Mapping):
        if LABELS not in targets:
            raise ConfigError(
                f"--strategy pipeline scores a dict batch's logits against its {LABELS!r}; this batch has "
                f"{', '.join(targets)}"
            )
        return targets[LABELS]
    return targets


def stage_loss(model: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor], targets: Any) -> Callable:
    """The last stage's loss of (outputs, scored targets): the run's loss, or for a dict batch
    the model's own loss function."""
    if not isinstance(targets, Mapping):
        return loss_fn
    if not getattr(loss_fn, "uses_model_loss", False):
        raise ConfigError(
            "--strategy pipeline scores a dict batch with the model's own loss on its last stage: leave the "
            "loss out (the default), or give (inputs, targets) batches with a loss of (outputs, targets)"
        )
    return own_loss(model)


def own_loss(model: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The model's own loss of (logits, labels): a Hugging Face model's ``loss_function``."""
    own = getattr(model, "loss_function", None)
    if own is None:
        raise ConfigError(
            f"--strategy pipeline scores a dict batch with the model's loss_function, which "
            f"{type(model).__name__} has not (a Hugging Face model has): give (inputs, targets) batches and a loss"
        )
    return lambda logits, labels: own(logits, labels, vocab_size=logits.shape[-1])


class MicrobatchTraffic:
    """The bytes one training micro-batch sends from a stage: its outputs, forward (all but
    the last stage), and the gradient of its inputs, back (all but the first); measured by a
    forward hook on the stage. A step sends this once per micro-batch."""

    def __init__(self, module: nn.Module, first: bool, last: bool):
        self.first = first
        self.last = last
        self.bytes = 0
        module.register_forward_hook(self._measure)

    def _measure(self, _module: nn.Module, args: tuple, output: Any) -> None:
        if torch.is_grad_enabled():  # evaluation's forward passes are not training traffic
            self.bytes = (0 if self.last else nbytes(output)) + (0 if self.first else nbytes(args))


def nbytes(tensors: Any) -> int:
    """Bytes of a tensor or of a tuple of them."""
    if torch.is_tensor(tensors):
        return tensors.numel() * tensors.element_size()
    return sum(nbytes(t) for t in tensors)


def forward_in_shape(
    forward: Callable[[tuple[torch.Tensor, ...]], Any], tensors: tuple[torch.Tensor, ...], example: tuple
) -> Any:
    """``forward`` over ``tensors`` in chunks of the traced example's rows (the last padded by
    repeating its last row); the outputs of the real rows, or None where ``forward`` gives none."""
    rows, total = len(example[0]), len(tensors[0])
    for tensor, shape in zip(tensors, example):
        if tensor.shape[1:] != shape.shape[1:]:
            raise ConfigError(
                f"--strategy pipeline traced the model on inputs of shape {tuple(shape.shape[1:])} per example; "
                f"this batch's are {tuple(tensor.shape[1:])}: a traced stage keeps its shapes"
            )
    outputs = []
    for start in range(0, total, rows):
        chunk = tuple(t[start : start + rows] for t in tensors)
        short = rows - len(chunk[0])
        if short:
            chunk = tuple(torch.cat([c, c[-1:].expand(short, *c.shape[1:])]) for c in chunk)
        out = forward(chunk)
        if out is not None:
            outputs.append(out[: rows - short])
    return torch.cat(outputs) if outputs else None


def agreed_bounds(
    layers: list[nn.Module], example: torch.Tensor | None, num_stages: int, num_microbatches: int, device: torch.device
) -> list[tuple[int, int]]:
    """The split balanced by measured time, measured on global rank 0 and sent to every rank
    (timings differ between processes, the split must not)."""
    edges = torch.zeros(num_stages + 1, dtype=torch.int64, device="cpu")
    if dist.get_rank() == 0:
        micro = example[: max(1, len(example) // num_microbatches)].to(device)
        costs = layer_costs([layer.to(device) for layer in layers], "time", micro)
        bounds = balanced_bounds(costs, num_stages)
        edges = torch.tensor([a for a, _ in bounds] + [bounds[-1][1]], dtype=torch.int64, device="cpu")
    edges = edges.to(wire_device(device))
    dist.broadcast(edges, src=0)
    e = edges.cpu().tolist()
    return list(zip(e, e[1:]))
