"""Local multi-process launch with torchrun's environment (RANK, WORLD_SIZE,
MASTER_ADDR, ...), on loopback: ``launch(fn, *args, num_processes=N)``.

The processes are started and watched by ``launch/supervisor.py`` rather than by
PyTorch's elastic agent: the agent does not report a process killed by a signal
(``kill -9``, the OOM killer) among its failures, so it would blame the peer that
failed a moment later on the broken connection; and it stops every process on any
failure, where ps-async and ps-backup go on without a lost worker. Under torchrun
itself the agent is torchrun's, and paratrain joins its cluster.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from paratrain.errors import ParatrainError, WorkerFailed


def launch(
    fn: Callable[..., Any],
    *args: Any,
    num_processes: int,
    max_restarts: int = 0,
    expendable: frozenset[int] = frozenset(),
    rank_names: list[str] | None = None,
    checkpoint_dir: str | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` on ``num_processes`` local processes; their return values by rank.

    ``fn`` must be importable (a module-level function): processes are spawned fresh.
    When a process fails the others are stopped at once, so a failed run never hangs,
    and the failure is raised as WorkerFailed naming the rank, its exit code or signal
    and its error. Ranks in ``expendable`` may die without ending the run
    (parameter-server workers in ps-async and ps-backup); their results are None. With
    ``max_restarts`` a failed run starts again, up to that many times, and its processes
    resume from the newest checkpoint in ``checkpoint_dir``. ``rank_names`` name ranks in
    messages ("ps shard 0", "worker 1").
    """
    # Traffic stays on loopback: Gloo binds to the interface named here, not to
    # whatever the host name resolves to.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    names = rank_names or [f"worker {rank}" for rank in range(num_processes)]
    from paratrain.launch.supervisor import supervise

    return supervise(fn, args, num_processes, expendable, names, max_restarts, checkpoint_dir)


def _entry(fn: Callable[..., Any], *args: Any) -> Any:
    """Runs in each spawned process: ``fn(*args)``, with errors the parent can read.

    A ParatrainError is recorded (its message only) in the agent's error file and ends
    the process with its exit code; anything else is recorded with its traceback, exit 1.
    The process ends with ``os._exit`` on errors: a parameter-server thread may still be
    blocked in a receive that would hold up a normal interpreter shutdown.
    """
    try:
        return fn(*args)
    except ParatrainError as error:
        record_error(str(error), "", error.exit_code)
        _exit(error.exit_code)
    except Exception as error:
        record_error(f"{type(error).__name__}: {error}", traceback.format_exc(), 1)
        _exit(1)


def _exit(code: int) -> None:
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


def first_failure(failures: dict[int, tuple[int, float, str]], names: list[str]) -> WorkerFailed:
    """The failure that explains the run, from ``{rank: (exit code, time, message)}``:
    a bad-input or divergence exit first, else the earliest."""
    known = [rank for rank, (code, _, _) in failures.items() if code in (2, 3)]
    rank = min(known) if known else min(failures, key=lambda r: (failures[r][1], r))
    code, _, message = failures[rank]
    return WorkerFailed(rank, code, message, name=names[rank] if rank < len(names) else None)
