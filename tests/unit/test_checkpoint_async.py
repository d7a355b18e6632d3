"""Checkpoints written from a thread (``Checkpoint(asynchronous=True)``, ``--checkpoint-async``):
each holds the state of its own step while training goes on, a resume from one is exact,
and a write that fails is raised by the run."""

import threading
import time

import pytest
import torch

import paratrain
from paratrain.checkpoints.files import copy_state
from paratrain.checkpoints.store import CheckpointStore
from paratrain.data.datasets import load_digits
from paratrain.errors import ConfigError
from paratrain.models import build_model
from paratrain.train.callbacks import Callback
from paratrain.train.checkpoint import Checkpoint, load_checkpoint


class Snapshots(Callback):
    """The model's parameters after every ``every``-th step, the newest complete checkpoint
    in ``folder`` the step after, and a stop after ``stop_at``."""

    def __init__(self, every, stop_at=None, folder=None):
        self.every = every
        self.stop_at = stop_at
        self.folder = folder
        self.models = {}
        self.losses = []
        self.newest = {}

    def on_batch_end(self, step, logs):
        self.losses.append(logs["local_loss"].item())
        if self.folder is not None and step % self.every == 1:
            self.newest[step] = CheckpointStore(self.folder).latest()
        if step % self.every == 0:
            self.models[step] = {k: v.clone() for k, v in self.trainer.module.state_dict().items()}
        if step == self.stop_at:
            self.trainer.stop_training = True


def _trainer(seed=0):
    torch.manual_seed(seed)
    splits = load_digits()
    net = build_model("mlp", splits.spec)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    trainer = paratrain.Trainer(net, "cross_entropy", optimizer, strategy=paratrain.SingleDeviceStrategy(device="cpu"))
    return trainer, splits


def _fit(trainer, splits, *callbacks, epochs=1):
    return trainer.fit(splits.train, epochs=epochs, validation_data=splits.test, verbose=0, callbacks=list(callbacks))


@pytest.fixture
def slow_writes(monkeypatch):
    """Every part takes 0.2 s longer to write (a slow disk), and the threads that wrote each
    step's part are recorded."""
    writers = {}
    write_part = CheckpointStore.write_part

    def slow(self, step, part, state, save=None):
        writers[step] = threading.current_thread().name
        time.sleep(0.2)
        return write_part(self, step, part, state, save)

    monkeypatch.setattr(CheckpointStore, "write_part", slow)
    return writers


def test_each_checkpoint_holds_its_own_step_while_training_goes_on(tmp_path, slow_writes):
    """The digits mlp saves every 10 of its 44 steps from a thread that takes 0.2 s a part
    (about 40 steps' time here): each checkpoint still holds the parameters of its own step,
    not those training reached while it was written, and only the end's save is written
    on the training thread's watch (it waits for it)."""
    trainer, splits = _trainer()
    seen = Snapshots(every=10, folder=tmp_path)
    _fit(trainer, splits, Checkpoint(tmp_path, every_steps=10, keep=10, asynchronous=True), seen)
    assert [step for step, _ in CheckpointStore(tmp_path).complete()] == [44, 40, 30, 20, 10]
    # A step after each save, that save is still being written (and the one before it is done).
    assert [seen.newest[s] and seen.newest[s].name for s in (11, 21, 31, 41)] == [
        None,
        "ckpt-000000010",
        "ckpt-000000020",
        "ckpt-000000030",
    ]
    assert {slow_writes[s] for s in (10, 20, 30, 40, 44)} == {"checkpoint-write"}
    for step in (10, 20, 30, 40):
        saved = load_checkpoint(tmp_path / f"ckpt-{step:09d}")
        assert saved["trainer"]["global_step"] == step
        for name, tensor in seen.models[step].items():
            assert torch.equal(saved["model"][name], tensor), (step, name)
        final = trainer.module.state_dict()
        assert any(not torch.equal(saved["model"][name], final[name]) for name in final)  # it moved on since


def test_a_resume_from_an_asynchronous_checkpoint_is_exact(tmp_path, slow_writes):
    """Cut at step 25, resumed from step 20's checkpoint (written from a thread): every
    later step's loss and the final parameters equal those of the run never cut."""
    trainer, splits = _trainer()
    whole = Snapshots(every=10)
    _fit(trainer, splits, whole, epochs=2)
    cut, splits = _trainer()
    _fit(cut, splits, Checkpoint(tmp_path, every_steps=10, asynchronous=True), Snapshots(10, stop_at=25))
    (tmp_path / "ckpt-000000025").rename(tmp_path / "ignored")  # the end-of-run save: go back to 20
    resumed, splits = _trainer(seed=1)
    after = Snapshots(every=10)
    checkpoint = Checkpoint(tmp_path, every_steps=10, resume=True, asynchronous=True)
    _fit(resumed, splits, checkpoint, after, epochs=2)
    assert checkpoint.restored_step == 20
    assert after.losses == whole.losses[20:]
    for a, b in zip(trainer.module.parameters(), resumed.module.parameters()):
        assert torch.equal(a, b)


