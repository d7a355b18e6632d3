"""Virtual-cluster training, and the ``paratrain simulate`` command line."""

import copy
import json
import math

import pytest
import torch

from paratrain.data.datasets import load_digits
from paratrain.launch.cli import main
from paratrain.models import build_model
from paratrain.simulate.cluster import Cluster, parse_straggler
from paratrain.simulate.simulator import simulate
from paratrain.simulate.virtual import replay


@pytest.fixture(scope="module")
def digits():
    return load_digits()


def fresh_model(digits, seed=0):
    torch.manual_seed(seed)
    return build_model("mlp", digits.spec)


def synchronous_reference(model, train, workers, batch, lr, momentum, rounds, seed, optimizer=None):
    """One process, global batch workers x batch, torch.optim.SGD (or ``optimizer(params)``):
    what ps-sync must equal."""
    inputs, targets = train.tensors
    opt = optimizer(model.parameters()) if optimizer else torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    global_batch = workers * batch
    per_epoch = len(targets) // global_batch
    done, epoch = 0, 0
    while done < rounds:
        order = torch.randperm(len(targets), generator=torch.Generator().manual_seed(seed + epoch))
        for r in range(min(per_epoch, rounds - done)):
            idx = order[r * global_batch : (r + 1) * global_batch]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(inputs[idx]), targets[idx]).backward()
            opt.step()
        done += per_epoch
        epoch += 1
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach()


@pytest.mark.parametrize("strategy", ["ps-sync", "allreduce"])
def test_virtual_sync_equals_real_synchronous_training(digits, strategy):
    workers = 4  # 50 rounds cross an epoch boundary (22 per epoch)
    batch = 16
    rounds = 50
    cluster = Cluster(workers=workers, compute_s=0.01, model_bytes=1e5, bandwidth=math.inf, latency=0.0)
    outcome = simulate(strategy, cluster, rounds, record=True)
    model = fresh_model(digits)
    reference = synchronous_reference(copy.deepcopy(model), digits.train, workers, batch, 0.05, 0.9, rounds, seed=0)
    result = replay(outcome, model, digits.train, digits.test, batch=batch, lr=0.05, momentum=0.9, seed=0)
    torch.testing.assert_close(result["params"], reference, rtol=1e-5, atol=1e-6)
    assert result["updates"] == rounds


@pytest.mark.parametrize(
    ("name", "make"),
    [
        ("adam", lambda params: torch.optim.Adam(params, lr=0.003)),
        ("adamw", lambda params: torch.optim.AdamW(params, lr=0.003, weight_decay=0.1)),
    ],
)
def test_virtual_training_steps_the_run_s_optimizer(digits, name, make):
    """ps-sync replayed with Adam (AdamW and its decay) equals one process stepping
    torch.optim's on the global batch; local SGD on one worker equals it too, so each
    replica's optimizer state lives on through the synchronizations (reset there, the
    moments would start again every 4 steps)."""
    workers = 2  # past an epoch (44 rounds)
    batch = 16
    rounds = 60
    cluster = Cluster(workers=workers, compute_s=0.01, model_bytes=1e5, bandwidth=math.inf, latency=0.0)
    model = fresh_model(digits)
    reference = synchronous_reference(copy.deepcopy(model), digits.train, workers, batch, 0, 0, rounds, 0, make)
    decay = 0.1 if name == "adamw" else 0.0
    replayed = replay(
        simulate("ps-sync", cluster, rounds, record=True),
        model,
        digits.train,
        digits.test,
        batch=batch,
        lr=0.003,
        momentum=0.9,
        optimizer=name,
        weight_decay=decay,
        seed=0,
    )
    torch.testing.assert_close(replayed["params"], reference, rtol=1e-5, atol=1e-6)
    one = simulate("local-sgd", Cluster(workers=1, compute_s=0.01, model_bytes=1e5), 24, record=True, period=4)
    model = fresh_model(digits)
    reference = synchronous_reference(copy.deepcopy(model), digits.train, 1, batch, 0, 0, 24, 0, make)
    replayed = replay(
        one,
        model,
        digits.train,
        digits.test,
        batch=batch,
        lr=0.003,
        momentum=0.9,
        optimizer=name,
        weight_decay=decay,
        seed=0,
    )
    torch.testing.assert_close(replayed["params"], reference, rtol=1e-5, atol=1e-6)


