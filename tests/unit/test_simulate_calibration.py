"""``paratrain simulate --calibrate`` measures the cost model's numbers here and writes them;
``--calibration`` predicts with them, says where each number came from, and refuses a file
that is none or was measured for another model in one line."""

import json
import statistics
from pathlib import Path

import pytest

from paratrain.simulate.calibration import FORMAT, ROUND_COSTS, VERSION

PREDICT = ["--strategy", "allreduce", "--workers", "4", "--steps", "40", "--cpu-share", "0.5"]


def _calibration(path, **costs):
    """A calibration file as --calibrate writes one, with ``costs`` over plain ones."""
    document = {
        "format": FORMAT,
        "version": VERSION,
        "measured": {"host": "h1", "at": "2026-11-26T12:00:00+00:00", "torch": "2.13.0", "threads": 1, "cores": 2},
        "model": {
            "model": "mlp",
            "dataset": "digits",
            "batch_size": 32,
            "compression": "none",
            "gradient_bytes": 76840,
        },
        "costs": {
            "compute_ms": 2.0,
            "ring_step_us": 40.0,
            "message_cpu_us": 0.0,
            "ps_push_us": 80.0,
            "ps_update_us": 30.0,
            "codec_gbps": 0.0,
            **costs,
        },
    }
    path.write_text(json.dumps(document))
    return str(path)


def _with_rounds(path, rounds, **costs):
    """A calibration file whose measuring rounds gave ``rounds`` (each: costs over its medians)."""
    document = json.loads(Path(_calibration(path, **costs)).read_text())
    base = {name: document["costs"].get(name, 0.0) for name in ROUND_COSTS}
    document["rounds"] = [{**base, **r} for r in rounds]
    path.write_text(json.dumps(document))
    return str(path)


def _rate(result):
    """Examples/s of the table's one row."""
    assert result.returncode == 0, result.stderr[-2000:]
    row = next(line for line in result.stdout.splitlines() if "│ allreduce" in line)
    return float(row.split("│")[4])


def test_calibrate_measures_every_cost_here_and_predicts_with_them(cli, tmp_path):
    path = tmp_path / "cal.json"
    # one round of real runs; how rounds combine: the test below, with fake runs
    flags = ["--calibrate-rounds", "1", "--optimizer", "adamw", "--lr", "0.001"]
    result = cli("simulate", "--calibrate", str(path), *flags, *PREDICT)
    assert result.returncode == 0, result.stderr[-2000:]
    calibration = json.loads(path.read_text())
    assert calibration["format"] == FORMAT and calibration["model"]["model"] == "mlp"
    assert calibration["model"]["optimizer"] == "adamw"  # the runs' optimizer, which a prediction must share
    assert "--optimizer adamw --lr 0.001 " in calibration["measured"]["runs"]
    costs = calibration["costs"]
    for name in (
        "compute_ms",
        "ring_step_us",
        "ps_push_us",
        "ps_update_us",
        "epoch_end_ms",
        "shard_push_cpu_us",
    ):
        assert 0 < costs[name] < 1e6, (name, costs)
    assert 0 <= costs["ps_worker_cpu_us"] < 1e6  # below 0 in a noisy round counts as 0
    # a ring step's CPU is a fixed part and a hop's, split from rings of 2 and 3 workers; a noisy
    # round can put it all on one side (each part at least 0), but the 2-worker ring's CPU,
    # F + 2H, is never free
    assert costs["message_cpu_us"] >= 0 and costs["ring_fixed_cpu_us"] >= 0
    assert 0 < costs["ring_fixed_cpu_us"] + 2 * costs["message_cpu_us"] < 1e6
    # a real 2-process step costs more than a real 1-process one. A hop's CPU is at most half
    # of what a ring step adds to a process's CPU, and two processes on this machine's cores
    # average at most a core each, so a hop's CPU is at most the wall time a ring step adds;
    # the two are medians of separate runs, whose speed differs by a few percent (measured:
    # 175 us against 169 us once), hence the margin, far below a unit's factor of 1000
    assert costs["message_cpu_us"] < 1.25 * costs["ring_step_us"]
    assert costs["codec_gbps"] == 0.0  # no codec
    assert 0.1 < costs["host_link_gbps"] < 1e4  # loopback between two processes: Gb/s, not B/s or GB/s
    assert 0 < costs["host_step_us"] < 1e5  # microseconds (a bare 4 KiB all-reduce: about 0.1 ms alone here)
    assert 0 < costs["host_step_cpu_us"] < 1e5
    # the mlp's epoch end (evaluating 360 examples) is a fraction of its epoch of 44 steps, not seconds
    assert costs["epoch_end_ms"] < 44 * costs["compute_ms"]
    assert f"paratrain: calibration {path} (measured on " in result.stdout
    assert f"compute {costs['compute_ms']:.3g} ms a step" in result.stdout
    # the round's own costs are kept; a ring's fixed CPU and the host's link are probed in it
    (only,) = calibration["rounds"]
    assert set(only) == MEASURED
    assert "rounds, compute" not in result.stdout  # one round: no spread to tell
    steal = calibration["measured"]["steal"]
    assert steal is None or 0 <= steal < 1


