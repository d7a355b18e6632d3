"""fsdp-ft on Gloo processes: 2 replicas of 2 shards (FSDP2 inside a replica, a per-step
quorum across replicas); a shard of replica 1 killed mid-run takes its replica out as a
unit, the survivor goes on, a replacement replica takes every shard's part of the state from
the same shard of the survivor, and the run is the single-process run of the same global
batch all along."""

import json
import shutil

import pytest
import torch

import paratrain
from paratrain.data.datasets import load_digits
from paratrain.models import build_model
from paratrain.strategies.base import current_strategy
from paratrain.testing import flat_parameters, relative_difference
from tests.conftest import as_formed, assert_same_run, power_cut_run, replaced_replica_run, single_run

pytest.importorskip("torchft")

pytestmark = pytest.mark.distributed

# Batch 4 per process, 4 processes: a global batch of 16, 89 steps an epoch.
# 1 epoch: the run equals the single-process one from its first steps; a power cut after step 50
# resumes from step 40 and finishes the epoch.
RUN = ["--epochs", "1", "--no-progress", "--log-every", "0"]
FT = ["--strategy", "fsdp", "--fault-tolerant", "--workers", "4", "--shards-per-replica", "2", "--batch-size", "4"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return single_run(tmp_path_factory.mktemp("single"), RUN, 16)


def test_without_a_fault_it_is_fsdp_and_the_single_process_run(cli, tmp_path, reference):
    out = tmp_path / "m.json"
    result = cli("train", *FT, *RUN, "--metrics-out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads(out.read_text())
    assert metrics["strategy"] == "fsdp-ft" and metrics["fault_tolerance"] == "per-step"
    # --workers counts processes, as the "done:" line says: 2 replicas of 2 shards are 4
    assert (metrics["workers"], metrics["replicas"], metrics["shards_per_replica"]) == (4, 2, 2)
    assert as_formed(metrics["participants"]["per_step"], 2) == [[1, reference["global_steps"], 2]]
    assert_same_run(metrics, reference)


def test_a_killed_shard_takes_its_replica_out_and_a_whole_new_replica_rejoins_live(tmp_path):
    # 2 epochs (178 steps): killed at step 30, the new replica rejoins ~15 steps later alone,
    # so a loaded machine's slower start still finds it back well before the last step
    run = ["--epochs", "2", *RUN[2:]]
    reference = single_run(tmp_path, run, 16)
    # the 4th process to start: shard 1 of replica 1
    metrics = replaced_replica_run([*FT, *run[:2]], tmp_path / "m.json", 3, "shard 1 of replica 1")
    assert_same_run(metrics, reference)


@pytest.mark.matrix  # a survivor finishing alone: test_fault_tolerant.py's, and a killed shard's replica below
def test_without_restarts_the_surviving_replica_finishes_alone(cli, tmp_path, reference):
    out = tmp_path / "m.json"
    result = cli("train", *FT, *RUN, "--fail", "1@40", "--metrics-out", str(out))  # both shards of replica 1
    assert result.returncode == 0, result.stderr[-3000:]
    assert "replica 1 was lost (killed by SIGKILL) after step 40" in result.stderr
    metrics = json.loads(out.read_text())
    assert as_formed(metrics["participants"]["per_step"], 2) == [[1, 40, 2], [41, reference["global_steps"], 1]]
    assert_same_run(metrics, reference)


# fsdp's background saves resumed: test_fsdp.py's sharded checkpoints [saved in the background]
@pytest.mark.parametrize(
    "asynchronous", [False, pytest.param(True, marks=pytest.mark.matrix)], ids=["saved", "saved in the background"]
)
def test_every_replica_lost_at_once_resumes_from_the_last_checkpoint(tmp_path, reference, asynchronous):
    """A power cut: both replicas (all four processes) die after step 50. The shards of the
    first replica of each quorum wrote a checkpoint every 20 steps, each its own part of the
    model and optimizer (DCP's files) and its position; the replacements resume from step
    40, do 41-50 again and finish as if nothing happened. Written from threads
    (``--checkpoint-async``: DCP's over the replica's own save group, whichever replica is
    first), step 40's save may still be under way at the cut: then the run resumes from 20."""
    parts = ["model/.metadata", "model/__0_0.distcp", "model/__1_0.distcp", "shard-0", "shard-1"]
    flags = [*FT, *RUN] + ["--checkpoint-async"] * asynchronous
    metrics = power_cut_run(flags, tmp_path / "ckpt", parts, reference["global_steps"], 20 if asynchronous else 40)
    assert_same_run(metrics, reference)


def test_a_checkpoint_resumes_on_another_layout(cli, tmp_path):
    """2 replicas of 2 shards write a checkpoint at step 50 (the shards of one replica, through
    DCP); it resumes mid-epoch on 1 replica of 4 shards (the same global batch: the epoch ends
    as the uninterrupted run's, itself the single-process run's) and on 2 replicas of 1
    (--workers 2: a global batch of 8, so the epoch goes on at batch 100, after the 800
    examples already read)."""
    ckpt = tmp_path / "ckpt"
    first = cli(
        "train",
        *FT,
        "--epochs",
        "1",
        "--no-progress",
        "--log-every",
        "0",
        "--checkpoint-dir",
        str(ckpt),
        "--checkpoint-every",
        "50",
        "--metrics-out",
        str(tmp_path / "first.json"),
    )
    assert first.returncode == 0, first.stderr[-3000:]
    uninterrupted = json.loads((tmp_path / "first.json").read_text())
    shutil.rmtree(ckpt / "ckpt-000000089")  # the end of the epoch: resume from step 50, mid-epoch
    manifest = json.loads((ckpt / "ckpt-000000050" / "manifest.json").read_text())
    assert {"shard-0", "shard-1", "model/.metadata"} <= set(manifest["parts"])
    shutil.copytree(ckpt, tmp_path / "copy")

    def resume(folder, layout, now, batch, epochs):
        out = tmp_path / "m.json"
        result = cli(
            "train",
            *FT,
            *layout,
            "--epochs",
            epochs,
            *RUN[2:],
            "--checkpoint-dir",
            str(folder),
            "--resume",
            "--metrics-out",
            str(out),
        )
        assert result.returncode == 0, result.stderr[-3000:]
        said = (
            f"was written by 2 replicas of 4 processes, this run has {now}: the model is resharded and epoch 1 goes on"
        )
        assert f"{said} at batch {batch}" in result.stdout
        metrics = json.loads(out.read_text())
        assert metrics["resumed_from_step"] == 50
        return metrics

    # The end of epoch 1, 39 steps on (1 replica of 4 shards steps slowest, ~45 ms a step):
    # a part of the model or optimizer misplaced, or the wrong batches, show at once.
    metrics = resume(ckpt, ["--shards-per-replica", "4"], "1 replica of 4 processes", 50, "1")
    assert metrics["global_steps"] == uninterrupted["global_steps"] == 89
    assert metrics["test_loss"] == pytest.approx(uninterrupted["test_loss"], rel=1e-4)
    # 2 epochs: 0.95 here (0.90 at the end of epoch 1)
    metrics = resume(tmp_path / "copy", ["--workers", "2", "--shards-per-replica", "1"], "2", 100, "2")
    assert metrics["test_accuracy"] > 0.9


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--strategy", "fsdp-ft", "--workers", "3", "--shards-per-replica", "2"], "is not a multiple of"),
        (["--strategy", "fsdp", "--workers", "2", "--shards-per-replica", "2"], "--shards-per-replica applies to"),
        ([*FT, "--compression", "int8"], "--compression int8"),
        ([*FT, "--min-replicas", "3"], "--min-replicas 3 is more than the run's 2 replicas"),
    ],
)
def test_what_fsdp_ft_cannot_take_is_refused_in_one_line(cli, tmp_path, flags, message):
    result = cli("train", *RUN, *flags)
    assert result.returncode == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def _in_scope():
    """In each process of ``paratrain.launch(..., strategy=s)``: the MLP on digits under ``s``
    with AdamW; the whole parameters (gathered from the replica's shards)."""
    torch.manual_seed(0)
    data = load_digits()
    model = build_model("mlp", data.spec)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.003)
    trainer = paratrain.Trainer(model, "cross_entropy", optimizer, strategy=current_strategy())
    trainer.fit(data.train, epochs=2, batch_size=8, verbose=0)
    return torch.cat([p.detach().full_tensor().reshape(-1) for p in trainer.module.parameters()])


def test_the_python_api_is_one_process_with_adamw():
    """``FaultTolerantFSDPStrategy(shards=2, workers=4)`` through ``paratrain.launch``: every
    shard of both replicas ends on one process's AdamW parameters with the global batch of
    32 (Adam's update is not linear in the gradient: only the exact mean gradient gets there)."""
    torch.manual_seed(0)
    data = load_digits()
    model = build_model("mlp", data.spec)
    trainer = paratrain.Trainer(model, "cross_entropy", torch.optim.AdamW(model.parameters(), lr=0.003))
    trainer.fit(data.train, epochs=2, batch_size=32, verbose=0)
    reference = flat_parameters(trainer.module)
    strategy = paratrain.FaultTolerantFSDPStrategy(shards=2, workers=4, device="cpu")
    results = paratrain.launch(_in_scope, strategy=strategy)
    assert len(results) == 4
    for params in results:
        assert relative_difference(params, reference) < 1e-4
