"""--logdir, --timeline, recipes, --config-from and paratrain report on real runs (Gloo, CPU)."""

import json
import os
import random
import time
from collections import Counter
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]


def test_allreduce_run_writes_tensorboard_scalars_and_a_merged_timeline(cli, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logdir, trace = tmp_path / "tb", tmp_path / "trace.json"
    done = cli(
        "train",
        "--strategy",
        "allreduce",
        "--workers",
        "2",
        "--epochs",
        "2",
        "--log-every",
        "10",
        "--logdir",
        str(logdir),
        "--timeline",
        str(trace),
        "--metrics-out",
        str(tmp_path / "m.json"),
    )
    assert done.returncode == 0, done.stderr
    metrics = json.loads((tmp_path / "m.json").read_text())
    steps = metrics["global_steps"]

    run = EventAccumulator(str(logdir))
    run.Reload()
    tags = set(run.Tags()["scalars"])
    for tag in (
        "step/loss",
        "step/learning_rate",
        "step/examples_per_second",
        "epoch/train_loss",
        "epoch/test_accuracy",
        "epoch/test_loss",
        "run/bytes_per_step",
        "run/staleness_mean",
        "run/staleness_max",
        "run/dropped_gradients",
    ):
        assert tag in tags, tag
    assert [e.step for e in run.Scalars("step/loss")] == list(range(1, steps + 1))
    accuracy = run.Scalars("epoch/test_accuracy")
    assert [e.step for e in accuracy] == [1, 2]
    assert accuracy[-1].value == pytest.approx(metrics["history"][-1]["test_accuracy"], rel=1e-6)
    assert run.Scalars("step/learning_rate")[0].value == pytest.approx(0.05)
    assert run.Scalars("run/bytes_per_step")[0].value == pytest.approx(metrics["bytes_sent"] / steps)

    for rank in (0, 1):
        timing = EventAccumulator(str(logdir / f"rank-{rank}"))
        timing.Reload()
        sent = timing.Scalars("rank/bytes_sent_per_step")
        assert len(sent) == steps
        # Each replica hands its whole gradient to the all-reduce every step.
        assert {e.value for e in sent} == {metrics["bytes_sent"] / steps / 2}
        assert all(e.value > 0 for e in timing.Scalars("rank/step_seconds"))
        assert {e.value for e in timing.Scalars("rank/staleness")} == {0.0}

    document = json.loads(trace.read_text())
    spans = [e for e in document["traceEvents"] if e["ph"] == "X"]
    assert not trace.with_name("trace.json.parts").exists()
    for rank in (0, 1):
        mine = [e for e in spans if e["pid"] == rank]
        names = {e["name"] for e in mine}
        assert {"data", "forward", "backward", "optimizer", "evaluate"} <= names
        comm = [e for e in mine if e["name"] == "allreduce"]
        assert len(comm) >= steps and all(e["tid"] == 1 and e["args"]["bytes"] > 0 for e in comm)
        assert sum(e["name"] == "forward" for e in mine) == steps
    # One clock: both ranks' first steps start within a second of each other, from 0.
    assert min(e["ts"] for e in spans) == 0
    firsts = [min(e["ts"] for e in spans if e["pid"] == r and e["name"] == "forward") for r in (0, 1)]
    assert abs(firsts[0] - firsts[1]) < 1e6
    named = {e["pid"]: e["args"]["name"] for e in document["traceEvents"] if e["name"] == "process_name"}
    assert named == {0: "rank 0 (worker 0)", 1: "rank 1 (worker 1)"}


@pytest.mark.parametrize(
    "flags",
    [
        ["--strategy", "allreduce-ft", "--workers", "2", "--fail", "1@30", "--max-restarts", "1"],
        ["--strategy", "fsdp-ft", "--workers", "4", "--shards-per-replica", "2", "--batch-size", "8"],
    ],
    ids=["allreduce-ft-through-a-loss", "fsdp-ft"],
)
def test_a_fault_tolerant_run_s_timeline_has_a_track_per_process(cli, tmp_path, flags):
    """Each replica of a fault-tolerant run is a process group of its own (or none): the
    tracks are the processes' places in the whole run, not their ranks in their group (every
    replica wrote rank 0's track over the others', and the merge read a part two wrote at
    once). Through a loss, the replacement's steps fill the lost replica's track."""
    trace = tmp_path / "trace.json"
    done = cli(
        "train",
        *flags,
        "--epochs",
        "2",
        "--log-every",
        "0",
        "--no-progress",
        "--timeline",
        str(trace),
        "--metrics-out",
        str(tmp_path / "m.json"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    steps = json.loads((tmp_path / "m.json").read_text())["global_steps"]
    document = json.loads(trace.read_text())
    processes = int(flags[flags.index("--workers") + 1])
    assert document["otherData"]["ranks"] == processes and document["otherData"]["missing_ranks"] == []
    forwards = Counter(e["pid"] for e in document["traceEvents"] if e["ph"] == "X" and e["name"] == "forward")
    if "--fail" in flags:
        # The replacement of replica 1 takes part in the steps after the kill (step 30) from
        # when it joins (under load, possibly none: the survivor steps on alone meanwhile),
        # and may compute the step it takes the live state in without taking part in it.
        spans = json.loads((tmp_path / "m.json").read_text())["participants"]["per_step"]
        joined = sum(max(0, last - max(first, 31) + 1) for first, last, count in spans if count == 2)
        assert forwards[0] == steps and forwards[1] - joined in (0, 1), (forwards, spans)
    else:
        assert all(forwards[rank] == steps for rank in range(processes)), forwards
    named = {e["pid"]: e["args"]["name"] for e in document["traceEvents"] if e["name"] == "process_name"}
    assert sorted(named) == list(range(processes))


@pytest.mark.parametrize(
    "flags, lost",
    [
        (["--strategy", "allreduce-ft", "--workers", "2"], ["rank-1"]),
        (
            ["--strategy", "fsdp-ft", "--workers", "4", "--shards-per-replica", "2", "--batch-size", "8"],
            ["rank-2", "rank-3"],
        ),
        (["--strategy", "pipeline-ft", "--stages", "2", "--workers", "4"], ["rank-2", "rank-3"]),
    ],
    ids=["allreduce-ft", "fsdp-ft", "pipeline-ft"],
)
def test_a_timeline_does_not_wait_for_a_replica_lost_unreplaced(cli, tmp_path, flags, lost):
    """A replica killed with no restart left writes no part: its launcher marks it lost for
    good, and the chief merges the others' parts and ends, where it waited 60 s for it."""
    seed = int(os.environ.get("PARATRAIN_KILL_SEED", random.SystemRandom().randrange(10**6)))
    step = random.Random(seed).randint(3, 18)  # an epoch is 22 steps (pipeline-ft) to 44
    print(f"kill seed {seed} (PARATRAIN_KILL_SEED={seed} repeats it): replica 1 lost at step {step}")
    trace = tmp_path / "trace.json"
    began = time.monotonic()
    done = cli(
        "train",
        *flags,
        "--fail",
        f"1@{step}",
        "--epochs",
        "1",
        "--log-every",
        "0",
        "--no-progress",
        "--timeline",
        str(trace),
    )
    seconds = time.monotonic() - began
    assert done.returncode == 0, done.stderr[-3000:]
    assert "the run goes on with 1 replica" in done.stderr
    # The process that injected the failure died by SIGKILL and wrote nothing; the other
    # process of a 2-process replica may write its part on its way out (job.py's finally,
    # its peer's death failing its step) before its launcher stops it.
    missing = json.loads(trace.read_text())["otherData"]["missing_ranks"]
    assert missing and set(missing) <= set(lost), missing
    assert seconds < 45, f"{seconds:.1f} s: the chief waited for the lost replica's part"


@pytest.fixture(scope="module")
def three_runs(tmp_path_factory):
    """allreduce, ps-sync and ps-async on digits from the recipes, one epoch each."""
    from tests.conftest import run_cli

    folder = tmp_path_factory.mktemp("runs")
    paths = []
    for recipe in ("digits_allreduce", "digits_ps_sync", "digits_ps_async"):
        path = folder / f"{recipe}.json"
        extra = ["--timeline", str(folder / "ps_sync_trace.json")] if recipe == "digits_ps_sync" else []
        done = run_cli(
            "train", "--config", f"recipes/{recipe}.toml", "--epochs", "1", "--metrics-out", str(path), *extra
        )
        assert done.returncode == 0, done.stderr
        paths.append(path)
    return paths


def test_report_on_allreduce_ps_sync_and_ps_async_runs(cli, three_runs, tmp_path):
    from matplotlib import image

    from paratrain.launch.report import PLOTS

    out = tmp_path / "report"
    done = cli("report", *map(str, three_runs), "--out", str(out))
    assert done.returncode == 0, done.stderr
    for name in PLOTS:
        pixels = image.imread(out / name)
        assert pixels.shape[0] >= 300 and pixels.shape[1] >= 500 and pixels.shape[2] in (3, 4), name
    assert image.imread(out / "accuracy.png").shape[:2] == (400, 1000)
    table = (out / "report.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| digits") or "x2 (digits" in line]
    assert [r.split(" | ")[1] for r in rows] == ["allreduce", "ps-sync", "ps-async"]


def test_recipe_run_repeats_from_its_metrics_file(cli, three_runs, tmp_path):
    first = json.loads(three_runs[0].read_text())
    assert first["config"]["strategy"] == "allreduce" and first["config"]["epochs"] == 1
    again = tmp_path / "again.json"
    done = cli("train", "--config-from", str(three_runs[0]), "--metrics-out", str(again))
    assert done.returncode == 0, done.stderr
    second = json.loads(again.read_text())
    assert {k: v for k, v in second["config"].items() if k != "metrics_out"} == {
        k: v for k, v in first["config"].items() if k != "metrics_out"
    }
    # Same seed, same data order, one process per replica: the same result.
    assert second["test_accuracy"] == pytest.approx(first["test_accuracy"], abs=1e-6)


def test_env_runs_a_two_process_gloo_check(cli):
    done = cli("env")
    assert done.returncode == 0, done.stderr
    assert "gloo loopback run" in done.stdout and "works" in done.stdout
    assert "pytorch" in done.stdout


def test_parameter_server_timeline_has_pull_and_push_on_every_worker(three_runs):
    trace = json.loads((three_runs[1].parent / "ps_sync_trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in spans if e["pid"] == 0] == ["serve"]  # the shard
    for rank in (1, 2):  # the workers
        names = {e["name"] for e in spans if e["pid"] == rank}
        assert {"forward", "backward", "pull", "push"} <= names
        assert {e["tid"] for e in spans if e["pid"] == rank and e["name"] in ("pull", "push")} == {1}
        # A worker waits for the reply to its push as it takes its next batch (the batch's
        # number comes with it): that wait is a pull too, not the data's, besides the step's own.
        steps = sum(e["name"] == "forward" for e in spans if e["pid"] == rank)
        assert sum(e["name"] == "pull" for e in spans if e["pid"] == rank) >= 2 * steps
