"""paratrain under a real SLURM on this machine (paratrain/testing_slurm.py: munge on a
private socket, slurmctld and one slurmd, all removed after): the tasks of an srun step
form one run, and the batch script ``paratrain slurm`` writes runs to COMPLETED."""

import json
import os
import sys
import time
from pathlib import Path

import pytest

from paratrain.testing_slurm import LocalSlurm, missing

pytestmark = [pytest.mark.distributed, pytest.mark.skipif(missing() is not None, reason=str(missing()))]


@pytest.fixture(scope="module")
def slurm():
    cluster = LocalSlurm()
    yield cluster
    cluster.stop()


def test_the_tasks_of_srun_form_one_run(slurm, tmp_path):
    out = tmp_path / "m.json"
    result = slurm.run("srun", "-n", "2", sys.executable, "-m", "paratrain", "train", "--strategy", "allreduce",
                       "--epochs", "1", "--no-progress", "--metrics-out", str(out), cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("done:") == 1  # one run, whose chief reports it
    metrics = json.loads(out.read_text())
    assert metrics["workers"] == 2 and metrics["global_steps"] == 1433 // 64 and metrics["test_accuracy"] > 0.7


def test_the_batch_script_of_paratrain_slurm_runs_a_parameter_server_to_completed(slurm, tmp_path):
    """3 tasks: 1 shard and 2 workers, the job COMPLETED."""
    out = tmp_path / "m.json"
    env = {**slurm.env(), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    submitted = slurm.run(sys.executable, "-m", "paratrain", "slurm", "--tasks-per-node", "3", "--time", "00:05:00",
                          "--submit", "--", "--strategy", "ps-sync", "--ps-shards", "1", "--epochs", "1",
                          "--no-progress", "--metrics-out", str(out), cwd=tmp_path, env=env)  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr[-3000:]
    job = submitted.stdout.split()[-1]  # "Submitted batch job N"
    assert slurm.wait_for_job(job) == "COMPLETED", (tmp_path / f"paratrain-{job}.out").read_text()[-3000:]
    metrics = json.loads(out.read_text())
    assert metrics["workers"] == 2 and metrics["ps_shards"] == 1 and metrics["test_accuracy"] > 0.7


def test_a_job_warned_of_its_time_limit_stops_requeues_itself_and_ends_as_the_uninterrupted_run(slurm, tmp_path, cli):
    """What ``--signal=USR1@90`` sends before the time limit, sent now (``scancel --signal=USR1``)
    once the run has a checkpoint: the run stops at an agreed step with its checkpoint (exit
    75), the script requeues the job, the job runs again with --resume and COMPLETES with the
    test loss of the run that was never stopped, to the bit."""
    out, folder = tmp_path / "m.json", tmp_path / "ck"
    run = ["--strategy", "allreduce", "--epochs", "40", "--no-progress", "--checkpoint-dir", str(folder),
           "--checkpoint-every", "50", "--metrics-out", str(out)]  # fmt: skip
    env = {**slurm.env(), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    submitted = slurm.run(sys.executable, "-m", "paratrain", "slurm", "--tasks-per-node", "2", "--time", "00:10:00",
                          "--requeue", "--submit", "--", *run, cwd=tmp_path, env=env)  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr[-3000:]
    job = submitted.stdout.split()[-1]
    deadline = time.monotonic() + 120
    while not (folder / "ckpt-000000050").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert slurm.run("scancel", "--signal=USR1", job).returncode == 0
    assert slurm.wait_for_job(job) == "COMPLETED", (tmp_path / f"paratrain-{job}.out").read_text()[-3000:]
    assert slurm.job(job)["Restarts"] == "1"
    resumed = json.loads(out.read_text())
    assert resumed["resumed_from_step"] >= 50 and resumed["global_steps"] == 40 * (1433 // 64)
    whole = cli("train", "--workers", "2", *run[:5], "--metrics-out", str(tmp_path / "whole.json"))
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert resumed["test_loss"] == json.loads((tmp_path / "whole.json").read_text())["test_loss"]
