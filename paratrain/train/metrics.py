"""Training metrics: step losses reduced across replicas, and the run's metrics file."""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from paratrain.errors import ConfigError, DivergedError

METRICS_KEYS = (
    "strategy", "workers", "ps_shards", "backup_workers", "compression", "model", "dataset",
    "epochs", "global_steps", "test_accuracy", "test_loss", "train_loss", "wall_seconds",
    "examples_per_second", "loader_wait_seconds", "bytes_sent", "dropped_gradients", "staleness", "history",
)


class StepWindow:
    """Losses and correct counts of the steps since the last reduction.

    Steps only append detached device tensors (no host sync, no collective). A
    reduction sums, across replicas and in one all-reduce, the vector
    ``[examples, correct, loss_1 * n, ..., loss_k * n]``: the per-step sums keep
    their place, so a NaN or Inf names the exact first step where any replica
    diverged, identically on every replica.
    """

    def __init__(self) -> None:
        self._losses: list[torch.Tensor] = []
        self._correct: list[torch.Tensor] = []
        self._examples = 0
        self.first_step = 1

    def add(self, loss: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> None:
        n = len(targets)
        self._losses.append(loss * n)
        self._correct.append((logits.argmax(dim=-1) == targets).sum())
        self._examples += n

    def __len__(self) -> int:
        return len(self._losses)

    def reduce(self, strategy: Any) -> dict[str, float]:
        """Replica-averaged ``loss`` and ``accuracy`` of the window; resets it.

        Raises DivergedError naming the first step whose loss was NaN or infinite."""
        if not self._losses:
            return {}
        device = self._losses[0].device
        head = torch.tensor([self._examples], dtype=torch.float64, device=device)
        correct = torch.stack(self._correct).sum().to(torch.float64).reshape(1)
        vector = torch.cat([head, correct, torch.stack(self._losses).to(torch.float64)])
        vector = strategy.all_reduce_sum(vector).cpu()
        examples, correct_total, per_step = vector[0].item(), vector[1].item(), vector[2:]
        per_step_examples = examples / len(per_step)
        finite = torch.isfinite(per_step)
        if not bool(finite.all()):
            bad = int((~finite).nonzero()[0])
            raise DivergedError(per_step[bad].item() / per_step_examples, self.first_step + bad)
        self.first_step += len(self._losses)
        self._losses.clear()
        self._correct.clear()
        self._examples = 0
        return {"loss": per_step.sum().item() / examples, "accuracy": correct_total / examples, "examples": examples}


def write_json_atomic(path: str | os.PathLike, document: dict[str, Any]) -> None:
    """Write JSON so that a reader sees the old file or the new one, never half of one."""
    target = Path(path).expanduser()
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
        with os.fdopen(fd, "w") as handle:
            json.dump(document, handle, indent=2, allow_nan=True)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except OSError as error:
        raise ConfigError(f"cannot write {target}: {error.strerror}") from None


def metrics_document(describe: dict[str, Any], stats: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    """The metrics file: the strategy's description, its counters, and the run's results."""
    document = {**describe, **stats, **run}
    missing = [key for key in METRICS_KEYS if key not in document]
    if missing:
        raise KeyError(f"metrics document lacks {missing}")
    return {key: _plain(value) for key, value in document.items()}


def _plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value
