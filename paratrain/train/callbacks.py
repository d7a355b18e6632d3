"""Callbacks: hooks around the Trainer's loop, Keras-style.

The loop calls, in order: ``on_train_begin``, then per epoch ``on_epoch_begin``, per
step ``on_batch_begin`` and ``on_batch_end``, then ``on_epoch_end``; finally
``on_train_end``. Parameter-server runs add ``on_version``; a shard's process gets
``on_serve_begin``, ``on_version`` per version, and ``on_serve_end`` instead. ``self.trainer`` is set before the first call. Callbacks that print
do so on the chief only.
"""

from __future__ import annotations

import math
import time
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from paratrain.console import console
from paratrain.errors import ConfigError


class Callback:
    trainer: Any  # the Trainer (train/trainer.py) whose loop calls this callback

    def on_train_begin(self, logs: dict[str, Any]) -> None: ...
    def on_epoch_begin(self, epoch: int, logs: dict[str, Any]) -> None: ...
    def on_batch_begin(self, step: int, logs: dict[str, Any]) -> None: ...
    def on_batch_end(self, step: int, logs: dict[str, Any]) -> None: ...
    def on_epoch_end(self, epoch: int, logs: dict[str, Any]) -> None: ...
    def on_train_end(self, logs: dict[str, Any]) -> None: ...
    def on_stop(self, step: int, logs: dict[str, Any]) -> None:
        """Training stops after ``step``, before its epoch's end (a callback set
        ``stop_training``): the loop still stands at that step (the epoch's close and
        ``on_train_end`` follow)."""

    def on_train_left(self, logs: dict[str, Any]) -> None:
        """This process leaves the run before its end, as it was asked to (SIGTERM to a
        fault-tolerant replica or an asynchronous worker): no on_train_end follows."""

    def on_version(self, version: int) -> None:
        """A parameter version was published (on a parameter-server shard) or received (on a
        parameter-server worker)."""

    # Instead of the training hooks, on a process that serves rather than trains (a
    # parameter-server shard): before it serves, and once serving has ended.
    def on_serve_begin(self, logs: dict[str, Any]) -> None: ...
    def on_serve_end(self, logs: dict[str, Any]) -> None: ...


class CallbackList:
    def __init__(self, callbacks: list[Callback], trainer: Any):
        self.callbacks = callbacks
        for callback in callbacks:
            callback.trainer = trainer

    def __getattr__(self, hook: str):
        def call(*args: Any) -> None:
            for callback in self.callbacks:
                getattr(callback, hook)(*args)

        return call


class LearningRateScheduler(Callback):
    """Sets the learning rate from ``schedule(global_step)`` before every step."""

    def __init__(self, schedule):
        self.schedule = schedule

    def on_batch_begin(self, step: int, logs: dict[str, Any]) -> None:
        lr = self.schedule(step)
        if lr != self.trainer.learning_rate:
            self.trainer.set_learning_rate(lr)


class EarlyStopping(Callback):
    """Stops training when ``monitor`` has not improved by ``min_delta`` for ``patience`` epochs.

    Every replica sees the same (reduced) validation metrics, so all stop together."""

    def __init__(self, monitor: str = "test_loss", patience: int = 3, min_delta: float = 0.0):
        self.monitor = monitor
        self.patience = patience
        self.min_delta = min_delta
        self.sign = 1.0 if "loss" in monitor else -1.0  # minimise losses, maximise the rest
        self.best = float("inf")
        self.wait = 0
        self.stopped_epoch: int | None = None

    def on_epoch_end(self, epoch: int, logs: dict[str, Any]) -> None:
        if self.monitor not in logs:
            raise KeyError(f"EarlyStopping monitors {self.monitor!r}, epoch logs have {sorted(logs)}")
        if logs[self.monitor] is None:
            raise ConfigError(
                f"EarlyStopping needs {self.monitor} on every process; under {self.trainer.strategy.name} this "
                "one does not evaluate (parameter-server workers other than the chief)"
            )
        value = self.sign * logs[self.monitor]
        if value < self.best - self.min_delta:
            self.best, self.wait = value, 0
            return
        self.wait += 1
        if self.wait >= self.patience:
            self.trainer.stop_training = True
            self.stopped_epoch = epoch
            if self.trainer.strategy.is_chief:
                console.print(f"early stopping: {self.monitor} has not improved for {self.patience} epochs")


