"""allreduce-ft on Gloo processes: a replica killed mid-run is dropped, the survivor goes on
at the next step without restarting, a replacement takes the live state from it, and the
run is the single-process run of the same global batch all along."""

import json
import re

import pytest

pytest.importorskip("torchft")

pytestmark = pytest.mark.distributed

# Batch 8 x 2 replicas: 89 steps an epoch, enough for a replacement to start and rejoin.
RUN = ["--epochs", "8", "--batch-size", "8", "--no-progress", "--log-every", "0"]


def _train(cli, tmp_path, name, *args):
    out = tmp_path / f"{name}.json"
    result = cli("train", *RUN, *args, "--metrics-out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text()), result.stderr


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """``single`` with the global batch of 2 replicas: what every allreduce-ft run must equal."""
    from tests.conftest import run_cli

    out = tmp_path_factory.mktemp("single") / "single.json"
    result = run_cli("train", *RUN[:2], "--batch-size", "16", *RUN[4:], "--metrics-out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


def _same_run(metrics, reference):
    """Every committed step took the whole global batch, whoever was alive: the losses are
    the single-process run's, up to the order of float sums (two halves' weighted gradients
    against one whole), which over 700 steps stays far below 1e-3."""
    assert metrics["global_steps"] == reference["global_steps"]
    for mine, theirs in zip(metrics["history"], reference["history"], strict=True):
        assert mine["train_loss"] == pytest.approx(theirs["train_loss"], rel=1e-3)
        assert mine["test_loss"] == pytest.approx(theirs["test_loss"], rel=1e-3)
    assert abs(metrics["test_accuracy"] - reference["test_accuracy"]) <= 0.01


def test_without_a_fault_it_is_the_single_process_run(cli, tmp_path, reference):
    metrics, _ = _train(cli, tmp_path, "plain", "--strategy", "allreduce-ft", "--workers", "2")
    assert metrics["participants"]["per_step"] == [[1, reference["global_steps"], 2]]
    assert metrics["uncommitted_steps"] == 0 and metrics["fault_tolerance"] == "per-step"
    _same_run(metrics, reference)


def test_a_killed_replica_is_replaced_live_while_the_survivor_goes_on(cli, tmp_path, reference):
    metrics, stderr = _train(
        cli,
        tmp_path,
        "replaced",
        "--strategy",
        "allreduce-ft",
        "--workers",
        "2",
        "--fail",
        "1@40",
        "--max-restarts",
        "1",
    )
    assert (
        "paratrain: worker 1 was lost (killed by SIGKILL) after step 40; a replacement joins the run (restart 1 of 1)"
        in stderr
    )
    joined = re.search(r"paratrain: worker 1 joined the run at step (\d+) with a live peer's state", stderr)
    assert joined, stderr[-2000:]
    assert "restarting the run" not in stderr
    # The survivor never restarted: it is the chief, first incarnation, and saw 2 -> 1 -> 2.
    assert metrics["restarts"] == 0
    (first, second, third) = metrics["participants"]["per_step"]
    assert first == [1, 40, 2] and second[0] == 41 and second[2] == 1
    assert third == [second[1] + 1, reference["global_steps"], 2]
    assert third[0] == int(joined.group(1)) + 1  # the replacement's first step is the survivor's next
    _same_run(metrics, reference)


def test_without_restarts_the_survivor_finishes_alone(cli, tmp_path, reference):
    metrics, stderr = _train(cli, tmp_path, "alone", "--strategy", "allreduce-ft", "--workers", "2", "--fail", "1@40")
    assert "paratrain: worker 1 was lost (killed by SIGKILL) after step 40; the run goes on with 1 replica" in stderr
    assert metrics["participants"]["per_step"] == [[1, 40, 2], [41, reference["global_steps"], 1]]
    _same_run(metrics, reference)
