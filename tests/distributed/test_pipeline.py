"""pipeline on 2-4 Gloo processes against the unsplit model in one process."""

import json

import pytest
import torch

import paratrain
from paratrain.data.datasets import load_digits
from paratrain.models import build_model
from paratrain.strategies.pipeline.strategy import PipelineStrategy
from paratrain.testing import flat_parameters, relative_difference, run_distributed

pytestmark = pytest.mark.distributed


def _deep_mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Flatten(),
        torch.nn.Linear(64, 48),
        torch.nn.Tanh(),
        torch.nn.Linear(48, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 24),
        torch.nn.Tanh(),
        torch.nn.Linear(24, 10),
    )


def _cifar_cnn():
    """Convolutions, max-pooling and local response normalisation (across channels, per
    example: nothing in it depends on which examples share a micro-batch)."""
    torch.manual_seed(0)
    return build_model("cifar_cnn", load_digits().spec)


MODELS = {"deep_mlp": _deep_mlp, "cifar_cnn": _cifar_cnn}


def _batch(n=32):
    x, y = load_digits().train.tensors
    return x[:n], y[:n]


def _one_step(schedule, stages, microbatches, balance="params", model_name="deep_mlp"):
    """One pipelined step; this stage's gradients and (last stage) logits and loss."""
    strategy = PipelineStrategy(
        num_stages=stages, num_microbatches=microbatches, schedule=schedule, balance=balance, device="cpu"
    )
    model = MODELS[model_name]()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    stage, optimizer = strategy.prepare(model, optimizer)
    x, y = _batch()
    out = strategy.train_step(stage, torch.nn.CrossEntropyLoss(), optimizer, x, y)
    stage = strategy.unwrap(stage)  # by time, the split is made at the first step
    with torch.no_grad():  # the evaluation path: a plain forward through the stages
        logits = strategy.forward(stage, x)
    result = {
        "stage": strategy.stage,
        "bounds": strategy.bounds,
        "grads": [p.grad.clone() for p in stage.parameters()],
        "loss": out.loss,
        "logits": out.logits,
        "eval_logits": logits,
    }
    strategy.teardown()
    return result


