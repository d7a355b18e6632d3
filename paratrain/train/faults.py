"""Fault injection for drills and tests, in every strategy: ``--fail``, ``--hang`` and ``--straggler``;
``--fail ps:SHARD@VERSION`` for a parameter-server shard.

Both are callbacks keyed by the worker index (``strategy.rank``, 0..workers-1), so the
same flags mean the same thing under allreduce and under a parameter server. A failure
is injected in the first attempt of a run only: a run restarted by ``--max-restarts``
goes through that step again and must get past it.
"""

from __future__ import annotations

import mmap
import os
import signal
import struct
import sys
import time
from typing import Any

from paratrain.train.callbacks import Callback


def restart_count() -> int:
    """How many times this run was restarted (--max-restarts, or torchrun's), 0 at first."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


class FailAt(Callback):
    """The process of worker ``worker`` is killed (SIGKILL, as by ``kill -9``, the OOM
    killer or a preempted machine: no cleanup) at the end of step ``step``."""

    def __init__(self, worker: int, step: int):
        self.worker, self.step = worker, step

    def on_batch_end(self, step: int, logs: dict[str, Any]) -> None:
        if step == self.step and self.trainer.strategy.rank == self.worker and restart_count() == 0:
            _die(f"worker {self.worker}: injected failure at step {step}")


class ShardFailAt(Callback):
    """The process of parameter-server shard ``shard`` is killed (SIGKILL) once it has
    published version ``version``: the workers' waits on it fail and the run stops with
    an error naming it (or restarts from its checkpoint, with --max-restarts)."""

    def __init__(self, shard: int, version: int):
        self.shard, self.version = shard, version

    def on_serve(self, strategy: Any) -> None:
        if strategy.rank == self.shard and restart_count() == 0:
            strategy.on_version(self._check)

    def _check(self, version: int) -> None:
        if version == self.version:
            _die(f"ps shard {self.shard}: injected failure at version {version}")


def _die(what: str) -> None:
    print(f"paratrain: {what}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


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


def fault_callbacks(config: Any, global_rank: int = 0) -> list[Callback]:
    """The callbacks that ``--fail``, ``--hang`` and ``--straggler`` ask for, and the
    progress beacon when a supervisor watches this process."""
    callbacks: list[Callback] = []
    if os.environ.get("PARATRAIN_PROGRESS"):
        callbacks.append(StepBeacon(os.environ["PARATRAIN_PROGRESS"], global_rank))
    if config.fail_at:
        callbacks.append(FailAt(*config.fail_at))
    if config.fail_shard_at:
        callbacks.append(ShardFailAt(*config.fail_shard_at))
    if config.hang_at:
        callbacks.append(HangAt(*config.hang_at))
    if config.straggler_factor:
        callbacks.append(Straggler(*config.straggler_factor))
    return callbacks


class HangAt(Callback):
    """Worker ``worker`` stops answering at the end of step ``step`` (it sleeps for good),
    like a deadlocked or swapped-out process: the others must time out (``--timeout``)
    and name it, never hang with it."""

    def __init__(self, worker: int, step: int):
        self.worker, self.step = worker, step

    def on_batch_end(self, step: int, logs: dict[str, Any]) -> None:
        if step == self.step and self.trainer.strategy.rank == self.worker and restart_count() == 0:
            print(f"paratrain: worker {self.worker}: injected hang at step {step}", file=sys.stderr, flush=True)
            while True:
                time.sleep(3600)


class StepBeacon(Callback):
    """Records the last step this process finished (a parameter-server shard: the last
    version it published) in slot ``rank`` of the supervisor's progress file (``PARATRAIN_PROGRESS``): one 8-byte store into shared memory a step,
    read by the supervisor when a process dies without a word."""

    def __init__(self, path: str, rank: int):
        self._file = open(path, "r+b")
        self._map = mmap.mmap(self._file.fileno(), 0)
        self._slot = memoryview(self._map).cast("q")
        self.rank = rank

    def on_batch_end(self, step: int, logs: dict[str, Any]) -> None:
        self._slot[self.rank] = step

    def on_serve(self, strategy: Any) -> None:
        # A parameter-server shard's step is its version: the global step of a ps-* run.
        strategy.on_version(self._record)

    def _record(self, version: int) -> None:
        self._slot[self.rank] = version


def read_progress(path: str | os.PathLike, num_processes: int) -> list[int]:
    """The steps recorded by StepBeacon, by global rank (0 where none was)."""
    try:
        data = open(path, "rb").read()
    except OSError:
        return [0] * num_processes
    return list(struct.unpack(f"{num_processes}q", data[: 8 * num_processes].ljust(8 * num_processes, b"\0")))
