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
    result = cli("simulate", "--calibrate", str(path), "--across-hosts", "--strategy", "ps-sync", "--workers", "2",
                 "--steps", "20", "--cpu-share", "0.5", timeout=900)  # fmt: skip
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
