"""local-sgd and diloco on Gloo processes against the single-process reference."""

import json
import shutil

import pytest
import torch

import paratrain
from paratrain.data.datasets import load_digits
from paratrain.models import build_model
from paratrain.testing import flat_parameters, relative_difference, run_distributed

pytestmark = pytest.mark.distributed

B, STEPS = 16, 12


def _train(strategy, batch_size, steps, optimizer="sgd", callbacks=()):
    """``steps`` steps of the MLP on digits (no momentum, no randomness in the model); the
    parameters, and the strategy's stats where it has replicas."""
    torch.manual_seed(0)
    splits = load_digits()
    model = build_model("mlp", splits.spec)
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=0.003, weight_decay=0.01)
    trainer = paratrain.Trainer(model, "cross_entropy", opt, strategy=strategy)
    x, y = splits.train.tensors
    n = steps * batch_size * strategy.num_replicas
    trainer.fit((x[:n], y[:n]), epochs=1, batch_size=batch_size, seed=0, verbose=0, callbacks=list(callbacks))
    assert trainer.global_step == steps
    stats = strategy.stats()
    params = flat_parameters(trainer.module)
    strategy.teardown()
    return params, stats


def _single(batch_size, steps, **kwargs):
    return _train(paratrain.SingleDeviceStrategy(device="cpu"), batch_size, steps, **kwargs)[0]


def _replicas(name, options):
    options = dict(options)
    optimizer = options.pop("optimizer", "sgd")
    cls = {"local-sgd": paratrain.LocalSGDStrategy, "diloco": paratrain.DiLoCoStrategy, "allreduce": None}[name]
    strategy = paratrain.AllReduceStrategy(device="cpu") if cls is None else cls(device="cpu", **options)
    return _train(strategy, B, STEPS, optimizer=optimizer)


@pytest.mark.parametrize(
    "options",
    [
        {"sync_every": 1},  # averaging after every SGD step is the gradient all-reduce
        {"sync_every": 5, "local_after": STEPS},  # post-local SGD: all-reduce throughout the warm-up
    ],
    ids=["H=1", "warm-up"],
)
def test_local_sgd_equals_single_where_the_math_says_so(options):
    reference = _single(2 * B, STEPS)
    ranks = run_distributed(_replicas, "local-sgd", options, world_size=2)
    for params, _ in ranks:
        assert relative_difference(params, reference) < 1e-5


def test_local_sgd_sends_h_times_fewer_bytes_and_differs_from_allreduce():
    h = 4
    local = run_distributed(_replicas, "local-sgd", {"sync_every": h}, world_size=2)
    allreduce = run_distributed(_replicas, "allreduce", {}, world_size=2)
    assert torch.equal(local[0][0], local[1][0])  # the run ends averaged
    assert relative_difference(local[0][0], allreduce[0][0]) > 1e-4  # replicas did step apart
    assert local[0][1]["synchronizations"] == STEPS // h
    assert local[0][1]["bytes_sent"] * h == allreduce[0][1]["bytes_sent"]


class _OuterNesterov(paratrain.Callback):
    """DiLoCo written out by hand for one replica: every H steps, the delta from the anchor
    is the outer gradient of Nesterov SGD; the model goes on from the new anchor."""

    def __init__(self, h, lr, momentum):
        self.h = h
        self.lr = lr
        self.mu = momentum

    def on_train_begin(self, logs):
        self.anchor = flat_parameters(self.trainer.module).clone()
        self.buffer = None

    @torch.no_grad()
    def on_batch_end(self, step, logs):
        if step % self.h:
            return
        delta = self.anchor - flat_parameters(self.trainer.module)
        self.buffer = delta.clone() if self.buffer is None else self.mu * self.buffer + delta
        self.anchor -= self.lr * (delta + self.mu * self.buffer)
        torch.nn.utils.vector_to_parameters(self.anchor.clone(), self.trainer.module.parameters())


def test_diloco_is_the_outer_nesterov_step_on_the_inner_adamw():
    h = 4
    lr = 0.7
    mu = 0.9
    reference = _train(
        paratrain.SingleDeviceStrategy(device="cpu"), B, STEPS, "adamw", callbacks=[_OuterNesterov(h, lr, mu)]
    )[0]
    options = {"sync_every": h, "outer_lr": lr, "outer_momentum": mu, "optimizer": "adamw"}
    ((params, stats),) = run_distributed(_replicas, "diloco", options, world_size=1)
    assert stats["synchronizations"] == STEPS // h
    assert relative_difference(params, reference) < 1e-5
    assert relative_difference(params, _single(B, STEPS, optimizer="adamw")) > 1e-3  # the outer step mattered


