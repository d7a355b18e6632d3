"""The user's own code under every strategy: a Dataset paratrain has never seen, a
regression model with dict inputs, the README's script verbatim under torchrun,
``paratrain.launch``, and ``--model``/``--dataset`` references on the command line."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import paratrain
from paratrain.data.datasets import load_digits
from paratrain.models import build_model
from paratrain.testing import flat_parameters, relative_difference
from tests.conftest import torchrun_on_loopback

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
PROJECT = REPO / "examples" / "user_project"


class Digits(Dataset):
    """The digits as a plain map-style Dataset: examples one at a time, no tensors to index."""

    def __init__(self, split: str, n: int | None = None):
        data = getattr(load_digits(), split)
        self.x, self.y = (t[:n] for t in data.tensors)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, index):
        return self.x[index], int(self.y[index])


def _train(batch_size, steps, as_loader=False, epochs=1):
    """Plain SGD on Digits for exactly ``steps`` global steps; the chief's parameters and scores."""
    strategy = paratrain.current_strategy()
    torch.manual_seed(0)
    model = build_model("mlp", load_digits().spec)
    trainer = paratrain.Trainer(model, "cross_entropy", torch.optim.SGD(model.parameters(), lr=0.1))
    replicas = strategy.num_replicas - getattr(strategy, "backup_workers", 0)
    train = Digits("train", steps * batch_size * replicas)
    data = DataLoader(train, batch_size=batch_size, num_workers=1) if as_loader else train
    trainer.fit(data, epochs=epochs, batch_size=batch_size, verbose=0)
    scores = trainer.evaluate(Digits("test"))
    if strategy.role.value == "ps":
        return None
    return flat_parameters(trainer.module), scores, trainer.global_step, strategy.is_chief


def _reference(global_batch, steps):
    return paratrain.launch(_train, global_batch, steps, strategy=paratrain.SingleDeviceStrategy(device="cpu"))[0]


@pytest.mark.parametrize(
    "name, options, as_loader",
    [
        ("allreduce", {"workers": 2}, False),
        ("allreduce", {"workers": 2}, True),  # a DataLoader with its own worker process
        ("ps-sync", {"workers": 2}, False),
        ("pipeline", {"stages": 2}, False),
        ("fsdp", {"workers": 2}, False),
        ("local-sgd", {"workers": 2, "sync_every": 1}, False),
    ],
)
def test_a_plain_dataset_gives_the_single_process_result(name, options, as_loader):
    """Synchronous modes on a non-tensor Dataset equal one process with the global batch
    (float32 sums in another order: 1e-5 relative)."""
    b, k = 16, 8
    strategy = paratrain.make_strategy(name, device="cpu", **options)
    replicas = strategy.planned_topology().num_replicas
    reference = _reference(b * replicas, k)[0]
    results = [r for r in paratrain.launch(_train, b, k, as_loader, strategy=strategy) if r is not None]
    # a pipeline's stages hold consecutive layers: their parameters, in rank order, are the model's
    params = torch.cat([r[0] for r in results]) if name == "pipeline" else next(r[0] for r in results if r[3])
    assert all(r[2] == k for r in results)
    assert relative_difference(params, reference) < 1e-5
    torch.manual_seed(0)
    assert relative_difference(flat_parameters(build_model("mlp", load_digits().spec)), reference) > 1e-2


@pytest.mark.parametrize("name, options", [("ps-async", {}), ("ps-backup", {"backup_workers": 1})])
def test_a_plain_dataset_trains_under_the_asynchronous_modes(name, options):
    strategy = paratrain.make_strategy(name, device="cpu", workers=2, **options)
    results = paratrain.launch(_train, 16, 40, False, 3, strategy=strategy)
    _, scores, steps, _ = next(r for r in results if r is not None and r[3])
    single = paratrain.launch(_train, 32, 40, False, 3, strategy=paratrain.SingleDeviceStrategy(device="cpu"))[0]
    assert steps > 0
    # as many examples as the single process with the global batch saw (which reaches ~0.83 on
    # 10 classes); stale or dropped gradients cost a few points at most
    assert scores["accuracy"] > single[1]["accuracy"] - 0.05


