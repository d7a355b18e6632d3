"""Embedding tables on the parameter server: row-sharded on the shards, only the rows a
batch touches pulled and pushed, in every mode, against the single-process reference."""

import json
import shlex
import shutil
import subprocess
import sys

import pytest
import torch
from torch.utils.data import Subset

import paratrain
from paratrain.data.clicks import load_clicks
from paratrain.models.dlrm import DLRM
from paratrain.strategies.ps.strategy import ParameterServerStrategy
from paratrain.testing import relative_difference, run_distributed, write_text_folders
from tests.conftest import REPO

pytestmark = pytest.mark.distributed

CLICKS = "tables=3,rows=300/2000/40,examples=3000,seed=3"


def _fit(strategy, batch, steps, optimizer="sgd", lazy=False):
    torch.manual_seed(0)
    splits = load_clicks(None, CLICKS)
    model = DLRM(splits.spec, lazy_tables=lazy)
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.2)
    else:
        opt = torch.optim.Adagrad(model.parameters(), lr=0.05)
    trainer = paratrain.Trainer(model, "cross_entropy", opt, strategy=strategy)
    n = steps * batch * max(strategy.num_replicas, 1)
    trainer.fit(Subset(splits.train, range(n)), epochs=1, batch_size=batch, verbose=0)
    return trainer


def _dense(module):
    return torch.cat([p.detach().reshape(-1) for n, p in module.named_parameters() if not n.startswith("tables.")])


def _ps(mode, shards, sharding, batch, steps, dense="ps"):
    strategy = ParameterServerStrategy(
        mode, num_shards=shards, device="cpu", tables="all", table_sharding=sharding, dense=dense
    )
    trainer = _fit(strategy, batch, steps, lazy=True)
    result = None
    if strategy.is_chief:
        rows = strategy.worker.tables
        result = (_dense(trainer.module), [rows.read(t) for t in range(3)], strategy.stats())
    strategy.teardown()
    return result


@pytest.mark.parametrize(
    "shards, sharding, dense", [(1, "mod", "ps"), (2, "mod", "ps"), (2, "range", "ps"), (2, "mod", "allreduce")]
)
def test_ps_sync_with_tables_equals_single_with_the_global_batch(shards, sharding, dense):
    """Two workers of batch b, the tables split by rows over the shards (never whole on a
    worker: the model is built with its tables on the meta device), equal one process of
    batch 2b with SGD: a touched row moves as under the dense step, an untouched one not
    at all. To float32 rounding (1e-5). With --dense allreduce the shards hold the tables
    alone and the workers all-reduce the rest and step it themselves: the same."""
    b, k = 16, 12
    single = _fit(paratrain.SingleDeviceStrategy(device="cpu"), 2 * b, k)
    tables = [t.weight.detach() for t in single.module.tables]
    results = run_distributed(_ps, "sync", shards, sharding, b, k, dense, world_size=shards + 2)
    dense, rows, stats = results[shards]
    assert relative_difference(dense, _dense(single.module)) < 1e-5
    initial = _initial_tables()
    for got, want, start in zip(rows, tables, initial):
        assert relative_difference(got, want) < 1e-5
        # the rows' movement alone (most rows are untouched): float32 rounding of the steps
        assert relative_difference(got - start, want - start) < 1e-4
    moved = sum(int((w != t0).any(1).sum()) for w, t0 in zip(tables, initial))
    assert stats["tables"]["rows_applied"] >= moved > 0  # each step stepped the rows its batch touched
    assert stats["tables"]["row_staleness"]["max"] == 0


def _initial_tables():
    torch.manual_seed(0)
    return [t.weight.detach() for t in DLRM(load_clicks(None, CLICKS).spec).tables]


def _adagrad(shards, batch, steps):
    strategy = ParameterServerStrategy("sync", num_shards=shards, device="cpu", tables="all")
    trainer = _fit(strategy, batch, steps, optimizer="adagrad", lazy=True)
    result = _dense(trainer.module) if strategy.is_chief else None
    rows = [strategy.worker.tables.read(t) for t in range(3)] if strategy.is_chief else None
    strategy.teardown()
    return result, rows