@pytest.mark.parametrize("strategy", ["local-sgd", "diloco"])
def test_cli_trains_to_single_accuracy_with_a_codec_and_resumes_exactly(cli, tmp_path, strategy):
    """From the command line, with int8 on the wire: the accuracy of single, and a run
    resumed from a checkpoint written between synchronizations (each replica's own model,
    the outer state) that ends exactly where the uninterrupted run ends."""
    common = [
        "--strategy",
        strategy,
        "--workers",
        "2",
        "--sync-every",
        "6",
        "--compression",
        "int8",
        "--log-every",
        "0",
    ]
    if strategy == "diloco":
        common += ["--optimizer", "adamw", "--lr", "0.003", "--fragments", "2"]
    whole, first, second = (tmp_path / f"{n}.json" for n in ("whole", "first", "second"))
    ckpt = str(tmp_path / "ckpt")
    result = cli("train", *common, "--epochs", "6", "--metrics-out", str(whole))
    assert result.returncode == 0, result.stderr
    done = json.loads(whole.read_text())
    assert done["test_accuracy"] >= 0.93
    assert done["compression"] == "int8"
    # 22 steps per epoch: the checkpoints at 7, 14, ... 63 are between synchronizations.
    result = cli(
        "train",
        *common,
        "--epochs",
        "3",
        "--checkpoint-dir",
        ckpt,
        "--checkpoint-every",
        "7",
        "--metrics-out",
        str(first),
    )
    assert result.returncode == 0, result.stderr
    # The end of a run averages what the last round left: go on from step 63, mid-round.
    shutil.rmtree(tmp_path / "ckpt" / "ckpt-000000066")
    result = cli("train", *common, "--epochs", "6", "--checkpoint-dir", ckpt, "--resume", "--metrics-out", str(second))
    assert result.returncode == 0, result.stderr
    resumed = json.loads(second.read_text())
    assert resumed["resumed_from_step"] == 63
    assert resumed["test_loss"] == pytest.approx(done["test_loss"], rel=1e-6)
    assert [e["train_loss"] for e in resumed["history"]] == pytest.approx(
        [e["train_loss"] for e in done["history"]], rel=1e-6
    )


def _coded_means():
    import torch.distributed as dist

    from paratrain.comm.average import average
    from paratrain.comm.codec_config import make_codec
    from paratrain.config import TrainConfig

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    tensors = [torch.randn(300, 20), torch.randn(50)]
    results = {}
    for name in ("none", "fp16", "bf16", "int8", "topk", "powersgd"):
        codec = make_codec(name, TrainConfig(compression="none").codec)
        means, sent = average(tensors, codec, ["a", "b"])
        results[name] = ([m.clone() for m in means], sent, sum(codec.wire_bytes(tuple(t.shape)) for t in tensors))
    dist.destroy_process_group()
    return results, tensors


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_coded_mean_over_processes(world_size):
    """comm/average.py: every process gets the same mean, as close as each codec carries it,
    and hands exactly the codec's wire bytes to the collective."""
    ranks = run_distributed(_coded_means, world_size=world_size)
    exact = [torch.stack([inputs[i] for _, inputs in ranks]).mean(0) for i in range(2)]
    tolerance = {"none": 1e-6, "fp16": 1e-3, "bf16": 1e-2, "int8": 2e-2}
    for name, (means, sent, wire) in ranks[0][0].items():
        assert sent == wire, name
        for other, _ in ranks[1:]:
            assert all(torch.equal(a, b) for a, b in zip(means, other[name][0])), name
        if name in tolerance:
            for mean, truth in zip(means, exact):
                assert relative_difference(mean, truth) < tolerance[name], name


def _running_statistics(name, sync_every, steps):
    """A model with BatchNorm trained by ``name`` for ``steps`` steps: its running mean and
    variance, and whether the replica's last synchronization came at the end."""
    torch.manual_seed(0)
    splits = load_digits()
    model = torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(64, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(), torch.nn.Linear(32, 10)
    )
    cls = {"local-sgd": paratrain.LocalSGDStrategy, "diloco": paratrain.DiLoCoStrategy}[name]
    strategy = cls(device="cpu", sync_every=sync_every)
    trainer = paratrain.Trainer(model, "cross_entropy", torch.optim.SGD(model.parameters(), lr=0.1), strategy=strategy)
    x, y = splits.train.tensors
    n = steps * B * strategy.num_replicas
    trainer.fit((x[:n], y[:n]), epochs=1, batch_size=B, seed=0, verbose=0)
    bn = trainer.module[2]
    out = torch.cat([bn.running_mean, bn.running_var]).clone()
    strategy.teardown()
    return out


@pytest.mark.parametrize("name", ["local-sgd", "diloco"])
def test_running_statistics_are_one_models_at_the_end(name):
    """Each replica's BatchNorm statistics follow its own batches between synchronizations:
    they are averaged with the parameters, and the replicas end as one model (they ended
    with each replica's own, which the evaluation and the saved model then differed by)."""
    first, second = run_distributed(_running_statistics, name, 5, 12, world_size=2)
    assert torch.equal(first, second)
    assert not torch.equal(first[:32], torch.zeros(32))  # trained: the statistics moved
