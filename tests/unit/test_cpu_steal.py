"""What a hypervisor took of the machine's CPU between two readings of /proc/stat."""

import sys

import pytest

from paratrain.cpu_steal import cpu_times, stolen_share


def test_the_stolen_share_is_steal_over_all_the_cpu_time_between_two_readings():
    before = [100, 5, 50, 800, 10, 1, 2, 30]
    after = [160, 5, 70, 900, 10, 1, 2, 50]  # 200 ticks in all, 20 of them stolen
    assert stolen_share(before, after) == pytest.approx(0.1)
    assert stolen_share(before, before) is None  # no time between them
    assert stolen_share(None, after) is None and stolen_share(before, None) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/stat is Linux's")
def test_this_machine_s_cpu_times_are_read_by_kind():
    first = cpu_times()
    assert first is not None and len(first) == 8 and all(value >= 0 for value in first)
    share = stolen_share(first, [value + 1 for value in first])
    assert share == pytest.approx(1 / 8)
