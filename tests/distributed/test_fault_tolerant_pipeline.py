"""pipeline-ft on Gloo processes: 2 pipeline replicas of 2 stages; one stage of replica 1
killed mid-run takes its replica out as a unit (the launcher stops the other stage), the
survivor goes on, a replacement pipeline takes every stage's state from the same stage of
the survivor, and the run is the single-process run of the same global batch all along."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from paratrain.testing import run_processes
from tests.conftest import as_formed, assert_same_run, single_run

pytest.importorskip("torchft")

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
# Batch 8 per replica, 4 micro-batches of 2, 2 replicas: a global batch of 16, 89 steps an epoch.
RUN = ["--epochs", "3", "--no-progress", "--log-every", "0"]
FT = ["--strategy", "pipeline-ft", "--stages", "2", "--workers", "4", "--batch-size", "8", "--microbatches", "4"]


def _same_run(metrics, reference):
    """Every committed step took the whole global batch, whoever was alive: the single-process
    run up to the order of float sums, a relative 1e-4 on every epoch's losses."""
    assert_same_run(metrics, reference)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return single_run(tmp_path_factory.mktemp("single"), RUN, 16)


def test_without_a_fault_it_is_the_single_process_run(cli, tmp_path, reference):
    out = tmp_path / "m.json"
    result = cli("train", *FT, *RUN, "--metrics-out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads(out.read_text())
    assert as_formed(metrics["participants"]["per_step"], 2) == [[1, reference["global_steps"], 2]]
    assert metrics["replicas"] == 2 and metrics["stages"] == 2 and metrics["fault_tolerance"] == "per-step"
    _same_run(metrics, reference)


def _stage_process(launcher: int, replica: int, stage: int) -> int:
    """The pid of ``stage`` of ``replica`` of a local run: the launcher starts each replica's
    stages in turn, so the run's processes in the order they started are replica 0's stages,
    then replica 1's."""
    run = run_processes(launcher)
    assert len(run) == 4, run
    return run[replica * 2 + stage]


def test_a_killed_stage_takes_its_replica_out_and_a_whole_new_pipeline_rejoins_live(tmp_path, reference):
    out = tmp_path / "m.json"
    command = [sys.executable, "-m", "paratrain", "train", *FT, *RUN[:2], "--progress", "--log-every", "10",
               "--max-restarts", "1", "--metrics-out", str(out)]  # fmt: skip
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        for line in run.stdout:
            if line.startswith("step ") and int(line.split()[1].rstrip(",")) >= 30:
                break
        os.kill(_stage_process(run.pid, replica=1, stage=1), signal.SIGKILL)
        _, stderr = run.communicate(timeout=300)
    finally:
        run.kill()
    assert run.returncode == 0, stderr[-3000:]
    assert re.search(r"paratrain: stage 1 of replica 1 was lost \(killed by SIGKILL\) after step \d+; a replacement "
                     r"joins the run \(restart 1 of 1\)", stderr), stderr[-3000:]  # fmt: skip
    assert len(re.findall(r"paratrain: worker \d joined the run at step \d+ with a live peer's state", stderr)) == 2
    metrics = json.loads(out.read_text())
    counts = [span[2] for span in as_formed(metrics["participants"]["per_step"], 2)]
    # 2 -> 1 -> 2, or 2 throughout when the new pipeline was in the quorum before the
    # survivor committed a step alone
    assert counts[0] == 2 and counts[-1] == 2 and set(counts) <= {1, 2}, metrics["participants"]
    assert metrics["restarts"] == 0
    _same_run(metrics, reference)


def test_a_chief_lost_after_the_last_step_leaves_the_survivor_to_report_the_run(cli, tmp_path, reference):
    """Replica 0 holds the chief (its last stage); lost once the last step is committed, before
    it wrote the run's results, the survivor's view of the run is reported: exit 0, the
    metrics file written, every step with both replicas."""
    out = tmp_path / "m.json"
    last = reference["global_steps"]
    result = cli("train", *FT, *RUN, "--fail", f"0@{last}", "--max-restarts", "1", "--metrics-out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"replica 0 was lost (killed by SIGKILL) after step {last}" in result.stderr
    metrics = json.loads(out.read_text())
    assert as_formed(metrics["participants"]["per_step"], 2) == [[1, last, 2]]
    _same_run(metrics, reference)


def test_every_replica_lost_at_once_resumes_from_the_last_checkpoint(cli, tmp_path, reference):
    """A power cut: both pipeline replicas (all four processes) die after step 50. The stages
    of the first replica of each quorum wrote a checkpoint every 20 steps, each its own
    stage; the replacements resume from step 40, do 41-50 again and finish as if nothing
    happened."""
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
    assert manifests and all(sorted(m["parts"]) == ["stage-0", "stage-1"] for m in manifests)
    _same_run(metrics, reference)
