"""A parameter-server worker's sign of life: ``hb/<worker>`` in the run's store goes up
every fifth of the heartbeat timeout, from a thread of its own, so that a worker busy in a
long step still beats. The shards' monitor (protocol/server.py) counts a worker whose count
stands still for the whole timeout as lost."""

from __future__ import annotations

import time
from typing import Any

from paratrain.periodic import Periodic

BEATS_PER_TIMEOUT = 5
"""Beats within one heartbeat timeout: a few late ones (a loaded machine) are no loss."""


def heartbeat(store: Any, worker: int, heartbeat_timeout: float) -> Periodic:
    """Beats for ``worker`` in ``store`` every fifth of ``heartbeat_timeout`` once started;
    its ``stop()`` returns once the thread is out of the store (before the process may go)."""

    def beat() -> bool:
        try:
            store.add(f"hb/{worker}", 1)
        except RuntimeError:
            return False  # the store (on shard 0) is gone; the main thread will hear of it
        return True

    return Periodic(beat, heartbeat_timeout / BEATS_PER_TIMEOUT, "ps-heartbeat")


class Watch:
    """The shards' side: when each worker last beat or sent a message, and which fell silent.

    A process may beat (its heartbeat thread) and yet be stuck: no message for half of
    ``wait_timeout`` (--timeout) counts as lost too. Half: the shard must name the stuck
    worker before the others' waits (--timeout) blame the shard."""

    def __init__(self, store: Any, heartbeat_timeout: float, wait_timeout: float):
        self.store = store
        self.heartbeat_timeout = heartbeat_timeout
        self.wait_timeout = wait_timeout
        self.interval = min(0.5, heartbeat_timeout / BEATS_PER_TIMEOUT)
        """Seconds between two looks."""
        self.last_message: dict[int, float] = {}
        self._beats: dict[int, tuple[int, float]] = {}  # worker -> (its count, when it last moved)

    def heard(self, worker: int) -> None:
        """A message from ``worker``: a sign of life too."""
        self.last_message[worker] = time.monotonic()

    def silent(self, workers: list[int]) -> list[tuple[int, str]]:
        """``(worker, why)`` for each of ``workers`` that fell silent, as of now."""
        now, found = time.monotonic(), []
        for worker in workers:
            beats = self.store.add(f"hb/{worker}", 0)
            if worker not in self._beats or self._beats[worker][0] != beats:
                self._beats[worker] = (beats, now)
            last_message = self.last_message.get(worker, 0.0)
            if now - max(self._beats[worker][1], last_message) > self.heartbeat_timeout:
                found.append((worker, f"no heartbeat for {self.heartbeat_timeout:g} s"))
            elif now - last_message > self.wait_timeout / 2:
                found.append((worker, f"no message for {self.wait_timeout / 2:g} s, half of --timeout"))
        return found
