"""Observability callbacks: TensorBoard scalars (``--logdir``) and the timeline (``--timeline``).

Under ``--logdir D`` the chief writes run-level scalars to ``D/`` (``step/*``, ``epoch/*`` and, at the end,
``run/*`` from the metrics document) and every worker its own timing to ``D/rank-N/`` (``rank/*``: step time,
bytes, waits, staleness); docs/command_line.md lists the tags. Values come from the strategy's host-side
counters; the loss costs one host sync per step, paid only with ``--logdir``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from paratrain import timeline
from paratrain.errors import ConfigError
from paratrain.train.callbacks import Callback


def _writer(folder: Path) -> Any:
    from torch.utils.tensorboard import SummaryWriter

    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"--logdir {folder}: {error.strerror}") from None
    return SummaryWriter(log_dir=str(folder), flush_secs=5)


class TensorBoardLogger(Callback):
    """Scalars to TensorBoard event files: run-level on the chief, timing on every worker."""

    def __init__(self, logdir: str | os.PathLike):
        self.logdir = Path(logdir).expanduser()
        self.run_writer: Any = None
        self.rank_writer: Any = None

    def on_train_begin(self, logs: dict[str, Any]) -> None:
        strategy = self.trainer.strategy
        if strategy.is_chief:
            self.run_writer = _writer(self.logdir)
        self.rank_writer = _writer(self.logdir / f"rank-{strategy.rank}")
        self._last = strategy.step_counters()
        self._epoch_wait = self._last["wait_seconds"]
        self._step_start = time.perf_counter()

    def on_batch_begin(self, step: int, logs: dict[str, Any]) -> None:
        self._step_start = time.perf_counter()

    def on_batch_end(self, step: int, logs: dict[str, Any]) -> None:
        seconds = time.perf_counter() - self._step_start
        counters = self.trainer.strategy.step_counters()
        rank = self.rank_writer
        rank.add_scalar("rank/step_seconds", seconds, step)
        rank.add_scalar("rank/bytes_sent_per_step", counters["bytes_sent"] - self._last["bytes_sent"], step)
        rank.add_scalar("rank/wait_seconds", counters["wait_seconds"] - self._last["wait_seconds"], step)
        rank.add_scalar("rank/staleness", counters["staleness"], step)
        self._last = counters
        if self.run_writer is not None:
            loss = logs["loss"] if "loss" in logs else logs["local_loss"].item()
            self.run_writer.add_scalar("step/loss", loss, step)
            self.run_writer.add_scalar("step/learning_rate", self.trainer.learning_rate, step)
            if seconds > 0:
                self.run_writer.add_scalar("step/examples_per_second", logs["global_batch"] / seconds, step)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any]) -> None:
        wait = self.trainer.strategy.step_counters()["wait_seconds"]
        self.rank_writer.add_scalar("rank/epoch_wait_seconds", wait - self._epoch_wait, epoch + 1)
        self.rank_writer.add_scalar("rank/loader_wait_seconds", logs["loader_wait_seconds"], epoch + 1)
        self._epoch_wait = wait
        if self.run_writer is None:
            return
        for key in ("train_loss", "test_loss", "test_accuracy", "learning_rate", "examples_per_second"):
            if key in logs:
                self.run_writer.add_scalar(f"epoch/{key}", logs[key], epoch + 1)
        self.run_writer.flush()

    def on_train_end(self, logs: dict[str, Any]) -> None:
        if self.rank_writer is not None:
            self.rank_writer.close()
            self.rank_writer = None

    def write_summary(self, document: dict[str, Any]) -> None:
        """On the chief, after the run: the totals of the metrics document."""
        if self.run_writer is None:
            return
        step = document["global_steps"]
        staleness = document["staleness"]
        totals = {
            "bytes_sent": document["bytes_sent"],
            "bytes_per_step": document["bytes_sent"] / max(step, 1),
            "staleness_mean": staleness["mean"],
            "staleness_max": staleness["max"],
            "dropped_gradients": document["dropped_gradients"],
            "test_accuracy": document["test_accuracy"],
            "examples_per_second": document["examples_per_second"],
        }
        for key, value in totals.items():
            if value is not None:
                self.run_writer.add_scalar(f"run/{key}", value, step)
        self.close()

    def close(self) -> None:
        for writer in (self.run_writer, self.rank_writer):
            if writer is not None:
                writer.close()
        self.run_writer = self.rank_writer = None


class TimelineSpans(Callback):
    """The loop's own spans: ``data`` (waiting for the next batch, from the end of one
    step to the start of the next). The phases inside a step come from the strategy."""

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any]) -> None:
        recorder = timeline.recorder()
        self._since = recorder.now_us() if recorder else 0.0

    def on_batch_begin(self, step: int, logs: dict[str, Any]) -> None:
        recorder = timeline.recorder()
        if recorder is not None:
            recorder.add("data", self._since, recorder.now_us())

    def on_batch_end(self, step: int, logs: dict[str, Any]) -> None:
        recorder = timeline.recorder()
        if recorder is not None:
            self._since = recorder.now_us()


class ExamplesApplied(Callback):
    """Examples seen at the end of every epoch, for the metrics file's history: the loop's
    count (every replica's, reduced) unless the strategy knows the run-wide count of
    examples in applied updates (a parameter-server worker sees only its own batches)."""

    def __init__(self) -> None:
        self.per_epoch: list[int | None] = []

    def on_epoch_end(self, epoch: int, logs: dict[str, Any]) -> None:
        remote = self.trainer.strategy.remote
        self.per_epoch.append(remote.examples_applied() if remote is not None else None)