def test_a_failed_write_is_raised_by_the_run_and_the_earlier_checkpoints_stay(tmp_path, monkeypatch):
    """The write of step 20 fails on its thread (a full disk): the run raises that error at
    its next save, and the checkpoint of step 10 stays the newest complete one."""
    write_part = CheckpointStore.write_part

    def failing(self, step, part, state, save=None):
        if step == 20:
            raise ConfigError(f"checkpoint {self.folder(step)}: cannot write (No space left on device)")
        return write_part(self, step, part, state, save)

    monkeypatch.setattr(CheckpointStore, "write_part", failing)
    trainer, splits = _trainer()
    seen = Snapshots(every=10)
    with pytest.raises(ConfigError, match="No space left on device"):
        _fit(trainer, splits, seen, Checkpoint(tmp_path, every_steps=10, asynchronous=True))
    assert trainer.global_step == 30  # raised at step 30's save, on the training thread
    assert CheckpointStore(tmp_path).latest().name == "ckpt-000000010"


def test_a_strategy_that_writes_with_a_collective_refuses_it(tmp_path):
    class Sharded(paratrain.SingleDeviceStrategy):
        checkpoints_in_background = False

    torch.manual_seed(0)
    splits = load_digits()
    net = build_model("mlp", splits.spec)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    trainer = paratrain.Trainer(net, "cross_entropy", optimizer, strategy=Sharded(device="cpu"))
    with pytest.raises(ConfigError, match="asynchronous=False"):
        _fit(trainer, splits, Checkpoint(tmp_path, asynchronous=True))


def test_a_copy_of_the_state_shares_what_the_state_shares():
    """Tied weights (one storage under two names, as two detached tensors the way
    ``state_dict`` gives them) stay one tensor in the copy; the copy is the CPU's and changes
    to the originals do not reach it."""
    weight = torch.ones(3, requires_grad=True)
    state = {
        "model": {"embed": weight.detach(), "head": weight.detach()},
        "steps": [torch.zeros(2), 7],
        "rng": (torch.ones(1), "x"),
    }
    copied = copy_state(state)
    assert copied["model"]["embed"] is copied["model"]["head"]
    with torch.no_grad():
        weight.add_(1)
    state["steps"][0].add_(1)
    assert torch.equal(copied["model"]["embed"], torch.ones(3)) and not copied["model"]["embed"].requires_grad
    assert torch.equal(copied["steps"][0], torch.zeros(2)) and copied["steps"][1] == 7
    assert isinstance(copied["rng"], tuple) and copied["rng"][1] == "x"


def test_a_background_save_is_on_the_timelines_io_track(tmp_path):
    """With a timeline on, a save written from its thread is an ``io`` span that overlaps the
    training thread's; one written on the training thread stays one of its ``compute`` phases."""
    from paratrain import timeline

    tracks = {}
    for asynchronous in (True, False):
        trainer, splits = _trainer()
        recorder = timeline.start(0, "worker 0")
        try:
            _fit(trainer, splits, Checkpoint(tmp_path / str(asynchronous), every_steps=10, asynchronous=asynchronous))
        finally:
            timeline.stop()
        tracks[asynchronous] = [e["tid"] for e in recorder.events if e["name"] == "checkpoint"]
        names = {m["tid"]: m["args"]["name"] for m in recorder.metadata() if m["name"] == "thread_name"}
        assert names == {timeline.COMPUTE: "compute", timeline.COMM: "comm", timeline.IO: "io"}
    assert tracks == {True: [timeline.IO] * 5, False: [timeline.COMPUTE] * 5}


def test_a_replica_that_leaves_ends_the_save_it_began_first(tmp_path, slow_writes):
    """A process asked to leave (SIGTERM to a fault-tolerant replica: ReplicaLeft, after
    which the process ends at once) the step after a save, whose write takes 0.2 s: the
    save is complete when the loop raises, so the step the run counts on is on disk."""
    from paratrain.errors import ReplicaLeft

    class LeavesAt21(paratrain.SingleDeviceStrategy):
        def train_step(self, model, loss_fn, optimizer, inputs, targets):
            if self._steps_taken == 20:
                raise ReplicaLeft("worker 0 left the run after step 20 (SIGTERM); the others go on")
            self._steps_taken += 1
            return super().train_step(model, loss_fn, optimizer, inputs, targets)

    torch.manual_seed(0)
    splits = load_digits()
    net = build_model("mlp", splits.spec)
    strategy = LeavesAt21(device="cpu")
    strategy._steps_taken = 0
    trainer = paratrain.Trainer(net, "cross_entropy", torch.optim.SGD(net.parameters(), lr=0.05), strategy=strategy)
    with pytest.raises(ReplicaLeft):
        _fit(trainer, splits, Checkpoint(tmp_path, every_steps=20, asynchronous=True))
    assert [step for step, _ in CheckpointStore(tmp_path).complete()] == [20]
