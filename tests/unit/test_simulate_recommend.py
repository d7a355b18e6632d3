"""``paratrain simulate --recommend``: the strategies and their key options ranked on hosts
described as ``paratrain cluster run`` takes them, each prediction the one the explicit
flags for those hosts give."""

import json

import pytest

from paratrain.launch.cli import main
from tests.unit.test_simulate_calibration import _calibration, _with_rounds

HOSTS = ["--hosts", "4", "--cpu", "0.3", "--link", "1gbit", "--host", "3:cpu=0.15"]


def _run(tmp_path, name, *flags):
    out = tmp_path / f"{name}.json"
    assert main(["simulate", *flags, "--steps", "200", "--json-out", str(out)]) == 0
    return json.loads(out.read_text())


def test_each_candidate_is_the_prediction_of_the_explicit_flags_for_those_hosts(tmp_path):
    calibration = _calibration(tmp_path / "cal.json", message_cpu_us=700.0, ps_push_us=1200.0)
    result = _run(tmp_path, "recommend", "--recommend", *HOSTS, "--calibration", calibration)
    rows = {r["candidate"]: r for r in result["candidates"]}
    assert sorted(rows) == sorted(
        [
            "allreduce",
            "ps-sync",
            "ps-async",
            "ps-async --staleness-bound 2",
            "ps-backup --backup-workers 1",
            "local-sgd --sync-every 4",
            "local-sgd --sync-every 8",
            "local-sgd --sync-every 16",
        ]
    )  # (no fsdp: the quota engine does not model it)
    hosts = ["--cpu-share", "0.3", "--cpu-period-ms", "10", "--bandwidth-gbps", "1", "--calibration", calibration]
    # host 3 is allreduce's worker 3, and under a parameter server (host 0 the shard) worker 2
    for candidate, flags in [
        ("allreduce", ["--strategy", "allreduce", "--workers", "4", "--straggler", "fixed:3:2"]),
        ("ps-sync", ["--strategy", "ps-sync", "--workers", "3", "--straggler", "fixed:2:2"]),
        (
            "ps-backup --backup-workers 1",
            ["--strategy", "ps-backup", "--workers", "2", "--backup-workers", "1", "--straggler", "fixed:2:2"],
        ),
    ]:
        (alone,) = _run(tmp_path, candidate.split()[0], *flags, *hosts)["results"]
        assert rows[candidate]["examples_per_second"] == pytest.approx(alone["examples_per_second"], rel=1e-9)
    same = sorted((r for r in result["candidates"] if r["same_updates"]), key=lambda r: -r["examples_per_second"])
    assert result["recommendation"].startswith(
        f"on this cluster (4 hosts at 0.3 of a core, 1gbit links, host 3 at 0.15): by examples/s, {same[0]['candidate']} "
    )


def test_whole_cores_add_fsdp_and_a_target_ranks_by_time_to_it(tmp_path):
    result = _run(
        tmp_path,
        "target",
        "--recommend",
        "--hosts",
        "3",
        "--compute-ms",
        "1",
        "--target-accuracy",
        "0.85",
        "--epochs",
        "3",
        "--seeds",
        "1",
    )
    names = [r["candidate"] for r in result["candidates"]]
    assert "fsdp" in names and "ps-backup --backup-workers 1" in names
    reached = sorted(
        (r for r in result["candidates"] if r["median_seconds"] is not None), key=lambda r: r["median_seconds"]
    )
    assert reached and f"to test accuracy 0.85 first: {reached[0]['candidate']} in " in result["recommendation"]


def test_a_host_calibrated_on_its_own_is_the_slow_host_its_compute_says(tmp_path, capsys):
    """A cluster of two kinds of machine: host 2's calibration measured 2.5 times the others'
    compute a step, so it is the slow host at that factor, composed with a CPU share below
    the others'. Calibrations within 10% of each other are one machine measured twice."""
    base = _calibration(tmp_path / "cal.json", message_cpu_us=700.0, ps_push_us=1200.0)
    slow = _calibration(tmp_path / "old.json", compute_ms=5.0)
    again = _calibration(tmp_path / "same.json", compute_ms=2.1)
    hosts = ["--hosts", "3", "--link", "1gbit", "--calibration", base]
    result = _run(
        tmp_path, "own", "--recommend", *hosts, "--host", f"2:calibration={slow}", "--host", f"1:calibration={again}"
    )
    assert f"3 hosts at 1 of a core, 1gbit links, host 2 2.5x the compute a step ({slow})" in result["recommendation"]
    rows = {r["candidate"]: r for r in result["candidates"]}
    explicit = ["--bandwidth-gbps", "1", "--calibration", base]
    for candidate, flags in [
        ("allreduce", ["--strategy", "allreduce", "--workers", "3", "--straggler", "fixed:2:2.5"]),
        ("ps-sync", ["--strategy", "ps-sync", "--workers", "2", "--straggler", "fixed:1:2.5"]),
    ]:
        (alone,) = _run(tmp_path, candidate, *flags, *explicit)["results"]
        assert rows[candidate]["examples_per_second"] == pytest.approx(alone["examples_per_second"], rel=1e-9)
    shared = ["--recommend", "--hosts", "3", "--cpu", "0.4", "--link", "1gbit", "--calibration", base]
    result = _run(tmp_path, "both", *shared, "--host", f"2:cpu=0.2,calibration={slow}")
    assert "host 2 at 0.2 and 2.5x the compute a step" in result["recommendation"]
    (alone,) = _run(
        tmp_path,
        "both-alone",
        "--strategy",
        "allreduce",
        "--workers",
        "3",
        "--straggler",
        "fixed:2:5",
        "--cpu-share",
        "0.4",
        "--cpu-period-ms",
        "10",
        *explicit,
    )["results"]
    rows = {r["candidate"]: r for r in result["candidates"]}
    assert rows["allreduce"]["examples_per_second"] == pytest.approx(alone["examples_per_second"], rel=1e-9)


