import math

import pytest
import torch

import paratrain
from paratrain.data.datasets import load_digits
from paratrain.errors import ConfigError, DivergedError
from paratrain.models import build_model
from paratrain.train.callbacks import Callback, EarlyStopping, LearningRateScheduler
from paratrain.train.metrics import EpochSums, StepWindow


def _trainer(lr=0.05, momentum=0.9, seed=0):
    torch.manual_seed(seed)
    splits = load_digits()
    model = build_model("mlp", splits.spec)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    return paratrain.Trainer(
        model, "cross_entropy", optimizer, strategy=paratrain.SingleDeviceStrategy(device="cpu")
    ), splits


def test_fit_evaluate_predict_on_digits():
    trainer, splits = _trainer()
    history = trainer.fit(splits.train, epochs=15, validation_data=splits.test, verbose=0)
    assert len(history.epochs) == 15
    assert history["test_accuracy"][-1] >= 0.95
    assert history["train_loss"][-1] < history["train_loss"][0]
    results = trainer.evaluate(splits.test)
    assert results["accuracy"] == pytest.approx(history["test_accuracy"][-1])
    logits = trainer.predict(splits.test)
    assert logits.shape == (len(splits.test), 10)
    accuracy = (logits.argmax(1) == splits.test.tensors[1]).double().mean().item()
    assert accuracy == pytest.approx(results["accuracy"])


def test_fit_takes_numpy_pairs():
    trainer, splits = _trainer()
    x, y = splits.train.tensors
    history = trainer.fit((x.numpy(), y.numpy()), epochs=1, verbose=0)
    assert math.isfinite(history["train_loss"][0])


def test_fit_is_deterministic_for_a_seed():
    runs = []
    for _ in range(2):
        trainer, splits = _trainer()
        runs.append(trainer.fit(splits.train, epochs=2, verbose=0, seed=3)["train_loss"])
    assert runs[0] == runs[1]


def test_divergence_names_the_first_bad_step():
    class PoisonAt(Callback):
        def on_batch_begin(self, step, logs):
            if step == 6:  # the 7th step sees an infinite learning rate
                self.trainer.set_learning_rate(float("inf"))

    trainer, splits = _trainer()
    with pytest.raises(DivergedError) as error:
        trainer.fit(splits.train, epochs=1, verbose=0, log_every=5, callbacks=[PoisonAt()])
    # The update of step 7 poisons the weights; step 8's loss is the first NaN.
    assert error.value.step == 8
    assert str(error.value) == "model diverged with loss = nan at step 8"


def test_early_stopping_stops_when_the_monitor_stalls():
    trainer, splits = _trainer()
    stopper = EarlyStopping("test_accuracy", patience=1, min_delta=1.0)  # nothing improves by 1.0
    history = trainer.fit(splits.train, epochs=10, validation_data=splits.test, callbacks=[stopper], verbose=0)
    assert len(history.epochs) == 2
    assert stopper.stopped_epoch == 1


def test_learning_rate_schedule_is_applied_each_step():
    trainer, splits = _trainer()
    schedule = paratrain.ExponentialDecay(0.1, decay_steps=10, decay_rate=0.5, staircase=True)
    seen = []

    class Record(Callback):
        def on_batch_end(self, step, logs):
            seen.append(self.trainer.optimizer.param_groups[0]["lr"])

    trainer.fit(splits.train, epochs=1, callbacks=[LearningRateScheduler(schedule), Record()], verbose=0)
    assert seen[:10] == [0.1] * 10
    assert seen[10:20] == [0.05] * 10
    assert seen[20] == 0.025


def test_step_log_has_the_classic_form(capsys):
    trainer, splits = _trainer()
    trainer.fit(splits.train, epochs=1, verbose=1, log_every=10)
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(lines) == 4  # 44 steps of 32
    import re

    assert re.fullmatch(r"step 10, loss = \d+\.\d{4} \(\d+\.\d examples/sec; \d+\.\d{4} sec/batch\)", lines[0])


