"""A calibration's hosts measured computing at once (``busy_hosts``, written by ``--calibrate
--across-hosts --recommend``): each node's work on the described cluster costs what a step
cost its host there, the slow host's too; hosts measured for another cluster are not used,
and a file whose hosts are malformed is refused in one line."""

import json
from pathlib import Path

import pytest

from paratrain.launch.cli import main
from tests.unit.test_simulate_calibration import _calibration, _with_rounds
from tests.unit.test_simulate_recommend import HOSTS, _run

COSTS = {"message_cpu_us": 700.0, "ps_push_us": 2000.0}


def _busy(path, walls, shares=(0.3, 0.3, 0.3, 0.15), **costs):
    """The calibration of COSTS (and ``costs``) with ``busy_hosts`` whose steps took ``walls``
    milliseconds."""
    document = json.loads(Path(_calibration(path, **COSTS, **costs)).read_text())
    hosts = [{"cpu": share, "wall_ms": wall, "cpu_ms": 2.0} for share, wall in zip(shares, walls)]
    document["busy_hosts"] = {"hosts": hosts, "cluster": "cluster 9: hosts pt9h0-3 on 198.18.9.0/24"}
    path.write_text(json.dumps(document))
    return str(path)


def test_each_node_s_work_costs_what_a_step_cost_its_host_busy(tmp_path):
    """Hosts 0-2 at 0.3 took 10 ms a step of 2 ms of work (x1.5), host 3 at 0.15 40 ms (x3):
    every candidate is the prediction of a file whose CPU costs are 1.5 times these (a ring
    step's wait alone not), with host 3 slower than the others by 2 (its share) times 3 / 1.5."""
    busy = _busy(tmp_path / "busy.json", [10.0, 9.5, 10.5, 40.0])
    result = _run(tmp_path, "busy", "--recommend", *HOSTS, "--calibration", busy)
    assert "host 3 at 0.15" in result["recommendation"]
    rows = {r["candidate"]: r for r in result["candidates"]}
    scaled = _calibration(tmp_path / "scaled.json", compute_ms=3.0, message_cpu_us=1050.0, ps_push_us=3000.0,
                          ps_update_us=45.0)  # fmt: skip
    hosts = ["--cpu-share", "0.3", "--cpu-period-ms", "10", "--bandwidth-gbps", "1", "--calibration", scaled]
    for candidate, flags in [
        ("allreduce", ["--strategy", "allreduce", "--workers", "4", "--straggler", "fixed:3:4"]),
        ("ps-sync", ["--strategy", "ps-sync", "--workers", "3", "--straggler", "fixed:2:4"]),
    ]:  # fmt: skip
        (alone,) = _run(tmp_path, candidate, *flags, *hosts)["results"]
        assert rows[candidate]["examples_per_second"] == pytest.approx(alone["examples_per_second"], rel=1e-9)
    plain = _run(tmp_path, "plain", "--recommend", *HOSTS, "--calibration", _calibration(tmp_path / "p.json", **COSTS))
    slower = {r["candidate"]: r["examples_per_second"] for r in plain["candidates"]}
    assert all(rows[name]["examples_per_second"] < rate for name, rate in slower.items())


def test_the_line_says_what_the_hosts_measured_and_when_they_are_another_cluster_s(tmp_path, capsys):
    busy = _busy(tmp_path / "busy.json", [10.0, 10.0, 10.0, 40.0])
    assert main(["simulate", "--recommend", *HOSTS, "--calibration", busy, "--steps", "50"]) == 0
    out = capsys.readouterr().out
    assert "its 4 hosts computing at once (cluster 9: hosts pt9h0-3 on 198.18.9.0/24): a step's work x1.50 " \
           "(host 3: x3.00)" in out  # fmt: skip
    other = [
        "simulate",
        "--recommend",
        "--hosts",
        "3",
        "--cpu",
        "0.3",
        "--link",
        "1gbit",
        "--calibration",
        busy,
        "--steps",
        "50",
    ]
    out_other = tmp_path / "other.json"
    assert main([*other, "--json-out", str(out_other)]) == 0
    assert "its hosts computing at once were 4 hosts at 0.3, 0.3, 0.3, 0.15 of a core, not this cluster's: not " \
           "used" in capsys.readouterr().out  # fmt: skip
    plain = _calibration(tmp_path / "p.json", **COSTS)
    assert main([*other[:-4], "--calibration", plain, "--steps", "50", "--json-out", str(tmp_path / "p.json.out")]) == 0
    unused = json.loads(out_other.read_text())["candidates"]
    without = json.loads((tmp_path / "p.json.out").read_text())["candidates"]
    assert [r["examples_per_second"] for r in unused] == [r["examples_per_second"] for r in without]


@pytest.mark.parametrize(
    "busy",
    [{"hosts": []}, {"hosts": [{"cpu": 0.3, "wall_ms": 0, "cpu_ms": 1.0}]}, {"hosts": [{"cpu": 0.3}]}, ["x"]],
)
def test_a_file_whose_busy_hosts_are_malformed_is_one_line_and_exit_2(tmp_path, capsys, busy):
    document = json.loads(Path(_calibration(tmp_path / "cal.json")).read_text())
    document["busy_hosts"] = busy
    (tmp_path / "cal.json").write_text(json.dumps(document))
    assert main(["simulate", "--recommend", *HOSTS, "--calibration", str(tmp_path / "cal.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "its busy_hosts must list hosts, each with numbers > 0 for cpu, wall_ms, cpu_ms" in err[0]


def test_each_round_s_hosts_give_that_round_s_prediction(tmp_path):
    """Measured in every round of the calibration, the hosts' wall clocks of each round scale
    that round's prediction: a round whose hosts took twice as long gives each candidate's
    low end, the prediction of a file whose hosts took that long."""
    walls, more = [10.0, 10.0, 10.0, 40.0], {"shard_push_cpu_us": 900.0, "ps_worker_cpu_us": 500.0, "epoch_end_ms": 1.0}
    spread = json.loads(Path(_with_rounds(tmp_path / "r.json", [{}, {}, {}], **COSTS, **more)).read_text())
    spread["busy_hosts"] = json.loads(Path(_busy(tmp_path / "b.json", walls)).read_text())["busy_hosts"]
    spread["busy_hosts"]["rounds"] = [walls, walls, [2 * w for w in walls]]
    (tmp_path / "r.json").write_text(json.dumps(spread))
    result = _run(tmp_path, "spread", "--recommend", *HOSTS, "--calibration", str(tmp_path / "r.json"))
    slow = _run(
        tmp_path,
        "slow",
        "--recommend",
        *HOSTS,
        "--calibration",
        _busy(tmp_path / "s.json", [2 * w for w in walls], **more),
    )
    low = {r["candidate"]: r["examples_per_second"] for r in slow["candidates"]}
    for row in result["candidates"]:
        lowest, highest = row["examples_per_second_range"]
        assert lowest == pytest.approx(low[row["candidate"]], rel=1e-9)
        assert highest == pytest.approx(row["examples_per_second"], rel=1e-9) and lowest < highest
