"""A parameter-server worker's sign of life: ``hb/<worker>`` in the run's store goes up
every fifth of the heartbeat timeout, from a thread of its own, so that a worker busy in a
long step still beats. The shards' monitor (protocol/server.py) counts a worker whose count
stands still for the whole timeout as lost."""

from __future__ import annotations

import threading
from typing import Any

BEATS_PER_TIMEOUT = 5
"""Beats within one heartbeat timeout: a few late ones (a loaded machine) are no loss."""


class Heartbeat:
    def __init__(self, store: Any, worker: int, heartbeat_timeout: float):
        self.store, self.worker, self.interval = store, worker, heartbeat_timeout / BEATS_PER_TIMEOUT
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="ps-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop beating; returns once the thread is out of the store (before it may go)."""
        self._stop.set()
        self._thread.join()

    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.store.add(f"hb/{self.worker}", 1)
            except RuntimeError:
                return  # the store (on shard 0) is gone; the main thread will hear of it