def test_virtual_async_uses_stale_versions_and_is_deterministic(digits):
    cluster = Cluster(workers=4, compute_s=0.01, model_bytes=1e5, straggler=parse_straggler("lognormal:0.5"))
    runs = []
    for _ in range(2):
        outcome = simulate("ps-async", cluster, 20, seed=7, record=True)
        runs.append(
            replay(outcome, fresh_model(digits), digits.train, digits.test, batch=16, lr=0.05, momentum=0.0, seed=7)
        )
    assert torch.equal(runs[0]["params"], runs[1]["params"])
    assert runs[0]["staleness"]["max"] >= 3
    assert [u.versions[0] for u in outcome.trace] != list(range(len(outcome.trace)))  # stale, not sequential
    # Async on one worker is plain SGD with batch b: the reference with workers=1.
    one = simulate("ps-async", Cluster(workers=1, compute_s=0.01, model_bytes=1e5), 30, record=True)
    model = fresh_model(digits)
    reference = synchronous_reference(copy.deepcopy(model), digits.train, 1, 16, 0.05, 0.0, 30, seed=0)
    result = replay(one, model, digits.train, digits.test, batch=16, lr=0.05, momentum=0.0, seed=0)
    torch.testing.assert_close(result["params"], reference, rtol=1e-5, atol=1e-6)


def test_virtual_local_sgd_on_one_worker_is_plain_sgd_and_averages_replicas(digits):
    one = simulate("local-sgd", Cluster(workers=1, compute_s=0.01, model_bytes=1e5), 24, record=True, period=4)
    model = fresh_model(digits)
    reference = synchronous_reference(copy.deepcopy(model), digits.train, 1, 16, 0.05, 0.9, 24, seed=0)
    result = replay(one, model, digits.train, digits.test, batch=16, lr=0.05, momentum=0.9, seed=0)
    torch.testing.assert_close(result["params"], reference, rtol=1e-5, atol=1e-6)
    four = simulate("local-sgd", Cluster(workers=4, compute_s=0.01, model_bytes=1e5), 40, record=True, period=8)
    result = replay(four, fresh_model(digits), digits.train, digits.test, batch=16, lr=0.05, momentum=0.9, seed=0)
    assert result["updates"] == 5 and result["test_accuracy"] > 0.7


@pytest.mark.parametrize(
    ("strategy", "options", "batches_an_update"),
    [("allreduce", {}, 4), ("ps-async", {}, 1), ("local-sgd", {"period": 8}, 32)],
)
def test_a_replay_evaluates_at_each_epoch_s_end_as_a_run_does(digits, strategy, options, batches_an_update):
    """evals=None: one evaluation after the update that ends each epoch of the data (a local
    SGD period that ends one mid-way: after the period), at that update's simulated time."""
    workers, batch = 4, 16
    group = 1 if strategy == "ps-async" else workers  # a synchronous epoch is whole rounds
    per_epoch = len(digits.train.tensors[1]) // (batch * group) * group  # batches
    outcome = simulate(
        strategy,
        Cluster(workers=workers, compute_s=0.01, model_bytes=1e5),
        3 * per_epoch // workers,
        record=True,
        **options,
    )
    result = replay(
        outcome, fresh_model(digits), digits.train, digits.test, batch=batch, lr=0.05, momentum=0.9, seed=0, evals=None
    )
    ends = [
        i
        for i in range(1, len(outcome.trace) + 1)
        if i * batches_an_update // per_epoch > (i - 1) * batches_an_update // per_epoch
    ]
    assert len(ends) >= 2
    assert [h["updates"] for h in result["history"]] == ends
    assert [h["sim_seconds"] for h in result["history"]] == [outcome.trace[i - 1].time for i in ends]


def test_profile_measures_the_compute_time(capsys):
    assert main(["simulate", "--profile", "--workers", "1,2", "--steps", "10"]) == 0
    out = capsys.readouterr().out
    ms = float(out.split("simulated: ")[1].split(" ms")[0])
    assert 0 < ms < 1000


