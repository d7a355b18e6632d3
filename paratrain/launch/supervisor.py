"""Local launch for runs that survive the loss of some processes (ps-async, ps-backup).

PyTorch's elastic agent treats any failed process as the failure of the whole group,
which is right for synchronous modes and wrong for asynchronous ones: there a lost
worker is a normal event that the parameter server absorbs. This supervisor starts the
same processes with torchrun's environment, watches them, reports a lost expendable
process in one line and lets the others finish; any other failure stops every process
at once, as the agent would.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from paratrain.comm.transport import free_port
from paratrain.launch.torchrun import _entry, first_failure


def supervise(
    fn: Callable[..., Any], args: tuple, num_processes: int, expendable: frozenset[int], names: list[str]
) -> list[Any]:
    context = multiprocessing.get_context("spawn")
    port = free_port()
    folder = Path(tempfile.mkdtemp(prefix="paratrain-"))
    processes = []
    for rank in range(num_processes):
        env = {
            "RANK": str(rank), "WORLD_SIZE": str(num_processes), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(num_processes), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "TORCHELASTIC_ERROR_FILE": str(folder / f"error-{rank}.json"),
        }
        process = context.Process(target=_run, args=(env, str(folder / f"result-{rank}.pkl"), fn, args), daemon=False)
        process.start()
        processes.append(process)
    lost: dict[int, tuple[int, float, str]] = {}
    try:
        while any(p.exitcode is None for p in processes):
            time.sleep(0.1)
            for rank, process in enumerate(processes):
                code = process.exitcode
                if code in (None, 0) or rank in lost:
                    continue
                failure = (code, _failed_at(folder, rank), _message(folder, rank, code))
                if rank not in expendable:
                    raise first_failure({rank: failure}, names)
                lost[rank] = failure
                print(f"paratrain: {names[rank]} was lost (exit code {code}); the run goes on without it", file=sys.stderr, flush=True)
        return [_result(folder, rank) for rank in range(num_processes)]
    finally:
        for process in processes:
            if process.exitcode is None:
                process.terminate()
        for process in processes:
            process.join(timeout=10)
            if process.exitcode is None:
                process.kill()


def _run(env: dict[str, str], result_path: str, fn: Callable[..., Any], args: tuple) -> None:
    os.environ.update(env)
    result = _entry(fn, *args)
    with open(result_path, "wb") as handle:
        pickle.dump(result, handle)


def _result(folder: Path, rank: int) -> Any:
    path = folder / f"result-{rank}.pkl"
    if not path.exists():
        return None
    with open(path, "rb") as handle:  # written by this run's own processes
        return pickle.load(handle)


def _failed_at(folder: Path, rank: int) -> float:
    import json

    path = folder / f"error-{rank}.json"
    if path.exists():
        return float(json.loads(path.read_text())["message"]["extraInfo"].get("paratrain_time", time.time()))
    return time.time()


def _message(folder: Path, rank: int, code: int) -> str:
    import json

    path = folder / f"error-{rank}.json"
    if path.exists():
        message = json.loads(path.read_text())["message"]
        text, stack = message["message"], message["extraInfo"].get("py_callstack", "")
        return f"{text}\n{stack.rstrip()}" if stack else text
    if code < 0:
        return f"killed by signal {-code}"
    return "no error recorded"