def test_a_host_calibration_that_does_not_fit_is_one_line_and_exit_2(tmp_path, capsys):
    base = _calibration(tmp_path / "cal.json")
    fast = _calibration(tmp_path / "fast.json", compute_ms=1.0)
    cases = [
        (["--host", f"1:calibration={base}"], "give theirs as --calibration FILE"),
        (["--calibration", base, "--host", f"1:calibration={fast}"], "slower than --calibration's"),
        (["--calibration", base, "--host", f"7:calibration={base}"], "expected I < --hosts 3"),
        (
            ["--calibration", base, "--host", f"1:calibration={tmp_path / 'none.json'}"],
            f"--host 1:calibration={tmp_path / 'none.json'}: no such file",
        ),
        (["--calibration", base, "--model", "cnn", "--host", f"1:calibration={base}"], "measured model=mlp"),
    ]
    for flags, words in cases:
        assert main(["simulate", "--recommend", "--hosts", "3", *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0], (flags, err)


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--recommend"], "give --hosts N"),
        (["--recommend", "--hosts", "3", "--strategy", "ps-sync"], "not --strategy or --workers"),
        (["--hosts", "3"], "describe the cluster for --recommend"),
        (["--recommend", "--hosts", "1"], "2 or more --hosts"),
        (
            ["--recommend", "--hosts", "4", "--host", "1:cpu=0.1", "--host", "2:cpu=0.1", "--cpu", "0.5"],
            "one host slower",
        ),
        (["--recommend", "--hosts", "3", "--link", "fast"], "--link must be a rate in tc's units"),
        (["--recommend", "--hosts", "3", "--cpu-share", "0.5"], "not --cpu-share or --straggler"),
    ],
)
def test_a_cluster_that_cannot_be_described_is_one_line_and_exit_2(capsys, flags, words):
    assert main(["simulate", "--compute-ms", "1", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err


def test_a_calibration_s_rounds_give_each_candidate_the_range_of_their_predictions(tmp_path):
    """Each candidate's range is the lowest and highest of the predictions made with each round's
    costs: here the slowest round's is the prediction of a file whose costs are that round's."""
    costs = {"message_cpu_us": 700.0, "ps_push_us": 1200.0, "shard_push_cpu_us": 900.0, "epoch_end_ms": 3.0}
    slow = {"compute_ms": 3.0, "shard_push_cpu_us": 1500.0}
    spread = _with_rounds(tmp_path / "rounds.json", [{}, {}, slow], **costs)
    slowest = _calibration(tmp_path / "slow.json", **{**costs, **slow})
    target = ["--target-accuracy", "0.85", "--epochs", "2", "--seeds", "1"]
    result = _run(tmp_path, "spread", "--recommend", *HOSTS, "--calibration", spread, *target)
    low = {
        r["candidate"]: r for r in _run(tmp_path, "slow", "--recommend", *HOSTS, "--calibration", slowest)["candidates"]
    }
    for row in result["candidates"]:
        lowest, highest = row["examples_per_second_range"]
        assert highest == pytest.approx(row["examples_per_second"], rel=1e-9)  # two rounds are the medians
        assert lowest == pytest.approx(low[row["candidate"]]["examples_per_second"], rel=1e-9)
        assert lowest < highest  # a slower step slows every candidate
        if row["median_seconds"] is not None:  # the same steps at each round's pace
            assert row["seconds_range"] == pytest.approx(
                [row["median_seconds"], row["median_seconds"] * highest / lowest], rel=1e-9
            )
    first = max((r for r in result["candidates"] if r["same_updates"]), key=lambda r: r["examples_per_second"])
    lowest, highest = first["examples_per_second_range"]
    assert (
        f"by examples/s, {first['candidate']} {highest:,.0f} ({lowest:,.0f}-{highest:,.0f})" in result["recommendation"]
    )


def test_the_line_names_the_candidates_tied_with_the_first_within_the_rounds():
    from paratrain.simulate.recommend import _ranked

    rows = [
        {"candidate": "a", "examples_per_second": 100.0, "examples_per_second_range": [90.0, 110.0]},
        {"candidate": "b", "examples_per_second": 95.0, "examples_per_second_range": [91.0, 96.0]},
        {"candidate": "c", "examples_per_second": 80.0, "examples_per_second_range": [70.0, 89.0]},
        {"candidate": "d", "examples_per_second": 79.0, "examples_per_second_range": [60.0, 90.0]},
    ]
    words = _ranked(rows, "examples_per_second", lambda v: f"{v:,.0f}", larger=True)
    assert words == "a 100 (90-110), b 95 (91-96), c 80 (70-89) (a tied with b, d within the calibration's rounds)"
    alone = [{**r, "examples_per_second_range": None} for r in rows]
    assert "tied" not in _ranked(alone, "examples_per_second", str, larger=True)


@pytest.mark.parametrize(
    ("theirs", "larger", "tied"),
    [
        ([85.0, 90.0], True, True),
        ([80.0, 89.9], True, False),  # a rate: their highest against the first's lowest
        ([1.1, 1.3], False, True),
        ([1.21, 1.5], False, False),
    ],  # a time: their lowest against the first's highest
)
def test_a_candidate_is_tied_with_the_first_where_its_range_reaches_the_first_s(theirs, larger, tied):
    from paratrain.simulate.recommend import tied_with_first

    first = [90.0, 110.0] if larger else [1.0, 1.2]
    assert tied_with_first(first, theirs, larger) is tied
