"""Resume: exact for allreduce and ps-sync (every epoch's losses, the final parameters to
the bit), and allreduce and a parameter server on another number of workers (and shards)."""

import json
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from paratrain.train.checkpoint import load_checkpoint

pytestmark = pytest.mark.distributed

COMMON = ["--workers", "2", "--no-progress", "--log-every", "0", "--checkpoint-every", "15"]


def _run(cli, tmp_path, name, *args):
    out = tmp_path / f"{name}.json"
    result = cli("train", *COMMON, *args, "--metrics-out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text()), result


def _tensors(state):
    """Every tensor of a checkpoint part, by its path in the nesting."""
    found = {}

    def walk(value, path):
        if torch.is_tensor(value):
            found[path] = value
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{path}/{key}")
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                walk(item, f"{path}/{index}")

    walk(state, "")
    return found


def _losses(metrics):
    return [(e["train_loss"], e["test_loss"]) for e in metrics["history"]]


@pytest.mark.parametrize(
    ("strategy", "part", "prefixes"),
    [("allreduce", "rank-0", ("/model", "/optimizer")), ("ps-sync", "shard-0", ("/params", "/optimizer"))],
)
def test_a_resumed_run_is_the_uninterrupted_run_to_the_bit(cli, tmp_path, strategy, part, prefixes):
    """Stopped at the end of epoch 2 (mid-way between two checkpoints of every 15 steps),
    resumed to epoch 4: every epoch's train and test loss, and every parameter and optimizer
    tensor of the final checkpoint, equal those of the run never stopped."""
    whole, _ = _run(
        cli, tmp_path, "whole", "--strategy", strategy, "--epochs", "4", "--checkpoint-dir", str(tmp_path / "a")
    )
    _run(cli, tmp_path, "first", "--strategy", strategy, "--epochs", "2", "--checkpoint-dir", str(tmp_path / "b"))
    resumed, _ = _run(
        cli,
        tmp_path,
        "second",
        "--strategy",
        strategy,
        "--epochs",
        "4",
        "--checkpoint-dir",
        str(tmp_path / "b"),
        "--resume",
    )
    assert resumed["resumed_from_step"] == 44
    # (a parameter-server worker's history holds the epochs it ran itself, and its train loss
    # is over the batches it was handed, which depend on the workers' arrival order)
    column = 1 if strategy.startswith("ps-") else slice(None)
    ran = len(resumed["history"])
    assert [e[column] for e in _losses(resumed)] == [e[column] for e in _losses(whole)[-ran:]]
    assert len(resumed["history"]) >= 2
    assert resumed["global_steps"] == whole["global_steps"]
    ours, theirs = (_tensors(load_checkpoint(tmp_path / d, part=part)) for d in ("b", "a"))
    state = [key for key in ours if key.startswith(prefixes)]
    assert state and ours.keys() == theirs.keys()
    for key in state:
        assert torch.equal(ours[key], theirs[key]), key


def test_a_pipeline_that_cuts_its_stages_at_the_first_batch_resumes_as_if_never_stopped(cli, tmp_path):
    """--balance time cuts the stages where a measured first batch says, at the first step,
    after the checkpoint was read: each stage takes its saved state once cut, where the saved
    run cut it (the state did not fit the whole model, and a new measure could cut elsewhere).
    Stopped after epoch 1 of 2, resumed: the test loss of the run never stopped."""
    flags = ["--strategy", "pipeline", "--stages", "2", "--balance", "time"]
    whole, _ = _run(cli, tmp_path, "whole", *flags, "--epochs", "2", "--checkpoint-dir", str(tmp_path / "a"))
    _run(cli, tmp_path, "first", *flags, "--epochs", "1", "--checkpoint-dir", str(tmp_path / "b"))
    resumed, result = _run(
        cli, tmp_path, "resumed", *flags, "--epochs", "2", "--checkpoint-dir", str(tmp_path / "b"), "--resume"
    )
    assert resumed["resumed_from_step"] == 44 and resumed["global_steps"] == whole["global_steps"]
    assert resumed["test_loss"] == pytest.approx(whole["test_loss"], rel=1e-6)


def test_allreduce_resumes_on_another_number_of_workers(cli, tmp_path):
    """Written by 2 workers, read by 3: the same model (its test loss before any step), and
    training goes on from where the epoch stood, to the accuracy of the run never stopped."""
    first, _ = _run(
        cli, tmp_path, "first", "--strategy", "allreduce", "--epochs", "2", "--checkpoint-dir", str(tmp_path / "c")
    )
    shutil.copytree(tmp_path / "c", tmp_path / "d")
    same, result = _run(
        cli,
        tmp_path,
        "same",
        "--strategy",
        "allreduce",
        "--workers",
        "3",
        "--epochs",
        "2",
        "--checkpoint-dir",
        str(tmp_path / "c"),
        "--resume",
    )
    assert "was written by 2 replicas, this run has 3: the model is resharded" in result.stdout
    assert same["test_loss"] == pytest.approx(first["test_loss"], rel=1e-5)
    longer, _ = _run(
        cli,
        tmp_path,
        "longer",
        "--strategy",
        "allreduce",
        "--workers",
        "3",
        "--epochs",
        "6",
        "--checkpoint-dir",
        str(tmp_path / "d"),
        "--resume",
    )
    assert longer["resumed_from_step"] == 44
    assert longer["global_steps"] == 44 + 4 * (1437 // 96)
    assert longer["test_accuracy"] >= 0.93


def test_a_parameter_server_resumes_on_another_number_of_workers_and_shards(cli, tmp_path):
    """ps-sync written by 2 workers and 1 shard goes on with 3 workers from the shards' state
    and the epoch's position, to the accuracy of the run never stopped; on 2 shards, the
    resharded run is the run never stopped to the bit (every epoch's test loss). Another
    strategy is refused in one line, the checkpoint untouched."""
    _run(cli, tmp_path, "first", "--strategy", "ps-sync", "--epochs", "2", "--checkpoint-dir", str(tmp_path / "c"))
    shutil.copytree(tmp_path / "c", tmp_path / "d")
    longer, result = _run(
        cli,
        tmp_path,
        "longer",
        "--strategy",
        "ps-sync",
        "--workers",
        "3",
        "--epochs",
        "4",
        "--checkpoint-dir",
        str(tmp_path / "c"),
        "--resume",
    )
    assert "was written by a run with 2 workers, this one has 3" in result.stdout
    assert longer["resumed_from_step"] == 44 and longer["workers"] == 3
    assert longer["global_steps"] == 44 + 2 * (1437 // 96)  # two epochs of rounds of 3 batches
    whole, _ = _run(cli, tmp_path, "whole", "--strategy", "ps-sync", "--epochs", "4")
    assert longer["test_accuracy"] >= whole["test_accuracy"] - 0.02
    sharded, result = _run(
        cli,
        tmp_path,
        "sharded",
        "--strategy",
        "ps-sync",
        "--ps-shards",
        "2",
        "--epochs",
        "4",
        "--checkpoint-dir",
        str(tmp_path / "d"),
        "--resume",
    )
    assert "was written by 1 ps shards, this run has 2: the parameters and optimizer state are resharded" in (
        result.stdout
    )
    assert sharded["resumed_from_step"] == 44 and sharded["global_steps"] == whole["global_steps"]
    ran = len(sharded["history"])
    assert ran >= 2 and [e[1] for e in _losses(sharded)] == [e[1] for e in _losses(whole)[-ran:]]
    saved = sorted(p.name for p in (tmp_path / "d").iterdir())
    refused = cli(
        "train", *COMMON, "--strategy", "ps-async", "--epochs", "6", "--checkpoint-dir", str(tmp_path / "d"), "--resume"
    )
    assert refused.returncode == 2
    assert "strategy=ps-sync; this run has strategy=ps-async" in refused.stderr
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == saved


def test_a_parameter_server_resumes_mid_epoch_on_another_number_of_workers(cli, tmp_path):
    """ps-sync's epochs are whole rounds of its workers: 44 batches of 32 for 2 workers, 42
    for 3. Written by 2 workers at step 30 (epoch 1, 16 batches handed out), read by 3: the
    epoch goes on from batch 16 to its 42nd, 26 batches in rounds of 3 (the last of 2, whose
    third worker has finished), then ends the run at step 30 + 9."""
    _run(cli, tmp_path, "first", "--strategy", "ps-sync", "--epochs", "2", "--checkpoint-dir", str(tmp_path / "c"))
    shutil.rmtree(tmp_path / "c" / "ckpt-000000044")
    resumed, result = _run(
        cli,
        tmp_path,
        "resumed",
        "--strategy",
        "ps-sync",
        "--workers",
        "3",
        "--epochs",
        "2",
        "--checkpoint-dir",
        str(tmp_path / "c"),
        "--resume",
    )
    assert "was written by a run with 2 workers, this one has 3" in result.stdout
    assert resumed["resumed_from_step"] == 30
    assert resumed["global_steps"] == 30 + -(-(42 - 16) // 3)
    assert resumed["test_accuracy"] >= 0.85


# The stop comes at the first check at or after step 30; the checks come about a second
# apart at the pace of the first 20 steps, warm-up included: every ~330 steps of allreduce
# here (1.2 ms a step after), every ~18 of the pipeline (5.4 ms a step after; its first 20
# took ~1 s). 40 epochs of 22 steps and 12 of 44 (528) hold the stop even at the pipeline's
# later pace (~190 steps a second).
@pytest.mark.parametrize(
    ("flags", "worker"),
    [
        (["--strategy", "allreduce", "--workers", "2", "--epochs", "40"], 1),
        (["--strategy", "pipeline", "--stages", "2", "--epochs", "12"], 0),
    ],
)
def test_a_signal_stops_the_run_with_a_checkpoint_and_resume_goes_on_to_the_bit(cli, tmp_path, flags, worker):
    """SIGTERM to one process after step 30 (as a preemption sends it; SLURM's time-limit
    warning is SIGUSR1): the run agrees on a step (checks about a second apart after step
    20), saves it, and every process exits 75; run again with --resume, it ends where the
    uninterrupted run ends, to the last bit of its test loss."""
    run = ["train", *flags, "--no-progress", "--checkpoint-dir", str(tmp_path / "ck")]
    stopped = cli(*run, "--terminate", f"{worker}@30", "--metrics-out", str(tmp_path / "a.json"))
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    first = json.loads((tmp_path / "a.json").read_text())
    assert first["stopped"]["signal"] == "SIGTERM" and first["stopped"]["step"] >= 30
    assert f"stopped after step {first['stopped']['step']} on SIGTERM" in stopped.stdout
    resumed = cli(*run, "--resume", "--metrics-out", str(tmp_path / "b.json"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    second = json.loads((tmp_path / "b.json").read_text())
    assert second["resumed_from_step"] == first["stopped"]["step"] and second["stopped"] is None
    whole = cli(*run[:-2], "--metrics-out", str(tmp_path / "c.json"))
    assert whole.returncode == 0, whole.stderr[-3000:]
    reference = json.loads((tmp_path / "c.json").read_text())
    assert first["stopped"]["step"] < reference["global_steps"]  # mid-run
    assert second["global_steps"] == reference["global_steps"]
    assert second["test_loss"] == reference["test_loss"]
    losses = [[(e["epoch"], e["train_loss"], e["test_loss"]) for e in run["history"]] for run in (second, reference)]
    assert losses[0] == losses[1]  # every epoch's, the one stopped in included


def test_sigterm_to_the_launcher_reaches_its_processes_which_stop_with_a_checkpoint(tmp_path):
    """``kill PID`` of ``paratrain train --workers 2`` (a pod's main process, say): the launcher
    hands the signal to its processes, which stop at an agreed step with a checkpoint (exit 75)."""
    folder, out = tmp_path / "ck", tmp_path / "m.json"
    command = [
        sys.executable,
        "-m",
        "paratrain",
        "train",
        "--strategy",
        "allreduce",
        "--workers",
        "2",
        "--epochs",
        "200",
        "--no-progress",
        "--checkpoint-dir",
        str(folder),
        "--checkpoint-every",
        "50",
        "--metrics-out",
        str(out),
    ]
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (folder / "ckpt-000000050").exists() and launcher.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # training: its first checkpoint is written
    launcher.send_signal(signal.SIGTERM)
    stdout, stderr = launcher.communicate(timeout=120)
    assert launcher.returncode == 75, stderr[-3000:]
    stopped = json.loads(out.read_text())["stopped"]
    assert stopped["signal"] == "SIGTERM" and 50 <= stopped["step"] < 200 * 22
    assert (folder / f"ckpt-{stopped['step']:09d}").is_dir()
