"""The Trainer: a Keras-like ``fit``/``evaluate``/``predict`` over any strategy.

``fit`` is one loop that reads top to bottom; everything that differs between modes
of training happens inside ``strategy.train_step`` and ``strategy.distribute``.
Users who want their own loop keep it: ``strategy.prepare``, ``strategy.distribute``
and ``strategy.train_step`` are the same pieces this loop uses.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from paratrain.errors import ConfigError
from paratrain.strategies.base import Strategy, get_strategy
from paratrain.train.callbacks import Callback, CallbackList, EpochLog, ProgressBar, StepLog
from paratrain.train.metrics import StepWindow
from paratrain.timeline import span

LOSSES: dict[str, Callable[[], nn.Module]] = {"cross_entropy": nn.CrossEntropyLoss}
METRICS = ("accuracy",)


@dataclass
class History:
    """Per-epoch logs of a ``fit``; ``history["test_accuracy"]`` gives one list, Keras-style."""

    epochs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def history(self) -> dict[str, list[Any]]:
        keys = {k for entry in self.epochs for k in entry}
        return {k: [entry.get(k) for entry in self.epochs] for k in sorted(keys)}

    def __getitem__(self, key: str) -> list[Any]:
        return self.history[key]


class Trainer:
    def __init__(
        self,
        model: nn.Module,
        loss: str | Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = "cross_entropy",
        optimizer: torch.optim.Optimizer | None = None,
        metrics: Sequence[str] = ("accuracy",),
        strategy: Strategy | None = None,
    ):
        unknown = [m for m in metrics if m not in METRICS]
        if unknown:
            raise ConfigError(f"unknown metric {unknown[0]!r}; valid: {', '.join(METRICS)}")
        if isinstance(loss, str):
            if loss not in LOSSES:
                raise ConfigError(f"unknown loss {loss!r}; valid: {', '.join(LOSSES)}")
            loss = LOSSES[loss]()
        if optimizer is None:
            raise ConfigError("Trainer needs an optimizer, e.g. torch.optim.SGD(model.parameters(), lr=0.05)")
        self.strategy = strategy or get_strategy()
        self.loss_fn = loss
        self.metrics = tuple(metrics)
        self.model, self.optimizer = self.strategy.prepare(model, optimizer)
        self.learning_rate = optimizer.param_groups[0]["lr"]
        self.global_step = 0
        self.epoch = 0
        self.stop_training = False
        self.train_seconds = 0.0
        self.examples_seen = 0
        self.loader_wait_seconds = 0.0
        """Seconds the training loop waited for input batches (this replica)."""

    @property
    def module(self) -> nn.Module:
        """The user's model, unwrapped from whatever the strategy wrapped it in."""
        return self.strategy.unwrap(self.model)

    def set_learning_rate(self, lr: float) -> None:
        self.strategy.set_learning_rate(self.optimizer, lr)
        self.learning_rate = lr

    def fit(
        self,
        train_data: object,
        epochs: int = 1,
        validation_data: object | None = None,
        callbacks: Sequence[Callback] = (),
        batch_size: int = 32,
        seed: int = 0,
        verbose: int = 1,
        log_every: int = 0,
    ) -> History:
        """Train for ``epochs`` passes over ``train_data``; ``batch_size`` is per replica.

        ``verbose``: 0 silent, 1 progress bar and one line per epoch (chief only).
        ``log_every``: reduce the loss across replicas and print the step log every
        this many steps (0: once per epoch). Divergence is detected at these points.
        """
        strategy = self.strategy
        if strategy.role == "ps":
            # A parameter-server shard serves until training ends, like `server.join()`.
            strategy.serve()
            return History()
        batches = strategy.distribute(train_data, batch_size, shuffle=True, drop_last=True, seed=seed)
        global_batch = batch_size * strategy.num_replicas
        defaults: list[Callback] = [ProgressBar(), EpochLog()] if verbose else []
        if verbose and log_every:
            defaults.append(StepLog())
        hooks = CallbackList(list(callbacks) + defaults, self)
        history = History()
        self.stop_training = False
        start = time.perf_counter()
        hooks.on_train_begin({"epochs": epochs, "steps_per_epoch": len(batches), "global_batch": global_batch})
        window = StepWindow()
        window.first_step = self.global_step + 1
        for epoch in range(self.epoch, epochs):
            self.epoch = epoch
            batches.set_epoch(epoch)
            hooks.on_epoch_begin(epoch, {})
            self.module.train()
            epoch_start = time.perf_counter()
            waited = batches.wait_seconds
            epoch_loss = epoch_examples = 0.0
            for batch, (inputs, targets) in enumerate(batches, start=1):
                hooks.on_batch_begin(self.global_step, {})
                out = strategy.train_step(self.model, self.loss_fn, self.optimizer, inputs, targets)
                window.add(out.loss, len(targets))
                self.global_step += 1
                logs: dict[str, Any] = {"batch": batch, "global_batch": global_batch, "local_loss": out.loss}
                if log_every and self.global_step % log_every == 0:
                    reduced = window.reduce(strategy)
                    logs["loss"] = reduced["loss"]
                    epoch_loss += reduced["loss"] * reduced["examples"]
                    epoch_examples += reduced["examples"]
                hooks.on_batch_end(self.global_step, logs)
                if self.stop_training:  # a callback ends training mid-epoch (e.g. at a step count)
                    break
            if len(window):
                reduced = window.reduce(strategy)
                epoch_loss += reduced["loss"] * reduced["examples"]
                epoch_examples += reduced["examples"]
            seconds = time.perf_counter() - epoch_start
            self.train_seconds += seconds
            self.examples_seen += int(epoch_examples)
            self.loader_wait_seconds += batches.wait_seconds - waited
            logs = {
                "epoch": epoch + 1,
                "epochs": epochs,
                "train_loss": epoch_loss / max(epoch_examples, 1),
                "examples_per_second": epoch_examples / seconds if seconds > 0 else 0.0,
                "learning_rate": self.learning_rate,
                "loader_wait_seconds": batches.wait_seconds - waited,
                "examples_seen": self.examples_seen,
            }
            if validation_data is not None and strategy.evaluates:
                logs.update({f"test_{k}": v for k, v in self.evaluate(validation_data).items()})
            logs["wall_seconds"] = time.perf_counter() - start
            history.epochs.append({k: v for k, v in logs.items() if k != "epochs"})
            hooks.on_epoch_end(epoch, logs)
            self.epoch = epoch + 1
            if self.stop_training:
                break
        strategy.finish(self.model)
        hooks.on_train_end({"history": history})
        return history

    @torch.no_grad()
    def evaluate(self, data: object, batch_size: int = 256) -> dict[str, float]:
        """Loss and accuracy on ``data``, each replica on its own part, summed across replicas.

        Empty on a process that does not evaluate (parameter-server workers other than the chief)."""
        if not self.strategy.evaluates:
            return {}
        with span("evaluate"):
            return self._evaluate(data, batch_size)

    def _evaluate(self, data: object, batch_size: int) -> dict[str, float]:
        self.strategy.refresh(self.model)
        model = self.module
        was_training = model.training
        model.eval()
        sums = torch.zeros(3, dtype=torch.float64, device=self.strategy.device)
        for inputs, targets in self.strategy.distribute(data, batch_size, shuffle=False, drop_last=False):
            logits = self.strategy.forward(model, inputs)
            if logits is None:  # a pipeline stage before the last: it passed its activations on
                continue
            sums[0] += self.loss_fn(logits, targets).double() * len(targets)
            sums[1] += (logits.argmax(dim=-1) == targets).sum()
            sums[2] += len(targets)
        model.train(was_training)
        loss_sum, correct, count = self.strategy.all_reduce_sum(sums).tolist()
        results = {"loss": loss_sum / max(count, 1)}
        if "accuracy" in self.metrics:
            results["accuracy"] = correct / max(count, 1)
        return results

    @torch.no_grad()
    def predict(self, data: object, batch_size: int = 256) -> torch.Tensor:
        """Model outputs for every example of ``data``, in order, computed on this process
        (with ``pipeline``: called on every stage, the outputs on the last, empty elsewhere)."""
        from paratrain.data.sharding import ShardedBatches

        model = self.module
        was_training = model.training
        model.eval()
        batches = ShardedBatches(data, batch_size, shuffle=False, drop_last=False, device=self.strategy.device)
        # Through the strategy: pipeline stages all take part, the last one holds the outputs.
        outputs = [self.strategy.forward(model, inputs) for inputs, _ in batches]
        outputs = [out for out in outputs if out is not None]
        model.train(was_training)
        return torch.cat(outputs) if outputs else torch.empty(0)