#: What each round of a calibration keeps (files from before the ring's fixed CPU and the
#: host's link were probed lack them).
MEASURED = {*ROUND_COSTS, "ring_fixed_cpu_us", "host_link_gbps", "host_step_us", "host_step_cpu_us"}


def test_each_cost_is_the_median_of_its_rounds_and_each_round_is_kept(cli, tmp_path, monkeypatch):
    """Three rounds of fake measuring runs (no process started), whose steps slow down 1, 2 and
    6 ms and whose links differ (a mean would differ from the median in each): the file's
    costs are the medians over the rounds,
    the derived costs (a hop's CPU, a ring's fixed part) come from each round's own runs, and
    the line says how far the rounds' compute spread."""
    from paratrain.simulate import calibrate

    calls = []

    def fake_step(args, splits, flags, workers, processes, across=None):
        # (step s, first process's CPU s a step, epoch end s, shard CPU s a push) of one run
        run = len(calls) % 4  # single, ring of 2, ring of 3, ps-sync, in that order each round
        slow = (1, 2, 6)[len(calls) // 4]  # ms each step of the round's runs takes more
        calls.append(flags[1])
        seconds = [0.010, 0.012, 0.013, 0.011][run] + slow * 1e-3
        cpu = [0.009, 0.010, 0.0105, 0.0095][run] + slow * 1e-3
        return seconds, cpu, 0.004, 0.0002 if run == 3 else 0.0

    links = iter([(9.0, 120.0, 80.0), (20.0, 100.0, 70.0), (6.0, 190.0, 90.0)])
    monkeypatch.setattr(calibrate, "_step_s", fake_step)
    monkeypatch.setattr(calibrate, "host_link", lambda: next(links))
    path = tmp_path / "cal.json"
    result = cli("simulate", "--calibrate", str(path), "--calibrate-rounds", "3", *PREDICT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert calls == ["single", "allreduce", "allreduce", "ps-sync"] * 3
    calibration = json.loads(path.read_text())
    rounds = calibration["rounds"]
    assert len(rounds) == 3 and all(set(r) == MEASURED for r in rounds)
    assert [r["compute_ms"] for r in rounds] == pytest.approx([11.0, 12.0, 16.0])
    # a ring step: half of what 2 workers add to single's step; a hop's CPU: F + 2H for 2
    # workers (1 ms), F + 4H for 3 (1.5 ms), so H = 0.25 ms and F = 0.5 ms in every round
    assert all(r["ring_step_us"] == pytest.approx(1000.0) for r in rounds)
    assert all(r["message_cpu_us"] == pytest.approx(250.0) for r in rounds)
    assert all(r["ring_fixed_cpu_us"] == pytest.approx(500.0) for r in rounds)
    costs = calibration["costs"]
    for name in MEASURED:
        assert costs[name] == pytest.approx(statistics.median(r[name] for r in rounds)), name
    assert (costs["host_link_gbps"], costs["host_step_us"], costs["host_step_cpu_us"]) == (9.0, 120.0, 80.0)
    assert costs["compute_ms"] == pytest.approx(12.0)
    assert "3 rounds, compute 11-16 ms a step" in result.stdout


def test_the_measuring_runs_train_at_the_given_rate_and_a_failed_one_is_one_line(cli, tmp_path):
    """--lr reaches the measuring runs: at a rate the mlp diverges at, the first run stops on
    NaN, and --calibrate says so in one line, exit 2, no file written."""
    path = tmp_path / "cal.json"
    result = cli("simulate", "--calibrate", str(path), "--lr", "1e30", *PREDICT)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1, result.stderr
    assert "--calibrate: the measuring run paratrain train --strategy single failed: " in result.stderr
    assert "diverged with loss = nan" in result.stderr and not path.exists()


def _applied(path, *flags):
    import argparse

    from paratrain.simulate.calibration import apply
    from paratrain.simulate.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--calibration", str(path), *flags])
    return args, apply(args)


def test_the_engine_s_parameters_are_derived_for_the_prediction_at_hand(tmp_path):
    path = _calibration(tmp_path / "e.json", ps_push_us=1000.0, ps_update_us=100.0, message_cpu_us=200.0)
    args, lines = _applied(path)  # whole cores: a push's messages cost no quota'd CPU apart
    assert (args.compute_ms, args.ring_latency_us, args.ps_update_us) == (2.0, 40.0, 100.0)
    assert args.ps_message_us == 900.0 and args.message_cpu_us is None
    args, _ = _applied(path, "--cpu-share", "0.5")  # the push's and the reply's CPU counted apart
    assert args.ps_message_us == 1000.0 - 100.0 - 2 * 200.0 and args.message_cpu_us == 200.0
    args, lines = _applied(path, "--ps-update-us", "7", "--profile")
    assert args.ps_update_us == 7.0 and args.compute_ms is None  # --profile measures it now
    assert lines[0].endswith("; from the flags: --ps-update-us; compute measured now (--profile)")


def test_each_end_s_cpu_a_push_is_taken_under_a_quota(tmp_path):
    """Measured in the parameter server's own run: under a quota the shard's CPU a push is
    its message's plus --ps-message-us, the worker's its own flag; on whole cores the push's
    wall-clock cost as before, and a file without them (measured before) as before."""
    costs = dict(ps_push_us=1000.0, ps_update_us=100.0, message_cpu_us=200.0)
    path = _calibration(tmp_path / "p.json", shard_push_cpu_us=1500.0, ps_worker_cpu_us=700.0, **costs)
    args, lines = _applied(path, "--cpu-share", "0.5")
    assert (args.ps_message_us, args.message_cpu_us, args.ps_worker_cpu_us) == (1500.0 - 200.0, 200.0, 700.0)
    assert "1.5e+03 us of a shard's CPU a push, 700 us of a worker's CPU a push and its reply" in lines[0]
    args, _ = _applied(path)  # whole cores: what the push adds to a step, its CPU not counted apart
    assert (args.ps_message_us, args.ps_worker_cpu_us) == (900.0, None)
    args, _ = _applied(_calibration(tmp_path / "old.json", **costs), "--cpu-share", "0.5")
    assert (args.ps_message_us, args.ps_worker_cpu_us) == (1000.0 - 100.0 - 2 * 200.0, None)
    args, lines = _applied(path, "--cpu-share", "0.5", "--ps-worker-cpu-us", "5")
    assert args.ps_worker_cpu_us == 5.0 and lines[0].endswith("; from the flags: --ps-worker-cpu-us")


@pytest.mark.parametrize(
    ("ring_cpu", "ring3_cpu", "fixed", "hop"),
    [
        (1.4e-3, 2.4e-3, 0.4e-3, 0.5e-3),
        (1.4e-3, 1.2e-3, 1.4e-3, 0.0),  # noisy
        (1.0e-3, 3.0e-3, 0.0, 0.5e-3),
    ],
)
def test_a_round_splits_a_ring_s_cpu_into_a_fixed_part_and_one_per_hop_each_at_least_0(ring_cpu, ring3_cpu, fixed, hop):
    from paratrain.simulate.calibrate import _round_costs

    costs = _round_costs((1e-3, 1e-3, ring_cpu, ring3_cpu, 1e-3, 1e-3, 1e-3, 1e-4, (10.0, 300.0, 600.0)), 0.0)
    assert costs["ring_fixed_cpu_us"] == pytest.approx(fixed * 1e6)
    assert costs["message_cpu_us"] == pytest.approx(hop * 1e6)
    # the round's own probe of the host's link, as the probe gives it (Gb/s, us, us)
    assert (costs["host_link_gbps"], costs["host_step_us"], costs["host_step_cpu_us"]) == (10.0, 300.0, 600.0)


def test_a_ring_s_fixed_cpu_is_taken_under_a_quota_and_a_file_without_it_adds_none(tmp_path):
    path = _calibration(tmp_path / "f.json", message_cpu_us=200.0, ring_fixed_cpu_us=450.0)
    args, lines = _applied(path, "--cpu-share", "0.5")
    assert (args.message_cpu_us, args.ring_fixed_cpu_us) == (200.0, 450.0)
    assert "450 us of CPU a ring all-reduce's launch and finish" in lines[0]
    args, _ = _applied(path)  # whole cores: a ring step's time holds it
    assert args.ring_fixed_cpu_us is None
    args, _ = _applied(_calibration(tmp_path / "old.json", message_cpu_us=200.0), "--cpu-share", "0.5")
    assert args.ring_fixed_cpu_us == 0.0


def test_an_epoch_end_s_costs_come_from_the_file_and_a_file_without_them_adds_none(tmp_path):
    path = _calibration(tmp_path / "x.json", epoch_end_ms=1.5, host_step_us=60.0, host_step_cpu_us=90.0)
    args, lines = _applied(path)  # whole cores: a small all-reduce's step takes the host link's time
    assert (args.epoch_end_ms, args.collective_us) == (1.5, 60.0)
    assert "an epoch's end 1.5 ms" in lines[0] and "90 us of CPU a ring step on it" in lines[0]
    args, _ = _applied(path, "--cpu-share", "0.5")  # under a quota: the CPU it costs
    assert (args.epoch_end_ms, args.collective_us) == (1.5, 90.0)
    args, lines = _applied(path, "--epoch-end-ms", "3")
    assert args.epoch_end_ms == 3.0 and lines[0].endswith("; from the flags: --epoch-end-ms")
    # a file measured before epochs' ends were: its steps' costs include them
    old = _calibration(tmp_path / "old.json", host_step_us=60.0)
    args, _ = _applied(old, "--cpu-share", "0.5")
    assert (args.epoch_end_ms, args.collective_us) == (0.0, 0.0)


def test_an_epoch_end_makes_the_predicted_rate_lower_by_its_cost(cli, tmp_path):
    """digits' 1,437 training examples at batch 32: 44 batches, 11 steps an epoch on 4 workers;
    40 steps have 3 epoch ends between them."""
    path = _calibration(tmp_path / "r.json")
    flags = [
        "--strategy",
        "allreduce",
        "--workers",
        "4",
        "--steps",
        "40",
        "--calibration",
        str(path),
        "--latency-us",
        "0",
        "--bandwidth-gbps",
        "1e6",
    ]
    bare = 40 * 4 * 32 / _rate(cli("simulate", *flags))
    ended = 40 * 4 * 32 / _rate(cli("simulate", *flags, "--epoch-end-ms", "8", "--collective-us", "100"))
    assert ended - bare == pytest.approx(3 * (8e-3 / 4 + 2 * 6 * 100e-6), rel=0.01)


def test_the_host_link_is_tensor_s_link_inside_a_replica(tmp_path):
    path = _calibration(tmp_path / "t.json", host_link_gbps=12.5, host_step_us=60.0)
    args, lines = _applied(path, "--strategy", "tensor")
    assert (args.tp_bandwidth_gbps, args.tp_latency_us) == (12.5, 60.0)
    assert (
        "a host's link 12.5 Gb/s, 60 us a ring step on it (tensor's replicas, an epoch end's all-reduces)" in lines[0]
    )
    args, lines = _applied(path, "--strategy", "tensor", "--tp-bandwidth-gbps", "100")
    assert args.tp_bandwidth_gbps == 100.0 and lines[0].endswith("; from the flags: --tp-bandwidth-gbps")
    args, _ = _applied(path)  # another strategy: no tensor link to give
    assert args.tp_bandwidth_gbps is None and args.tp_latency_us is None
    args, _ = _applied(_calibration(tmp_path / "old.json"), "--strategy", "tensor")  # written before it was measured
    assert args.tp_bandwidth_gbps is None


def test_a_message_s_cpu_from_the_calibration_slows_a_quota_host_s_ring(cli, tmp_path):
    free = _rate(cli("simulate", "--calibration", _calibration(tmp_path / "a.json"), *PREDICT))
    costly = cli("simulate", "--calibration", _calibration(tmp_path / "b.json", message_cpu_us=500.0), *PREDICT)
    # 6 hops of 500 us of CPU at half a core: 6 ms more a 2 ms step
    assert _rate(costly) < 0.5 * free
    assert "500 us of CPU a message received" in costly.stdout
    assert "no calibration" not in costly.stdout


def test_a_flag_given_wins_over_the_calibration_and_the_line_says_so(cli, tmp_path):
    path = _calibration(tmp_path / "c.json", message_cpu_us=500.0)
    result = cli("simulate", "--calibration", path, *PREDICT, "--message-cpu-us", "0")
    assert _rate(result) == _rate(cli("simulate", "--calibration", _calibration(tmp_path / "d.json"), *PREDICT))
    assert "from the flags: --message-cpu-us" in result.stdout


def test_a_prediction_without_a_calibration_says_so(cli):
    result = cli("simulate", "--compute-ms", "2", *PREDICT)
    assert result.returncode == 0
    assert "paratrain: no calibration: a message's and a shard's CPU are taken as 0" in result.stdout


@pytest.mark.parametrize(
    ("write", "words"),
    [
        (None, "no such file (paratrain simulate --calibrate"),
        ("{not json", "not a calibration file"),
        ('{"format": "other"}', "not a paratrain calibration file"),
        ({"version": 99}, "version 99 of the calibration file; this paratrain reads version 1"),
        ({"costs": {"compute_ms": -1}}, "its costs must be numbers >= 0"),
        ({"costs": {"host_link_gbps": "fast"}}, "its host_link_gbps must be a number >= 0"),
        ({"rounds": [{"compute_ms": 1.0}]}, "its rounds must each hold numbers >= 0 for compute_ms, ring_step_us"),
        ({"rounds": {"compute_ms": 1.0}}, "its rounds must each hold numbers >= 0"),
        (
            {"rounds": [{**dict.fromkeys(ROUND_COSTS, 1.0), "host_step_cpu_us": -5.0}]},
            "its rounds' host_step_cpu_us must be numbers >= 0",
        ),
        (
            {"model": {"model": "cifar_cnn", "dataset": "digits", "batch_size": 32, "compression": "none"}},
            "measured model=cifar_cnn; this prediction has model=mlp: calibrate for it",
        ),
        (
            {
                "model": {
                    "model": "mlp",
                    "dataset": "digits",
                    "batch_size": 32,
                    "compression": "none",
                    "optimizer": "adam",
                }
            },
            "measured optimizer=adam; this prediction has optimizer=sgd: calibrate for it",
        ),
    ],
)
def test_a_file_that_is_no_calibration_for_this_prediction_is_one_line(cli, tmp_path, write, words):
    path = tmp_path / "bad.json"
    if isinstance(write, str):
        path.write_text(write)
    elif isinstance(write, dict):
        _calibration(path)
        document = json.loads(path.read_text())
        for key, value in write.items():
            document[key] = {**document[key], **value} if isinstance(value, dict) and key == "costs" else value
        path.write_text(json.dumps(document))
    result = cli("simulate", "--calibration", str(path), *PREDICT)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], result.stderr


def test_a_calibration_written_before_the_optimizer_was_recorded_measured_sgd(cli, tmp_path):
    """A calibration file that does not name its optimizer was measured with SGD (the only one
    measured then): refused for an Adam prediction."""
    old = _calibration(tmp_path / "old.json")  # no optimizer recorded: measured with SGD
    result = cli("simulate", "--calibration", old, "--optimizer", "adam", *PREDICT)
    assert result.returncode == 2
    assert "measured optimizer=sgd; this prediction has optimizer=adam" in result.stderr


def test_an_optimizer_for_a_prediction_that_neither_trains_nor_calibrates_is_refused(cli):
    result = cli("simulate", "--compute-ms", "2", "--optimizer", "adam", *PREDICT)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "paratrain: error: --optimizer and --weight-decay are for the training a prediction replays (--train, "
        "--target-*) and the update a calibration measures (--calibrate, --calibration); this prediction has neither"
    )


