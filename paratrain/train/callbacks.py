"""Callbacks: hooks around the Trainer's loop, Keras-style.

The loop calls, in order: ``on_train_begin``, then per epoch ``on_epoch_begin``, per
step ``on_batch_begin`` and ``on_batch_end``, then ``on_epoch_end``; finally
``on_train_end``. ``self.trainer`` is set before the first call. Callbacks that print
do so on the chief only.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from paratrain.errors import ConfigError
from paratrain.timeline import span

if TYPE_CHECKING:
    from paratrain.train.trainer import Trainer

console = Console(highlight=False, soft_wrap=True)


class Callback:
    trainer: "Trainer"

    def on_train_begin(self, logs: dict[str, Any]) -> None: ...
    def on_epoch_begin(self, epoch: int, logs: dict[str, Any]) -> None: ...
    def on_batch_begin(self, step: int, logs: dict[str, Any]) -> None: ...
    def on_batch_end(self, step: int, logs: dict[str, Any]) -> None: ...
    def on_epoch_end(self, epoch: int, logs: dict[str, Any]) -> None: ...
    def on_train_end(self, logs: dict[str, Any]) -> None: ...


class CallbackList:
    def __init__(self, callbacks: list[Callback], trainer: "Trainer"):
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
        self.monitor, self.patience, self.min_delta = monitor, patience, min_delta
        self.sign = 1.0 if "loss" in monitor else -1.0  # minimise losses, maximise the rest
        self.best = float("inf")
        self.wait = 0
        self.stopped_epoch: int | None = None

    def on_epoch_end(self, epoch: int, logs: dict[str, Any]) -> None:
        if self.monitor not in logs:
            raise KeyError(f"EarlyStopping monitors {self.monitor!r}, epoch logs have {sorted(logs)}")
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
            fields = {"loss": f"{logs['local_loss'].item():.4f}", "rate": f"{logs['global_batch'] * (logs['batch'] - seen) / (now - then):.0f}"}
            self._shown = (now, logs["batch"])
        self.progress.update(self.task, completed=logs["batch"], **fields)

    def on_train_end(self, logs: dict[str, Any]) -> None:
        if self.progress:
            self.progress.stop()
            self.progress = None


class StepCheckpoint(Callback):
    """Saves the model and optimizer every ``every_steps`` steps and at the end, on the
    chief, as ``DIR/model.ckpt-STEP.pt`` (the CIFAR-10 recipe's Saver: every 1000 steps,
    the last ``keep`` files kept).

    Each file is written to a temporary name and renamed, so a crash never leaves a
    half-written checkpoint; it holds only tensors and numbers, so ``load`` reads it
    with ``weights_only=True``, which never runs code from the file.
    """

    def __init__(self, directory: str | os.PathLike, every_steps: int = 1000, keep: int = 5):
        self.directory = Path(directory).expanduser()
        self.every_steps = every_steps
        self.keep = keep
        self.saved: list[Path] = []
        self._last_saved = -1

    def on_train_begin(self, logs: dict[str, Any]) -> None:
        if self.trainer.strategy.is_chief:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
            except OSError as error:
                raise ConfigError(f"checkpoint directory {self.directory}: {error.strerror}") from None

    def on_batch_end(self, step: int, logs: dict[str, Any]) -> None:
        if step % self.every_steps == 0:
            self.save(step)

    def on_train_end(self, logs: dict[str, Any]) -> None:
        self.save(self.trainer.global_step)

    def save(self, step: int) -> None:
        if not self.trainer.strategy.is_chief or step == self._last_saved:
            return
        state = {
            "model": self.trainer.module.state_dict(),
            "optimizer": self.trainer.optimizer.state_dict(),
            "step": step,
            "epoch": self.trainer.epoch,
        }
        path = self.directory / f"model.ckpt-{step}.pt"
        with span("checkpoint"):
            self._write(state, path)
        self._last_saved = step
        self.saved.append(path)
        while len(self.saved) > self.keep:
            self.saved.pop(0).unlink(missing_ok=True)

    def _write(self, state: dict[str, Any], path: Path) -> None:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=self.directory)
        try:
            with os.fdopen(fd, "wb") as handle:
                torch.save(state, handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @staticmethod
    def load(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> dict[str, Any]:
        """A checkpoint's ``{"model", "optimizer", "step", "epoch"}``; ConfigError if unreadable."""
        try:
            return torch.load(path, map_location=map_location, weights_only=True)
        except FileNotFoundError:
            raise ConfigError(f"checkpoint {path}: no such file") from None
        except (RuntimeError, OSError, EOFError, ValueError, pickle.UnpicklingError) as error:
            raise ConfigError(f"checkpoint {path}: not a readable checkpoint ({str(error).splitlines()[0]})") from None