def test_scope_makes_the_trainer_use_the_strategy():
    strategy = paratrain.SingleDeviceStrategy(device="cpu")
    with strategy.scope():
        assert paratrain.get_strategy() is strategy
        model = torch.nn.Linear(4, 2)
        trainer = paratrain.Trainer(model, "cross_entropy", torch.optim.SGD(model.parameters(), lr=0.1))
    assert trainer.strategy is strategy
    assert paratrain.get_strategy() is not strategy


def test_scope_sets_the_default_device_only_where_it_is_another():
    """A default device is a torch function mode, which every torch call of a step goes
    through in Python: the scope of a CPU strategy adds none where the CPU is the default,
    and still makes the CPU the default where another device is."""
    strategy = paratrain.SingleDeviceStrategy(device="cpu")
    with strategy.scope():
        assert torch._C._len_torch_function_stack() == 0
        assert torch.zeros(1).device.type == "cpu"
    with torch.device("meta"), strategy.scope():
        assert torch.zeros(1).device.type == "cpu"
    with torch.device("meta"):
        assert torch.zeros(1).device.type == "meta"


def test_trainer_rejects_unknown_names():
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="unknown loss 'hinge'"):
        paratrain.Trainer(model, "hinge", optimizer)
    with pytest.raises(ConfigError, match="unknown metric 'f1'"):
        paratrain.Trainer(model, "cross_entropy", optimizer, metrics=["f1"])


def test_a_collective_that_times_out_in_evaluation_is_diagnosed_as_in_a_step():
    """A peer lost while the replicas reduce evaluation's sums: the strategy names it, as it
    does for a collective of a training step (a cut link at the end of an epoch)."""

    class Lost(paratrain.SingleDeviceStrategy):
        def all_reduce_sum(self, tensor):
            raise RuntimeError("Timed out waiting 10000ms for recv operation to complete")

        def diagnose(self, error, step):
            return RuntimeError(f"worker 1 did not answer at step {step}: {error}")

    model = torch.nn.Linear(4, 2)
    trainer = paratrain.Trainer(
        model, "cross_entropy", torch.optim.SGD(model.parameters(), lr=0.1), strategy=Lost(device="cpu")
    )
    data = (torch.randn(8, 4), torch.randint(0, 2, (8,)))
    with pytest.raises(RuntimeError, match="worker 1 did not answer at step 0: Timed out"):
        trainer.evaluate(data, batch_size=4)


def test_an_epochs_loss_is_one_exact_sum_however_its_steps_were_reduced():
    """Steps reduced in windows split anywhere (a checkpoint mid-epoch splits a resumed run's)
    give the epoch's train loss of one window to the last bit: the sums are exact."""
    strategy = paratrain.SingleDeviceStrategy(device="cpu")
    generator = torch.Generator().manual_seed(5)
    losses = torch.rand(200, dtype=torch.float64, generator=generator) * 3
    sizes = torch.randint(1, 97, (200,), generator=generator).tolist()
    means = set()
    for cuts in ([], [1, 2, 3, 50, 51, 199], list(range(0, 200, 7)), list(range(200))):
        sums, window = EpochSums(), StepWindow()
        for step, (loss, size) in enumerate(zip(losses, sizes)):
            window.add(loss, size)
            if step in cuts:
                sums.add(window.reduce(strategy))
        if len(window):
            sums.add(window.reduce(strategy))
        means.add(EpochSums.from_state(sums.state_dict()).mean())
    assert len(means) == 1


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"threads": 0}, "threads"),
        ({"threads": True}, "threads"),
        ({"flush_denormal": 1}, "flush_denormal"),
        ({"onednn_layers": "yes"}, "onednn_layers"),
    ],
)
def test_cpu_tuning_refuses_what_it_cannot_apply_naming_the_option(options, named):
    with pytest.raises(ConfigError, match=f"CpuTuning.{named} must be"):
        paratrain.CpuTuning(**options)
