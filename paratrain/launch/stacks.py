"""Where a run's processes were when their launcher was interrupted: each process of a local
launch writes every thread's Python stack to a file of its own on SIGUSR1 (``faulthandler``,
from the signal handler itself: it answers when the process is stuck in C code or a
deadlock), and a launcher stopped by an exception it did not raise (a test's timeout, an
error of its own) asks the processes still running for theirs and attaches them to that
exception as a note, which tracebacks and test reports print. A process that hangs then
says where it hangs, instead of leaving only its launcher's ``sleep`` in the report.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import time
from pathlib import Path
from typing import Any

ENV = "PARATRAIN_STACKS"
_OPEN: list[Any] = []  # the file faulthandler writes to must stay open


def dump_on_signal() -> None:
    """In a launched process: write every thread's stack to ``$PARATRAIN_STACKS`` on SIGUSR1."""
    path = os.environ.get(ENV)
    if not path:
        return
    handle = open(path, "w")  # noqa: SIM115 - open for the life of the process
    _OPEN.append(handle)
    faulthandler.register(signal.SIGUSR1, file=handle, all_threads=True)


def stack_file(folder: Path, rank: int | str) -> str:
    return str(folder / f"stacks-{rank}.txt")


def attach_stacks(error: BaseException, processes: list[Any], names: list[str], folder: Path) -> None:
    """Ask the processes still running for their stacks and add them to ``error`` as a note."""
    running = [(rank, p) for rank, p in enumerate(processes) if p.exitcode is None and p.pid]
    if not running or not hasattr(error, "add_note"):  # add_note: Python 3.11+
        return
    for _, process in running:
        try:
            os.kill(process.pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and not all(_read(folder, rank) for rank, _ in running):
        time.sleep(0.05)
    time.sleep(0.1)  # a dump under way finishes
    for rank, _ in running:
        text = _read(folder, rank) or "(no answer)"
        error.add_note(f"paratrain: {names[rank]} was still running; its threads:\n{text}")


def _read(folder: Path, rank: int) -> str:
    try:
        return Path(stack_file(folder, rank)).read_text(errors="replace").strip()
    except OSError:
        return ""
