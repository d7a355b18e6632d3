"""What runs inside each process a local launch starts: the function, with its errors
written where the supervising parent reads them (the elastic agent's error file format,
``TORCHELASTIC_ERROR_FILE``), and an exit that no leftover thread can hold up.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from paratrain.errors import ParatrainError


def run_entry(fn: Callable[..., Any], *args: Any) -> Any:
    """Runs in each spawned process: ``fn(*args)``, with errors the parent can read.

    A ParatrainError is recorded (its message only) in the agent's error file and ends
    the process with its exit code; anything else is recorded with its traceback, exit 1.
    The process ends with ``os._exit`` on errors: a parameter-server thread may still be
    blocked in a receive that would hold up a normal interpreter shutdown.
    """
    die_with_parent()
    try:
        return fn(*args)
    except ParatrainError as error:
        record_error(str(error), "", error.exit_code)
        exit_now(error.exit_code)
    except Exception as error:
        record_error(f"{type(error).__name__}: {error}", traceback.format_exc(), 1)
        exit_now(1)


def die_with_parent() -> None:
    """Linux: this process gets SIGKILL when the launcher dies (kill -9 included), so no
    process of a run outlives the launcher to train on, or wait, alone."""
    launcher = int(os.environ.get("PARATRAIN_LAUNCHER_PID", os.getppid()))
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return  # not Linux: the supervisor's own teardown is all there is
    if os.getppid() != launcher:  # the launcher died while this process was starting
        os.kill(os.getpid(), signal.SIGKILL)


def exit_now(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def record_error(message: str, callstack: str, exit_code: int) -> None:
    """Write the agent's error file (``TORCHELASTIC_ERROR_FILE``), read back by the parent."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    now = time.time()
    # The agent reads whole seconds; paratrain_time orders failures within one second
    # (a crash, then its peers' broken connections a millisecond later).
    extra = {"py_callstack": callstack, "timestamp": str(int(now)), "paratrain_time": repr(now), "exit_code": exit_code}
    document = {"message": {"message": message, "extraInfo": extra}}
    with open(path, "w") as handle:
        json.dump(document, handle)
