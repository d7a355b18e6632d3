"""A signal stops a run at a step, with a checkpoint of where the epoch stands (train/preemption.py)."""

import signal
import threading

import torch

import paratrain
from paratrain.train.checkpoint import Checkpoint
from paratrain.train.preemption import StopOnSignal


class _SignalAt(paratrain.Callback):
    def __init__(self, step, number):
        self.step, self.number = step, number

    def on_batch_end(self, step, logs):
        if step == self.step:
            # Sent to this very process (the test runner's): without the stopper's handler
            # in place it would end the runner with the test unreported.
            handler = signal.getsignal(self.number)
            assert callable(handler) and getattr(handler, "__self__", None).__class__ is StopOnSignal, handler
            # To the main thread, where Python runs its handlers: a signal sent to the process
            # goes to any of its threads, and this runner holds threads that earlier tests
            # left (Gloo's, a store's), not this run's; one of them interrupted in a system
            # call may abort the runner (seen three times as a crashed worker during this test).
            signal.pthread_kill(threading.main_thread().ident, self.number)


def _fit(tmp_path, callbacks, resume=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    trainer = paratrain.Trainer(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), metrics=())
    checkpoint = Checkpoint(tmp_path / "ck", every_steps=1000, resume=resume)
    stopper = StopOnSignal(checkpoint)
    x = torch.randn(320, 8, generator=torch.Generator().manual_seed(1))
    data = (x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())
    trainer.fit(data, epochs=3, batch_size=16, verbose=0, callbacks=[*callbacks, checkpoint, stopper])
    return trainer, stopper


def test_sigusr1_stops_mid_epoch_and_resume_ends_where_the_whole_run_ends(tmp_path):
    """SLURM's warning before the time limit: the run stops after that step (checked every
    step before step 20), the checkpoint is there, and the handler is the previous one again."""
    before = signal.getsignal(signal.SIGUSR1)
    stopped, stopper = _fit(tmp_path, [_SignalAt(13, signal.SIGUSR1)])
    assert stopper.stopped == {"signal": "SIGUSR1", "step": 13} and stopped.global_step == 13
    assert signal.getsignal(signal.SIGUSR1) is before
    resumed, _ = _fit(tmp_path, [], resume=True)
    whole, _ = _fit(tmp_path / "whole", [])
    assert resumed.global_step == whole.global_step == 60
    for a, b in zip(resumed.module.parameters(), whole.module.parameters()):
        assert torch.equal(a, b)


def test_a_run_resumed_past_the_pace_step_agrees_on_its_pace_too(tmp_path):
    """A restart from a checkpoint past step PACE_STEP begins at a later global step: its
    checks still slow to their pace PACE_STEP steps into the new start, not one every step."""
    from paratrain.train.preemption import PACE_STEP

    _fit(tmp_path, [])  # 60 steps, the checkpoint at the end
    stopper = StopOnSignal(Checkpoint(tmp_path / "ck", every_steps=1000, resume=True))
    stopper.trainer = type("Trainer", (), {"strategy": type("Strategy", (), {"process_rank": 0, "device": None})})()
    stopper.on_train_begin({})
    for step in range(61, 61 + PACE_STEP):  # steps of a quick model: far under a second each
        stopper.on_batch_end(step, {})
    stopper.on_train_end({})
    assert stopper.every > 1 and stopper.stopped is None
