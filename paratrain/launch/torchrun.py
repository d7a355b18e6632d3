"""Local multi-process launch through PyTorch's elastic agent (the machinery of torchrun).

``launch(fn, *args, num_processes=N)`` runs ``fn(*args)`` in N fresh processes on
loopback with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...), monitors
them, and returns their results by rank. When one process fails the agent stops the
others at once, so a failed run never hangs; the failure is raised as WorkerFailed
naming the rank, its exit code and its error.
"""

from __future__ import annotations

import logging
import os
import sys
import uuid
from collections.abc import Callable
from typing import Any

from paratrain.comm.transport import free_port
from paratrain.errors import ParatrainError, WorkerFailed

_ELASTIC_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")


def launch(fn: Callable[..., Any], *args: Any, num_processes: int, max_restarts: int = 0) -> list[Any]:
    """Run ``fn(*args)`` on ``num_processes`` local processes; their return values by rank.

    ``fn`` must be importable (a module-level function): processes are spawned fresh.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # Traffic stays on loopback: Gloo binds to the interface named here, not to
    # whatever the host name resolves to.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=num_processes,
        run_id=f"paratrain-{uuid.uuid4().hex[:8]}",
        rdzv_backend="static",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        rdzv_configs={"rank": 0},
        max_restarts=max_restarts,
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
        raise _first_failure(error) from None
    finally:
        for logger, level in quiet:
            logger.setLevel(level)
    return [results[rank] for rank in sorted(results)]


def _entry(fn: Callable[..., Any], *args: Any) -> Any:
    """Runs in each spawned process: ``fn(*args)``, with errors the parent can read.

    A ParatrainError is recorded (its message only) in the agent's error file and ends
    the process with its exit code; anything else propagates with its traceback, which
    the agent records, and exits 1.
    """
    try:
        return fn(*args)
    except ParatrainError as error:
        _record(error)
        sys.exit(error.exit_code)


def _record(error: ParatrainError) -> None:
    import json
    import time

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    message = {"message": {"message": str(error), "extraInfo": {"py_callstack": "", "timestamp": str(int(time.time()))}}}
    with open(path, "w") as handle:
        json.dump(message, handle)


def _first_failure(error: Any) -> WorkerFailed:
    """The failure that explains the run: a bad-input or divergence exit first, else the earliest."""
    failures = error.failures
    known = [rank for rank, f in failures.items() if f.exitcode in (2, 3)]
    rank = min(known) if known else min(failures, key=lambda r: (failures[r].timestamp, r))
    failure = failures[rank]
    return WorkerFailed(rank, failure.exitcode, _message(failure))


def _message(failure: Any) -> str:
    message = failure.message
    if isinstance(message, dict):
        text = message.get("message", "")
        stack = message.get("extraInfo", {}).get("py_callstack", "")
        return f"{text}\n{stack.rstrip()}" if stack and failure.exitcode not in (2, 3) else text
    if failure.exitcode < 0:
        return f"killed by signal {-failure.exitcode}"
    return str(message) if message and "To enable traceback" not in str(message) else "no error recorded"
