"""local-sgd and diloco with --fault-tolerant on Gloo processes: without a fault each equals
its plain strategy; through a kill the survivor goes on at its next synchronization and a
replacement joins at one, taking the anchor, the outer and inner optimizers and the loop's
position from it."""

import json
import re

import pytest

import paratrain
from paratrain.data.datasets import load_digits
from paratrain.models import build_model
from paratrain.strategies.base import current_strategy
from paratrain.testing import flat_parameters, relative_difference
from tests.conftest import as_formed

pytest.importorskip("torchft")

pytestmark = pytest.mark.distributed

# Batch 8 x 2 replicas: 89 steps an epoch, 445 in all.
RUN = ["--epochs", "5", "--batch-size", "8", "--no-progress", "--log-every", "0", "--workers", "2"]


def _train(cli, tmp_path, name, *args):
    out = tmp_path / f"{name}.json"
    result = cli("train", *RUN, *args, "--metrics-out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text()), result.stderr


def _test_losses(metrics):
    return [epoch["test_loss"] for epoch in metrics["history"]]


@pytest.mark.parametrize(
    "flags",
    [
        ["--strategy", "local-sgd", "--sync-every", "4"],
        ["--strategy", "diloco", "--sync-every", "4", "--optimizer", "adamw", "--lr", "0.003"],
        ["--strategy", "diloco", "--sync-every", "4", "--fragments", "2", "--compression", "bf16"],
    ],
    ids=["local-sgd", "diloco", "streaming-bf16"],
)
def test_without_a_fault_it_is_the_plain_strategy(cli, tmp_path, flags):
    """Each delta weighted by its replica's share of the round's examples (1/2 each) over the
    weights' sum is the plain mean: the shared model, which evaluation scores, is the plain
    run's up to float rounding (a relative 1e-5 over five epochs). Only if both replicas are
    in every synchronization: one silent for longer than --replica-heartbeat-timeout is
    taken for lost and its round's local steps count for nothing (a test loss 0.1% off
    after one epoch, once, under the suite's load at the 0.2 s default), so this run gives
    the heartbeat 2 s."""
    plain, _ = _train(cli, tmp_path, "plain", *flags)
    ft, _ = _train(cli, tmp_path, "ft", *flags, "--fault-tolerant", "--replica-heartbeat-timeout", "2")
    assert ft["strategy"] == f"{flags[1]}-ft" and ft["fault_tolerance"] == "per-synchronization"
    syncs = plain["synchronizations"]
    assert ft["synchronizations"] == syncs and ft["participants"]["per_step"] == [[1, syncs, 2]]
    assert ft["uncommitted_steps"] == 0 and ft["recoveries"] == []
    assert _test_losses(ft) == pytest.approx(_test_losses(plain), rel=1e-5)
    assert ft["test_accuracy"] == pytest.approx(plain["test_accuracy"], abs=1e-6)


def test_local_sgd_averaging_every_step_follows_single_through_a_kill_and_a_live_rejoin(cli, tmp_path):
    """With H = 1 and plain SGD, local SGD is single-process SGD on the global batch (the
    mean of one step's deltas is one step on the mean gradient). Worker 1 is killed after
    step 40: the survivor's step 41 had only its half of the batch (the lost replica's half
    went with it; the next quorum weighs the survivor's delta alone), then whole batches
    again, with the replacement or alone. One step of 445 on half its batch moves the test
    loss by ~2e-4 relative here; held to 2e-3, and every step is in the run."""
    flags = ["--strategy", "local-sgd", "--fault-tolerant", "--sync-every", "1", "--momentum", "0"]
    single = tmp_path / "single.json"
    result = cli("train", *RUN[:2], "--batch-size", "16", *RUN[4:7], "--momentum", "0", "--metrics-out", str(single))
    assert result.returncode == 0, result.stderr[-3000:]
    reference = json.loads(single.read_text())
    metrics, stderr = _train(
        cli, tmp_path, "killed", *flags, "--straggler", "0:2", "--fail", "1@40", "--max-restarts", "1"
    )
    assert "worker 1 was lost (killed by SIGKILL) after step 40; a replacement joins the run" in stderr
    assert re.search(r"worker 1 joined the run at step (\d+) with a live peer's state", stderr), stderr[-2000:]
    assert metrics["global_steps"] == reference["global_steps"] == 445
    segments = as_formed(metrics["participants"]["per_step"], 2)
    assert segments[0][0] == 1 and segments[-1][1] == 445 and segments[-1][2] == 2
    assert all(a[1] + 1 == b[0] for a, b in zip(segments, segments[1:])), segments  # every synchronization once
    assert _test_losses(metrics) == pytest.approx(_test_losses(reference), rel=2e-3)
    assert abs(metrics["test_accuracy"] - reference["test_accuracy"]) <= 0.01


def test_diloco_s_replacement_joins_at_a_synchronization_and_the_run_keeps_its_accuracy(cli, tmp_path):
    """Worker 0 is killed after step 42, inside a round of H = 4: the replacement joins in the
    survivor's next synchronization (a step that is a multiple of 4), leads the quorums after
    it (the lowest replica) and reports the run, its own heal included. DiLoCo's outer
    Nesterov state comes with the anchor, and the run keeps learning: the plain run's
    accuracy moves by 2-3 points with the seed here (0.915-0.959 over seeds 0-2), the killed
    run's stayed in that band (0.934-0.948); held to 5 points and over 0.9."""
    flags = ["--strategy", "diloco", "--sync-every", "4", "--optimizer", "adamw", "--lr", "0.001"]
    plain, _ = _train(cli, tmp_path, "plain", *flags)
    metrics, stderr = _train(
        cli,
        tmp_path,
        "killed",
        *flags,
        "--fault-tolerant",
        "--straggler",
        "1:2",
        "--fail",
        "0@42",
        "--max-restarts",
        "1",
    )
    joined = re.search(r"worker 0 joined the run at step (\d+) with a live peer's state", stderr)
    assert joined, stderr[-2000:]
    assert int(joined.group(1)) % 4 == 0 and int(joined.group(1)) >= 44
    assert [heal["worker"] for heal in metrics["recoveries"]][-1:] == [0]
    segments = as_formed(metrics["participants"]["per_step"], 2)
    assert segments[-1][1:] == [plain["synchronizations"], 2]
    assert metrics["global_steps"] == plain["global_steps"]
    assert metrics["test_accuracy"] >= max(plain["test_accuracy"] - 0.05, 0.9)


def test_every_replica_lost_at_once_resumes_from_the_last_checkpoint(cli, tmp_path):
    """A power cut: both replicas die after step 50. The first replica of the last quorum
    wrote a checkpoint every 20 steps; the replacements resume from step 40 (its Manager's
    step is the checkpoint's synchronizations), do 41-50 again and finish. With H = 1 and
    plain SGD, every synchronization leaves the replicas equal, so the run is single's to
    the order of float sums (1e-4 relative), and every synchronization is in the record once.
    A replica taken for lost for a stalled heartbeat would leave a step with half its batch
    (~2e-4): the heartbeat gets 2 s, as in the runs without a fault above."""
    folder = tmp_path / "ckpt"
    flags = [
        "--strategy",
        "local-sgd-ft",
        "--sync-every",
        "1",
        "--momentum",
        "0",
        "--checkpoint-dir",
        str(folder),
        "--checkpoint-every",
        "20",
        "--max-restarts",
        "2",
        "--fail",
        "all@50",
        "--replica-heartbeat-timeout",
        "2",
    ]
    metrics, stderr = _train(cli, tmp_path, "cut", *flags)
    assert "paratrain: worker 0: injected failure at step 50" in stderr
    assert "paratrain: worker 1: injected failure at step 50" in stderr
    assert metrics["restarts"] >= 1 and metrics["resumed_from_step"] >= 40
    segments = as_formed(metrics["participants"]["per_step"], 2)
    assert segments[0][0] == 1 and segments[-1][1] == metrics["synchronizations"] == 445
    assert all(a[1] + 1 == b[0] for a, b in zip(segments, segments[1:])), segments
    single = tmp_path / "single.json"
    result = cli("train", *RUN[:2], "--batch-size", "16", *RUN[4:7], "--momentum", "0", "--metrics-out", str(single))
    assert result.returncode == 0, result.stderr[-3000:]
    assert _test_losses(metrics) == pytest.approx(_test_losses(json.loads(single.read_text())), rel=1e-4)


def test_without_restarts_the_survivor_finishes_alone(cli, tmp_path):
    flags = ["--strategy", "local-sgd-ft", "--sync-every", "4"]
    metrics, stderr = _train(cli, tmp_path, "alone", *flags, "--fail", "1@42")
    assert "worker 1 was lost (killed by SIGKILL) after step 42; the run goes on with 1 replica" in stderr
    syncs = metrics["synchronizations"]
    assert as_formed(metrics["participants"]["per_step"], 2) == [[1, 10, 2], [11, syncs, 1]]
    assert metrics["global_steps"] == 445 and metrics["test_accuracy"] > 0.9


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--strategy", "local-sgd", "--fault-tolerant", "--local-after", "10"], "--local-after applies to"),
        (["--strategy", "diloco-ft", "--compression", "int8"], "--compression must be one of none, fp16, bf16"),
        (["--strategy", "local-sgd-ft", "--outer-lr", "0.5"], "--outer-lr applies to"),
        (["--strategy", "ps-sync", "--fault-tolerant"], "--fault-tolerant keeps allreduce, pipeline, fsdp, local-sgd"),
    ],
)
def test_what_a_fault_tolerant_averaging_run_cannot_take_is_refused_in_one_line(cli, flags, message):
    result = cli("train", *RUN, *flags)
    assert result.returncode == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def _in_scope(epochs):
    """In each process of ``paratrain.launch(..., strategy=s)``: the MLP on digits under ``s``."""
    import torch

    torch.manual_seed(0)
    data = load_digits()
    model = build_model("mlp", data.spec)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = paratrain.Trainer(model, "cross_entropy", optimizer, strategy=current_strategy())
    trainer.fit(data.train, epochs=epochs, batch_size=16, verbose=0)
    return flat_parameters(trainer.module)


def test_the_python_api_with_every_step_averaged_is_one_process():
    """``FaultTolerantLocalSGDStrategy(sync_every=1)`` through ``paratrain.launch``: both
    replicas end with one process's parameters (plain SGD, the global batch of 32)."""
    import torch

    torch.manual_seed(0)
    data = load_digits()
    model = build_model("mlp", data.spec)
    trainer = paratrain.Trainer(model, "cross_entropy", torch.optim.SGD(model.parameters(), lr=0.1))
    trainer.fit(data.train, epochs=2, batch_size=32, verbose=0)
    reference = flat_parameters(trainer.module)
    strategy = paratrain.FaultTolerantLocalSGDStrategy(workers=2, device="cpu", sync_every=1)
    results = paratrain.launch(_in_scope, 2, strategy=strategy)
    assert len(results) == 2
    for params in results:
        assert relative_difference(params, reference) < 1e-5