@pytest.mark.parametrize("strategy, workers", [("allreduce", "2"), ("ps-sync", "2")])
def test_regression_with_dict_inputs_from_the_command_line(cli, tmp_path, strategy, workers):
    """The example project: --model/--dataset/--metrics references, mse loss, a map-style
    Dataset of dict examples. Predicting the mean price gives an MAE near 1.8."""
    out = tmp_path / "m.json"
    result = cli(
        "train",
        "--model",
        "tabular:model",
        "--dataset",
        "tabular:data",
        "--loss",
        "mse",
        "--metrics",
        "mae,tabular:within_10_percent",
        "--strategy",
        strategy,
        "--workers",
        workers,
        "--epochs",
        "4",
        "--lr",
        "0.02",
        "--no-progress",
        "--metrics-out",
        str(out),
        cwd=PROJECT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads(out.read_text())
    assert metrics["test_mae"] < 0.3
    assert metrics["test_within_10_percent"] > 0.6
    assert metrics["test_accuracy"] is None  # not asked for
    assert metrics["config"]["model"] == "tabular:model"


def _readme_python(index):
    text = (REPO / "README.md").read_text()
    return re.findall(r"```python\n(.*?)```", text, re.DOTALL)[index]


@pytest.mark.parametrize(
    "flags, processes",
    [
        (["--strategy", "allreduce"], 2),
        (["--strategy", "ps-async"], 3),
        # each process group's teardown at exit is in test_teardown_ends_the_groups_... too
        pytest.param(["--strategy", "single"], 1, marks=pytest.mark.matrix),
        pytest.param(["--strategy", "ps-sync"], 3, marks=pytest.mark.matrix),
        pytest.param(["--strategy", "ps-backup", "--backup-workers", "1"], 3, marks=pytest.mark.matrix),
        pytest.param(["--strategy", "pipeline", "--stages", "2"], 2, marks=pytest.mark.matrix),
        pytest.param(["--strategy", "local-sgd", "--sync-every", "4"], 2, marks=pytest.mark.matrix),
        pytest.param(["--strategy", "fsdp"], 2, marks=pytest.mark.matrix),
    ],
)
def test_the_readme_script_runs_under_torchrun_and_exits(tmp_path, flags, processes):
    """Verbatim, without a teardown call: every process must exit 0 (no SIGABRT at exit, no
    shard waiting out the 60 s timeout) well within the limit here."""
    script = tmp_path / "script.py"
    script.write_text(_readme_python(0))
    command = torchrun_on_loopback(processes, str(script), *flags)
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = re.findall(r"\{'loss': [^}]*\}", result.stdout)  # one per process, lines may interleave
    assert len(reports) == processes
    accuracy = max(float(a) for a in re.findall(r"'accuracy': ([0-9.]+)", result.stdout))
    assert accuracy > 0.85


TEARDOWN = """
import sys, torch, paratrain
from paratrain.session.teardown import gloo_threads
strategy = paratrain.strategy_from_flags(sys.argv[1:])
with strategy.scope():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # the first optimizer imports torch._dynamo
    model, optimizer = strategy.prepare(model, optimizer)
model(torch.randn(3, 4)).sum().backward()  # the gradients' collectives run (DDP, FSDP)
strategy.teardown()  # the script keeps its model, which held the groups
print("gloo threads", len(gloo_threads()))
"""


@pytest.mark.parametrize("name", ["allreduce", "local-sgd", "diloco", "fsdp"])
def test_teardown_ends_the_groups_and_their_gloo_threads_while_the_model_lives(name):
    """A group alive at interpreter exit (held by a model the script keeps: DDP's reducer,
    FSDP's device mesh) let a Gloo thread reach for the GIL during finalization, aborting a
    finished script ("terminate called without an active exception")."""
    result = subprocess.run(
        [sys.executable, "-c", TEARDOWN, "--strategy", name, "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "gloo threads 0"


HAND_MADE_DDP = """
import torch, paratrain
from torch.nn.parallel import DistributedDataParallel
from paratrain.session.teardown import gloo_threads
strategy = paratrain.make_strategy("allreduce", device="cpu")
strategy.setup()  # forms the default group; the script wraps a second model on it by hand
model = DistributedDataParallel(torch.nn.Linear(4, 2))
model(torch.randn(3, 4)).sum().backward()
strategy.teardown()
print("gloo threads", len(gloo_threads()))
"""


def test_teardown_takes_the_groups_out_of_a_ddp_the_script_made_itself():
    """A DDP wrapped by hand on the strategy's group kept it in its reducer past teardown; when
    the script later dropped that model (the GIL held), the group's destructor could wait for a
    Gloo thread that waited for the GIL: the allreduce benchmark, which times such a DDP beside
    the strategy, hung at its worker's return."""
    result = subprocess.run([sys.executable, "-c", HAND_MADE_DDP], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "gloo threads 0"


DESTROY_RIGHT_AFTER_A_COLLECTIVE = """
import torch, paratrain

def step():
    strategy = paratrain.make_strategy("allreduce", device="cpu")
    with strategy.scope():
        model = torch.nn.Linear(64, 64)
        model, _ = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.randn(8, 64)).sum().backward()  # ends with the gradients' all-reduce
    strategy.teardown()
    # returning drops the model, whose reducer held the group

for _ in range(40):
    step()
print("done")
"""


def test_a_group_destroyed_right_after_a_collective_does_not_hang():
    """A group whose last reference was a DDP reducer's, dropped from Python (the GIL held),
    joined a Gloo thread that needed the GIL to drop the last all-reduce: the process hung
    within ~20 rounds (40 here). Teardown takes the groups out of the wrappers first."""
    result = subprocess.run(
        [sys.executable, "-c", DESTROY_RIGHT_AFTER_A_COLLECTIVE], capture_output=True, text=True, timeout=90
    )
    assert result.returncode == 0 and result.stdout.strip() == "done", result.stderr[-3000:]


CONV_NET = """
from torch import nn


def model(spec=None):
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(16 * 4 * 4, 10))
"""


def test_a_user_conv_net_pools_before_its_relu_and_trains_exactly_as_written(cli, tmp_path):
    """--pool-before-relu (the default) on a user's nn.Sequential under allreduce: every
    epoch's losses equal those of --no-pool-before-relu exactly (the rewrite is exact)."""
    (tmp_path / "convnet.py").write_text(CONV_NET)
    runs = {}
    for flag in ("--pool-before-relu", "--no-pool-before-relu"):
        out = tmp_path / f"{flag}.json"
        # On the CPU: a GPU's convolution kernels need not give the same bits twice
        result = cli(
            "train",
            "--model",
            "convnet:model",
            "--strategy",
            "allreduce",
            "--workers",
            "2",
            "--epochs",
            "2",
            "--no-progress",
            flag,
            "--device",
            "cpu",
            "--metrics-out",
            str(out),
            cwd=tmp_path,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        runs[flag] = json.loads(out.read_text())
    on, off = runs["--pool-before-relu"], runs["--no-pool-before-relu"]
    assert on["config"]["pool_before_relu"] is True and off["config"]["pool_before_relu"] is False
    assert [e["train_loss"] for e in on["history"]] == [e["train_loss"] for e in off["history"]]
    assert on["test_loss"] == off["test_loss"] and on["test_accuracy"] > 0.8
