"""Fault injection for drills and tests, in every strategy: ``--fail`` and ``--straggler``.

Both are callbacks keyed by the worker index (``strategy.rank``, 0..workers-1), so the
same flags mean the same thing under allreduce and under a parameter server.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from paratrain.train.callbacks import Callback

#: Exit code of a process killed by --fail (distinct from paratrain's own codes).
INJECTED_FAILURE_EXIT = 17


class FailAt(Callback):
    """The process of worker ``worker`` dies at the end of step ``step`` (no cleanup, like a crash)."""

    def __init__(self, worker: int, step: int):
        self.worker, self.step = worker, step

    def on_batch_end(self, step: int, logs: dict[str, Any]) -> None:
        if step == self.step and self.trainer.strategy.rank == self.worker:
            print(f"paratrain: worker {self.worker}: injected failure at step {step}", file=sys.stderr, flush=True)
            os._exit(INJECTED_FAILURE_EXIT)


class Straggler(Callback):
    """Worker ``worker`` sleeps ``(factor - 1)`` times each step's duration after it:
    its steps take ``factor`` times as long, as on a slower or busier machine."""

    def __init__(self, worker: int, factor: float):
        self.worker, self.factor = worker, factor
        self._start = 0.0

    def on_batch_begin(self, step: int, logs: dict[str, Any]) -> None:
        self._start = time.perf_counter()

    def on_batch_end(self, step: int, logs: dict[str, Any]) -> None:
        if self.trainer.strategy.rank == self.worker:
            time.sleep((self.factor - 1.0) * (time.perf_counter() - self._start))


def fault_callbacks(config: Any) -> list[Callback]:
    """The callbacks that ``--fail`` and ``--straggler`` ask for."""
    callbacks: list[Callback] = []
    if config.fail_at:
        callbacks.append(FailAt(*config.fail_at))
    if config.straggler_factor:
        callbacks.append(Straggler(*config.straggler_factor))
    return callbacks
