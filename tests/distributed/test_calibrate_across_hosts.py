"""``paratrain simulate --calibrate FILE --across-hosts``: the runs that measure messages go
between two emulated hosts, the file says which, and nothing of the hosts is left. With
``--recommend``'s cluster, every host of it, emulated, computes a step at once at its share."""

import json
import re

import pytest

from paratrain.cluster.hosts import leftovers
from tests.conftest import needs_hosts

pytestmark = pytest.mark.distributed


@needs_hosts
def test_a_calibration_across_emulated_hosts_measures_there_and_says_so(cli, tmp_path):
    path = tmp_path / "cal.json"
    result = cli("simulate", "--calibrate", str(path), "--across-hosts", "--recommend", "--hosts", "3", "--cpu", "0.5",
                 "--host", "2:cpu=0.25", "--steps", "20", timeout=900)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    calibration = json.loads(path.read_text())
    where = re.fullmatch(
        r"cluster (\d+): hosts pt\d+h0-1 on 198\.18\.\d+\.0/24", calibration["measured"]["across_hosts"]
    )
    assert where, calibration["measured"]
    assert "allreduce and ps-sync between 2 emulated hosts" in calibration["measured"]["runs"]
    costs = calibration["costs"]
    for name in ("compute_ms", "ring_step_us", "message_cpu_us", "ps_push_us"):
        assert 0 < costs[name] < 1e6, (name, costs)
    assert f"; messages between 2 emulated hosts, {calibration['measured']['across_hosts']}): " in result.stdout
    assert leftovers("pt", int(where.group(1))) == []
    busy = calibration["busy_hosts"]
    assert [host["cpu"] for host in busy["hosts"]] == [0.5, 0.5, 0.25]
    for host in busy["hosts"]:  # each ran under its quota: no more CPU a step than its share of the wall clock
        assert host["wall_ms"] * host["cpu"] >= 0.8 * host["cpu_ms"], busy
    assert busy["hosts"][2]["wall_ms"] > 1.5 * busy["hosts"][0]["wall_ms"], busy  # half the quota: about twice
    assert f"its 3 hosts computing at once ({busy['cluster']}): a step's work x" in result.stdout
    assert leftovers("pt", int(re.match(r"cluster (\d+)", busy["cluster"]).group(1))) == []
