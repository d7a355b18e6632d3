"""The strategies on a CUDA GPU against the CPU reference: what runs on a machine with one
GPU (several processes share it where the strategy allows: over Gloo, which all-reduces
CUDA tensors through host memory, since NCCL refuses two ranks on one device).

Skipped without a GPU. Each run is a ``paratrain train`` command in a fresh interpreter,
so that no process of the suite holds a CUDA context when another forks. The reference is
one CPU process with the global batch; fp32 on both (TF32 matrix products are off by
default in PyTorch), so a run that equals it does to float32 rounding: 1e-4 relative on
the test loss after two epochs, where a wrong gradient average or a missed update moves
it by more than 1e-2.
"""

import json
import math
import os
import subprocess
import sys

import pytest

from paratrain.data.text_lm import builtin_corpus
from tests.conftest import REPO

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # asks NVML, creates no CUDA context
import torch  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

RUN = ("--epochs", "2", "--log-every", "0", "--no-progress", "--seed", "3")


def train(tmp_path, *args, device="cuda", timeout=300):
    """``paratrain train ARGS --device DEVICE``; the metrics file's document."""
    out = tmp_path / f"metrics-{len(list(tmp_path.iterdir()))}.json"
    command = [sys.executable, "-m", "paratrain", "train", *RUN, *args, "--device", device, "--metrics-out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One CPU process of the global batch (32), mlp on digits."""
    return train(tmp_path_factory.mktemp("reference"), "--batch-size", "32", device="cpu")


def assert_equal_loss(metrics, reference, tolerance=1e-4):
    assert metrics["test_loss"] == pytest.approx(reference["test_loss"], rel=tolerance)
    assert metrics["test_accuracy"] == pytest.approx(reference["test_accuracy"], abs=2 / 360)


def test_single_on_the_gpu_equals_the_cpu(tmp_path, reference):
    assert_equal_loss(train(tmp_path, "--batch-size", "32"), reference)


@pytest.mark.parametrize("workers", [1, 2])
def test_allreduce_on_the_gpu_equals_one_cpu_process(tmp_path, reference, workers):
    """1 worker: NCCL; 2 workers on the one GPU: Gloo with CUDA tensors."""
    metrics = train(tmp_path, "--strategy", "allreduce", "--workers", str(workers), "--batch-size", str(32 // workers))
    assert_equal_loss(metrics, reference)


def test_ps_sync_with_cuda_workers_equals_one_cpu_process(tmp_path, reference):
    metrics = train(tmp_path, "--strategy", "ps-sync", "--workers", "2", "--batch-size", "16", "--ps-shards", "2")
    assert_equal_loss(metrics, reference)


@pytest.mark.parametrize("workers", [1, 2])
def test_fsdp_on_the_gpu_equals_one_cpu_process(tmp_path, reference, workers):
    metrics = train(tmp_path, "--strategy", "fsdp", "--workers", str(workers), "--batch-size", str(32 // workers))
    assert_equal_loss(metrics, reference)


def test_fault_tolerant_fsdp_of_one_process_a_replica_on_the_gpu_equals_one_cpu_process(tmp_path, reference):
    """Each replica's group is one process on the GPU, so NCCL: what the replicas count and
    sum at the end (bytes sent) goes through it too, from GPU memory."""
    pytest.importorskip("torchft")
    metrics = train(
        tmp_path,
        "--strategy",
        "fsdp",
        "--fault-tolerant",
        "--workers",
        "2",
        "--shards-per-replica",
        "1",
        "--batch-size",
        "16",
    )
    assert_equal_loss(metrics, reference)


def test_a_pipeline_of_two_stages_on_one_gpu_equals_one_cpu_process(tmp_path, reference):
    metrics = train(tmp_path, "--strategy", "pipeline", "--stages", "2", "--microbatches", "4", "--batch-size", "32")
    assert_equal_loss(metrics, reference)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_mixed_precision_on_the_gpu_trains_as_well_as_fp32(tmp_path, reference, precision):
    """fp16 (autocast and a gradient scaler) and bf16 (autocast): the same accuracy as fp32
    within a few test examples, the loss within 5% (16-bit products round at 1e-3 and 1e-2)."""
    metrics = train(tmp_path, "--batch-size", "32", "--precision", precision)
    assert metrics["test_loss"] == pytest.approx(reference["test_loss"], rel=0.05)
    assert metrics["test_accuracy"] >= reference["test_accuracy"] - 0.02
    assert metrics["skipped_updates"] <= 3  # the scaler's first steps may overflow, then it settles


SMALL_GPT = ("--model", "gpt", "--gpt-layers", "2", "--gpt-width", "64", "--gpt-heads", "2", "--seq-len", "64")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """40 KB of the built-in corpus: 562 training examples of 64 tokens."""
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_bytes(builtin_corpus(40_000))
    return ("--dataset", f"text-lm:{path}")


def test_the_builtin_gpt_on_the_gpu_equals_the_cpu(tmp_path, corpus):
    """SGD (Adam's update of a gradient near zero is its sign, which float rounding flips)."""
    cpu = train(tmp_path, *SMALL_GPT, *corpus, "--batch-size", "32", device="cpu")
    gpu = train(tmp_path, *SMALL_GPT, *corpus, "--batch-size", "32")
    assert gpu["test_loss"] == pytest.approx(cpu["test_loss"], rel=1e-4)
    assert gpu["test_loss"] < 0.8 * math.log(256)


def test_the_builtin_gpt_under_allreduce_on_the_gpu_equals_single(tmp_path, corpus):
    single = train(tmp_path, *SMALL_GPT, *corpus, "--batch-size", "32")
    shared = train(tmp_path, *SMALL_GPT, *corpus, "--batch-size", "16", "--strategy", "allreduce", "--workers", "2")
    assert shared["test_loss"] == pytest.approx(single["test_loss"], rel=1e-4)


def test_the_builtin_gpt_learns_the_builtin_corpus_on_the_gpu(tmp_path):
    """One epoch with AdamW takes it from a uniform guess over 256 bytes (perplexity 256)
    to below perplexity 3 (measured 1.5 at --gpt-width 128 on the CPU)."""
    metrics = train(
        tmp_path, *SMALL_GPT, "--dataset", "text-lm", "--optimizer", "adamw", "--lr", "0.003", "--epochs", "1"
    )
    assert metrics["test_perplexity"] < 3.0
    assert metrics["tokens_per_second"] > 0


def test_a_run_resumed_on_the_gpu_is_the_uninterrupted_run(tmp_path):
    """A checkpoint loads onto the GPU (its random-number states with it, which the
    generators take back from host memory) and the run goes on exactly."""
    whole = train(tmp_path, "--strategy", "allreduce", "--workers", "2", "--batch-size", "16")
    folder = str(tmp_path / "checkpoints")
    common = ("--strategy", "allreduce", "--workers", "2", "--batch-size", "16", "--checkpoint-dir", folder)
    train(tmp_path, *common, "--checkpoint-every", "30", "--epochs", "1")
    resumed = train(tmp_path, *common, "--resume")
    assert resumed["resumed_from_step"] is not None
    assert resumed["test_loss"] == pytest.approx(whole["test_loss"], rel=1e-6)


NO_WAIT = """
import itertools, torch, paratrain
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import TensorDataset
from paratrain.data.batch import to_device

strategy = paratrain.SingleDeviceStrategy(device="cuda")
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
trainer = paratrain.Trainer(model, "cross_entropy", torch.optim.AdamW(model.parameters()), metrics=(), strategy=strategy)
data = TensorDataset(torch.randn(4096, 64), torch.randint(0, 10, (4096,)))
trainer.fit(data, epochs=1, batch_size=64, verbose=0, log_every=0)  # warms the allocators
batches = strategy.distribute(data, 64, seed=0)
iterator = iter(batches)
first = next(iterator)  # the data set and the epoch's order move to the GPU here, once
torch.cuda.synchronize()
torch.cuda.set_sync_debug_mode("error")  # any step that waits for the GPU raises
with profile(activities=[ProfilerActivity.CUDA]) as trace:
    for inputs, targets in itertools.chain([first], iterator):
        strategy.train_step(trainer.model, trainer.loss_fn, trainer.optimizer, inputs, targets)
    torch.cuda.synchronize()
    # A batch from host memory (a data set too large for the GPU, a parameter server's
    # assigned batches) crosses from page-locked memory.
    host_batch = to_device(torch.randn(64, 64), strategy.device, non_blocking=True)
    torch.cuda.synchronize()
torch.cuda.set_sync_debug_mode(0)
copies = [e.name for e in trace.events() if "Memcpy HtoD" in e.name]
print("steps", len(batches), "copies", len(copies), "pageable", sum("Pageable" in name for name in copies))
"""


def test_a_step_on_the_gpu_never_waits_for_it(tmp_path):
    """The host queues the next step while the GPU runs this one: no step synchronises (the
    losses are read at the epoch's end) or copies anything (the epoch's order is on the GPU
    with the data), and a batch from host memory crosses from page-locked memory (a copy
    from pageable memory holds the host until the GPU has run everything queued before it)."""
    result = subprocess.run([sys.executable, "-c", NO_WAIT], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    steps, copies, pageable = (int(v) for v in result.stdout.split()[1::2])
    assert (steps, copies, pageable) == (64, 1, 0), result.stdout
