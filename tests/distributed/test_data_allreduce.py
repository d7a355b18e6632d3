"""Real-format data sets with several workers through the command line."""

import json

import pytest

from paratrain.testing import write_fashion_mnist

pytestmark = pytest.mark.distributed


def test_fashion_mnist_on_two_workers(cli, tmp_path):
    data = write_fashion_mnist(tmp_path / "fm", num_train=256, num_test=64)
    out = tmp_path / "m.json"
    result = cli(
        "train",
        "--dataset",
        "fashion-mnist",
        "--data-dir",
        str(data),
        "--no-download",
        "--strategy",
        "allreduce",
        "--workers",
        "2",
        "--epochs",
        "2",
        "--batch-size",
        "16",
        "--optimizer",
        "adam",
        "--lr",
        "0.002",
        "--no-progress",
        "--metrics-out",
        str(out),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads(out.read_text())
    assert (metrics["workers"], metrics["dataset"]) == (2, "fashion-mnist")
    assert metrics["global_steps"] == 2 * (256 // 32)
    assert metrics["loader_wait_seconds"] >= 0
    assert metrics["test_accuracy"] >= 0.8


def test_bad_data_with_two_workers_fails_before_starting_them(cli, tmp_path):
    data = write_fashion_mnist(tmp_path / "fm", 10, 10)
    (data / "t10k-images-idx3-ubyte.gz").write_bytes(b"\x1f\x8b\x08\x00garbage")
    result = cli(
        "train",
        "--dataset",
        "fashion-mnist",
        "--data-dir",
        str(data),
        "--strategy",
        "allreduce",
        "--workers",
        "2",
        "--epochs",
        "1",
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "t10k-images-idx3-ubyte.gz: the gzip stream is truncated" in lines[0]
