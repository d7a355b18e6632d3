"""Leaving a run on SIGTERM (a scale-down, a preemption notice), for every strategy whose
runs go on without a replica (allreduce-ft, pipeline-ft, ps-backup and ps-async workers).

The first SIGTERM asks the process to leave once its current step is done: the strategy
reads ``asked`` at the end of a step, says so to the others its own way and raises
ReplicaLeft, which exits 0. A second SIGTERM ends the process at once, as SIGTERM does
without a handler.
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

    def install(self) -> None:
        """Handle SIGTERM in this process (from its main thread only: Python delivers
        signals there, and a handler can be set nowhere else)."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.asked:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
        self.asked = True
