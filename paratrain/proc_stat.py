"""Who a process of this machine is and whether it still runs, from /proc/PID/stat: the
launcher's share of the cores (launch/host_share.py), the shared-memory all-reduce's wait
on its peers (comm/shared_memory.py) and the tests' process helpers read it here."""

from __future__ import annotations

from pathlib import Path


def stat_fields(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name: state, parent, ..., start time
    (19). OSError when there is no such process."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def started(pid: int) -> str | None:
    """A running process's start time (clock ticks since boot): with its pid, who it is (a
    pid is reused). None when it is gone, cannot be read, or has exited and waits for its
    parent (a zombie)."""
    try:
        fields = stat_fields(pid)
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]
