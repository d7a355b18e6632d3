"""allreduce on 2 Gloo processes against the single-process reference."""

import json

import pytest
import torch

import paratrain
from paratrain.data.datasets import load_digits
from paratrain.errors import WorkerFailed
from paratrain.models import build_model
from paratrain.testing import flat_parameters, relative_difference, run_distributed

pytestmark = pytest.mark.distributed


def _train_steps(strategy, batch_size, steps, seed=0):
    """Plain SGD (no momentum, no randomness in the model) for ``steps`` steps."""
    torch.manual_seed(seed)
    splits = load_digits()
    model = build_model("mlp", splits.spec)
    trainer = paratrain.Trainer(model, "cross_entropy", torch.optim.SGD(model.parameters(), lr=0.1), strategy=strategy)
    x, y = splits.train.tensors
    n = steps * batch_size * strategy.num_replicas  # exactly `steps` global batches
    trainer.fit((x[:n], y[:n]), epochs=1, batch_size=batch_size, seed=seed, verbose=0)
    assert trainer.global_step == steps
    return flat_parameters(trainer.module)


def _allreduce_params(batch_size, steps):
    strategy = paratrain.AllReduceStrategy(device="cpu")
    params = _train_steps(strategy, batch_size, steps)
    strategy.teardown()
    return params


def test_allreduce_equals_single_with_the_global_batch():
    """The seeds' central claim: N replicas of batch b == one replica of batch N*b."""
    b, k = 16, 12
    reference = _train_steps(paratrain.SingleDeviceStrategy(device="cpu"), 2 * b, k)
    ranks = run_distributed(_allreduce_params, b, k, world_size=2)
    for params in ranks:
        assert relative_difference(params, reference) < 1e-5
    assert torch.equal(ranks[0], ranks[1])
    # and the run moved the parameters well beyond that tolerance
    torch.manual_seed(0)
    initial = flat_parameters(build_model("mlp", load_digits().spec))
    assert relative_difference(initial, reference) > 1e-2


def _scope_pattern():
    strategy = paratrain.MirroredStrategy(device="cpu")
    splits = load_digits()
    with strategy.scope():
        torch.manual_seed(strategy.rank)  # different inits: DDP must broadcast rank 0's
        model = build_model("mlp", splits.spec)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        trainer = paratrain.Trainer(model, "cross_entropy", optimizer)
    history = trainer.fit(splits.train, epochs=6, validation_data=splits.test, verbose=0)
    result = {
        "strategy": type(trainer.strategy).__name__,
        "replicas": trainer.strategy.num_replicas,
        "accuracy": history["test_accuracy"][-1],
        "params": flat_parameters(trainer.module),
    }
    strategy.teardown()
    return result


def test_scope_pattern_trains_mirrored_replicas():
    ranks = run_distributed(_scope_pattern, world_size=2)
    assert all(r["strategy"] == "AllReduceStrategy" and r["replicas"] == 2 for r in ranks)
    assert ranks[0]["accuracy"] == ranks[1]["accuracy"] >= 0.93
    assert torch.equal(ranks[0]["params"], ranks[1]["params"])


def _fail_on_rank_one():
    strategy = paratrain.AllReduceStrategy(device="cpu")
    strategy.setup()
    if strategy.rank == 1:
        raise RuntimeError("disk on fire")
    # rank 0 would wait forever in this collective if the launcher did not stop it
    torch.distributed.barrier()
    return "unreachable"


def test_a_failing_worker_fails_the_run_with_its_error():
    with pytest.raises(WorkerFailed) as error:
        run_distributed(_fail_on_rank_one, world_size=2)
    assert error.value.rank == 1
    assert "RuntimeError: disk on fire" in str(error.value)
    assert error.value.exit_code == 1


def test_cli_allreduce_two_workers(cli, tmp_path):
    out = tmp_path / "m.json"
    result = cli("train", "--strategy", "allreduce", "--workers", "2", "--metrics-out", str(out))
    assert result.returncode == 0, result.stderr
    metrics = json.loads(out.read_text())
    assert metrics["workers"] == 2 and metrics["strategy"] == "allreduce"
    assert metrics["test_accuracy"] >= 0.95
    assert metrics["global_steps"] == 15 * (1433 // 64)
    grad_bytes = (64 * 256 + 256 + 256 * 10 + 10) * 4
    assert metrics["bytes_sent"] == grad_bytes * metrics["global_steps"] * 2
    assert result.stdout.count("done: ") == 1  # only the chief prints


def test_cli_divergence_in_allreduce_exits_3(cli):
    result = cli(
        "train", "--strategy", "mirrored", "--workers", "2", "--epochs", "1", "--lr", "1e30", "--log-every", "4"
    )
    assert result.returncode == 3, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("paratrain: model diverged with loss = ")
