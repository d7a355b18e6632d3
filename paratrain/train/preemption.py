"""Stopping a run at a signal, with a checkpoint to go on from: SLURM's warning before a job's time limit
(``sbatch --signal=USR1@90``) and a preemption's SIGTERM (SLURM, a Kubernetes eviction).

Each process gets the signal at its own moment, so the run agrees on the step to stop at: at each check
every process adds what it was sent to one small all-reduce, and all stop after the same step; that step is
checkpointed (mid-epoch if so) and the command exits with ``EXIT_STOPPED``; ``--resume`` goes on from it.
Checks cost an all-reduce each, so after the ``PACE_STEP``-th step they come about once every
``CHECK_SECONDS``, at a pace every process agrees on. For runs whose processes all train in step;
parameter-server workers and fault-tolerant replicas leave one by one instead (session/leaving.py).
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from paratrain.comm.transport import wire_device
from paratrain.train.callbacks import Callback

#: The signals that stop a run at an agreed step.
SIGNALS = (signal.SIGUSR1, signal.SIGTERM)

#: A stopped run's exit code: EX_TEMPFAIL, "try again" (a scheduler that restarts failed
#: jobs starts it again; with --resume it goes on).
EXIT_STOPPED = 75

#: The step (of this start of the run) at which the processes agree on how often to check,
#: and the time between checks.
PACE_STEP, CHECK_SECONDS = 20, 1.0


class StopOnSignal(Callback):
    """Stops training after the step at which the run learns that one of its processes was
    sent SIGUSR1 or SIGTERM; ``stopped`` then says which signal and at which step."""

    def __init__(self, checkpoint: Any) -> None:
        self.checkpoint = checkpoint  # saves the step stopped at, where the epoch stands (train/checkpoint.py)
        self.every, self.sent = 1, 0
        self.stopped: dict[str, Any] | None = None
        self._previous: dict[int, Any] = {}
        self._started = 0.0
        self._before: int | None = None  # the global step this start of the run began after

    def on_train_begin(self, logs: dict[str, Any]) -> None:
        if threading.current_thread() is threading.main_thread():  # Python's handlers run there
            for number in SIGNALS:
                self._previous[number] = signal.signal(number, self._handle)
        self._started = time.perf_counter()

    def _handle(self, number: int, frame: Any) -> None:
        self.sent = number

    def on_batch_end(self, step: int, logs: dict[str, Any]) -> None:
        if self._before is None:  # every process of the run starts from the same step
            self._before = step - 1
        done = step - self._before
        if done % self.every:
            return
        strategy = self.trainer.strategy
        pace = (time.perf_counter() - self._started) / done if done == PACE_STEP else 0.0
        # One sum: which signals came anywhere, and the first process's pace.
        shared = torch.tensor([float(self.sent == s) for s in SIGNALS] + [pace * (strategy.process_rank == 0)])
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            shared = shared.to(wire_device(strategy.device))
            dist.all_reduce(shared)
        *sent, pace = shared.tolist()
        if done == PACE_STEP and pace > 0:
            self.every = max(1, min(1000, round(CHECK_SECONDS / pace)))
        if any(sent):
            names = [signal.Signals(s).name for s, n in zip(SIGNALS, sent) if n]
            self.stopped = {"signal": ",".join(names), "step": self.trainer.global_step}
            self.checkpoint.save(self.trainer.global_step)  # mid-epoch: the loop then closes the epoch
            self.trainer.stop_training = True

    def on_train_end(self, logs: dict[str, Any]) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}


def stops_on_signal(strategy: Any) -> bool:
    """Whether the run's processes all train in step (no server, no replica replaced alone)."""
    topology = strategy.topology
    roles = {topology.role(rank) for rank in range(topology.num_processes)}
    return strategy.server is None and len(roles) == 1 and not topology.replaces_lost
