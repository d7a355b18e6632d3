"""The emulated hosts' CPU accounting (cluster/usage.py) and their cores (cluster/hosts.py),
on cgroup files written here: no root needed."""

import pytest

from paratrain.cluster.hosts import EmulatedCluster, HostSpec, host_cores
from paratrain.cluster.usage import Usage, UsageRecorder, read_usage, window


def _v1(tmp_path, usage_ns, joined=False):
    cpu = tmp_path / "cpu"
    cpu.mkdir()
    (cpu / "cpu.stat").write_text("nr_periods 200\nnr_throttled 150\nthrottled_time 900000000\nnr_bursts 0\n")
    accounting = cpu if joined else tmp_path / "cpuacct"
    accounting.mkdir(exist_ok=True)
    (accounting / "cpuacct.usage").write_text(f"{usage_ns}\n")
    return cpu, None if joined else accounting


@pytest.mark.parametrize("joined", [False, True])
def test_v1_counters_are_read_from_cpu_stat_and_cpuacct(tmp_path, joined):
    cpu, accounting = _v1(tmp_path, 2_500_000_000, joined)
    assert read_usage(cpu, accounting) == Usage(cpu_s=2.5, periods=200, throttled_periods=150, throttled_s=0.9)


def test_v2_counters_are_read_from_cpu_stat_alone(tmp_path):
    (tmp_path / "cpu.stat").write_text(
        "usage_usec 1500000\nuser_usec 1000000\nsystem_usec 500000\n"
        "nr_periods 40\nnr_throttled 10\nthrottled_usec 250000\n"
    )
    assert read_usage(tmp_path, None) == Usage(cpu_s=1.5, periods=40, throttled_periods=10, throttled_s=0.25)


def test_a_window_interpolates_between_samples():
    # [unix_s, cpu_s, periods, throttled_periods, throttled_s], 0.3 of a core throughout
    samples = [[100.0 + t, 0.3 * t, 100 * t, 50 * t, 0.7 * t] for t in range(5)]
    used = window(samples, 100.5, 103.0)
    assert used.cpu_s == pytest.approx(0.75)
    assert (used.periods, used.throttled_periods) == (250, 125)
    assert used.throttled_s == pytest.approx(1.75)
    # beyond the samples: held at the first and last
    assert window(samples, 90.0, 200.0).cpu_s == pytest.approx(1.2)


def test_the_summary_gives_each_hosts_cpu_against_its_share():
    cluster = EmulatedCluster([HostSpec(cpu=0.3), HostSpec(cpu=0.15)], cluster_id=7, pin="never")
    recorder = UsageRecorder(cluster)
    recorder.samples = [
        [[0.0, 1.0, 0, 0, 0.0], [10.0, 4.0, 1000, 900, 6.0]],
        [[0.0, 1.0, 0, 0, 0.0], [10.0, 1.5, 1000, 100, 0.5]],
    ]
    host0, host1 = recorder.summary()
    assert host0 == "host0: 3.0 CPU-s in 10.0 s (0.30 of a core; share 0.3), quota ran out in 90% of its periods"
    assert host1.startswith("host1: 0.5 CPU-s in 10.0 s (0.05 of a core; share 0.15)") and "10% of" in host1
    assert recorder.document()["hosts"][1]["cpu"] == 0.15


def test_the_summary_counts_from_when_the_shares_began():
    """A cluster made unthrottled (``--throttle-from training``) has no share to compare with
    until ``throttle``; from then on its summary counts only the samples since."""
    cluster = EmulatedCluster([HostSpec(cpu=0.3)], cluster_id=7, pin="never", throttled=False)
    recorder = UsageRecorder(cluster)
    assert recorder.summary() == ["the hosts ran at the machine's speed throughout: no share began"]
    assert recorder.document()["throttled_at"] is None
    recorder.throttled_at = 10.0  # what shares_began() records at that moment
    recorder.samples = [[[0.0, 0.0, 0, 0, 0.0], [10.0, 9.0, 1000, 0, 0.0], [20.0, 12.0, 2000, 800, 5.0]]]
    (line,) = recorder.summary()
    assert line.startswith("host0: 3.0 CPU-s in 10.0 s (0.30 of a core; share 0.3)") and "80% of" in line


def test_hosts_take_cores_in_turn():
    small = [HostSpec(cpu=0.3)] * 5
    assert host_cores(small, [0, 1]) == [[0], [1], [0], [1], [0]]
    # ceil(share) cores each, at most all of them
    mixed = [HostSpec(cpu=2.0), HostSpec(cpu=0.5), HostSpec(cpu=3.0), HostSpec(cpu=9.0)]
    assert host_cores(mixed, [4, 5, 6, 7]) == [[4, 5], [6], [7, 4, 5], [6, 7, 4, 5]]


def test_a_pinned_host_runs_under_taskset_and_an_unpinned_one_does_not():
    pinned = EmulatedCluster([HostSpec(cpu=0.5)] * 2, cluster_id=7, pin="always")
    command = pinned.command(pinned.hosts[1], ["python", "x.py"])
    assert f"taskset -c {pinned.hosts[1].cores[0]} ip netns exec pt7h1" in command[2]
    loose = EmulatedCluster([HostSpec(cpu=0.5)] * 2, cluster_id=7, pin="never")
    assert loose.hosts[1].cores is None and "taskset" not in loose.command(loose.hosts[1], ["python"])[2]


def test_auto_pins_only_where_every_host_has_cores_of_its_own(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    fits = EmulatedCluster([HostSpec(cpu=1.5), HostSpec(cpu=0.3), HostSpec(cpu=0.3)], cluster_id=7)
    assert [h.cores for h in fits.hosts] == [[0, 1], [2], [3]]
    shared = EmulatedCluster([HostSpec(cpu=0.3)] * 5, cluster_id=7)
    assert all(h.cores is None for h in shared.hosts)
    assert [h.cores for h in EmulatedCluster([HostSpec(cpu=0.3)] * 5, cluster_id=7, pin="always").hosts] == [
        [0],
        [1],
        [2],
        [3],
        [0],
    ]
