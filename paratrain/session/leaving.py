"""Leaving a run on SIGTERM (a scale-down, a preemption notice), for every strategy whose
runs go on without a replica (allreduce-ft, pipeline-ft, ps-backup and ps-async workers).

The first SIGTERM asks the process to leave once its current step is done: the strategy
reads ``asked`` at the end of a step, says so to the others its own way and raises
ReplicaLeft, which exits 0. A second SIGTERM ends the process at once, as SIGTERM does
without a handler. Once the run is over (its strategy's teardown), the handler that was
there before is back: a process that goes on after the run (a notebook, a test) is not left
ignoring its first SIGTERM.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any


class LeaveOnSigterm:
    def __init__(self) -> None:
        self.asked = False
        """SIGTERM came: leave after the current step."""
        self._previous: list[Any] = []  # the handler install() replaced, until uninstall()

    def install(self) -> None:
        """Handle SIGTERM in this process (from its main thread only: Python delivers
        signals there, and a handler can be set nowhere else)."""
        if threading.current_thread() is threading.main_thread() and not self._previous:
            self._previous.append(signal.signal(signal.SIGTERM, self._handle))

    def uninstall(self) -> None:
        """Put back the handler that install() replaced (the run is over)."""
        if self._previous and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous.pop())

    def _handle(self, signum: int, frame: Any) -> None:
        if self.asked:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
        self.asked = True
