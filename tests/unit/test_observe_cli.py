"""paratrain report's input checks and plots (synthetic metrics), --config-from, the timeline recorder."""

import json

import pytest

from paratrain import timeline


def metrics(strategy="allreduce", staleness=None, **extra):
    return {
        "strategy": strategy,
        "workers": 2,
        "ps_shards": 0,
        "backup_workers": 0,
        "compression": "none",
        "model": "mlp",
        "dataset": "digits",
        "epochs": 2,
        "global_steps": 40,
        "test_accuracy": 0.9,
        "test_loss": 0.3,
        "train_loss": 0.4,
        "wall_seconds": 2.0,
        "examples_per_second": 1000.0,
        "bytes_sent": 4000,
        "dropped_gradients": 0,
        "staleness": staleness or {"mean": 0.0, "max": 0, "histogram": {"0": 40}},
        "history": [
            {
                "epoch": 1,
                "train_loss": 1.0,
                "test_accuracy": 0.8,
                "test_loss": 0.6,
                "wall_seconds": 1.0,
                "examples_seen": 640,
            },
            {"epoch": 2, "train_loss": 0.4, "test_accuracy": 0.9, "test_loss": 0.3, "wall_seconds": 2.0},
        ],
        "config": {"strategy": strategy, "workers": 2, "epochs": 2, "metrics_out": "old.json", "timeline": "t.json"},
        **extra,
    }


@pytest.mark.slow
def test_report_writes_plots_and_table(cli, tmp_path):
    from matplotlib import image

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(metrics()))
    b.write_text(json.dumps(metrics("ps-async", {"mean": 1.5, "max": 3, "histogram": {"0": 10, "1": 10, "3": 20}})))
    done = cli("report", str(a), str(b), "--out", str(tmp_path / "out" / "deep"))
    assert done.returncode == 0, done.stderr
    for name in ("accuracy.png", "loss.png", "throughput.png", "staleness.png", "bytes_per_step.png"):
        assert image.imread(tmp_path / "out" / "deep" / name).ndim == 3
    assert image.imread(tmp_path / "out" / "deep" / "throughput.png").shape[:2] == (400, 600)
    table = (tmp_path / "out" / "deep" / "report.md").read_text()
    assert "| allreduce x2 (a) | allreduce | 2 | 2 | 40 | 0.9000 |" in table
    assert "| 1.50 | 3 | 0 |" in table


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "no such file"),
        ("not json", "not JSON"),
        ('{"strategy": "x"}', "not a paratrain metrics file"),
        ("[1, 2]", "not a paratrain metrics file"),
    ],
)
def test_report_bad_input_is_one_line_exit_2(cli, tmp_path, content, message):
    path = tmp_path / "run.json"
    if content is not None:
        path.write_text(content)
    done = cli("report", str(path), "--out", str(tmp_path / "out"))
    assert done.returncode == 2
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_report_unwritable_out_is_exit_2(cli, tmp_path):
    run = tmp_path / "run.json"
    run.write_text(json.dumps(metrics()))
    done = cli("report", str(run), "--out", str(run))
    assert done.returncode == 2 and "is a file" in done.stderr
    done = cli("report", str(run), "--out", str(run / "sub"))  # a folder inside a file (root may write anywhere)
    assert done.returncode == 2 and "cannot create" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_config_from_takes_the_embedded_config_without_outputs(tmp_path):
    from paratrain.config_files import config_from_run
    from paratrain.errors import ConfigError

    run = tmp_path / "run.json"
    run.write_text(json.dumps(metrics()))
    assert config_from_run(str(run)) == {"strategy": "allreduce", "workers": 2, "epochs": 2}
    run.write_text(json.dumps({"no": "config"}))
    with pytest.raises(ConfigError, match="no embedded"):
        config_from_run(str(run))


def test_config_from_a_file_written_when_every_run_held_tensor_parallel_2(tmp_path, cli):
    """Before --tensor-parallel's default became each strategy's own, every metrics file held
    its former default, 2: a pipeline run repeated from one stays unsplit; a file written
    since (it holds loss_parallel) keeps its 2, a choice."""
    from paratrain.config_files import config_from_run

    old, new = tmp_path / "old.json", tmp_path / "new.json"
    config = {"strategy": "pipeline", "stages": 2, "workers": 2, "tensor_parallel": 2}
    old.write_text(json.dumps({"config": config}))
    new.write_text(json.dumps({"config": {**config, "workers": 4, "loss_parallel": True}}))
    assert "tensor_parallel" not in config_from_run(str(old))
    assert config_from_run(str(new))["tensor_parallel"] == 2
    done = cli("train", "--config-from", str(old), "--model", "mlp", "--epochs", "1", "--no-progress")
    assert done.returncode == 0, done.stderr[-2000:]


def test_config_from_with_config_is_exit_2(cli, tmp_path):
    done = cli("train", "--config", "recipes/digits_allreduce.toml", "--config-from", "x.json")
    assert done.returncode == 2 and "not both" in done.stderr


def test_span_is_a_no_op_without_a_timeline():
    assert timeline.recorder() is None
    assert timeline.span("forward") is timeline.span("backward")  # one shared null context


def test_recorder_parts_merge_onto_one_clock(tmp_path):
    path = tmp_path / "trace.json"
    for rank in (0, 1):
        recorder = timeline.start(rank, f"worker {rank}")
        with timeline.span("forward"):
            pass
        with timeline.span("allreduce", timeline.COMM, bytes=8):
            pass
        timeline.stop().write_part(path)
    trace = timeline.merge(path, 2, timeout=1)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {(e["pid"], e["name"], e["tid"]) for e in spans} == {
        (0, "forward", 0),
        (0, "allreduce", 1),
        (1, "forward", 0),
        (1, "allreduce", 1),
    }
    assert min(e["ts"] for e in spans) == 0 and json.loads(path.read_text()) == trace
    assert timeline.recorder() is None and recorder is not None


def test_every_recipe_is_a_valid_config():
    from pathlib import Path

    from paratrain.config import make_config
    from paratrain.config_files import load_toml

    recipes = sorted(Path(__file__).resolve().parents[2].glob("recipes/*.toml"))
    assert len(recipes) >= 6
    for recipe in recipes:
        config = make_config(load_toml(str(recipe)), {"epochs": 1})
        assert config.epochs == 1
