"""pipeline-ft on Gloo processes: 2 pipeline replicas of 2 stages; one stage of replica 1
killed mid-run takes its replica out as a unit (the launcher stops the other stage), the
survivor goes on, a replacement pipeline takes every stage's state from the same stage of
the survivor, and the run is the single-process run of the same global batch all along."""

import json

import pytest

from tests.conftest import as_formed, assert_same_run, power_cut_run, replaced_replica_run, single_run

pytest.importorskip("torchft")

pytestmark = pytest.mark.distributed

# Batch 8 per replica, 4 micro-batches of 2, 2 replicas: a global batch of 16, 89 steps an epoch.
# 1 epoch: the run equals the single-process one from its first steps; a power cut after step 50
# resumes from step 40 and finishes the epoch.
RUN = ["--epochs", "1", "--no-progress", "--log-every", "0"]
FT = ["--strategy", "pipeline-ft", "--stages", "2", "--workers", "4", "--batch-size", "8", "--microbatches", "4"]


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
    assert_same_run(metrics, reference)


def test_a_killed_stage_takes_its_replica_out_and_a_whole_new_pipeline_rejoins_live(tmp_path):
    # 2 epochs (178 steps): killed at step 30, the new pipeline rejoins some steps later, so a
    # loaded machine's slower start still finds it back well before the last step
    run = ["--epochs", "2", *RUN[2:]]
    reference = single_run(tmp_path, run, 16)
    # the 4th process to start: stage 1 of replica 1
    metrics = replaced_replica_run([*FT, *run[:2]], tmp_path / "m.json", 3, "stage 1 of replica 1")
    assert_same_run(metrics, reference)


@pytest.mark.matrix  # the survivor's report of the run: test_fault_tolerant.py's chief lost after the last step
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
    assert_same_run(metrics, reference)


def test_every_replica_lost_at_once_resumes_from_the_last_checkpoint(tmp_path, reference):
    """A power cut: both pipeline replicas (all four processes) die after step 50. The stages
    of the first replica of each quorum wrote a checkpoint every 20 steps, each its own
    stage; the replacements resume from step 40, do 41-50 again and finish as if nothing
    happened."""
    metrics = power_cut_run([*FT, *RUN], tmp_path / "ckpt", ["stage-0", "stage-1"], reference["global_steps"])
    assert_same_run(metrics, reference)
