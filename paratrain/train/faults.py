"""Fault injection for drills and tests, in every strategy: ``--fail``, ``--hang``, ``--vanish``, ``--terminate``
and ``--straggler``;
``--fail ps:SHARD@VERSION`` for a parameter-server shard.

They are callbacks keyed by the worker index (``strategy.rank``, 0..workers-1), so the
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
from collections.abc import Iterable
from typing import Any

from paratrain.session.incarnation import restart_count
from paratrain.train.callbacks import Callback
from paratrain.train.fault_config import ALL_WORKERS


class AtStep(Callback):
    """Something done to worker ``worker``'s process at the end of step ``step``, in the run's
    first attempt only (``act``)."""

    def __init__(self, worker: int, step: int):
        self.worker, self.step = worker, step

    def on_batch_end(self, step: int, logs: dict[str, Any]) -> None:
        if step == self.step and self._here():
            self.act(step)

    def _here(self) -> bool:
        return self.worker in (self.trainer.strategy.rank, ALL_WORKERS) and restart_count() == 0

    def act(self, step: int) -> None:
        raise NotImplementedError


class FailAt(AtStep):
    """The process of worker ``worker`` (every worker's: ``ALL_WORKERS``) is killed (SIGKILL,
    as by ``kill -9``, the OOM killer or a preempted machine: no cleanup) at the end of step
    ``step``."""

    def act(self, step: int) -> None:
        _die(f"worker {self.trainer.strategy.rank}: injected failure at step {step}")


class TerminateAt(AtStep):
    """Worker ``worker``'s process gets SIGTERM at the end of step ``step`` (as from a
    scheduler scaling the job down, or a preemption notice)."""

    def act(self, step: int) -> None:
        os.kill(os.getpid(), signal.SIGTERM)


class ShardFailAt(Callback):
    """The process of parameter-server shard ``shard`` is killed (SIGKILL) once it has
    published version ``version``: the workers' waits on it fail and the run stops with
    an error naming it (or restarts from its checkpoint, with --max-restarts)."""

    def __init__(self, shard: int, version: int):
        self.shard, self.version = shard, version

    def on_version(self, version: int) -> None:
        strategy = self.trainer.strategy
        if (
            version == self.version
            and strategy.server is not None
            and strategy.rank == self.shard
            and restart_count() == 0
        ):
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


def fault_callbacks(config: Any) -> list[Callback]:
    """The callbacks that ``--fail``, ``--hang``, ``--vanish``, ``--terminate`` and ``--straggler`` ask for."""
    callbacks: list[Callback] = []
    faults = config.faults
    if faults.fail_at:
        callbacks.append(FailAt(*faults.fail_at))
    if faults.fail_shard_at:
        callbacks.append(ShardFailAt(*faults.fail_shard_at))
    if faults.hang_at:
        callbacks.append(HangAt(*faults.hang_at))
    if faults.vanish_at:
        callbacks.append(VanishAt(*faults.vanish_at))
    if faults.terminate_at:
        callbacks.append(TerminateAt(*faults.terminate_at))
    if faults.straggler_factor:
        callbacks.append(Straggler(*faults.straggler_factor))
    return callbacks


class HangAt(AtStep):
    """Worker ``worker`` stops answering at the end of step ``step`` (it sleeps for good),
    like a deadlocked or swapped-out process: the others must time out (``--timeout``)
    and name it, never hang with it."""

    def act(self, step: int) -> None:
        print(f"paratrain: worker {self.worker}: injected hang at step {step}", file=sys.stderr, flush=True)
        while True:
            time.sleep(3600)


class VanishAt(AtStep):
    """Worker ``worker``'s process stops (SIGSTOP), every thread of it, in the forward pass of
    step ``step`` (after the step's quorum; at the step's end where the model's own forward is
    not called, in a pipeline's stage): its connections stay open and its heartbeats stop, as
    when its host loses power or its network. The others must go on without it (per-step
    fault tolerance: after the Lighthouse's heartbeat timeout) or time out and name it
    (``--timeout``); the launcher kills it at the end."""

    def on_batch_begin(self, step: int, logs: dict[str, Any]) -> None:
        if step + 1 == self.step and self._here():
            self.trainer.module.register_forward_pre_hook(lambda *_: self.act(self.step))

    def act(self, step: int) -> None:
        print(f"paratrain: worker {self.worker}: injected vanish at step {step}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)


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

    def on_version(self, version: int) -> None:
        # A parameter-server shard's step is its version: the global step of a ps-* run.
        if self.trainer.strategy.server is not None:
            self._slot[self.rank] = version


def progress_beacon(rank: int) -> list[Callback]:
    """The StepBeacon of global rank ``rank`` when a supervisor watches this process (it
    sets ``PARATRAIN_PROGRESS``), else none."""
    path = os.environ.get("PARATRAIN_PROGRESS")
    return [StepBeacon(path, rank)] if path else []


LOST = -1
"""A progress slot's value once its launcher has given its process up for good (lost with
no replacement to take its place): nothing of it (a timeline part) is waited for."""


def mark_lost(path: str | os.PathLike, ranks: Iterable[int]) -> None:
    """Set the slots of ``ranks`` to LOST (the launcher, once no process of theirs will run again)."""
    with open(path, "r+b") as file:
        for rank in ranks:
            file.seek(8 * rank)
            file.write(struct.pack("q", LOST))


def lost_ranks(num_processes: int) -> set[int]:
    """The global ranks this process's launcher has given up for good (``PARATRAIN_PROGRESS``);
    none without such a launcher."""
    path = os.environ.get("PARATRAIN_PROGRESS")
    return {r for r, step in enumerate(read_progress(path, num_processes)) if step == LOST} if path else set()


def new_progress(path: str | os.PathLike, num_processes: int) -> None:
    """The progress file of ``num_processes`` processes, every step 0 (StepBeacon writes a
    process's slot, read_progress reads them all)."""
    with open(path, "wb") as file:
        file.write(bytes(8 * num_processes))


def read_progress(path: str | os.PathLike, num_processes: int) -> list[int]:
    """The steps recorded by StepBeacon, by global rank (0 where none was)."""
    try:
        data = open(path, "rb").read()
    except OSError:
        return [0] * num_processes
    return list(struct.unpack(f"{num_processes}q", data[: 8 * num_processes].ljust(8 * num_processes, b"\0")))
