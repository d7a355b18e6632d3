"""fsdp-ft on Gloo processes: 2 replicas of 2 shards (FSDP2 inside a replica, a per-step
quorum across replicas); a shard of replica 1 killed mid-run takes its replica out as a
unit, the survivor goes on, a replacement replica takes every shard's part of the state from
the same shard of the survivor, and the run is the single-process run of the same global
batch all along."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import paratrain
from paratrain.data.datasets import load_digits
from paratrain.models import build_model
from paratrain.strategies.base import current_strategy
from paratrain.testing import flat_parameters, relative_difference, run_processes
from tests.conftest import as_formed, assert_same_run, single_run

pytest.importorskip("torchft")

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
# Batch 4 per process, 4 processes: a global batch of 16, 89 steps an epoch.
RUN = ["--epochs", "3", "--no-progress", "--log-every", "0"]
FT = ["--strategy", "fsdp", "--fault-tolerant", "--workers", "4", "--shards-per-replica", "2", "--batch-size", "4"]


def _same_run(metrics, reference):
    """Every committed step took the whole global batch, whoever was alive: the single-process
    run up to the order of float sums, a relative 1e-4 on every epoch's losses."""
    assert_same_run(metrics, reference)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return single_run(tmp_path_factory.mktemp("single"), RUN, 16)


def test_without_a_fault_it_is_fsdp_and_the_single_process_run(cli, tmp_path, reference):
    out = tmp_path / "m.json"
    result = cli("train", *FT, *RUN, "--metrics-out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads(out.read_text())
    assert metrics["strategy"] == "fsdp-ft" and metrics["fault_tolerance"] == "per-step"
    assert metrics["shards_per_replica"] == 2
    assert as_formed(metrics["participants"]["per_step"], 2) == [[1, reference["global_steps"], 2]]
    _same_run(metrics, reference)


def test_a_killed_shard_takes_its_replica_out_and_a_whole_new_replica_rejoins_live(tmp_path, reference):
    out = tmp_path / "m.json"
    command = [sys.executable, "-m", "paratrain", "train", *FT, *RUN[:2], "--progress", "--log-every", "10",
               "--max-restarts", "1", "--metrics-out", str(out)]  # fmt: skip
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        for line in run.stdout:
            if line.startswith("step ") and int(line.split()[1].rstrip(",")) >= 30:
                break
        processes = run_processes(run.pid)
        assert len(processes) == 4, processes
        os.kill(processes[3], signal.SIGKILL)  # shard 1 of replica 1 (replicas start in turn)
        _, stderr = run.communicate(timeout=300)
    finally:
        run.kill()
    assert run.returncode == 0, stderr[-3000:]
    assert re.search(r"paratrain: shard 1 of replica 1 was lost \(killed by SIGKILL\) after step \d+; a replacement "
                     r"joins the run \(restart 1 of 1\)", stderr), stderr[-3000:]  # fmt: skip
    assert len(re.findall(r"paratrain: worker \d joined the run at step \d+ with a live peer's state", stderr)) == 2
    metrics = json.loads(out.read_text())
    counts = [span[2] for span in as_formed(metrics["participants"]["per_step"], 2)]
    # 2 -> 1 -> 2, or 2 throughout when the new replica was in the quorum before the survivor
    # committed a step alone
    assert counts[0] == 2 and counts[-1] == 2 and set(counts) <= {1, 2}, metrics["participants"]
    assert metrics["restarts"] == 0
    _same_run(metrics, reference)


def test_without_restarts_the_surviving_replica_finishes_alone(cli, tmp_path, reference):
    out = tmp_path / "m.json"
    result = cli("train", *FT, *RUN, "--fail", "1@40", "--metrics-out", str(out))  # both shards of replica 1
    assert result.returncode == 0, result.stderr[-3000:]
    assert "replica 1 was lost (killed by SIGKILL) after step 40" in result.stderr
    metrics = json.loads(out.read_text())
    assert as_formed(metrics["participants"]["per_step"], 2) == [[1, 40, 2], [41, reference["global_steps"], 1]]
    _same_run(metrics, reference)


def test_every_replica_lost_at_once_resumes_from_the_last_checkpoint(cli, tmp_path, reference):
    """A power cut: both replicas (all four processes) die after step 50. The shards of the
    first replica of each quorum wrote a checkpoint every 20 steps, each its own part of the
    model and optimizer; the replacements resume from step 40, do 41-50 again and finish as
    if nothing happened."""
    folder = tmp_path / "ckpt"
    out = tmp_path / "m.json"
    flags = ["--checkpoint-dir", str(folder), "--checkpoint-every", "20", "--max-restarts", "4", "--fail", "all@50"]
    result = cli("train", *FT, *RUN, *flags, "--metrics-out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads(out.read_text())
    assert metrics["restarts"] >= 1 and metrics["resumed_from_step"] >= 40, metrics["participants"]
    segments = as_formed(metrics["participants"]["per_step"], 2)
    assert segments[0][0] == 1 and segments[-1][1] == reference["global_steps"]
    assert all(a[1] + 1 == b[0] for a, b in zip(segments, segments[1:])), segments  # every step once
    manifests = [json.loads((d / "manifest.json").read_text()) for d in sorted(folder.glob("ckpt-*"))]
    assert manifests and all(sorted(m["parts"]) == ["shard-0", "shard-1"] for m in manifests)
    _same_run(metrics, reference)


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
