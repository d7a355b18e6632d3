"""Training metrics: step losses reduced across replicas, and the run's metrics file."""

from __future__ import annotations

import json
import math
import os
import tempfile
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch

from paratrain.errors import ConfigError, DivergedError

METRICS_KEYS = (
    "strategy",
    "workers",
    "ps_shards",
    "backup_workers",
    "compression",
    "model",
    "dataset",
    "epochs",
    "global_steps",
    "test_accuracy",
    "test_loss",
    "train_loss",
    "wall_seconds",
    "examples_per_second",
    "loader_wait_seconds",
    "bytes_sent",
    "dropped_gradients",
    "staleness",
    "history",
)


class StepWindow:
    """Losses of the steps since the last reduction.

    A step only appends its detached loss tensor: no tensor op, no host sync, no
    collective (benchmarks/allreduce_overhead.py measured four small per-step ops at
    half of the loop's overhead over a bare DDP loop). A reduction sums, across
    replicas and in one all-reduce, the vector ``[examples, loss_1 * n, ..., loss_k * n]``:
    the per-step sums keep their place, so a NaN or Inf names the exact first step
    where any replica diverged, identically on every replica.
    """

    def __init__(self) -> None:
        self._losses: list[torch.Tensor] = []
        self._examples: list[int] = []
        self.first_step = 1

    def add(self, loss: torch.Tensor, examples: int) -> None:
        self._losses.append(loss)
        self._examples.append(examples)

    def __len__(self) -> int:
        return len(self._losses)

    def state_dict(self) -> dict[str, Any]:
        """The unreduced losses and their batch sizes (for a checkpoint)."""
        losses = torch.stack(self._losses).cpu() if self._losses else torch.empty(0, device="cpu")
        return {"losses": losses, "examples": list(self._examples), "first_step": self.first_step}

    def load_state_dict(self, state: dict[str, Any], device: torch.device | str = "cpu") -> None:
        self._losses = [loss.to(device) for loss in state["losses"]]
        self._examples = [int(n) for n in state["examples"]]
        self.first_step = int(state["first_step"])

    def reduce(self, strategy: Any) -> dict[str, float]:
        """Replica-averaged ``loss`` over the window's examples, their count and each step's
        loss x examples summed over replicas (``step_sums``); resets the window.

        Raises DivergedError naming the first step whose loss was NaN or infinite."""
        if not self._losses:
            return {}
        losses = torch.stack(self._losses).to(torch.float64)
        sizes = torch.tensor(self._examples, dtype=torch.float64, device=losses.device)
        vector = torch.cat([sizes, losses * sizes])
        vector = strategy.all_reduce_sum(vector).cpu()
        k = len(self._losses)
        step_examples, step_sums = vector[:k], vector[k:]
        finite = torch.isfinite(step_sums)
        if not bool(finite.all()):
            bad = int((~finite).nonzero()[0])
            raise DivergedError(step_sums[bad].item() / step_examples[bad].item(), self.first_step + bad)
        self.first_step += k
        self._losses.clear()
        self._examples.clear()
        examples = step_examples.sum().item()
        return {"loss": step_sums.sum().item() / examples, "examples": examples, "step_sums": step_sums.tolist()}


class EpochSums:
    """The epoch's loss x examples, summed over its reduced windows exactly (as fractions:
    the same to the bit however the windows were split, so an epoch resumed from a
    checkpoint logs the loss of the epoch never stopped), and its examples."""

    def __init__(self, total: Fraction = Fraction(0), examples: float = 0.0) -> None:
        self.total, self.examples = total, examples

    def add(self, reduced: dict[str, Any]) -> None:
        self.total += sum(map(Fraction, reduced["step_sums"]), Fraction(0))
        self.examples += reduced["examples"]

    def mean(self) -> float:
        return float(self.total / max(self.examples, 1))

    def state_dict(self) -> dict[str, Any]:
        """Plain values (a checkpoint loads with ``weights_only``): the float sums as before,
        and the exact total as numerator and denominator."""
        exact = [self.total.numerator, self.total.denominator]
        return {"epoch_sums": [float(self.total), self.examples], "epoch_loss_exact": exact}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> EpochSums:
        exact = state.get("epoch_loss_exact", (state["epoch_sums"][0],))  # older checkpoints: a float
        return cls(Fraction(*exact), float(state["epoch_sums"][1]))


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
