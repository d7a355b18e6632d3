"""Leaving every run this process joined when the process ends: at interpreter exit (a
script that never called ``teardown``), and before a launched process ends with
``os._exit``, which runs no exit handler (a strategy the function made itself, not given
to ``launch``, would otherwise leave its parameter-server shards waiting out their timeout
for the chief's word)."""

from __future__ import annotations

import atexit
from collections.abc import Callable

_TEARDOWNS: list[Callable[[], None]] = []


def leave_at_exit(teardown: Callable[[], None]) -> None:
    """Call ``teardown`` when this process ends (idempotent teardowns: it may run earlier)."""
    if not _TEARDOWNS:
        atexit.register(leave_all)
    _TEARDOWNS.append(teardown)


def leave_all() -> None:
    """Every registered teardown, the last joined first."""
    while _TEARDOWNS:
        _TEARDOWNS.pop()()
