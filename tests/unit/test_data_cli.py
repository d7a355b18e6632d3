"""Training from files in the real formats through the command line, and bad data files
ending in one line and exit code 2."""

import json

import numpy as np
import pytest

from paratrain.comm.transport import free_port
from paratrain.testing import write_cifar10, write_fashion_mnist, write_idx, write_text_folders
from paratrain.train.metrics import METRICS_KEYS


def _train(cli, tmp_path, *args):
    out = tmp_path / "m.json"
    result = cli("train", "--no-progress", "--metrics-out", str(out), *args)
    assert result.returncode == 0, result.stderr
    metrics = json.loads(out.read_text())
    assert set(METRICS_KEYS) <= set(metrics)
    assert metrics["loader_wait_seconds"] >= 0
    cpu = [e["cpu_seconds"] for e in metrics["history"]]  # the process's CPU since training began
    assert 0 < cpu[0] and cpu == sorted(cpu), cpu
    # an epoch's steps take less than the wall clock between the epochs' ends (evaluation)
    walls = [0.0] + [e["wall_seconds"] for e in metrics["history"]]
    for entry, before, after in zip(metrics["history"], walls, walls[1:]):
        assert 0 < entry["train_seconds"] < after - before, (entry, before, after)
    return metrics


@pytest.mark.slow
def test_fashion_mnist_from_idx_files(cli, tmp_path):
    data = write_fashion_mnist(tmp_path / "fm", num_train=200, num_test=100)
    metrics = _train(
        cli,
        tmp_path,
        "--dataset",
        "fashion-mnist",
        "--data-dir",
        str(data),
        "--epochs",
        "2",
        "--optimizer",
        "adam",
        "--lr",
        "0.002",
    )
    assert metrics["dataset"] == "fashion-mnist"
    assert metrics["global_steps"] == 2 * (200 // 32)
    assert metrics["test_accuracy"] >= 0.8  # each class is a template plus noise


@pytest.mark.slow
def test_cifar10_from_binary_records(cli, tmp_path):
    data = write_cifar10(tmp_path / "c", per_batch=40, num_test=40)
    metrics = _train(
        cli,
        tmp_path,
        "--dataset",
        "cifar10",
        "--data-dir",
        str(data.parent),
        "--model",
        "cifar_cnn",
        "--epochs",
        "1",
        "--batch-size",
        "20",
    )
    assert (metrics["dataset"], metrics["model"], metrics["global_steps"]) == ("cifar10", "cifar_cnn", 200 // 20)
    assert 0.0 <= metrics["test_accuracy"] <= 1.0


@pytest.mark.slow
def test_text_folders_with_the_lstm(cli, tmp_path):
    data = write_text_folders(tmp_path / "t", docs_per_class=40, num_test=20)
    metrics = _train(
        cli,
        tmp_path,
        "--dataset",
        "text",
        "--data-dir",
        str(data),
        "--model",
        "lstm",
        "--optimizer",
        "adam",
        "--lr",
        "0.01",
        "--max-len",
        "40",
        "--vocab-size",
        "100",
        "--batch-size",
        "8",
        "--epochs",
        "3",
    )
    assert metrics["config"]["max_len"] == 40 and metrics["global_steps"] == 3 * (80 // 8)
    assert metrics["test_accuracy"] > 0.5


def _bad_magic(tmp_path):
    data = write_fashion_mnist(tmp_path / "fm", 10, 10)
    write_idx(data / "train-images-idx3-ubyte.gz", np.zeros((10, 28, 28, 1), dtype=np.uint8))
    return ["--dataset", "fashion-mnist", "--data-dir", str(data)], ["magic number 2052, expected 2051 (IDX images)"]


def _truncated_cifar(tmp_path):
    folder = write_cifar10(tmp_path / "c", per_batch=10, num_test=10)
    (folder / "data_batch_3.bin").write_bytes((folder / "data_batch_3.bin").read_bytes()[:30000])
    return ["--dataset", "cifar10", "--model", "cifar_cnn", "--data-dir", str(folder)], [
        "data_batch_3.bin: 30000 bytes is not a multiple of 3073-byte records"
    ]


def _missing_class(tmp_path):
    data = write_text_folders(tmp_path / "t", 4, 2, classes=("neg", "pos"))
    for path in (data / "train" / "pos").iterdir():
        path.unlink()
    (data / "train" / "pos").rmdir()
    return ["--dataset", "text", "--model", "lstm", "--data-dir", str(data)], [
        "train has classes ['neg'] but test has ['neg', 'pos']"
    ]


def _no_files_no_download(tmp_path):
    return ["--dataset", "fashion-mnist", "--data-dir", str(tmp_path / "empty"), "--no-download"], [
        "fashion-mnist: train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz, "
        "t10k-labels-idx1-ubyte.gz not found and --no-download is set",
        f"put these IDX files (gzip or plain) in {tmp_path / 'empty'} (or pass --data-dir)",
    ]


def _text_without_data_dir(tmp_path):
    return ["--dataset", "text", "--model", "lstm"], ["--dataset text needs --data-dir"]


def _mlp_on_tokens(tmp_path):
    data = write_text_folders(tmp_path / "t", 4, 2)
    return ["--dataset", "text", "--data-dir", str(data)], ["model mlp needs image-like float inputs"]


@pytest.mark.parametrize(
    "case",
    [_bad_magic, _truncated_cifar, _missing_class, _no_files_no_download, _text_without_data_dir, _mlp_on_tokens],
)
def test_bad_data_is_one_line_and_exit_2(cli, tmp_path, case):
    args, words = case(tmp_path)
    result = cli("train", "--epochs", "1", *args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("paratrain: error: ")
    for word in words:
        assert word in lines[0]


def test_offline_download_says_which_files_to_put_where(cli, tmp_path):
    # A proxy on a closed local port stands in for a machine without network.
    proxy = f"http://127.0.0.1:{free_port()}"
    env = {"PARATRAIN_DATA": str(tmp_path), "http_proxy": proxy, "https_proxy": proxy, "no_proxy": ""}
    result = cli("train", "--dataset", "cifar10", "--model", "cifar_cnn", "--epochs", "1", env=env)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr  # no empty progress bar before the error
    line = lines[0]
    assert line.startswith(
        "paratrain: error: cifar10: cannot download cifar-10-binary.tar.gz (https://www.cs.toronto.edu/~kriz/"
    )
    assert "put cifar-10-batches-bin/ with data_batch_1.bin" in line and f"in {tmp_path / 'cifar10'}" in line


def test_help_lists_the_data_options(cli):
    result = cli("train", "--help")
    for flag in ("--data-dir", "--no-download", "--max-len", "--vocab-size", "mnist", "cifar10", "text"):
        assert flag in result.stdout
