"""A task repeated on a thread of its own (a worker's heartbeat, a cluster's CPU samples)."""

from __future__ import annotations

import threading
from collections.abc import Callable


class Periodic:
    """Calls ``tick`` every ``interval`` seconds on a daemon thread from ``start()`` until
    ``stop()``, which returns once the thread is out of ``tick``. ``tick`` returns False to
    end the thread itself (what it reads is gone). ``first``/``last``: one call as the
    thread starts, and one more as it is stopped (a sample at both ends)."""

    def __init__(
        self, tick: Callable[[], bool | None], interval: float, name: str, first: bool = False, last: bool = False
    ):
        self.tick = tick
        self.interval = interval
        self.first = first
        self.last = last
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Periodic:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        if self.first and self.tick() is False:
            return
        while not self._stop.wait(self.interval):
            if self.tick() is False:
                return
        if self.last:
            self.tick()
