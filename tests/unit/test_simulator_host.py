"""Processes on one host (simulate/host.py) and the shard's work: closed forms."""

import math

import pytest

from paratrain.errors import ConfigError
from paratrain.simulate.cluster import Cluster, parse_straggler
from paratrain.simulate.engine import SharedCores
from paratrain.simulate.simulator import simulate

C = 0.01  # seconds of compute per step
MB = 1e6


def cluster(workers, **kw):
    return Cluster(workers=workers, compute_s=C, model_bytes=kw.pop("model_bytes", 1 * MB), **kw)


def ends(cores, works):
    shared, out = SharedCores(cores), {}
    for i, w in enumerate(works):
        shared.start(0.0, w, lambda t, i: out.__setitem__(i, t), i)
    while shared.jobs:
        t = shared.next_end()
        done, args = shared.pop(t)
        done(t, *args)
    return [out[i] for i in range(len(works))]


def test_processor_sharing_closed_forms():
    assert ends(2, [1.0] * 4) == pytest.approx([2.0] * 4)  # 4 jobs, 2 cores: half a core each
    assert ends(4, [1.0] * 3) == pytest.approx([1.0] * 3)  # never more than one core per job
    # 1, 2, 3 s on 2 cores: 2/3 of a core each until the first ends at 1.5 s, then a core each.
    assert ends(2, [1.0, 2.0, 3.0]) == pytest.approx([1.5, 2.5, 3.5])
    assert ends(None, [1.0, 2.0]) == pytest.approx([1.0, 2.0])
    # A measured curve: two processes together do 1.5 processes' work, so each runs at 0.75.
    assert ends(2, [1.0, 1.0]) == pytest.approx([1.0, 1.0])
    speedup = Cluster(workers=1, compute_s=C, model_bytes=MB, host_cores=2, host_speedup=(1.0, 1.5)).host_capacity
    shared = SharedCores(2, speedup)
    for w in (1.0, 1.0, 0.5):
        shared.start(0.0, w, lambda t: None)
    # three jobs: 1.5 / 3 = 0.5 each until the short one ends at 1 s; then 0.75 each.
    assert shared.next_end() == pytest.approx(1.0)
    shared.pop(1.0)
    assert shared.next_end() == pytest.approx(1.0 + 0.5 / 0.75)


@pytest.mark.parametrize("workers, cores", [(2, 2), (3, 2), (4, 2), (8, 3)])
def test_allreduce_compute_stretches_when_workers_exceed_cores(workers, cores):
    c = cluster(workers, bandwidth=1e9, latency=1e-4, host_cores=cores)
    expected = C * max(1.0, workers / cores) + c.ring_allreduce_s(c.model_bytes)
    assert simulate("allreduce", c, 30).summary(32)["step_seconds"] == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("strategy", ["allreduce", "local-sgd", "ps-async"])
def test_enough_cores_agree_with_the_round_models(strategy):
    kw = dict(bandwidth=1e9, latency=1e-4, ps_message_s=2e-4, ps_update_s=3e-4)
    rounds = simulate(strategy, cluster(1 if strategy == "ps-async" else 8, **kw), 40, period=4).summary(32)
    host = simulate(strategy, cluster(1 if strategy == "ps-async" else 8, host_cores=64, **kw), 40, period=4).summary(
        32
    )
    assert host["step_seconds"] == pytest.approx(rounds["step_seconds"], rel=1e-9)


def test_one_worker_parameter_server_pays_the_shards_work_in_both_engines():
    kw = dict(bandwidth=1e9, latency=1e-4, ps_message_s=2e-4, ps_update_s=3e-4)
    c = cluster(1, **kw)
    expected = C + 2 * c.model_bytes / c.bandwidth + 2 * c.latency + 2e-4 + 3e-4
    assert simulate("ps-sync", c, 20).summary(32)["step_seconds"] == pytest.approx(expected, rel=1e-9)
    assert simulate("ps-sync", cluster(1, host_cores=2, **kw), 20).summary(32)["step_seconds"] == pytest.approx(
        expected, rel=1e-9
    )


