"""The command line as a user meets it: the default run, bad input, divergence."""

import json
import time

import pytest

from paratrain.train.metrics import METRICS_KEYS


@pytest.mark.slow
def test_default_run_reaches_95_percent_in_under_30_seconds(cli, tmp_path):
    out = tmp_path / "metrics.json"
    start = time.perf_counter()
    result = cli("train", "--metrics-out", str(out))
    elapsed = time.perf_counter() - start
    assert result.returncode == 0, result.stderr
    assert elapsed < 30
    metrics = json.loads(out.read_text())
    assert set(METRICS_KEYS) <= set(metrics)
    assert metrics["test_accuracy"] >= 0.95
    assert (metrics["strategy"], metrics["workers"], metrics["model"], metrics["dataset"]) == (
        "single",
        1,
        "mlp",
        "digits",
    )
    assert metrics["global_steps"] == 15 * (1433 // 32)
    assert len(metrics["history"]) == 15
    assert set(metrics["history"][0]) == {
        "epoch",
        "train_loss",
        "test_accuracy",
        "test_loss",
        "wall_seconds",
        "train_seconds",
        "cpu_seconds",
        "examples_seen",
    }
    assert metrics["staleness"] == {"mean": 0.0, "max": 0, "histogram": {"0": metrics["global_steps"]}}
    assert metrics["history"][-1]["examples_seen"] == metrics["global_steps"] * 32
    assert metrics["config"]["lr"] == 0.05
    assert "done: test_accuracy" in result.stdout
    assert "epoch 15/15" in result.stdout


@pytest.mark.parametrize(
    "args, words",
    [
        (["--workers", "0"], ["--workers must be >= 1"]),
        (["--workers", "two"], ["--workers", "invalid int value"]),
        (["--strategy", "magic"], ["unknown strategy 'magic'", "allreduce"]),
        (["--model", "resnet"], ["unknown model 'resnet'", "cifar_cnn, dlrm, gpt, lstm, mlp"]),
        (["--strategy", "single", "--workers", "3"], ["--strategy single", "--workers 3"]),
        (["--batch-size", "5000"], ["larger than the data set"]),
        (["--metrics-out", "/nonexistent/dir/m.json"], ["--metrics-out", "does not exist"]),
        (["--config", "/nonexistent.toml"], ["--config /nonexistent.toml: no such file"]),
        (["--frobnicate"], ["unrecognized arguments: --frobnicate"]),
        (["--momentum", "nan"], ["--momentum must be >= 0, got nan"]),  # it diverged at step 3
        (["--lr", "inf"], ["--lr must be > 0, got inf"]),
        (["--lr-schedule", "linear-scaling", "--warmup-epochs", "nan"], ["--warmup-epochs must be >= 0, got nan"]),
        # a flag shortened: taken whole only (--procs-per reached torchrun's processes, which
        # started torchrun again, without end)
        (["--procs-per", "1"], ["unrecognized arguments: --procs-per 1"]),
        (["--epoch", "2"], ["unrecognized arguments: --epoch 2"]),
    ],
)
def test_bad_input_is_one_line_and_exit_2(cli, args, words):
    result = cli("train", "--epochs", "1", *args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for word in words:
        assert word in lines[0]


def test_metrics_path_that_is_a_directory_keeps_the_directory(cli, tmp_path):
    result = cli("train", "--epochs", "1", "--metrics-out", str(tmp_path))
    assert result.returncode == 2
    assert "is a directory" in result.stderr
    assert tmp_path.is_dir()


@pytest.mark.slow
def test_divergence_exits_3_and_names_the_step(cli):
    result = cli("train", "--epochs", "1", "--lr", "1e30", "--log-every", "5")
    assert result.returncode == 3, result.stderr
    assert result.stderr.strip().startswith("paratrain: model diverged with loss = ")
    assert " at step " in result.stderr


@pytest.mark.slow
def test_config_file_with_flag_override(cli, tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('epochs = 1\nbatch-size = 64\noptimizer = "adam"\nlr = 0.002\n')
    out = tmp_path / "m.json"
    result = cli("train", "--config", str(config), "--epochs", "2", "--metrics-out", str(out))
    assert result.returncode == 0, result.stderr
    metrics = json.loads(out.read_text())
    assert metrics["epochs"] == 2 and metrics["config"]["optimizer"] == "adam"
    assert metrics["global_steps"] == 2 * (1433 // 64)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("epochs = 0\n[train]\nlr = 0.1\n", "keys beside its [train] table (epochs)"),  # epochs was dropped
        ("batch-size = 8\nbatch_size = 64\n", "batch-size is given twice"),  # the last one won
        ("fail = 5\n", "--fail must be str, got 5"),  # an AttributeError's traceback
        ('model = "lstm"\nlstm_layers = 2.5\n', "--lstm-layers must be int, got 2.5"),  # torch's TypeError
        ('model = "gpt"\ndataset = "text-lm"\ngpt_dropout = "0.1"\n', "--gpt-dropout must be float, got '0.1'"),
    ],
)
def test_a_config_file_that_would_drop_or_mistype_a_key_is_one_line_and_exit_2(cli, tmp_path, text, words):
    config = tmp_path / "run.toml"
    config.write_text(text)
    result = cli("train", "--config", str(config))
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert words in result.stderr


def test_help_lists_every_option(cli):
    result = cli("train", "--help")
    assert result.returncode == 0
    for flag in ("--strategy", "--workers", "--batch-size", "--lr-schedule", "--metrics-out", "--config"):
        assert flag in result.stdout


@pytest.mark.parametrize(
    "argv, world, workers",
    [
        (["--strategy", "allreduce", "--fail", "1@25"], 2, 2),
        (["--strategy", "ps-sync"], 3, 2),  # one shard beside two workers
        (["--strategy", "ps-backup", "--backup-workers", "1", "--ps-shards", "2"], 5, 2),
        (["--strategy", "pipeline", "--stages", "2"], 4, 4),  # pipeline --workers counts processes
    ],
)
def test_under_torchrun_workers_are_the_processes_beside_the_modes_own(argv, world, workers):
    from paratrain.comm.transport import ClusterEnv
    from paratrain.launch.cli import build_parser
    from paratrain.launch.flags import train_config

    cluster = ClusterEnv(rank=0, world_size=world, local_rank=0, master_addr="127.0.0.1", master_port=1)
    config = train_config(build_parser().parse_args(["train", *argv]), cluster)
    assert config.workers == workers
    assert config.topology.num_processes == world
