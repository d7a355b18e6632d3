"""The options of fault injection (``--fail``, ``--hang``, ``--vanish``, ``--terminate``, ``--straggler``):
a section of the run's TrainConfig, parsed and checked here; train/faults.py injects them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from paratrain.errors import ConfigError
from paratrain.options import check_options, flag, option
from paratrain.strategies.topology import Topology

FAIL_FORM = "WORKER@STEP (e.g. 1@40), all@STEP (every worker at once) or ps:SHARD@VERSION (e.g. ps:0@100)"
#: ``--fail all@STEP``'s worker: every worker of the run at once (a power cut).
ALL_WORKERS = -1


@dataclass
class FaultConfig:
    """Faults injected on purpose, for drills and tests."""

    fail: str | None = option(
        None,
        "fault injection: WORKER@STEP makes that worker's process die at that step (all@STEP: every worker's); "
        "ps:SHARD@VERSION makes a parameter-server shard die once it has published that version",
    )
    hang: str | None = option(
        None, "fault injection: WORKER@STEP makes that worker stop answering at that step (for --timeout drills)"
    )
    vanish: str | None = option(
        None,
        "fault injection: WORKER@STEP stops that worker's process (SIGSTOP) at that step: its connections stay "
        "open and its heartbeats stop, as when its host loses power",
    )
    terminate: str | None = option(
        None,
        "fault injection: WORKER@STEP sends that worker's process SIGTERM after that step (allreduce-ft, ps-async, "
        "ps-backup: it leaves the run; with --checkpoint-dir the others stop the run with a checkpoint)",
    )
    straggler: str | None = option(None, "fault injection: WORKER:FACTOR makes that worker's steps FACTOR times slower")

    def __post_init__(self) -> None:
        check_options(self)  # texts (a config file's fail = 5)
        parsed = self.fail_at or self.fail_shard_at  # each parses (and checks) its text
        if parsed is not None and parsed[1] < 1:
            raise ConfigError(f"--fail {self.fail}: the step or version must be >= 1")
        _ = self.hang_at, self.vanish_at, self.terminate_at  # parsed for their errors
        if self.straggler_factor and self.straggler_factor[1] < 1:
            raise ConfigError(f"--straggler factor must be >= 1, got {self.straggler_factor[1]}")

    @property
    def fail_at(self) -> tuple[int, int] | None:
        """``--fail WORKER@STEP`` as (worker, step)."""
        if self.fail is None or self.fail.startswith("ps:"):
            return None
        if self.fail.startswith("all@"):
            (_, step) = _parse("fail", self.fail.replace("all@", "0@", 1), "@", int, FAIL_FORM)
            return ALL_WORKERS, step
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
    def vanish_at(self) -> tuple[int, int] | None:
        return _parse("vanish", self.vanish, "@", int, "WORKER@STEP, e.g. 1@40")

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
            ("--vanish", self.vanish_at),
            ("--terminate", self.terminate_at),
            ("--straggler", self.straggler_factor),
        ):
            if parsed and parsed[0] >= workers:
                raise ConfigError(f"{name} names worker {parsed[0]}, but the run has workers 0..{workers - 1}")
        if self.fail_shard_at:
            shards = topology.num_servers
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