@pytest.mark.parametrize(
    "schedule, balance, model_name",
    [
        ("gpipe", "params", "deep_mlp"),
        ("1f1b", "params", "deep_mlp"),
        ("gpipe", "time", "deep_mlp"),
        ("1f1b", "params", "cifar_cnn"),
    ],
)
def test_pipelined_outputs_and_gradients_equal_the_unsplit_model(schedule, balance, model_name):
    """By time, rank 0 measures the split and every rank takes it (asserted: same bounds)."""
    stages = 2
    ranks = run_distributed(_one_step, schedule, stages, 4, balance, model_name, world_size=stages)
    model = MODELS[model_name]()
    x, y = _batch()
    logits = model(x)
    loss = torch.nn.functional.cross_entropy(logits, y)
    loss.backward()
    layers = list(model)
    assert [r["stage"] for r in ranks] == list(range(stages))
    assert ranks[0]["bounds"] == ranks[-1]["bounds"]
    for r in ranks:
        start, stop = r["bounds"][r["stage"]]
        reference = [p.grad for layer in layers[start:stop] for p in layer.parameters()]
        assert len(reference) == len(r["grads"]) > 0
        for got, want in zip(r["grads"], reference):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    last = ranks[-1]
    torch.testing.assert_close(last["logits"], logits.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(last["eval_logits"], logits.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(last["loss"], loss.detach(), rtol=1e-5, atol=1e-6)
    assert ranks[0]["eval_logits"] is None and float(ranks[0]["loss"]) == 0.0


def _train_steps(strategy, batch_size, steps, seed=0, loss="cross_entropy", callbacks=()):
    """Plain SGD (no momentum, no randomness in the model) for ``steps`` steps."""
    torch.manual_seed(seed)
    splits = load_digits()
    model = build_model("mlp", splits.spec)
    trainer = paratrain.Trainer(model, loss, torch.optim.SGD(model.parameters(), lr=0.1), strategy=strategy)
    x, y = splits.train.tensors
    n = steps * batch_size * strategy.num_replicas  # exactly `steps` global batches
    trainer.fit((x[:n], y[:n]), epochs=1, batch_size=batch_size, seed=seed, verbose=0, callbacks=list(callbacks))
    assert trainer.global_step == steps
    accuracy = trainer.evaluate(splits.test)
    result = (flat_parameters(trainer.module), getattr(strategy, "stage", 0), accuracy)
    return result


def _pipeline_params(batch_size, steps, schedule):
    strategy = PipelineStrategy(num_stages=2, num_microbatches=4, schedule=schedule, device="cpu")
    result = _train_steps(strategy, batch_size, steps)
    strategy.teardown()
    return result


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_stages_by_two_replicas_equal_single_with_the_global_batch(schedule):
    b, k = 16, 8
    reference, _, reference_accuracy = _train_steps(paratrain.SingleDeviceStrategy(device="cpu"), 2 * b, k)
    ranks = run_distributed(_pipeline_params, b, k, schedule, world_size=4)
    # mlp: Flatten, Linear, ReLU, Linear -> by parameter count [0, 2) and [2, 4)
    first_size = 64 * 256 + 256
    for params, stage, accuracy in ranks:
        want = reference[:first_size] if stage == 0 else reference[first_size:]
        assert relative_difference(params, want) < 1e-5
        assert accuracy["accuracy"] == pytest.approx(reference_accuracy["accuracy"])
        assert accuracy["loss"] == pytest.approx(reference_accuracy["loss"], rel=1e-5)
    assert [stage for _, stage, _ in ranks] == [0, 1, 0, 1]
    assert torch.equal(ranks[0][0], ranks[2][0]) and torch.equal(ranks[1][0], ranks[3][0])


def _tied_lm():
    """Token in, next token out, the output layer tied to the embedding as in a language model."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(16, 8), torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 16, bias=False)
    )
    model[3].weight = model[0].weight
    return model


def _tied_training(strategy, batch_size, steps=6):
    model = _tied_lm()
    trainer = paratrain.Trainer(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), strategy=strategy)
    x = torch.randint(0, 16, (steps * batch_size * strategy.num_replicas,), generator=torch.Generator().manual_seed(1))
    trainer.fit((x, (x + 1) % 16), epochs=1, batch_size=batch_size, seed=0, verbose=0)
    result = [p.detach().clone() for p in trainer.module.parameters()], getattr(strategy, "stage", None)
    strategy.teardown()
    return result


def _tied_pipeline(batch_size):
    return _tied_training(
        PipelineStrategy(num_stages=2, num_microbatches=2, split_points=[2], device="cpu"), batch_size
    )


def test_layers_that_share_a_parameter_on_two_stages_train_as_one_process():
    """The embedding on stage 0 and the output layer tied to it on stage 1: each stage's copy
    takes the sum of both gradients (parallel/shared.py), so both stay the single process's."""
    (embedding, linear_weight, linear_bias), _ = _tied_training(paratrain.SingleDeviceStrategy(device="cpu"), 16)
    ranks = dict((stage, params) for params, stage in run_distributed(_tied_pipeline, 16, world_size=2))
    for got, want in zip(ranks[0], [embedding, linear_weight, linear_bias]):
        assert relative_difference(got, want) < 1e-5
    (head,) = ranks[1]
    assert relative_difference(head, embedding) < 1e-5
    assert relative_difference(embedding, _tied_lm()[0].weight.detach()) > 1e-2  # it trained


class _NanAtStep(paratrain.Callback):
    """A cross-entropy that is NaN throughout step ``step`` (every micro-batch's), on
    replica 0 only; with ``where="gradient"`` instead an Inf in the last stage's last
    gradient alone (it does not flow back: the other stage's gradients stay finite)."""

    def __init__(self, step, where="loss"):
        self.step = step
        self.where = where
        self.current = 0
        self.hook = None

    def on_batch_begin(self, step, logs):
        self.current = step + 1
        strategy = self.trainer.strategy
        if self.where == "gradient" and self.current == self.step and strategy.rank == 0 and strategy.is_last_stage:
            bias = list(strategy._module.parameters())[-1]
            self.hook = bias.register_hook(lambda grad: grad * float("inf"))

    def on_batch_end(self, step, logs):
        if self.hook is not None:
            self.hook.remove()
            self.hook = None

    def loss(self, logits, targets):
        value = torch.nn.functional.cross_entropy(logits, targets)
        bad = self.where == "loss" and self.current == self.step and self.trainer.strategy.rank == 0
        return value * float("nan") if bad else value


def _pipeline_skipping(batch_size, steps, nan_step, where):
    strategy = PipelineStrategy(num_stages=2, num_microbatches=4, device="cpu")
    strategy.on_nan = "skip"
    nan = _NanAtStep(nan_step, where)
    params, stage, _ = _train_steps(strategy, batch_size, steps, loss=nan.loss, callbacks=[nan])
    strategy.teardown()
    return params, stage, strategy.skipped_updates


@pytest.mark.parametrize("where", ["loss", "gradient"])
def test_on_nan_skip_skips_the_step_on_every_stage_as_single_does(where):
    """A NaN loss or an Inf gradient on one replica's last stage: every stage of every
    replica skips that step, as single skips it. A stage sees only its own gradients, so
    the stages agree in one all-reduce of a flag."""
    b, k = 16, 6
    single = paratrain.SingleDeviceStrategy(device="cpu")
    single.on_nan = "skip"
    nan = _NanAtStep(3)
    reference, _, _ = _train_steps(single, 2 * b, k, loss=nan.loss, callbacks=[nan])
    assert single.skipped_updates == 1
    ranks = run_distributed(_pipeline_skipping, b, k, 3, where, world_size=4)
    first_size = 64 * 256 + 256
    for params, stage, skipped in ranks:
        assert skipped == 1
        want = reference[:first_size] if stage == 0 else reference[first_size:]
        assert relative_difference(params, want) < 1e-5


def test_cli_pipeline_reaches_the_accuracy_of_single(cli, tmp_path):
    out = tmp_path / "m.json"
    result = cli("train", "--strategy", "pipeline", "--stages", "2", "--microbatches", "4", "--metrics-out", str(out))
    assert result.returncode == 0, result.stderr
    metrics = json.loads(out.read_text())
    assert (metrics["strategy"], metrics["workers"], metrics["stages"], metrics["split"]) == (
        "pipeline",
        2,
        2,
        [[0, 2], [2, 4]],
    )
    assert metrics["global_steps"] == 15 * (1433 // 32)
    assert metrics["test_accuracy"] >= 0.95  # single: 0.9670 with these settings
    # activations forward and their gradients back: 32 examples x 256 floats each way
    assert metrics["bytes_sent"] == metrics["global_steps"] * 2 * 32 * 256 * 4
    assert result.stdout.count("done: ") == 1  # only the chief (the last stage) prints


@pytest.mark.parametrize(
    "args, words",
    [
        (["--stages", "5", "--schedule", "gpipe"], "--stages 5 is more than the model's 4 layers"),
        (["--stages", "2", "--split-points", "0"], "leaves a stage empty"),
        (["--stages", "2", "--workers", "3"], "not a multiple of --stages 2"),
    ],
)
def test_cli_bad_splits_exit_2_with_one_line(cli, args, words):
    result = cli("train", "--strategy", "pipeline", "--epochs", "1", *args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and lines[0].startswith("paratrain: error: ")


def test_a_conv_net_in_channels_last_order_crosses_the_stages(cli, tmp_path):
    """paratrain train puts a conv net in channels-last order on the CPU: the activations
    and gradients stages exchange are sent contiguous, and the run is the single process's."""
    runs = {}
    for name, flags in (("single", []), ("pipeline", ["--strategy", "pipeline", "--stages", "2"])):
        out = tmp_path / f"{name}.json"
        result = cli(
            "train",
            "--model",
            "cifar_cnn",
            "--epochs",
            "1",
            "--log-every",
            "0",
            "--metrics-out",
            str(out),
            "--device",
            "cpu",
            *flags,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        runs[name] = json.loads(out.read_text())
    assert runs["pipeline"]["channels_last"] is True
    assert runs["pipeline"]["test_loss"] == pytest.approx(runs["single"]["test_loss"], rel=1e-4)


class _PoisonLastStage(paratrain.Callback):
    """The last stage's parameters set to NaN after step 3 (a stage that diverged alone)."""

    def on_batch_end(self, step, logs):
        strategy = self.trainer.strategy
        if step == 3 and strategy.is_last_stage:
            with torch.no_grad():
                for p in self.trainer.module.parameters():
                    p.fill_(float("nan"))


def _diverged_alone():
    strategy = PipelineStrategy(num_stages=2, num_microbatches=2, device="cpu")
    strategy.on_nan = "skip"
    try:
        _train_steps(strategy, 16, 8, callbacks=[_PoisonLastStage()])
    except paratrain.DivergedError as error:
        return str(error)
    finally:
        strategy.teardown()
    return None


def test_a_stage_that_diverged_alone_stops_every_stage_at_the_same_step():
    """--on-nan skip: step 4's gradient is NaN everywhere (the last stage's parameters are),
    so every stage skips it; only the last stage's parameters are NaN, and every stage must
    see that, or the others went on to step 5's sends to a stage that had stopped."""
    said = run_distributed(_diverged_alone, world_size=2)
    assert said == ["model diverged with loss = nan at step 4"] * 2, said
