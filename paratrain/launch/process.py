"""How a local launch starts its processes, and what runs inside each: the function, with
its errors written where the supervising parent reads them (the elastic agent's error file
format, ``TORCHELASTIC_ERROR_FILE``), and an exit that no leftover thread can hold up.

On Linux the processes are forked from a fork server that imported torch and paratrain
once (``PRELOAD``): a fresh interpreter spends about 2.5 s of CPU importing them, which
every process of a run, and every replacement of a lost one, would pay again on cores the
others need. Each process still starts as a spawned one would, in the launcher's
environment (as it is when the process starts), working directory and ``sys.path``, its
``__main__`` imported afresh. Elsewhere they are spawned.
"""

from __future__ import annotations

import ctypes
import json
import multiprocessing
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing import reduction
from typing import Any

from paratrain.errors import ParatrainError
from paratrain.session.exits import leave_all

#: Imported once by the fork server, before it forks any process: first its guard (it dies
#: with its launcher, launch/orphan.py), then what every process of a run imports anyway
#: (torch._dynamo with the first optimizer; imported before any process group exists, see
#: ``comm.transport.load_compiler``). The server starts from the launcher's main thread
#: (``start_server``): it gets SIGKILL when the thread that started it ends.
PRELOAD = ["paratrain.launch.orphan", "paratrain.train.job", "torch._dynamo"]


def process_context() -> multiprocessing.context.BaseContext:
    """The multiprocessing context a local launch starts its processes with."""
    if sys.platform != "linux":
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([*PRELOAD, "paratrain.launch.frozen"])  # frozen.py: after the rest
    return context


def start_server() -> None:
    """Start the fork server now, so that its imports overlap the launcher's own work (the
    configuration's checks) instead of following it."""
    if process_context().get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()


class LauncherEnv:
    """What a process takes from its launcher as it starts: the launcher's environment now,
    with ``env`` over it (a forked process would otherwise see the fork server's, as it was
    when the server started), and the launcher's standard output and error as they are now
    (the fork server's are the launcher's when the server started: a launcher whose output
    was redirected since, a notebook or a test, would otherwise lose its processes' lines).
    """

    def __init__(self, env: dict[str, str], streams: tuple[Any, Any] = (None, None)) -> None:
        self.env = env
        self.streams = streams  # in the started process: the two descriptors it inherited

    def __reduce__(self) -> tuple:
        # Pickled as the process starts: each stream travels as a file descriptor the new
        # process inherits (multiprocessing.reduction.DupFd, under any start method).
        return (LauncherEnv, (self.env, tuple(_inheritable(fd) for fd in (1, 2))))


def _inheritable(fd: int) -> Any:
    try:
        os.fstat(fd)
        return reduction.DupFd(fd)
    except (OSError, AttributeError):
        return None  # the stream is closed, or the start method passes no descriptors (fork)


def launcher_env(env: dict[str, str]) -> LauncherEnv:
    """What a process started now takes from the launcher (``take_env`` applies it)."""
    return LauncherEnv({**os.environ, **env})


def take_env(start: LauncherEnv) -> None:
    """In the started process: the launcher's environment becomes its own, and its standard
    output and error go where the launcher's went when it started the process."""
    os.environ.clear()
    os.environ.update(start.env)
    for stream, target in zip(start.streams, (1, 2)):
        if stream is not None:
            fd = stream.detach()
            if fd != target:
                os.dup2(fd, target)
                os.close(fd)


def run_entry(fn: Callable[..., Any], *args: Any) -> Any:
    """Runs in each spawned process: ``fn(*args)``, with errors the parent can read.

    A ParatrainError is recorded (its message only) in the agent's error file and ends
    the process with its exit code; anything else is recorded with its traceback, exit 1.
    The process ends with ``os._exit`` on errors: a parameter-server thread may still be
    blocked in a receive that would hold up a normal interpreter shutdown.
    """
    die_with_parent()
    # Denormal numbers flushed to zero from the start, as TensorFlow's processes do: threads
    # inherit the setting from the one that starts them, so the compute threads this process
    # starts later have it too (the Trainer's CpuTuning.flush_denormal sets it for its own thread).
    import torch  # here: the launcher itself never needs it

    torch.set_flush_denormal(True)
    try:
        result = fn(*args)
        leave_all()  # the runs fn joined and did not leave: os._exit runs no exit handler
        return result
    except ParatrainError as error:
        record_error(str(error), "", error.exit_code, error.ends_run)
        exit_now(error.exit_code)
    except Exception as error:
        record_error(f"{type(error).__name__}: {error}", traceback.format_exc(), 1)
        exit_now(1)


def die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent dies (kill -9 included): the
    launcher, or the fork server, which ends when the launcher does. No process of a run
    outlives the launcher to train on, or wait, alone."""
    launcher = int(os.environ.get("PARATRAIN_LAUNCHER_PID", os.getppid()))
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return  # not Linux: the supervisor's own teardown is all there is
    _release_fork_server()
    if os.getppid() == 1 or not _alive(launcher):  # it died while this process was starting
        os.kill(os.getpid(), signal.SIGKILL)


def _release_fork_server() -> None:
    """A process the fork server forked holds the server's "alive" pipe, which keeps the
    server running while the process lives: with it held, a launcher killed with SIGKILL
    would leave the server and the processes (whose parent it is) running on. Closed, the
    server ends with the launcher, and the process with the server (its parent-death signal)."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)  # None in a spawned process
    if isinstance(fd, int):
        try:
            os.close(fd)
        except OSError:
            pass
        server._forkserver_alive_fd = None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def exit_now(code: int) -> None:
    """End the process at once (no interpreter finalization), output flushed and the
    named semaphores it made released (``release_semaphores``)."""
    release_semaphores()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def release_semaphores() -> None:
    """Unlink the named semaphores this process made, as multiprocessing's exit handler
    would, which ``os._exit`` skips: a library's lock (tqdm's, which ``datasets`` makes in
    every process that formats a batch as tensors) would else be counted by the resource
    tracker, which warns of "leaked semaphore objects" when the run ends. Only their own
    finalizers run (no other exit handler: a pool's or a manager's could wait)."""
    from multiprocessing import synchronize, util

    cleanup = getattr(synchronize.SemLock, "_cleanup", None)
    registry = getattr(util, "_finalizer_registry", {})
    for finalizer in list(registry.values()):
        if cleanup is not None and getattr(finalizer, "_callback", None) is cleanup:
            try:
                finalizer()
            except OSError:  # unlinked already
                pass


def record_error(message: str, callstack: str, exit_code: int, ends_run: bool = False) -> None:
    """Write the agent's error file (``TORCHELASTIC_ERROR_FILE``), read back by the parent;
    ``ends_run``: no replacement can go on with the run (``StateLost``)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    now = time.time()
    # The agent reads whole seconds; paratrain_time orders failures within one second
    # (a crash, then its peers' broken connections a millisecond later).
    extra = {"py_callstack": callstack, "timestamp": str(int(now)), "paratrain_time": repr(now), "exit_code": exit_code}
    if ends_run:
        extra["paratrain_ends_run"] = True
    document = {"message": {"message": message, "extraInfo": extra}}
    with open(path, "w") as handle:
        json.dump(document, handle)
