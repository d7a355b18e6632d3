"""The local launcher: starts a run's processes with torchrun's environment, watches them, and decides what a
failure means.

A needed process that fails stops every process at once (never a hang) and is raised, naming it and its
exit code or signal; one killed without a word (SIGKILL) is taken as the cause of its peers' failures. An
expendable process (a ps-async or ps-backup worker) lost after it joined the group (its ``joined-<rank>``
file) costs one line and the others finish. With ``--max-restarts`` left the whole group starts again
(``TORCHELASTIC_RESTART_COUNT`` makes it resume from its checkpoint), one line saying who died, after which
step, and how many steps are redone; the steps come from ``PARATRAIN_PROGRESS`` (``train/faults.StepBeacon``).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from paratrain.checkpoints.store import CheckpointStore
from paratrain.comm.transport import host_rendezvous
from paratrain.errors import ParatrainError, WorkerFailed, signal_name
from paratrain.launch.process import LauncherEnv, exit_now, launcher_env, process_context, run_entry, take_env
from paratrain.launch.stacks import ENV as STACKS_ENV
from paratrain.launch.stacks import attach_stacks, dump_on_signal, stack_file
from paratrain.session.join_token import JOIN_TOKEN_ENV, new_join_token
from paratrain.train.faults import new_progress, read_progress


def supervise(
    fn: Callable[..., Any],
    args: tuple,
    num_processes: int,
    expendable: frozenset[int],
    names: list[str],
    max_restarts: int = 0,
    checkpoint_dir: str | None = None,
) -> list[Any]:
    restart = 0
    # The run's join token (session/join_token.py): its processes' alone, never in the store.
    token = os.environ.get(JOIN_TOKEN_ENV) or new_join_token()
    while True:
        # The attempt's scratch folder: error files, results, the progress beacons.
        folder = Path(tempfile.mkdtemp(prefix="paratrain-"))
        try:
            return _attempt(fn, args, num_processes, expendable, names, folder, restart, token)
        except WorkerFailed as failure:
            if restart >= max_restarts or failure.worker_exit_code in (2, 3):
                raise
            restart += 1
            print(
                _restart_line(failure, folder, num_processes, restart, max_restarts, checkpoint_dir),
                file=sys.stderr,
                flush=True,
            )
        finally:
            shutil.rmtree(folder, ignore_errors=True)


def _restart_line(
    failure: WorkerFailed, folder: Path, num_processes: int, restart: int, limit: int, checkpoint_dir: str | None
) -> str:
    progress = read_progress(folder / "progress", num_processes)
    complete = CheckpointStore(checkpoint_dir).complete() if checkpoint_dir else []
    resumed = complete[0][0] if complete else 0
    reached = max(progress, default=0)
    origin = f"the checkpoint of step {resumed}" if complete else "the start (no checkpoint yet)"
    # A process killed by a signal said nothing: its beacon tells how far it got. One that
    # failed with an error said where in its own message.
    killed = failure.worker_exit_code < 0 and progress[failure.rank]
    after = f" after step {progress[failure.rank]}" if killed else ""
    return (
        f"paratrain: {str(failure).splitlines()[0]}{after}; restarting the run "
        f"(restart {restart} of {limit}) from {origin}: {max(reached - resumed, 0)} steps redone"
    )


def _attempt(
    fn: Callable[..., Any],
    args: tuple,
    num_processes: int,
    expendable: frozenset[int],
    names: list[str],
    folder: Path,
    restart: int,
    token: str,
) -> list[Any]:
    context = process_context()
    _store, rendezvous = host_rendezvous()  # kept until the attempt ends
    new_progress(folder / "progress", num_processes)
    processes = []
    for rank in range(num_processes):
        env = {
            "RANK": str(rank),
            "WORLD_SIZE": str(num_processes),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(num_processes),
            **rendezvous,
            "TORCHELASTIC_ERROR_FILE": str(folder / f"error-{rank}.json"),
            "TORCHELASTIC_RESTART_COUNT": str(restart),
            "PARATRAIN_PROGRESS": str(folder / "progress"),
            "PARATRAIN_LAUNCHER_PID": str(os.getpid()),
            STACKS_ENV: stack_file(folder, rank),
            JOIN_TOKEN_ENV: token,
        }
        process = context.Process(
            target=run_process, args=(launcher_env(env), str(folder / f"result-{rank}.pkl"), fn, args), daemon=False
        )
        process.start()
        processes.append(process)
    lost: dict[int, tuple[int, float, str]] = {}
    left: set[int] = set()
    forwarding = SignalForwarding(processes)
    try:
        # Until the processes the run needs are done; an expendable one that is stuck (the
        # run counted it lost) gets a grace period, then is stopped.
        grace_until = None
        while any(p.exitcode is None for p in processes):
            time.sleep(0.1)
            if grace_until is None and all(
                p.exitcode is not None for r, p in enumerate(processes) if r not in expendable
            ):
                grace_until = time.monotonic() + 10.0
            if grace_until is not None and time.monotonic() > grace_until:
                for rank, process in enumerate(processes):
                    if process.exitcode is None:
                        print(
                            f"paratrain: {names[rank]} did not finish with the run; stopped",
                            file=sys.stderr,
                            flush=True,
                        )
                break
            failed = _failures(processes, folder, lost)
            fatal = _fatal(failed, expendable, folder)
            if fatal:
                # The others' exits show soon after (a process whose input was refused takes
                # its peers down with it, and the order in which the fork server reports
                # exits is not theirs): wait for them, so the failure that explains the run
                # is chosen among all of them.
                settle = time.monotonic() + (0.0 if any(c in (2, 3) for c, _, _ in fatal.values()) else 0.5)
                while time.monotonic() < settle and any(p.exitcode is None for p in processes):
                    time.sleep(0.02)
                # (An expendable process lost in the same moment stays a loss: a SIGKILL
                # counts as the earliest failure and would hide the one that ends the run.)
                fatal = {**_fatal(_failures(processes, folder, lost), expendable, folder), **fatal}
                raise first_failure(fatal, names)
            for rank, process in enumerate(processes):  # left when asked (SIGTERM), with a word
                if rank not in left and left_when_asked(folder, rank, process.exitcode):
                    left.add(rank)
                    print(f"paratrain: {failure_message(folder, rank, 0)}", file=sys.stderr, flush=True)
            for rank, (code, _, _) in failed.items():
                lost[rank] = failed[rank]
                how = f"exit code {code}" if code > 0 else f"killed by {signal_name(-code)}"
                print(
                    f"paratrain: {names[rank]} was lost ({how}); the run goes on without it",
                    file=sys.stderr,
                    flush=True,
                )
        return [read_result(folder, rank) for rank in range(num_processes)]
    except BaseException as error:
        # Stopped by what the run did not raise (a test's timeout): say where the processes are.
        if not isinstance(error, (ParatrainError, KeyboardInterrupt)):
            attach_stacks(error, processes, names, folder)
        raise
    finally:
        forwarding.restore()
        for process in processes:
            if process.exitcode is None:
                process.terminate()
        for process in processes:
            process.join(timeout=10)
            if process.exitcode is None:
                process.kill()


def _failures(processes: list[Any], folder: Path, lost: dict[int, Any]) -> dict[int, tuple[int, float, str]]:
    """``{rank: (exit code, time, message)}`` of the processes that failed and are not ``lost``."""
    return {
        rank: (p.exitcode, failed_at(folder, rank, p.exitcode), failure_message(folder, rank, p.exitcode))
        for rank, p in enumerate(processes)
        if p.exitcode not in (None, 0) and rank not in lost
    }


def _fatal(failures: dict[int, Any], expendable: frozenset[int], folder: Path) -> dict[int, Any]:
    """The failures that end the run: a needed process's, or an expendable one's that was lost
    before it joined the group (the others cannot form the group without it)."""
    return {
        rank: failure
        for rank, failure in failures.items()
        if rank not in expendable or not (folder / f"joined-{rank}").exists()
    }


def run_process(env: LauncherEnv, result_path: str, fn: Callable[..., Any], args: tuple) -> None:
    take_env(env)
    dump_on_signal()
    result = run_entry(fn, *args)
    with open(result_path, "wb") as handle:
        pickle.dump(result, handle)
    # Past this point the process has nothing left to do. Interpreter finalization could
    # still destroy a Gloo process group's C++ threads or pending works in an order that
    # aborts the process (std::terminate, SIGABRT) after a run that succeeded.
    exit_now(0)


def read_result(folder: Path, rank: int | str) -> Any:
    path = folder / f"result-{rank}.pkl"
    if not path.exists():
        return None
    with open(path, "rb") as handle:  # written by this run's own processes
        return pickle.load(handle)


def left_when_asked(folder: Path, rank: int | str, code: int | None) -> bool:
    """Whether a process that exited left the run when asked (SIGTERM): exit 0 with its
    word in the error file (``ReplicaLeft``), not a finish."""
    return code == 0 and (folder / f"error-{rank}.json").exists()


def failed_at(folder: Path, rank: int | str, code: int) -> float:
    path = folder / f"error-{rank}.json"
    if path.exists():
        return float(json.loads(path.read_text())["message"]["extraInfo"].get("paratrain_time", time.time()))
    # Killed without a word (kill -9, the OOM killer): the cause of its peers' failures.
    return 0.0 if code == -signal.SIGKILL else time.time()


def ends_run(folder: Path, rank: int | str) -> bool:
    """Whether a process's error says that no replacement can go on with the run
    (``StateLost``: the run's state is gone)."""
    path = folder / f"error-{rank}.json"
    return path.exists() and bool(json.loads(path.read_text())["message"]["extraInfo"].get("paratrain_ends_run"))


def failure_message(folder: Path, rank: int | str, code: int) -> str:
    path = folder / f"error-{rank}.json"
    if path.exists():
        message = json.loads(path.read_text())["message"]
        text, stack = message["message"], message["extraInfo"].get("py_callstack", "")
        return f"{text}\n{stack.rstrip()}" if stack else text
    if code < 0:
        return f"killed by signal {-code}"
    return "no error recorded"


def first_failure(failures: dict[int, tuple[int, float, str]], names: list[str]) -> WorkerFailed:
    """The failure that explains the run, from ``{rank: (exit code, time, message)}``:
    a bad-input or divergence exit first, else the earliest."""
    known = [rank for rank, (code, _, _) in failures.items() if code in (2, 3)]
    rank = min(known) if known else min(failures, key=lambda r: (failures[r][1], r))
    code, _, message = failures[rank]
    return WorkerFailed(rank, code, message, name=names[rank] if rank < len(names) else None)


class SignalForwarding:
    """While a run's processes run, SIGTERM and SIGUSR1 sent to the launcher (a scheduler's
    preemption, SLURM's time-limit warning) go on to each of them, which stop at an agreed
    step with a checkpoint (train/preemption.py) or leave as their strategy does, instead of
    ending with the launcher. Handlers are set from the main thread only (Python's rule)."""

    def __init__(self, processes: list[Any]):
        self.processes, self.previous = processes, {}
        if threading.current_thread() is threading.main_thread():
            for number in (signal.SIGTERM, signal.SIGUSR1):
                self.previous[number] = signal.signal(number, self._forward)

    def _forward(self, number: int, frame: Any) -> None:
        for process in self.processes:
            if process.exitcode is None and process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, number)

    def restore(self) -> None:
        for number, handler in self.previous.items():
            signal.signal(number, handler)
