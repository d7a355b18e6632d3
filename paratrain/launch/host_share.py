"""The machine's cores shared among every paratrain process on it, whichever run it belongs to.

Runs started side by side on one machine would each take every core, and OpenMP's spinning threads make
that far slower than one run alone. So each computing process writes a line about itself (pid and start
time, cores, compute threads, fixed by ``--threads-per-worker`` or a default share) to a folder every paratrain
process reads (``$PARATRAIN_HOST_REGISTRY``, default ``/dev/shm/paratrain-processes``). A process on the
default takes ``(cores - others' fixed threads) // (default processes on its cores)``, at least one and never
counting fewer processes than its own run's ``LOCAL_WORLD_SIZE``. A thread rereads the folder every
``CHECK_SECONDS``; the compute thread applies the new count between steps (``apply``: OpenMP's count is per
thread). Lines of dead processes are removed; where the folder cannot be written the count stays.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

import torch

from paratrain.periodic import Periodic
from paratrain.proc_stat import started

REGISTRY_ENV = "PARATRAIN_HOST_REGISTRY"
#: Seconds between two readings of the folder.
CHECK_SECONDS = 1.0


def registry() -> Path:
    """The folder every paratrain process on this machine lists itself in."""
    given = os.environ.get(REGISTRY_ENV)
    if given:
        return Path(given)
    shm = Path("/dev/shm")
    return (shm if shm.is_dir() else Path(tempfile.gettempdir())) / "paratrain-processes"


def _cores() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def share(entries: list[dict[str, Any]], cores: list[int], usable: int, local: int) -> int:
    """Threads for a process on the default: ``usable`` cores, the fixed threads of the
    listed others on any of its ``cores`` set aside, divided among the processes on the
    default there (itself among them, and never fewer than ``local``); at least one."""
    mine = set(cores)
    fixed, shares = 0, 1
    for entry in entries:
        if not mine & set(entry["cores"]):
            continue
        if entry["fixed"]:
            fixed += entry["threads"]
        else:
            shares += 1
    return max(1, (usable - fixed) // max(shares, local))


class HostShare:
    """This process's line in the registry and its share of the cores (``fixed``: threads
    chosen for it, which it keeps; the others still count them)."""

    def __init__(self, threads: int, fixed: bool, usable: int, local: int, folder: Path | None = None):
        self.threads = threads
        self.fixed = fixed
        self.usable = usable
        self.local = local
        self.folder = folder or registry()
        self.pid, self.cores = os.getpid(), _cores()
        self.wanted = threads
        self.sharing = 1  # processes on this process's cores at the last reading, itself included
        self.changes: list[tuple[int, int]] = []  # (threads before, after), for the run's log
        self._path: Path | None = None
        self._poller: Periodic | None = None

    # ----- the registry ------------------------------------------------------------------------
    def join(self) -> HostShare:
        """List this process; a process on the default takes its share now and reads the
        folder again every CHECK_SECONDS."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            if self.folder.stat().st_uid == os.getuid():
                os.chmod(self.folder, 0o1777)  # every user's processes share the cores: sticky, like /tmp
            self._path = self.folder / f"{self.pid}.json"
            self._write()
        except OSError:
            self._path = None
            return self
        if self.fixed:
            self.others()  # no poller reads the folder: clear the lines the dead left (SIGKILL) now
        else:
            self.wanted = self._share()
            self.apply()
            self._poller = Periodic(self._check, CHECK_SECONDS, "paratrain-host-share").start()
        return self

    def leave(self) -> None:
        if self._poller is not None:
            self._poller.stop()
            self._poller = None
        if self._path is not None:
            self._path.unlink(missing_ok=True)
            self._path = None

    def others(self) -> list[dict[str, Any]]:
        """The live processes listed, this one aside; the lines of the dead are removed."""
        found = []
        try:
            names = os.listdir(self.folder)
        except OSError:
            return found
        for name in names:
            if not name.endswith(".json") or name == f"{self.pid}.json":
                continue
            path = self.folder / name
            try:
                entry = json.loads(path.read_text())
                alive = started(int(entry["pid"])) == entry["started"]
                entry["cores"] = list(entry["cores"])
                entry["threads"] = int(entry["threads"])
                entry["fixed"] = bool(entry["fixed"])
            except (OSError, ValueError, KeyError, TypeError):
                continue  # being written, or not one of ours
            if alive:
                found.append(entry)
            else:
                try:
                    path.unlink(missing_ok=True)
                except OSError:  # another user's line in the sticky folder
                    pass
        return found

    def _write(self) -> None:
        assert self._path is not None
        line = {
            "pid": self.pid,
            "started": started(self.pid),
            "cores": self.cores,
            "threads": self.threads,
            "fixed": self.fixed,
        }
        staging = self._path.with_suffix(".tmp")
        staging.write_text(json.dumps(line))
        os.chmod(staging, stat.S_IRUSR | stat.S_IWUSR | stat.S_IRGRP | stat.S_IROTH)
        os.replace(staging, self._path)

    def _share(self) -> int:
        others = [entry for entry in self.others() if set(self.cores) & set(entry["cores"])]
        self.sharing = 1 + len(others)
        return share(others, self.cores, self.usable, self.local)

    def _check(self) -> None:
        try:
            self.wanted = self._share()
        except Exception:  # noqa: BLE001 - a reading that fails keeps the last share
            pass

    # ----- the compute thread ------------------------------------------------------------------
    def apply(self) -> bool:
        """On the compute thread, between steps: take the share last read; True if it changed."""
        wanted = self.wanted
        if wanted == self.threads:
            return False
        self.changes.append((self.threads, wanted))
        self.threads = wanted
        torch.set_num_threads(wanted)
        if self._path is not None:
            try:
                self._write()
            except OSError:
                pass
        return True
