"""Losses and evaluation metrics by name, and the user's own.

A loss is any callable ``(outputs, targets) -> scalar tensor`` (the batch's mean); a metric any callable
``(outputs, targets) -> tensor`` (the batch's mean value). ``evaluate`` weights each batch by its examples and
sums across replicas in one all-reduce, so a metric is the mean over every evaluation example. ``model`` is
the loss the model returns itself (``outputs.loss``, a dict's ``"loss"``, a scalar), the default for batches
that are dicts of tensors; ``LOSSES`` and ``METRICS`` below name the rest. A loss marked ``loss_parallel = True`` is
``F.cross_entropy`` with the classes last and may be given logits split by vocabulary under ``--strategy
tensor``; any other loss, and every metric, gets them whole.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.data.batch import num_examples
from paratrain.errors import ConfigError

Score = Callable[[Any, Any], torch.Tensor]


def _like(outputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Regression outputs ``(n, 1)`` against targets ``(n,)``: the same shape, float targets."""
    if outputs.shape != targets.shape and outputs.numel() == targets.numel():
        outputs = outputs.reshape(targets.shape)
    return outputs, targets.to(outputs.dtype)


def mse_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(*_like(outputs, targets))


def l1_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.l1_loss(*_like(outputs, targets))


def smooth_l1_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.smooth_l1_loss(*_like(outputs, targets))


def bce_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(*_like(outputs, targets))


def cross_entropy_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of logits ``(n, classes)`` against labels ``(n,)``; of a sequence's
    logits ``(n, positions, classes)`` against a label per position ``(n, positions)``, as
    language models give them (the classes last), the mean over every position; and of
    PyTorch's own layout ``(n, classes, d1, ...)`` against ``(n, d1, ...)``."""
    if outputs.dim() > 2 and outputs.shape[:-1] == targets.shape:
        return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))
    return F.cross_entropy(outputs, targets)


# F.cross_entropy of the outputs, whose classes are last: tensor parallelism may hand it the
# logits split by vocabulary (torch's loss_parallel computes it on them; strategies/tensor/loss.py).
cross_entropy_loss.loss_parallel = True  # type: ignore[attr-defined]


def model_loss(outputs: Any, batch: Any) -> torch.Tensor:
    """The loss the model returned: ``outputs.loss`` or ``outputs["loss"]`` (a Hugging Face
    ``ModelOutput`` is both), or ``outputs`` itself when it is a scalar tensor."""
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else getattr(outputs, "loss", outputs)
    if not torch.is_tensor(loss) or loss.dim() != 0:
        raise ConfigError(
            f"loss 'model': the model returned {type(outputs).__name__} with no loss (a scalar tensor, .loss or "
            "['loss']); give the batch its labels, or name a loss (cross_entropy, ...) or pass a callable"
        )
    return loss


model_loss.uses_model_loss = True  # type: ignore[attr-defined]  # a pipeline computes it on its last stage

LOSSES: dict[str, Callable[[], Score]] = {
    "model": lambda: model_loss,
    "cross_entropy": lambda: cross_entropy_loss,
    "nll": nn.NLLLoss,
    "mse": lambda: mse_loss,
    "l1": lambda: l1_loss,
    "smooth_l1": lambda: smooth_l1_loss,
    "bce": lambda: bce_loss,
}


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (outputs.argmax(dim=-1) == targets).float().mean()


def top_k_accuracy(k: int) -> Score:
    """The share of examples whose target is among the ``k`` largest outputs."""

    def score(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        top = outputs.topk(min(k, outputs.shape[-1]), dim=-1).indices
        return (top == targets.unsqueeze(-1)).any(dim=-1).float().mean()

    score.__name__ = f"top{k}_accuracy"
    return score


def mean_absolute_error(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    outputs, targets = _like(outputs, targets)
    return (outputs - targets).abs().float().mean()


def mean_squared_error(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    outputs, targets = _like(outputs, targets)
    return (outputs - targets).float().pow(2).mean()


METRICS: dict[str, Score] = {"accuracy": accuracy, "mae": mean_absolute_error, "mse": mean_squared_error}
_TOP_K = re.compile(r"top(\d+)_accuracy")
METRIC_NAMES = (*METRICS, "top<k>_accuracy")


def default_loss(outputs: Any, targets: Any) -> torch.Tensor:
    """The model's own loss for a batch that is a dict alone (its targets are the batch),
    cross-entropy for an ``(inputs, targets)`` pair."""
    if isinstance(targets, Mapping):
        return model_loss(outputs, targets)
    return F.cross_entropy(outputs, targets)


default_loss.uses_model_loss = True  # type: ignore[attr-defined]  # for a dict batch
default_loss.loss_parallel = True  # type: ignore[attr-defined]  # for a pair: F.cross_entropy, classes last


def resolve_loss(loss: str | Score | None) -> Score:
    """A loss by name, the callable given, or (None) ``default_loss``."""
    if loss is None:
        return default_loss
    if callable(loss):
        return loss
    if loss not in LOSSES:
        raise ConfigError(f"unknown loss {loss!r}; valid: {', '.join(LOSSES)}, or a callable (outputs, targets)")
    return LOSSES[loss]()


def metric(name: str) -> Score:
    if name in METRICS:
        return METRICS[name]
    match = _TOP_K.fullmatch(name)
    if match and int(match.group(1)) >= 1:
        return top_k_accuracy(int(match.group(1)))
    raise ConfigError(f"unknown metric {name!r}; valid: {', '.join(METRIC_NAMES)}, or a callable (outputs, targets)")


def resolve_metrics(metrics: Sequence[str | Score] | Mapping[str, Score]) -> dict[str, Score]:
    """``{name: score}`` from names, callables (named by ``__name__``) or a dict of them."""
    if isinstance(metrics, Mapping):
        items = list(metrics.items())
    else:
        items = [(m, metric(m)) if isinstance(m, str) else (getattr(m, "__name__", ""), m) for m in metrics]
    out: dict[str, Score] = {}
    for name, score in items:
        if not callable(score):
            raise ConfigError(f"metric {name!r} is a {type(score).__name__}, not a callable (outputs, targets)")
        if not name or name == "<lambda>" or name == "loss":
            raise ConfigError(
                f"metric {score!r} needs a name other than {name or 'none'!r}: pass metrics as a dict {{name: fn}}"
            )
        if name in out:
            raise ConfigError(f"metric {name!r} is given twice")
        out[name] = score
    return out


def summed_scores(
    strategy: Any, model: nn.Module, loss_fn: Score, metrics: Sequence[Score], batches: Iterable[Any]
) -> torch.Tensor:
    """``[examples, loss x n, metric_1 x n, ...]`` summed over ``batches`` (``n``: a batch's
    examples), where ``strategy.score`` gives them (a pipeline stage before the last passes its
    activations on instead): one all-reduce sums them over replicas."""
    sums = torch.zeros(2 + len(metrics), dtype=torch.float64, device=strategy.device)
    for inputs, targets in batches:
        values = strategy.score(model, inputs, targets, loss_fn, metrics)
        n = num_examples(targets)
        if values is not None and n:  # an empty piece of a stream's last batch: no example
            sums[0] += n
            sums[1:] += torch.stack([v.detach().double().reshape(()) for v in values]) * n
    return sums
