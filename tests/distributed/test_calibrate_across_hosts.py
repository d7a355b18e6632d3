"""``paratrain simulate --calibrate FILE --across-hosts``: the runs that measure messages go
between two emulated hosts, the file says which, and nothing of the hosts is left."""

import json
import re

import pytest

from paratrain.cluster.hosts import leftovers
from tests.conftest import needs_hosts

pytestmark = pytest.mark.distributed


@needs_hosts
def test_a_calibration_across_two_emulated_hosts_measures_there_and_says_so(cli, tmp_path):
    path = tmp_path / "cal.json"
    result = cli(
        "simulate",
        "--calibrate",
        str(path),
        "--across-hosts",
        "--calibrate-rounds",
        "1",
        "--strategy",
        "ps-sync",
        "--workers",
        "2",
        "--steps",
        "20",
        "--cpu-share",
        "0.5",
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    calibration = json.loads(path.read_text())
    where = re.fullmatch(
        r"cluster (\d+): hosts pt\d+h0-1 on 198\.18\.\d+\.0/24", calibration["measured"]["across_hosts"]
    )
    assert where, calibration["measured"]
    assert "allreduce and ps-sync between 2 emulated hosts" in calibration["measured"]["runs"]
    costs = calibration["costs"]
    for name in ("compute_ms", "ring_step_us", "ps_push_us"):
        assert 0 < costs[name] < 1e6, (name, costs)
    # A ring step's CPU is split into a fixed part and a hop's from rings of 2 and 3 workers, a
    # split that a noisy round can put all on one side (each part at least 0); the 2-worker
    # ring's CPU, F + 2H, is what each round measured, and it is never free.
    for measured in calibration["rounds"]:
        assert measured["message_cpu_us"] >= 0 and measured["ring_fixed_cpu_us"] >= 0, measured
        assert 0 < measured["ring_fixed_cpu_us"] + 2 * measured["message_cpu_us"] < 1e6, measured
    assert f"; messages between 2 emulated hosts, {calibration['measured']['across_hosts']}): " in result.stdout
    number = int(where.group(1))
    assert leftovers(number) == []  # this cluster's; others may run beside it