def test_tables_under_adagrad_step_row_wise_and_the_rest_as_in_one_process():
    """Adagrad: the dense part equals one process exactly, the tables follow row-wise
    Adagrad (one accumulator per row), computed here from the single run's own gradients
    would need its history; instead: the tables moved, stayed finite, and rows no batch
    touched are their initial values."""
    b, k = 16, 8
    dense, rows = run_distributed(_adagrad, 2, b, k, world_size=4)[2]
    initial = _initial_tables()
    touched = [torch.zeros(len(t), dtype=torch.bool) for t in initial]
    ids = load_clicks(None, CLICKS).train.ids[: 2 * b * k]
    for t in range(3):
        touched[t][ids[:, t]] = True
        assert torch.isfinite(rows[t]).all()
        assert torch.equal(rows[t][~touched[t]], initial[t][~touched[t]])
        assert (rows[t][touched[t]] != initial[t][touched[t]]).any(1).all()
    assert torch.isfinite(dense).all()


@pytest.mark.parametrize(
    "args",
    [
        ["--strategy", "ps-async", "--staleness-bound", "1", "--optimizer", "adamw", "--lr", "0.01"],
        ["--strategy", "ps-backup", "--backup-workers", "1", "--optimizer", "adagrad", "--lr", "0.1"],
        # rows' staleness policies in one process: tests/unit/test_table_parts.py; --dense allreduce: above
        pytest.param(["--strategy", "ps-async", "--stale-policy", "scale-lr"], marks=pytest.mark.matrix),
        pytest.param(
            ["--strategy", "ps-async", "--dense", "allreduce", "--stale-policy", "drop", "--max-staleness", "2"],
            marks=pytest.mark.matrix,
        ),
    ],
)
def test_every_mode_trains_a_recommendation_model_with_its_tables_on_the_shards(cli, tmp_path, args):
    """The built-in DLRM on synthetic clicks, its tables on 2 shards, learns the click rule
    (a third are clicks: 0.67 for always-no) in every mode; the metrics say what the
    tables cost and how stale their rows were."""
    out = tmp_path / "m.json"
    result = cli(
        "train",
        "--model",
        "dlrm",
        "--dataset",
        "clicks:rows=500,examples=12000",
        "--workers",
        "2",
        "--ps-shards",
        "2",
        "--tables",
        "all",
        "--batch-size",
        "32",
        # 1 epoch (150 to 300 steps): the test accuracy is 0.86 after it in both modes, 0.88 after 3
        "--epochs",
        "1",
        "--momentum",
        "0",
        "--lr",
        "0.2",
        "--no-progress",
        "--log-every",
        "0",
        "--metrics-out",
        str(out),
        *args,
    )
    assert result.returncode == 0, result.stderr
    metrics = json.loads(out.read_text())
    assert metrics["test_accuracy"] > 0.75
    tables = metrics["tables"]
    assert sum(tables["bytes_per_shard"]) == 4 * 500 * 16 * 4
    assert tables["rows_served"] > 0 and tables["rows_applied"] > 0
    served = tables["rows_served_per_shard"]
    assert max(served) < 1.3 * min(served), served  # mod sharding spreads the hot rows of the Zipf law
    if "ps-async" in args:
        assert tables["row_staleness"]["max"] >= 1  # two workers: rows moved between pull and push


def test_an_lstm_text_classifier_trains_with_its_embedding_as_a_table(cli, tmp_path):
    """The tutorials' text classifier, its embedding (padding row and all) a table on the shards."""
    text_data = write_text_folders(tmp_path / "t", 40, 10, classes=("neg", "pos"))
    result = cli(
        "train",
        "--strategy",
        "ps-sync",
        "--workers",
        "2",
        "--dataset",
        "text",
        "--data-dir",
        str(text_data),
        "--model",
        "lstm",
        "--tables",
        "embedding",
        "--epochs",
        "2",
        "--no-progress",
        "--log-every",
        "0",
        "--metrics-out",
        str(tmp_path / "m.json"),
    )
    assert result.returncode == 0, result.stderr
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["tables"]["rows_served"] > 0