def test_ps_sync_rounds_queue_every_push_at_the_shards_worker():
    # Infinite bandwidth: the n pushes arrive together and the shard works through them.
    n = 6
    message = 1e-3
    update = 2e-3
    c = cluster(n, bandwidth=math.inf, latency=1e-4, ps_message_s=message, ps_update_s=update)
    expected = C + c.latency + n * message + update + c.latency
    assert simulate("ps-sync", c, 20).summary(32)["step_seconds"] == pytest.approx(expected, rel=1e-9)


def test_async_shard_bound_and_cpu_bound_throughput():
    # The shard's work per push bounds pushes per second, whatever the number of workers.
    c = cluster(8, bandwidth=math.inf, latency=0.0, ps_message_s=2e-3, ps_update_s=3e-3)
    pushes = simulate("ps-async", c, 100).summary(1)["examples_per_second"]
    assert pushes == pytest.approx(1 / 5e-3, rel=0.01)
    # Free shards, 2 cores, 6 workers: the cores bound it at 2 / C pushes per second.
    c = cluster(6, bandwidth=math.inf, latency=0.0, host_cores=2)
    summary = simulate("ps-async", c, 100).summary(1)
    assert summary["examples_per_second"] == pytest.approx(2 / C, rel=0.01)
    assert summary["staleness"]["mean"] == pytest.approx(5, abs=0.1)


def test_injected_straggler_sleeps_its_whole_step_after_it():
    # allreduce: the step runs to the end of the all-reduce, so every round after the first
    # (no sleep before it) takes F (C + ring).
    c = cluster(2, bandwidth=1e9, latency=1e-4, straggler=parse_straggler("sleep:1:2"))
    ring = c.ring_allreduce_s(c.model_bytes)
    wall = simulate("allreduce", c, 40).wall_s
    assert wall == pytest.approx((C + ring) + 39 * 2 * (C + ring), rel=1e-9)
    # ps-async with free links: worker 1 pushes every 3 C, worker 0 every C.
    c = cluster(2, bandwidth=math.inf, latency=0.0, straggler=parse_straggler("sleep:1:3"))
    pushes = simulate("ps-async", c, 300).summary(1)["examples_per_second"]
    assert pushes == pytest.approx(1 / C + 1 / (3 * C), rel=0.01)


def test_backup_worker_covers_an_injected_straggler():
    kw = dict(bandwidth=math.inf, latency=1e-4, straggler=parse_straggler("sleep:2:3"))
    sync = simulate("ps-sync", cluster(3, **kw), 60).summary(32)["examples_per_second"]
    backup = simulate("ps-backup", cluster(2, **kw), 60, backup=1).summary(32)
    assert backup["dropped_gradients"] > 0
    assert backup["examples_per_second"] > 1.5 * sync * 2 / 3  # rounds of 2 at full speed vs 3 held back


def test_ring_latency_replaces_the_link_latency_in_all_reduce_steps_only():
    c = cluster(4, bandwidth=1e9, latency=1e-4, ring_latency=1e-3)
    assert c.ring_allreduce_s(c.model_bytes) == pytest.approx(1.5 * c.model_bytes / 1e9 + 6 * 1e-3)
    one = cluster(1, bandwidth=1e9, latency=1e-4, ring_latency=1e-3)
    assert simulate("ps-sync", one, 10).summary(32)["step_seconds"] == pytest.approx(
        C + 2 * one.model_bytes / 1e9 + 2e-4
    )


def test_host_options_are_checked():
    assert parse_straggler("sleep:1:2").spec == "sleep:1:2"
    with pytest.raises(ConfigError, match="sleep:WORKER:FACTOR"):
        parse_straggler("sleep:1:0.5")
    with pytest.raises(ConfigError, match="--host-cores"):
        cluster(2, host_cores=0)
    with pytest.raises(ConfigError, match="--host-speedup"):
        cluster(2, host_cores=2, host_speedup=(1.0, 0.0))
    with pytest.raises(ConfigError, match="--ps-message-us"):
        cluster(2, ps_message_s=-1.0)