class StepLog(Callback):
    """The classic step log: ``step 120, loss = 0.41 (5230.1 examples/sec; 0.012 sec/batch)``.

    Printed at the steps where the Trainer reduces the loss across replicas
    (every ``log_every`` steps); examples/sec counts the global batch."""

    def on_train_begin(self, logs: dict[str, Any]) -> None:
        self._last = (time.perf_counter(), 0)

    def on_batch_end(self, step: int, logs: dict[str, Any]) -> None:
        if "loss" not in logs or not self.trainer.strategy.is_chief:
            return
        now = time.perf_counter()
        then, then_step = self._last
        steps = max(step - then_step, 1)
        seconds = (now - then) / steps
        rate = logs["global_batch"] / seconds if seconds > 0 else float("inf")
        console.print(f"step {step}, loss = {logs['loss']:.4f} ({rate:.1f} examples/sec; {seconds:.4f} sec/batch)")
        self._last = (now, step)


class EpochLog(Callback):
    """One line per epoch on the chief: losses, accuracy, throughput."""

    def on_epoch_end(self, epoch: int, logs: dict[str, Any]) -> None:
        if not self.trainer.strategy.is_chief:
            return
        parts = [f"epoch {epoch + 1}/{logs['epochs']}", f"train_loss {logs['train_loss']:.4f}"]
        if "test_loss" in logs:
            parts += [f"test_loss {logs['test_loss']:.4f}", f"test_accuracy {logs['test_accuracy']:.4f}"]
        parts.append(f"{logs['examples_per_second']:.0f} examples/sec")
        console.print(", ".join(parts))


class TokenLog(Callback):
    """A language model's epoch line on the chief: tokens/s and perplexity (exp of the mean
    loss per token), after EpochLog's: ``epoch 2/3: 41230 tokens/sec, train perplexity 4.12,
    test perplexity 4.30``."""

    def __init__(self, tokens_per_example: int):
        self.tokens_per_example = tokens_per_example

    def on_epoch_end(self, epoch: int, logs: dict[str, Any]) -> None:
        if not self.trainer.strategy.is_chief:
            return
        parts = [f"{logs['examples_per_second'] * self.tokens_per_example:.0f} tokens/sec"]
        parts += [
            f"{split} perplexity {perplexity(logs[f'{split}_loss']):.2f}"
            for split in ("train", "test")
            if f"{split}_loss" in logs
        ]
        console.print(f"epoch {epoch + 1}/{logs['epochs']}: {', '.join(parts)}")


def perplexity(loss: float) -> float:
    """exp(mean loss per token), infinite where that overflows."""
    return math.exp(loss) if loss < 700 else math.inf


class ProgressBar(Callback):
    """A rich progress bar on the chief (epoch, step, loss, examples/s, ETA), only in a terminal."""

    def __init__(self, refresh_seconds: float = 0.2):
        self.refresh_seconds = refresh_seconds
        self.progress: Progress | None = None

    def on_train_begin(self, logs: dict[str, Any]) -> None:
        if not (self.trainer.strategy.is_chief and console.is_terminal):
            return
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[rate]} ex/s"),
            TimeRemainingColumn(),
            console=console,
            transient=True,
        )
        self.progress.start()
        self.epochs = logs["epochs"]
        self.task = self.progress.add_task("", total=logs["steps_per_epoch"], loss="-", rate="-")

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any]) -> None:
        if self.progress:
            self.progress.reset(self.task, description=f"epoch {epoch + 1}/{self.epochs}")
            self._shown = (time.perf_counter(), 0)

    def on_batch_end(self, step: int, logs: dict[str, Any]) -> None:
        if not self.progress:
            return
        now = time.perf_counter()
        then, seen = self._shown
        fields = {}
        if now - then >= self.refresh_seconds:
            # One host sync per refresh, not per step.
            fields = {
                "loss": f"{logs['local_loss'].item():.4f}",
                "rate": f"{logs['global_batch'] * (logs['batch'] - seen) / (now - then):.0f}",
            }
            self._shown = (now, logs["batch"])
        self.progress.update(self.task, completed=logs["batch"], **fields)

    def on_train_end(self, logs: dict[str, Any]) -> None:
        if self.progress:
            self.progress.stop()
            self.progress = None
