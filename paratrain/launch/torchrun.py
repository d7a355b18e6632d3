"""Local multi-process launch through PyTorch's elastic agent (the machinery of torchrun).

``launch(fn, *args, num_processes=N)`` runs ``fn(*args)`` in N fresh processes on
loopback with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...), monitors
them, and returns their results by rank. When one process fails the agent stops the
others at once, so a failed run never hangs; the failure is raised as WorkerFailed
naming the rank, its exit code and its error.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
import uuid
from pathlib import Path
from collections.abc import Callable
from typing import Any

from paratrain.comm.transport import free_port
from paratrain.errors import ParatrainError, WorkerFailed

_ELASTIC_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")


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
    Ranks in ``expendable`` may die without ending the run (parameter-server workers in
    ps-async and ps-backup); with ``max_restarts`` a failed run starts again, up to that
    many times, and its processes resume from the newest checkpoint in ``checkpoint_dir``.
    The elastic agent stops every process on any failure and restarts without saying who
    died, so such runs are supervised by ``launch.supervisor`` instead. Results of lost
    processes are None. ``rank_names`` name ranks in messages ("ps shard 0", "worker 1").
    """
    # Traffic stays on loopback: Gloo binds to the interface named here, not to
    # whatever the host name resolves to.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    names = rank_names or [f"worker {rank}" for rank in range(num_processes)]
    if expendable or max_restarts:
        from paratrain.launch.supervisor import supervise

        return supervise(fn, args, num_processes, expendable, names, max_restarts, checkpoint_dir)
    return _elastic(fn, args, num_processes, names)


def _elastic(fn: Callable[..., Any], args: tuple, num_processes: int, names: list[str]) -> list[Any]:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=num_processes,
        run_id=f"paratrain-{uuid.uuid4().hex[:8]}",
        rdzv_backend="static",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        rdzv_configs={"rank": 0},
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
        local_addr="127.0.0.1",
    )
    quiet = [(logging.getLogger(name), logging.getLogger(name).level) for name in _ELASTIC_LOGGERS]
    for logger, _ in quiet:
        logger.setLevel(logging.CRITICAL)
    try:
        results = elastic_launch(config, _entry)(fn, *args)
    except ChildFailedError as error:
        failures = {rank: (f.exitcode, _time(f), _message(f)) for rank, f in error.failures.items()}
        raise first_failure({**_recorded_failures(error.failures), **failures}, names) from None
    finally:
        for logger, level in quiet:
            logger.setLevel(level)
    return [results[rank] for rank in sorted(results)]


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


def _recorded_failures(reported: dict[int, Any]) -> dict[int, tuple[int, float, str]]:
    """Failures recorded by every rank of the attempt, not only the one the agent saw first
    (when one process crashes, its peers fail a moment later on the broken connection,
    and the agent may report one of those)."""
    found: dict[int, tuple[int, float, str]] = {}
    files = [f.error_file for f in reported.values() if f.error_file and os.path.isfile(f.error_file)]
    if not files:
        return found
    attempt = Path(files[0]).parent.parent  # .../attempt_N/<local rank>/error.json
    for path in attempt.glob("*/error.json"):
        try:
            message = json.loads(path.read_text())["message"]
            extra = message["extraInfo"]
            code = int(extra.get("exit_code", 1))
            stack = extra.get("py_callstack", "")
            text = f"{message['message']}\n{stack.rstrip()}" if stack and code not in (2, 3) else message["message"]
            found[int(path.parent.name)] = (code, float(extra.get("paratrain_time", extra["timestamp"])), text)
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return found


def _time(failure: Any) -> float:
    message = failure.message
    if isinstance(message, dict):
        return float(message.get("extraInfo", {}).get("paratrain_time", failure.timestamp))
    return float(failure.timestamp)


def _message(failure: Any) -> str:
    message = failure.message
    if isinstance(message, dict):
        text = message.get("message", "")
        stack = message.get("extraInfo", {}).get("py_callstack", "")
        return f"{text}\n{stack.rstrip()}" if stack and failure.exitcode not in (2, 3) else text
    if failure.exitcode < 0:
        return f"killed by signal {-failure.exitcode}"
    return str(message) if message and "To enable traceback" not in str(message) else "no error recorded"