@pytest.mark.parametrize(
    "args, words",
    [
        (["--strategy", "allreduce", "--tables", "all"], "--tables applies to"),
        (["--strategy", "ps-sync", "--table-sharding", "range"], "give --tables too"),
        (["--strategy", "ps-sync", "--tables", "all", "--table-sharding", "hash"], "--table-sharding must be one of"),
        (["--strategy", "ps-sync", "--tables", "nosuch"], "no nn.Embedding or nn.EmbeddingBag of that name"),
        (["--strategy", "ps-sync", "--tables", "all", "--clip-grad-norm", "1"], "--clip-grad-norm needs the whole"),
        (["--strategy", "ps-sync", "--tables", "all", "--model", "mlp", "--dataset", "digits"], "has no nn.Embedding"),
        (["--strategy", "ps-sync", "--tables", "all", "--dataset", "clicks:rows=4000000000"], "GiB available"),
        (["--strategy", "ps-sync", "--dataset", "clicks:rows=1"], "rows >= 2 each"),
        (["--strategy", "ps-sync", "--dense", "allreduce"], "give --tables too"),
        (
            ["--strategy", "ps-backup", "--backup-workers", "1", "--tables", "all", "--dense", "allreduce"],
            "--dense applies to --strategy ps-sync and ps-async",
        ),
        (
            ["--strategy", "ps-sync", "--tables", "all", "--dense", "allreduce", "--checkpoint-dir", "ck"],
            "--checkpoint-dir is not available with --dense allreduce",
        ),
        (["--strategy", "ps-sync", "--dataset", "clicks:colour=red"], "is not KEY=VALUE with KEY one of"),
    ],
)
def test_bad_table_flags_are_one_line_exit_2(cli, args, words):
    base = ["train", "--model", "dlrm", "--dataset", "clicks:rows=100,examples=200", "--workers", "2", "--epochs", "1"]
    result = cli(*base, *args)
    assert result.returncode == 2, result.stderr
    assert words in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_tables_resume_to_the_bit_and_on_another_number_of_shards(cli, tmp_path):
    """ps-sync with tables stopped after 1 epoch and resumed to 2 is the run never stopped
    (every epoch's test loss, to the bit); read by 2 shards with range sharding instead of
    1, every row goes to the shard that holds it now, and the run is again the same; as it
    is where 2 shards sharded the rows by ``mod`` and 2 read them by ``range`` (the same
    parts, each holding other rows)."""
    common = [
        "train",
        "--strategy",
        "ps-sync",
        "--model",
        "dlrm",
        "--dataset",
        "clicks:rows=500,examples=1600",
        "--workers",
        "2",
        "--tables",
        "all",
        "--momentum",
        "0",
        "--lr",
        "0.2",
        "--batch-size",
        "32",
        "--checkpoint-every",
        "7",
        "--no-progress",
        "--log-every",
        "0",
    ]

    def run(name, *args):
        out = tmp_path / f"{name}.json"
        result = cli(*common, *args, "--metrics-out", str(out))
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(out.read_text()), result

    whole, _ = run("whole", "--epochs", "2")
    run("first", "--epochs", "1", "--checkpoint-dir", str(tmp_path / "c"))
    shutil.copytree(tmp_path / "c", tmp_path / "d")
    resumed, _ = run("resumed", "--epochs", "2", "--checkpoint-dir", str(tmp_path / "c"), "--resume")
    resharded, result = run(
        "resharded",
        "--epochs",
        "2",
        "--checkpoint-dir",
        str(tmp_path / "d"),
        "--resume",
        "--ps-shards",
        "2",
        "--table-sharding",
        "range",
    )
    assert "resharded" in result.stdout
    run("first-2", "--epochs", "1", "--checkpoint-dir", str(tmp_path / "e"), "--ps-shards", "2")
    rows_moved, result = run(
        "rows-moved",
        "--epochs",
        "2",
        "--checkpoint-dir",
        str(tmp_path / "e"),
        "--resume",
        "--ps-shards",
        "2",
        "--table-sharding",
        "range",
    )
    assert "was written with another --table-sharding: the parameters and optimizer state are resharded" in (
        result.stdout
    )
    for run_ in (resumed, resharded, rows_moved):
        assert run_["resumed_from_step"] == 20
        ran = len(run_["history"])
        assert ran == 1 and [e["test_loss"] for e in run_["history"]] == [e["test_loss"] for e in whole["history"][-1:]]


