"""A replica's watchdog: a wait that outlives every deadline under it ends the process with one line, instead
of a run that neither finishes nor fails.

Each wait of a fault-tolerant step has a deadline of its own (torchft's quorum and commit, Gloo's
collectives, the state transfer); the watchdog is the backstop for one that did not fire. Once a phase of a
step has run longer than ``bound`` seconds, it writes ``paratrain: worker W: the PHASE of step S did not end
within B s (...); the replica exits`` to stderr and exits with code 1, and the launcher treats the replica as
lost. It ends the process with ``os._exit`` (output flushed first) because the main thread is stuck in a
native wait that no Python exception interrupts. A phase costs two assignments.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

#: How often the watchdog looks, in seconds.
POLL_S = 0.25


class Watchdog:
    def __init__(self, bound: float, why: str, worker: int = 0, exit: Callable[[int], None] = os._exit):
        self.bound = bound
        self.why = why
        """What the bound is made of, for the line (say ``--timeout 60 s + 5 s``)."""
        self.worker = worker
        """This process's worker number, for the line (its owner sets it once known)."""
        self._exit = exit
        self._phase: tuple[str, int, float] | None = None
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()

    def __getstate__(self) -> dict:
        """Sent to another process (a strategy made before a launch), it is a new watchdog there."""
        return {"bound": self.bound, "why": self.why, "worker": self.worker, "exit": self._exit}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    @contextmanager
    def phase(self, what: str, step: int) -> Iterator[None]:
        """Watch ``what`` (say ``quorum``) of step ``step`` while the block runs."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="paratrain-watchdog", daemon=True)
            self._thread.start()
        self._phase = (what, step, time.monotonic())
        try:
            yield
        finally:
            self._phase = None

    def stop(self) -> None:
        self._stopped.set()
        self._phase = None

    def _watch(self) -> None:
        while not self._stopped.wait(POLL_S):
            phase = self._phase
            if phase is None:
                continue
            what, step, since = phase
            waited = time.monotonic() - since
            if waited > self.bound:
                print(
                    f"paratrain: worker {self.worker}: the {what} of step {step} did not end within "
                    f"{self.bound:g} s ({self.why}); the replica exits",
                    file=sys.stderr,
                    flush=True,
                )
                sys.stdout.flush()
                self._exit(1)
                return
