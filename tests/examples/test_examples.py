"""Each example runs as written, at tiny scale, on small files in the real formats."""

import re
from pathlib import Path

import pytest

from paratrain.testing import write_cifar10, write_fashion_mnist, write_text_folders
from paratrain.train.checkpoint import load_checkpoint
from tests.conftest import run_script

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

pytestmark = pytest.mark.distributed


def run_example(name, *args, timeout=300):
    """``python examples/NAME ARGS`` from the repository's root (in this test process:
    tests/conftest.py's ``run_script``)."""
    return run_script(EXAMPLES / name, *args, timeout=timeout)


def test_fashion_mnist_mirrored(tmp_path):
    data = write_fashion_mnist(tmp_path / "fm", num_train=128, num_test=64)
    result = run_example(
        "fashion_mnist_mirrored.py",
        "--data-dir",
        str(data),
        "--no-download",
        "--workers",
        "2",
        "--epochs",
        "2",
        "--batch-per-replica",
        "16",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 replica(s) x 16 = global batch 32" in result.stdout
    assert "epoch 2/2" in result.stdout
    accuracy = float(re.search(r"test accuracy (\d\.\d+)", result.stdout).group(1))
    assert accuracy > 0.3  # 10 classes; the fixture's classes are easy to tell apart


def test_cifar10_multi_gpu(tmp_path):
    data = write_cifar10(tmp_path / "c", per_batch=24, num_test=20)
    train_dir = tmp_path / "train"
    result = run_example(
        "cifar10_multi_gpu.py",
        "--data-dir",
        str(data),
        "--no-download",
        "--workers",
        "2",
        "--batch-size",
        "10",
        "--max-steps",
        "8",
        "--log-every",
        "2",
        "--checkpoint-every",
        "5",
        "--train-dir",
        str(train_dir),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 tower(s) x batch 10, 8 steps (2 epochs of 6 steps)" in result.stdout
    steps = re.findall(
        r"^step (\d+), loss = \d+\.\d+ \(\d+\.\d examples/sec; \d+\.\d+ sec/batch\)$", result.stdout, re.MULTILINE
    )
    assert steps == ["2", "4", "6", "8"]  # stops at --max-steps, in the middle of epoch 2
    assert re.search(r"step 8: precision @ 1 = \d\.\d{3}", result.stdout)
    assert sorted(p.name for p in train_dir.iterdir()) == ["ckpt-000000005", "ckpt-000000008"]
    state = load_checkpoint(train_dir)  # the newest: rank 0's part
    assert state["trainer"]["global_step"] == 8 and "0.weight" in state["model"] and "state" in state["optimizer"]
    groups = state["optimizer"]["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.004, 0.0]  # local3 and local4 weights only


def test_cifar10_multi_gpu_stops_on_nan_loss(tmp_path):
    data = write_cifar10(tmp_path / "c", per_batch=20, num_test=10)
    result = run_example(
        "cifar10_multi_gpu.py",
        "--data-dir",
        str(data),
        "--no-download",
        "--workers",
        "1",
        "--batch-size",
        "20",
        "--max-steps",
        "20",
        "--log-every",
        "2",
        "--lr",
        "1e8",
        "--train-dir",
        str(tmp_path / "train"),
    )
    assert result.returncode == 3, result.stderr[-3000:]
    assert re.fullmatch(r"cifar10_multi_gpu: model diverged with loss = nan at step \d+", result.stderr.strip())


def test_text_lstm(tmp_path):
    data = write_text_folders(tmp_path / "t", docs_per_class=24, num_test=8)
    result = run_example(
        "text_lstm.py", "--data-dir", str(data), "--epochs", "2", "--batch-size", "8", "--max-len", "30"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "48 training and 16 test documents, classes ['neg', 'pos']" in result.stdout
    assert "2 replica(s)" in result.stdout
    assert re.search(r"test loss \d\.\d{4}, test accuracy \d\.\d{4}", result.stdout)


def test_examples_report_bad_data_in_one_line(tmp_path):
    result = run_example("text_lstm.py", "--data-dir", str(tmp_path / "absent"), "--workers", "1")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"text_lstm: error: --data-dir {tmp_path / 'absent'}: no such directory; "
        "expected a folder with train/ and test/, each with one folder of .txt files per class"
    )


def test_parameter_server_async():
    result = run_example("parameter_server_async.py", "--workers", "2", "--epochs", "1", "--slowdown", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    for mode in ("ps-sync", "ps-backup", "ps-async"):
        assert re.search(rf"{mode}\s.*\d+\s.*0\.\d{{4}}", result.stdout), result.stdout


def test_pipeline_digits():
    result = run_example("pipeline_digits.py", "--epochs", "2", "--batch-size", "64", "--schedule", "gpipe")
    assert result.returncode == 0, result.stderr[-3000:]
    # mlp: Flatten, Linear, ReLU, Linear; split by parameter count
    assert "stage 0 of replica 0: layers 0-1 (Flatten, Linear)" in result.stdout
    assert "stage 1 of replica 0: layers 2-3 (ReLU, Linear)" in result.stdout
    assert "1 pipeline(s) x 2 stages, gpipe, batch 64 in 4 micro-batches of 16" in result.stdout
    assert "epoch 2/2" in result.stdout
    accuracy = float(re.search(r"test accuracy (\d\.\d+)", result.stdout).group(1))
    assert accuracy > 0.7  # 10 classes; 0.77 after one epoch


def test_pipeline_digits_bad_batch_in_one_line():
    result = run_example("pipeline_digits.py", "--batch-size", "30", "--microbatches", "4")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "pipeline_digits: error: --batch-size 30 must be a multiple of --microbatches 4 "
        "(every micro-batch has the same size)"
    )