def test_simulate_train_reports_accuracy_against_simulated_time(tmp_path, capsys):
    out = tmp_path / "train.json"
    rc = main(
        [
            "simulate",
            "--train",
            "--strategy",
            "ps-sync",
            "--workers",
            "2",
            "--epochs",
            "2",
            "--compute-ms",
            "5",
            "--json-out",
            str(out),
        ]
    )
    assert rc == 0
    result = json.loads(out.read_text())
    times = [p["sim_seconds"] for p in result["history"]]
    assert times == sorted(times) and times[-1] > 0
    assert result["test_accuracy"] > 0.8
    assert "done: test_accuracy" in capsys.readouterr().out


def test_simulate_sweep_writes_json_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "sim.json", tmp_path / "sim.png"
    rc = main(
        [
            "simulate",
            "--compute-ms",
            "20",
            "--model-mb",
            "50",
            "--workers",
            "1,4,16",
            "--strategy",
            "allreduce,ps-backup",
            "--backup-workers",
            "1",
            "--straggler",
            "lognormal:0.3",
            "--json-out",
            str(out),
            "--plot",
            str(png),
        ]
    )
    assert rc == 0
    rows = json.loads(out.read_text())["results"]
    assert [(r["strategy"], r["workers"]) for r in rows] == [
        ("allreduce", 1),
        ("allreduce", 4),
        ("allreduce", 16),
        ("ps-backup", 1),
        ("ps-backup", 4),
        ("ps-backup", 16),
    ]
    assert rows[0]["scaling_efficiency"] == 1.0
    assert {"step_seconds", "examples_per_second", "comm_share", "staleness", "dropped_gradients"} <= set(rows[0])
    assert png.stat().st_size > 1000
    assert "examples/s" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, words",
    [
        (["--workers", "0"], ["--workers", "1,2,4"]),
        (["--workers", "a,b"], ["--workers", "'a,b'"]),
        (["--strategy", "magic"], ["--strategy", "ps-async", "'magic'"]),
        (["--straggler", "lognormal:x"], ["--straggler", "lognormal:SIGMA"]),
        (["--straggler", "fixed:0:0.5"], ["FACTOR >= 1"]),
        (["--compression", "zip"], ["--compression", "powersgd"]),
        (["--bandwidth-gbps", "0"], ["--bandwidth-gbps must be > 0"]),
        (["--strategy", "ps-backup"], ["--backup-workers K >= 1"]),
        (["--steps", "0"], ["--steps must be >= 1"]),
        (["--plot", "out.txt"], ["--plot", ".png"]),
        (["--json-out", "/nonexistent/dir/x.json"], ["--json-out", "does not exist"]),
        (["--train", "--workers", "1,2"], ["--train takes one"]),
        (["--model", "resnet"], ["unknown model 'resnet'"]),
        (["--steps", "two"], ["--steps", "invalid int value"]),
        (["--cpu-share", "1.5"], ["--cpu-share must be in (0, 1]"]),
        (["--cpu-share", "0.5", "--host-cores", "2"], ["--cpu-share", "--host-cores", "exclude"]),
        (["--message-cpu-us", "300"], ["--message-cpu-us", "need --cpu-share"]),
        (["--cpu-share", "0.5", "--cpu-period-ms", "0"], ["--cpu-period-ms must be > 0"]),
        (["--cpu-share", "0.5", "--strategy", "fsdp"], ["--cpu-share", "fsdp", "not modelled"]),
        (["--epoch-end-ms", "-1"], ["--epoch-end-ms must be >= 0"]),
        (["--collective-us", "-5"], ["--collective-us must be >= 0"]),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, words, capsys):
    try:
        rc = main(["simulate", "--compute-ms", "10", *args])
    except SystemExit as stop:  # argparse's own errors
        rc = stop.code
    err = capsys.readouterr().err
    assert rc == 2
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    for word in words:
        assert word in err


def test_example_backup_workers_runs_as_written():
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    result = subprocess.run(
        [sys.executable, "examples/simulate_backup_workers.py", "--epochs", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=repo,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rates = [float(x) for x in re.findall(r"(\d+) examples/s", result.stdout)]
    assert len(rates) == 2 and rates[1] > rates[0]  # backup workers beat the stragglers