def test_across_hosts_is_refused_without_calibrate(cli):
    result = cli("simulate", "--across-hosts", *PREDICT)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "--across-hosts is how --calibrate FILE measures messages; give --calibrate FILE too" in result.stderr


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--calibrate-rounds", "3"], "--calibrate-rounds is how many rounds --calibrate FILE measures"),
        (
            ["--calibrate", "c.json", "--calibrate-rounds", "0"],
            "--calibrate-rounds must be a whole number of at least 1",
        ),
    ],
)
def test_calibrate_rounds_without_calibrate_or_below_one_is_one_line(cli, tmp_path, flags, words):
    result = cli("simulate", *flags, *PREDICT, cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert words in result.stderr and not (tmp_path / "c.json").exists()


def test_a_calibration_across_hosts_says_so_in_the_prediction_s_line(cli, tmp_path):
    path = tmp_path / "cal.json"
    _calibration(path)
    calibration = json.loads(path.read_text())
    calibration["measured"]["across_hosts"] = "cluster 7: hosts pt7h0-1 on 198.18.7.0/24"
    path.write_text(json.dumps(calibration))
    result = cli("simulate", "--calibration", str(path), *PREDICT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "; messages between 2 emulated hosts, cluster 7: hosts pt7h0-1 on 198.18.7.0/24): " in result.stdout


def test_a_calibration_s_rounds_give_each_predicted_rate_its_range(tmp_path):
    """A prediction's examples/s over each round's costs: the lowest is the prediction of a file
    whose costs are the slowest round's, the highest the medians' (two rounds are the medians)."""
    from paratrain.launch.cli import main

    slow = {"compute_ms": 3.0, "ring_step_us": 90.0}
    files = {
        "spread": _with_rounds(tmp_path / "rounds.json", [{}, {}, slow]),
        "slow": _calibration(tmp_path / "slow.json", **slow),
    }
    rows = {}
    for name, path in files.items():
        out = tmp_path / f"{name}.json"
        assert main(["simulate", "--calibration", path, *PREDICT, "--json-out", str(out)]) == 0
        rows[name] = json.loads(out.read_text())["results"]
    for row, slowest in zip(rows["spread"], rows["slow"]):
        assert row["examples_per_second_range"] == pytest.approx(
            [slowest["examples_per_second"], row["examples_per_second"]], rel=1e-9
        )
        assert "examples_per_second_range" not in slowest  # a file without rounds: no range


def test_a_calibration_of_one_round_gives_no_range(tmp_path):
    """One round (``--calibrate-rounds 1``) is the file's costs: no spread to predict over."""
    from paratrain.launch.cli import main

    out = tmp_path / "one.json"
    path = _with_rounds(tmp_path / "one_round.json", [{}])
    assert main(["simulate", "--calibration", path, *PREDICT, "--json-out", str(out)]) == 0
    assert all("examples_per_second_range" not in row for row in json.loads(out.read_text())["results"])
