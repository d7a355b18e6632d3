"""Update rules of the parameter server, and stale-gradient policies.

An update rule decides, for each gradient a shard receives, whether it is applied,
dropped, or held until enough have arrived; and, for each pull, whether the worker may
have the parameters now. Rules are objects chosen by strategy name (RULES), never
branches in the server loop.

| rule | gradients | pulls |
| --- | --- | --- |
| SyncRule (ps-sync) | average all N gradients of version v, then publish v+1 | wait for the version after the worker's last push |
| SyncRule (ps-backup) | average the first N gradients of v; later ones for v are dropped and counted | same |
| AsyncRule (ps-async) | apply each at once; staleness = versions since its pull | at once, unless the worker is more than S steps ahead of the slowest live worker (stale-synchronous parallel) |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass
class Gradient:
    worker: int
    version: int
    """The version of the parameters it was computed on."""
    samples: int
    lr_scale: float
    finite: bool = True
    """False: it held a NaN or Inf (--on-nan skip); the shard skips what it would have applied."""


class ServerView(Protocol):
    """What a rule may read of the shard's state."""

    version: int

    def active_workers(self) -> set[int]: ...
    def clocks(self) -> dict[int, int]: ...


class StalePolicy:
    """Stale-gradient policy of ps-async: ``none``, ``scale-lr`` or ``drop``."""

    NAMES = ("none", "scale-lr", "drop")

    def __init__(self, name: str = "none", max_staleness: int = 4):
        self.name, self.max_staleness = name, max_staleness

    def factor(self, staleness: int) -> float | None:
        """Multiplier of the step for a gradient of this staleness; None drops it."""
        if self.name == "drop" and staleness > self.max_staleness:
            return None
        if self.name == "scale-lr":
            # Staleness-aware async SGD (Zhang et al. 2016): the step of a gradient that
            # is s versions old is divided by s, so stale gradients move the model less.
            return 1.0 / max(staleness, 1)
        return 1.0


class SyncRule:
    """Synchronous rounds: ``required`` gradients per version, averaged (Chen et al. 2016
    with ``required`` < number of workers: the rest are backups, whose late gradients
    are dropped)."""

    def __init__(self, required: int):
        self.required = required

    def accept(self, grad: Gradient, server: ServerView) -> str:
        """``"hold"`` (add to this version's sum) or ``"drop"`` (late: a version was published since)."""
        return "hold" if grad.version == server.version else "drop"

    def ready(self, held: set[int], server: ServerView) -> bool:
        """Whether the gradients held (from these workers) make a version: N of them, or
        all that can still come (no active worker that has not sent one is left)."""
        could_still_come = server.active_workers() - held
        return bool(held) and (len(held) >= self.required or not could_still_come)

    def may_pull(self, worker: int, wanted: int, server: ServerView) -> bool:
        return server.version >= wanted

    def clocks(self, server: ServerView) -> dict[int, int]:
        """Each worker's steps, as the rule counts them (the shard counters' clock gap)."""
        return server.clocks()

    def wanted_after(self, grad: Gradient) -> int:
        """The version a worker waits for after this push: the round it took part in."""
        return grad.version + 1


class AsyncRule:
    """Every gradient applied on arrival; optional staleness bound on pulls."""

    def __init__(self, policy: StalePolicy, staleness_bound: int | None = None, warmup_steps: int = 0):
        self.policy = policy
        self.bound = staleness_bound
        self.warmup_steps = warmup_steps
        self._head_start: int | None = None
        """Worker 0's steps of the warm-up, once it is over: the others start level with it."""

    def accept(self, grad: Gradient, server: ServerView) -> str:
        factor = self.policy.factor(server.version - grad.version)
        if factor is None:
            return "drop"
        grad.lr_scale *= factor
        return "apply"

    def ready(self, held: set[int], server: ServerView) -> bool:
        return False

    def wanted_after(self, grad: Gradient) -> int:
        return 0  # whatever is current (the shard applied this push before answering)

    def may_pull(self, worker: int, wanted: int, server: ServerView) -> bool:
        active = server.active_workers()
        if server.version < self.warmup_steps and 0 in active:
            # warm-up: worker 0 trains alone for the first updates (unbounded: the others
            # wait for the warm-up, not behind it), until they are made or it has finished
            return worker == 0
        if self.bound is None:
            return True
        clocks = self.clocks(server)
        live = [clocks[w] for w in active]
        # Stale-synchronous parallel (Ho et al. 2013): no worker starts a step more than
        # `bound` steps ahead of the slowest worker that is still training.
        return not live or clocks[worker] - min(live) <= self.bound

    def clocks(self, server: ServerView) -> dict[int, int]:
        """Each worker's steps; under a warm-up the others count as level with worker 0,
        and from its end on, they count their own steps from worker 0's then."""
        clocks = server.clocks()
        if not self.warmup_steps:
            return clocks
        if server.version < self.warmup_steps:
            return {w: clocks.get(0, c) for w, c in clocks.items()}
        if self._head_start is None:
            self._head_start = clocks.get(0, 0)
        return {w: c + (self._head_start if w != 0 else 0) for w, c in clocks.items()}
