"""Compute threads per process and the channels-last default (launch/threads.py)."""

import json

import pytest
import torch

from paratrain.comm.transport import default_backend
from paratrain.data.datasets import DataSpec
from paratrain.launch.threads import default_threads, set_threads, usable_cores
from paratrain.models import build_model
from paratrain.strategies.recipe import prefers_channels_last


def test_the_cores_are_shared_among_the_processes_of_this_machine():
    cores = usable_cores()
    assert cores >= 1
    assert default_threads({"LOCAL_WORLD_SIZE": "1"}) == cores
    assert default_threads({"LOCAL_WORLD_SIZE": "2"}) == max(1, cores // 2)
    assert default_threads({"LOCAL_WORLD_SIZE": str(cores * 4)}) == 1  # never zero
    assert default_threads({}) == cores
    # Clusters that set no LOCAL_WORLD_SIZE: an srun step's tasks on this node, a TF_CONFIG's on this host.
    srun = {
        "SLURM_PROCID": "0",
        "SLURM_STEP_ID": "0",
        "SLURM_NTASKS": "4",
        "SLURM_NODEID": "0",
        "SLURM_STEP_NODELIST": "n[1-2]",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    }
    assert default_threads(srun) == max(1, cores // 2)
    hosts = {"worker": ["10.0.0.1:2222", "10.0.0.1:2223", "10.0.0.1:2224", "10.0.0.2:2222"]}
    tf_config = {"TF_CONFIG": json.dumps({"cluster": hosts, "task": {"type": "worker", "index": 0}})}
    assert default_threads(tf_config) == max(1, cores // 3)


def test_set_threads_takes_the_request_then_the_environment_then_the_default(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("PARATRAIN_THREADS_PER_WORKER", "3")
        assert set_threads(1) == 1 and torch.get_num_threads() == 1
        assert set_threads(None) == 3 and torch.get_num_threads() == 3
        monkeypatch.delenv("PARATRAIN_THREADS_PER_WORKER")
        assert set_threads(None) == default_threads()
    finally:
        torch.set_num_threads(before)


def test_channels_last_by_default_for_conv_nets_on_the_cpu():
    cnn = build_model("cifar_cnn", DataSpec(input_shape=(3, 24, 24), num_classes=10))
    mlp = build_model("mlp", DataSpec(input_shape=(64,), num_classes=10))
    assert prefers_channels_last(cnn, torch.device("cpu"))
    assert not prefers_channels_last(mlp, torch.device("cpu"))
    assert not prefers_channels_last(cnn, torch.device("cuda", 0))


@pytest.mark.parametrize(
    ("flags", "threads", "channels_last"),
    [(["--threads-per-worker", "1"], 1, True), (["--no-channels-last"], None, False)],
)
@pytest.mark.slow
def test_the_run_says_what_it_used(cli, tmp_path, flags, threads, channels_last):
    out = tmp_path / "m.json"
    result = cli(
        "train",
        "--model",
        "cifar_cnn",
        "--epochs",
        "1",
        "--log-every",
        "0",
        "--metrics-out",
        str(out),
        "--device",
        "cpu",
        *flags,
        env={"PARATRAIN_THREADS_PER_WORKER": "", "PARATRAIN_HOST_REGISTRY": str(tmp_path / "alone")},
    )
    assert result.returncode == 0, result.stderr
    metrics = json.loads(out.read_text())
    assert metrics["threads_per_worker"] == (threads or usable_cores())
    assert metrics["channels_last"] is channels_last
    assert metrics["config"]["channels_last"] is (None if channels_last else False)  # what was asked


def test_processes_that_share_a_gpu_join_over_gloo(monkeypatch):
    """NCCL refuses two ranks on one device: where a machine's processes outnumber its GPUs
    they all-reduce over Gloo, which moves CUDA tensors through host memory."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    cuda = torch.device("cuda", 0)
    torchrun = {"RANK": "0", "WORLD_SIZE": "6"}
    assert default_backend(cuda, {**torchrun, "LOCAL_WORLD_SIZE": "2"}) == "nccl"
    assert default_backend(cuda, {}) == "nccl"
    assert default_backend(cuda, {**torchrun, "LOCAL_WORLD_SIZE": "3"}) == "gloo"
    assert default_backend(torch.device("cpu"), {**torchrun, "LOCAL_WORLD_SIZE": "1"}) == "gloo"
    # TF_CONFIG names no local world: its tasks on this task's host are counted.
    cluster = {"worker": ["10.0.0.1:2222", "10.0.0.1:2223", "10.0.0.1:2224", "10.0.0.2:2222"]}
    tf_config = lambda index: {
        "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})
    }  # noqa: E731
    assert default_backend(cuda, tf_config(0)) == "gloo"  # 3 tasks, 2 GPUs
    assert default_backend(cuda, tf_config(3)) == "nccl"  # alone on its host
