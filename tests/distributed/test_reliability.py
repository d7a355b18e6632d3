"""Fault injection on Gloo processes: kill -9 at a random step, hangs, restarts, exact resume."""

import json
import os
import random
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.distributed

# 10 epochs of digits: every mode reaches 0.95 here, a run takes seconds.
RUN = ["--epochs", "10", "--no-progress", "--log-every", "0", "--checkpoint-every", "20"]
STEPS_PER_EPOCH = {2: 22}  # 1437 training examples, batch 32 x 2 workers


def _run(cli, tmp_path, name, *args):
    out = tmp_path / f"{name}.json"
    result = cli("train", *args, "--metrics-out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text()), result


def _kill_step(seed):
    """A random step, away from the first checkpoint (the restart then redoes work)."""
    return random.Random(seed).randint(25, 10 * STEPS_PER_EPOCH[2] - 5)


@pytest.mark.parametrize("strategy", ["allreduce", "ps-sync"])
def test_a_killed_worker_restarts_the_run_which_ends_as_if_nothing_happened(cli, tmp_path, strategy):
    step = _kill_step(seed=len(strategy))
    common = ["--strategy", strategy, "--workers", "2", *RUN]
    metrics, result = _run(
        cli,
        tmp_path,
        "killed",
        *common,
        "--checkpoint-dir",
        str(tmp_path / "b"),
        "--fail",
        f"1@{step}",
        "--max-restarts",
        "1",
    )
    line = re.search(
        r"paratrain: worker 1 was killed by SIGKILL after step (\d+); restarting the run \(restart 1 of 1\) "
        r"from the checkpoint of step (\d+): (\d+) steps redone",
        result.stderr,
    )
    assert line, result.stderr[-2000:]
    died, resumed, redone = map(int, line.groups())
    assert died == step and resumed == step // 20 * 20
    # Redone: up to the furthest step any worker reached; a ps-sync worker may have pushed
    # one step past the one its peer died after (it awaits that step's reply later).
    assert step - resumed <= redone <= step - resumed + (strategy == "ps-sync")
    assert metrics["restarts"] == 1 and metrics["resumed_from_step"] == resumed
    assert metrics["test_accuracy"] >= 0.95
    if strategy == "allreduce":  # resume is exact: the same final model as a run never interrupted
        whole, _ = _run(cli, tmp_path, "whole", *common, "--checkpoint-dir", str(tmp_path / "a"))
        assert metrics["test_loss"] == whole["test_loss"]
        assert metrics["global_steps"] == whole["global_steps"]


@pytest.mark.parametrize("mode", [["ps-async"], ["ps-backup", "--backup-workers", "1"]])
def test_a_killed_worker_in_a_tolerant_mode_leaves_the_others_to_finish(cli, tmp_path, mode):
    step = _kill_step(seed=len(mode))
    metrics, result = _run(
        cli,
        tmp_path,
        "killed",
        "--strategy",
        *mode,
        "--workers",
        "2",
        *RUN,
        "--fail",
        f"1@{step}",
        "--heartbeat-timeout",
        "2",
    )
    assert "paratrain: worker 1 was lost (killed by SIGKILL); the run goes on without it" in result.stderr
    assert metrics["workers_lost"] == [1] and metrics["restarts"] == 0
    assert metrics["test_accuracy"] >= 0.95


def test_a_run_that_keeps_failing_stops_after_its_restarts(cli, tmp_path):
    # The failure is injected in the first attempt only: a restart limit of 0 ends there.
    result = cli(
        "train", "--strategy", "allreduce", "--workers", "2", *RUN, "--fail", "1@30", "--checkpoint-dir", str(tmp_path)
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == "paratrain: worker 1 was killed by SIGKILL"
    assert (tmp_path / "ckpt-000000020" / "manifest.json").exists()  # the last good checkpoint stays


def test_a_dead_shard_stops_the_run_with_its_name(cli, tmp_path):
    # Two shards, the second killed: the workers' waits on it fail; the run ends, never hangs.
    result = cli(
        "train",
        "--strategy",
        "ps-async",
        "--workers",
        "2",
        "--ps-shards",
        "2",
        *RUN[:5],
        "--fail",
        "ps:1@60",
        "--timeout",
        "20",
    )
    assert result.returncode == 1
    assert "paratrain: ps shard 1: injected failure at version 60" in result.stderr
    assert result.stderr.strip().splitlines()[-1] == "paratrain: ps shard 1 was killed by SIGKILL"


def test_a_dead_shard_restarts_the_run_from_its_checkpoint(cli, tmp_path):
    metrics, result = _run(
        cli,
        tmp_path,
        "killed",
        "--strategy",
        "ps-sync",
        "--workers",
        "2",
        *RUN,
        "--checkpoint-dir",
        str(tmp_path / "c"),
        "--fail",
        "ps:0@50",
        "--max-restarts",
        "1",
    )
    # A shard's step is its version, the run's global step.
    assert (
        "paratrain: ps shard 0 was killed by SIGKILL after step 50; restarting the run (restart 1 of 1) "
        "from the checkpoint of step 40: 10 steps redone" in result.stderr
    )
    assert metrics["restarts"] == 1 and metrics["resumed_from_step"] == 40
    assert metrics["global_steps"] == 10 * STEPS_PER_EPOCH[2]  # every version, none twice
    assert metrics["test_accuracy"] >= 0.95


def test_a_hung_worker_is_named_when_the_timeout_expires(cli):
    result = cli("train", "--strategy", "allreduce", "--workers", "2", *RUN[:5], "--hang", "1@7", "--timeout", "4")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "paratrain: worker 0 failed (exit code 1): worker 1 did not answer within --timeout 4 s at step 8"
    )


def test_a_hung_worker_in_ps_sync_is_named_by_the_shard(cli):
    result = cli("train", "--strategy", "ps-sync", "--workers", "2", *RUN[:5], "--hang", "1@7", "--timeout", "4")
    assert result.returncode == 1
    assert "worker 1 (rank 2) was lost (no message for 2 s, half of --timeout) at version 7" in result.stderr


def test_resume_under_pipeline_restores_every_stage(cli, tmp_path):
    common = [
        "--strategy",
        "pipeline",
        "--stages",
        "2",
        "--workers",
        "2",
        "--epochs",
        "2",
        "--no-progress",
        "--log-every",
        "0",
        "--checkpoint-every",
        "10",
        "--checkpoint-dir",
        str(tmp_path / "c"),
    ]
    first, _ = _run(cli, tmp_path, "first", *common[:-4], "--epochs", "1", *common[-4:])
    assert sorted(p.name for p in (tmp_path / "c" / "ckpt-000000044").iterdir()) == [
        "manifest.json",
        "rank-0.pt",
        "rank-1.pt",
    ]
    resumed, result = _run(cli, tmp_path, "resumed", *common, "--resume")
    assert resumed["resumed_from_step"] == 44 and resumed["global_steps"] == 88
    # The second epoch went on from the first: better than the first epoch alone.
    assert resumed["test_loss"] < first["test_loss"]


def test_torchrun_restarts_resume_from_the_checkpoint(tmp_path):
    from paratrain.comm.transport import free_port

    out = tmp_path / "m.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{free_port()}",
            "-m",
            "paratrain",
            "train",
            "--strategy",
            "allreduce",
            "--epochs",
            "2",
            "--no-progress",
            "--log-every",
            "0",
            "--checkpoint-dir",
            str(tmp_path / "c"),
            "--checkpoint-every",
            "10",
            "--fail",
            "1@25",
            "--metrics-out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads(out.read_text())
    assert metrics["restarts"] == 1 and metrics["resumed_from_step"] == 20 and metrics["global_steps"] == 44
