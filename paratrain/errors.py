"""Errors a user can cause, each mapped to one exit code of the command line.

| error            | exit code | meaning                                              |
| ---------------- | --------- | ---------------------------------------------------- |
| ``ConfigError``  | 2         | bad input: a flag, config file, data file, checkpoint |
| ``DivergedError``| 3         | the loss became NaN or infinite                      |
| ``WorkerFailed`` | the worker's | a process of a multi-process run failed           |
| ``ReplicaLeft``  | 0         | an allreduce-ft replica left the run it asked to leave |

Anything else is a bug or an environment failure and exits with 1.
"""

from __future__ import annotations


class ParatrainError(Exception):
    """Base class of the errors that end a run with a one-line message."""

    exit_code = 1
    ends_run = False  # True: the launcher replaces no process of the run after this error


class ConfigError(ParatrainError, ValueError):
    """Bad input. The message names what is wrong and what would be valid."""

    exit_code = 2


class DivergedError(ParatrainError, ArithmeticError):
    """The training loss or a gradient became NaN or infinite."""

    exit_code = 3

    def __init__(self, loss: float, step: int):
        self.loss = loss
        self.step = step
        super().__init__(f"model diverged with loss = {loss} at step {step}")


class LauncherStopped(ParatrainError):
    """The launcher of a fault-tolerant run was sent SIGTERM or SIGUSR1: its replicas were
    stopped with it (their folder removed); exit code 128 + the signal's number."""

    def __init__(self, number: int, message: str):
        self.exit_code = 128 + number
        super().__init__(message)


class WorkerLost(ParatrainError):
    """A worker that the run cannot do without stopped answering."""


class StateLost(WorkerLost):
    """A replacement found no live replica holding the run's state (every replica that held
    it was lost, and no checkpoint had it): no replacement can go on with the run, which
    ends at once with this line (the launcher starts no other)."""

    ends_run = True


class ReplicaLeft(ParatrainError):
    """An ``allreduce-ft`` replica asked to leave (SIGTERM) finished its step and left; the
    others go on. Not a failure: the process exits 0 with this line."""

    exit_code = 0


class WorkerFailed(ParatrainError):
    """A process of a multi-process run failed; the run was stopped."""

    def __init__(self, rank: int, exit_code: int, message: str, name: str | None = None):
        self.rank = rank
        self.exit_code = exit_code if exit_code in (2, 3) else 1
        self.worker_exit_code = exit_code
        self.message = message
        who = name or f"worker {rank}"
        if exit_code < 0:  # killed by a signal: no message of its own
            super().__init__(f"{who} was killed by {signal_name(-exit_code)}")
        else:
            super().__init__(f"{who} failed (exit code {exit_code}): {message}")


def signal_name(number: int) -> str:
    import signal

    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
