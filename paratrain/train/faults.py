"""Fault injection for drills and tests, in every strategy: ``--fail``, ``--hang``, ``--terminate`` and ``--straggler``;
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
from dataclasses import dataclass
from typing import Any

from paratrain.errors import ConfigError
from paratrain.options import flag, option
from paratrain.strategies.topology import Role, Topology
from paratrain.train.callbacks import Callback

FAIL_FORM = "WORKER@STEP (e.g. 1@40) or ps:SHARD@VERSION (e.g. ps:0@100)"


@dataclass
class FaultConfig:
    """Faults injected on purpose, for drills and tests."""

    fail: str | None = option(
        None,
        "fault injection: WORKER@STEP makes that worker's process die at that step; ps:SHARD@VERSION makes a "
        "parameter-server shard die once it has published that version",
    )
    hang: str | None = option(
        None, "fault injection: WORKER@STEP makes that worker stop answering at that step (for --timeout drills)"
    )
    terminate: str | None = option(
        None,
        "fault injection: WORKER@STEP sends that worker's process SIGTERM after that step (allreduce-ft: it "
        "leaves the run; elsewhere it ends like any lost process)",
    )
    straggler: str | None = option(None, "fault injection: WORKER:FACTOR makes that worker's steps FACTOR times slower")

    def __post_init__(self) -> None:
        parsed = self.fail_at or self.fail_shard_at  # each parses (and checks) its text
        if parsed is not None and parsed[1] < 1:
            raise ConfigError(f"--fail {self.fail}: the step or version must be >= 1")
        _ = self.hang_at, self.terminate_at  # parsed for their errors
        if self.straggler_factor and self.straggler_factor[1] < 1:
            raise ConfigError(f"--straggler factor must be >= 1, got {self.straggler_factor[1]}")

    @property
    def fail_at(self) -> tuple[int, int] | None:
        """``--fail WORKER@STEP`` as (worker, step)."""
        if self.fail is None or self.fail.startswith("ps:"):
            return None
        return _parse("fail", self.fail, "@", int, FAIL_FORM)

    @property
    def fail_shard_at(self) -> tuple[int, int] | None:
        """``--fail ps:SHARD@VERSION`` as (shard, version)."""
        if self.fail is None or not self.fail.startswith("ps:"):
            return None
        return _parse("fail", self.fail, "@", int, FAIL_FORM, prefix="ps:")

    @property
    def hang_at(self) -> tuple[int, int] | None:
        return _parse("hang", self.hang, "@", int, "WORKER@STEP, e.g. 1@40")

    @property
    def terminate_at(self) -> tuple[int, int] | None:
        return _parse("terminate", self.terminate, "@", int, "WORKER@STEP, e.g. 2@40")

    @property
    def straggler_factor(self) -> tuple[int, float] | None:
        return _parse("straggler", self.straggler, ":", float, "WORKER:FACTOR, e.g. 2:3.0")

    def check(self, topology: Topology, strategy: str) -> None:
        """The faults must name a worker (0..replicas-1) or a shard that the run has."""
        workers = topology.num_replicas
        for name, parsed in (
            ("--fail", self.fail_at),
            ("--hang", self.hang_at),
            ("--terminate", self.terminate_at),
            ("--straggler", self.straggler_factor),
        ):
            if parsed and parsed[0] >= workers:
                raise ConfigError(f"{name} names worker {parsed[0]}, but the run has workers 0..{workers - 1}")
        if self.fail_shard_at:
            shards = getattr(topology, "num_shards", 0)
            if not shards:
                raise ConfigError(
                    f"--fail {self.fail} names a parameter-server shard; --strategy {strategy} has none "
                    "(the ps-* strategies do): name a worker, WORKER@STEP"
                )
            if self.fail_shard_at[0] >= shards:
                raise ConfigError(
                    f"--fail {self.fail} names shard {self.fail_shard_at[0]}, but the run has shards 0..{shards - 1}"
                )


def _parse(name: str, text: str | None, sep: str, kind: type, form: str, prefix: str = "") -> tuple[int, Any] | None:
    """``"1@40"`` -> (1, 40) for --fail, ``"2:3.0"`` -> (2, 3.0) for --straggler; ``prefix``
    (``"ps:"``) is dropped first."""
    if text is None:
        return None
    worker, found, value = text.removeprefix(prefix).partition(sep)
    try:
        if not found:
            raise ValueError
        parsed = (int(worker), kind(value))
    except ValueError:
        raise ConfigError(f"{flag(name)} must be {form}, got {text!r}") from None
    if parsed[0] < 0:
        raise ConfigError(f"{flag(name)}: {'shard' if prefix else 'worker'} index must be >= 0, got {parsed[0]}")
    return parsed


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


class TerminateAt(Callback):
    """Worker ``worker``'s process gets SIGTERM at the end of step ``step`` (as from a
    scheduler scaling the job down, or a preemption notice)."""

    def __init__(self, worker: int, step: int):
        self.worker, self.step = worker, step

    def on_batch_end(self, step: int, logs: dict[str, Any]) -> None:
        if step == self.step and self.trainer.strategy.rank == self.worker and restart_count() == 0:
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
            and strategy.role is Role.PS
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
    """The callbacks that ``--fail``, ``--hang``, ``--terminate`` and ``--straggler`` ask for."""
    callbacks: list[Callback] = []
    faults = config.faults
    if faults.fail_at:
        callbacks.append(FailAt(*faults.fail_at))
    if faults.fail_shard_at:
        callbacks.append(ShardFailAt(*faults.fail_shard_at))
    if faults.hang_at:
        callbacks.append(HangAt(*faults.hang_at))
    if faults.terminate_at:
        callbacks.append(TerminateAt(*faults.terminate_at))
    if faults.straggler_factor:
        callbacks.append(Straggler(*faults.straggler_factor))
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

    def on_version(self, version: int) -> None:
        # A parameter-server shard's step is its version: the global step of a ps-* run.
        if self.trainer.strategy.role is Role.PS:
            self._slot[self.rank] = version


def progress_beacon(rank: int) -> list[Callback]:
    """The StepBeacon of global rank ``rank`` when a supervisor watches this process (it
    sets ``PARATRAIN_PROGRESS``), else none."""
    path = os.environ.get("PARATRAIN_PROGRESS")
    return [StepBeacon(path, rank)] if path else []


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
