"""Evaluation in every fault-tolerant mode is split over the quorum of the last step: each
replica scores its part of the test set (each fsdp shard a part of that), and the sums over
the quorum are the scores of every example, as ``single`` gives them; a replica lost just
before an evaluation leaves the survivor to score every example itself."""

import ast
import json

import pytest

from tests.conftest import run_script

pytest.importorskip("torchft")

pytestmark = pytest.mark.distributed

SCRIPT = """
import sys

import torch

import paratrain
from paratrain.data.datasets import load_digits
from paratrain.models import build_model

SEEN = []  # examples each evaluation's batches brought this process's metric


def counted(outputs, targets):
    SEEN[-1] += len(targets)
    return (outputs.argmax(-1) == targets).float().mean()


class Mark(paratrain.Callback):
    def on_epoch_end(self, epoch, logs):
        SEEN.append(0)  # the next evaluation's count


def train(batch):
    torch.manual_seed(0)
    data = load_digits()
    model = build_model("mlp", data.spec)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.003)
    trainer = paratrain.Trainer(model, "cross_entropy", optimizer, metrics={"counted": counted})
    SEEN.append(0)
    history = trainer.fit(data.train, epochs=2, batch_size=batch, validation_data=data.test, callbacks=[Mark()],
                          verbose=0)
    # epoch 1's evaluation comes before its on_epoch_end
    return SEEN[0], len(data.test), history["test_loss"], history["test_counted"]


# All on the CPU: AdamW's update of a gradient near zero is its sign, so a GPU's other
# rounding would move the scores by more than the sums' order does
STRATEGIES = {
    "single": lambda: paratrain.SingleDeviceStrategy(device="cpu"),
    "allreduce-ft": lambda: paratrain.FaultTolerantAllReduceStrategy(workers=2, device="cpu"),
    "fsdp-ft": lambda: paratrain.FaultTolerantFSDPStrategy(workers=4, shards=2, device="cpu"),
    "pipeline-ft": lambda: paratrain.FaultTolerantPipelineStrategy(num_stages=2, workers=4, device="cpu"),
    "local-sgd": lambda: paratrain.LocalSGDStrategy(workers=2, sync_every=4, device="cpu"),
    "local-sgd-ft": lambda: paratrain.FaultTolerantLocalSGDStrategy(workers=2, sync_every=4, device="cpu"),
}

if __name__ == "__main__":
    name, batch = sys.argv[1], int(sys.argv[2])  # a batch per process; in all, 32
    print(train(batch) if name == "single" else paratrain.launch(train, batch, strategy=STRATEGIES[name]()))
"""


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    path = tmp_path_factory.mktemp("evaluation") / "evaluate.py"
    path.write_text(SCRIPT)
    return path


def _run(script, name, batch):
    result = run_script(script, name, str(batch), cwd=script.parent, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    return ast.literal_eval(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("name", "reference", "batch", "parts", "scoring"),
    [
        ("allreduce-ft", "single", 16, 2, [0, 1]),
        ("fsdp-ft", "single", 8, 4, [0, 1, 2, 3]),
        ("pipeline-ft", "single", 16, 2, [1, 3]),
        ("local-sgd-ft", "local-sgd", 16, 2, [0, 1]),
    ],
)
def test_each_replica_scores_its_part_and_the_scores_are_the_plain_run_s(
    script, name, reference, batch, parts, scoring
):
    """2 replicas: each scores half of the 360 test examples (fsdp-ft's 2 shards a quarter
    each; a pipeline's last stage scores, the first passes its activations on); the losses
    and accuracies, sums over the quorum, are those of single with the global batch (of
    local-sgd for local-sgd-ft): float sums in another order, relative 1e-5."""
    plain = _run(script, reference, 32 if reference == "single" else batch)
    _, examples, losses, accuracies = plain if reference == "single" else plain[0]
    processes = _run(script, name, batch)
    for rank, (seen, total, loss, accuracy) in enumerate(processes):
        assert total == examples
        assert seen == (examples // parts if rank in scoring else 0), (rank, seen)  # its part, not the whole
        assert loss == pytest.approx(losses, rel=1e-5) and accuracy == pytest.approx(accuracies, abs=1e-6)


def test_a_replica_lost_right_before_an_evaluation_leaves_the_survivor_to_score_every_example(cli, tmp_path):
    """Worker 1 is killed after the last step of epoch 1 (89 steps of 8 x 2): the survivor's
    sum over that step's quorum cannot complete, and it scores all 360 examples alone; its
    test loss is the undisturbed run's (relative 1e-9: the same model, the sums in another
    order)."""
    run = [
        "--strategy",
        "allreduce-ft",
        "--workers",
        "2",
        "--epochs",
        "2",
        "--batch-size",
        "8",
        "--no-progress",
        "--log-every",
        "0",
    ]
    scores = []
    for name, faults in (("calm", []), ("lost", ["--fail", "1@89", "--max-restarts", "1"])):
        out = tmp_path / f"{name}.json"
        result = cli("train", *run, *faults, "--metrics-out", str(out))
        assert result.returncode == 0, result.stderr[-3000:]
        scores.append(json.loads(out.read_text()))
    calm, lost = scores
    assert "worker 1 was lost (killed by SIGKILL) after step 89" in result.stderr
    assert lost["history"][0]["test_loss"] == pytest.approx(calm["history"][0]["test_loss"], rel=1e-9)
    assert lost["history"][0]["test_accuracy"] == pytest.approx(calm["history"][0]["test_accuracy"], abs=1e-9)