def test_a_table_larger_than_a_worker_trains_without_any_worker_holding_it(cli, tmp_path):
    """A 1.5 GB table (24 million rows of 16 floats) on 2 shards: every process of the run
    builds the model with the table on the meta device, each shard makes its half of the
    rows, and the workers' peak resident memory is that of the same run on a table of a
    thousand rows (within 5% of the table): each worker holds only the rows of its batches.
    On the CPU (where a GPU is visible too: the workers' own memory is what is measured);
    the base differs by build (a CUDA build of PyTorch maps 0.3 GB more libraries), so only
    the difference is asserted."""

    def run(rows):
        out = tmp_path / f"{rows}.json"
        result = cli(
            "train",
            "--strategy",
            "ps-sync",
            "--model",
            "dlrm",
            "--dataset",
            f"clicks:tables=1,rows={rows},examples=4000",
            "--workers",
            "2",
            "--ps-shards",
            "2",
            "--tables",
            "all",
            "--momentum",
            "0",
            "--epochs",
            "1",
            "--device",
            "cpu",
            "--no-progress",
            "--log-every",
            "0",
            "--metrics-out",
            str(out),
        )
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(out.read_text())

    rows, dim = 24_000_000, 16
    table = rows * dim * 4
    small, big = run(1000), run(rows)
    assert sum(big["tables"]["bytes_per_shard"]) == table
    rss, base = big["max_rss_bytes"], small["max_rss_bytes"]
    assert max(rss["workers"]) - max(base["workers"]) < 0.05 * table, (rss, base)
    assert min(rss["shards"]) - max(base["shards"]) > table / 2 * 0.9, (rss, base)  # each shard holds its half


def _documented_command(document):
    text = (REPO / document).read_text()
    start = text.index("paratrain train --strategy ps-async --workers 2 --ps-shards 2 --model dlrm")
    command = text[start : text.index("\n", text.index("--tables all", start))]
    return shlex.split(command.split("#")[0].replace("\\\n", " "))


def test_the_documented_tables_command_runs_verbatim(cli, tmp_path):
    """The command the README gives for tables (docs/parameter_server.md gives the same), as
    written there, learns the click rule."""
    argv = _documented_command("README.md")
    assert _documented_command("docs/parameter_server.md") == argv
    out = tmp_path / "m.json"
    result = cli(*argv[1:], "--no-progress", "--metrics-out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(out.read_text())["test_accuracy"] > 0.75


def test_a_worker_joins_a_running_run_with_tables(cli, tmp_path):
    """A worker that joins a ps-async run with tables (over its own link to each shard)
    takes the run's options, fetches rows and pushes their gradients like the others; the
    run goes on to learn the click rule."""
    out = tmp_path / "run.json"
    command = [
        sys.executable,
        "-m",
        "paratrain",
        "train",
        "--strategy",
        "ps-async",
        "--workers",
        "2",
        "--ps-shards",
        "2",
        "--model",
        "dlrm",
        "--dataset",
        "clicks:rows=2000,examples=16000",
        "--tables",
        "all",
        # 3 epochs (1200 steps, ~11 s idle): the worker joins ~1 s in, and the test accuracy
        # is on its plateau (0.86 at epoch 3 as at epoch 8 here)
        "--epochs",
        "3",
        "--no-progress",
        "--log-every",
        "0",
        "--metrics-out",
        str(out),
    ]
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        line = next(line for line in run.stdout if "--join " in line)
        address, token = line.split("--join ")[1].split()[0], line.split("--join-token-file ")[1].split()[0]
        joined = cli("train", "--join", address, "--join-token-file", token, "--no-progress", "--log-every", "0")
        _, stderr = run.communicate(timeout=240)
    finally:
        run.kill()
    assert joined.returncode == 0, joined.stderr[-3000:]
    assert int(joined.stdout.strip().splitlines()[-1].split(" took ")[1].split()[0]) >= 10, joined.stdout
    assert run.returncode == 0, stderr[-3000:]
    metrics = json.loads(out.read_text())
    assert metrics["workers_joined"] == [2] and metrics["test_accuracy"] > 0.75
