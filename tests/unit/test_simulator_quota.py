"""Nodes under a CPU quota (simulate/quota.py, cgroup CPU bandwidth control): closed forms."""

import numpy as np
import pytest

from paratrain.simulate.cluster import Cluster, parse_straggler
from paratrain.simulate.quota import ThrottledCore, ThrottledNodes
from paratrain.simulate.simulator import simulate

MS = 1e-3
MB = 1e6


def test_full_speed_until_the_quota_is_spent_then_the_next_period():
    core = ThrottledCore(0.3, 10 * MS)  # 3 ms of CPU in every 10 ms
    assert core.run(0.0, 2 * MS) == pytest.approx(2 * MS)  # within the quota: full speed
    # 1 ms of quota left: spent by 3 ms, throttled until 10 ms, the last 1 ms from there
    assert core.run(2 * MS, 2 * MS) == pytest.approx(11 * MS)
    # 2 ms left in this period's quota; 7 ms of work: 2 now, 3 in the next period, 2 after
    assert core.run(11 * MS, 7 * MS) == pytest.approx(32 * MS)
    # a period's unused quota does not carry over: idle until 45 ms, then 3 ms at once
    assert core.run(45 * MS, 3 * MS) == pytest.approx(48 * MS)
    # what starts while throttled waits for the next period
    assert core.run(48.5 * MS, 1 * MS) == pytest.approx(51 * MS)


def test_periods_start_at_the_node_s_own_phase():
    core = ThrottledCore(0.5, 10 * MS, phase=4 * MS)  # periods [4, 14), [14, 24), ... ms
    # 4 ms to the end of [-6, 4), where a fresh quota begins: never throttled
    assert core.run(0.0, 5 * MS) == pytest.approx(5 * MS)
    # 1 ms of [4, 14)'s 5 ms is used: 4 ms from 9 ms, throttled until 14 ms, 1 ms more
    assert core.run(9 * MS, 5 * MS) == pytest.approx(15 * MS)


def test_jobs_run_one_at_a_time_in_order():
    core, ends = ThrottledCore(0.5, 10 * MS), {}
    for name, work in (("a", 4 * MS), ("b", 4 * MS)):
        core.start(0.0, work, lambda t, name: ends.__setitem__(name, t), name)
    while core.jobs:
        t = core.next_end()
        done, args = core.pop(t)
        done(t, *args)
    assert ends == pytest.approx({"a": 4 * MS, "b": 13 * MS})  # b: 1 ms of the first quota, 3 of the next


def quota_cluster(workers, share, **kw):
    kw.setdefault("compute_s", 10 * MS)
    return Cluster(workers=workers, model_bytes=kw.pop("model_bytes", 1 * MB), cpu_share=share, **kw)


@pytest.mark.parametrize("strategy", ["allreduce", "ps-async"])
def test_a_busy_node_runs_at_exactly_its_share(strategy):
    # 10 ms of compute a step on a quarter of a core: 40 ms a step, whatever the phase, but for
    # the first and the last period (the run starts within one and ends once its work is done)
    cluster = quota_cluster(1, 0.25, cpu_period_s=10 * MS, bandwidth=1e15, latency=0.0)
    for seed in range(3):
        assert simulate(strategy, cluster, 50, seed=seed).wall_s == pytest.approx(50 * 40 * MS, abs=2 * 10 * MS)


@pytest.mark.parametrize("workers", [2, 3, 4])
@pytest.mark.parametrize("bandwidth", [125e6, 12.5e9])  # the wire bounds a hop; the receiver's CPU does
@pytest.mark.parametrize("fixed_cpu", [0.0, 300e-6])
def test_an_unthrottled_ring_is_compute_then_2_n_minus_1_hops(workers, bandwidth, fixed_cpu):
    """The collective's fixed CPU once, then each hop: the wait (a ring step's time less its
    CPU, a 2-process ring's fixed CPU over its 2 steps among it), then the slice's bytes on
    the wire while the receiver works on them (its CPU overlaps their arrival): the longer."""
    latency = 50e-6
    hop_cpu = 200e-6
    ring_step = 600e-6
    cluster = quota_cluster(
        workers,
        1.0,
        bandwidth=bandwidth,
        latency=latency,
        message_cpu_s=hop_cpu,
        model_bytes=0.3 * MB,
        ring_latency=ring_step,
        ring_fixed_cpu_s=fixed_cpu,
    )
    wait = ring_step - hop_cpu - fixed_cpu / 2
    step = 10 * MS + fixed_cpu + 2 * (workers - 1) * (wait + max(0.3 * MB / workers / bandwidth, hop_cpu))
    summary = simulate("allreduce", cluster, 40, seed=1).summary(32)
    assert summary["examples_per_second"] == pytest.approx(workers * 32 / step, rel=1e-6)


def test_throttled_hops_make_a_ring_slower_with_more_nodes():
    # Each node's quota covers its compute and hops with room to spare, yet every hop that
    # meets a throttled neighbour waits for its next period: steps lengthen with N.
    def step_s(workers):
        cluster = quota_cluster(workers, 0.3, compute_s=1.8 * MS, cpu_period_s=10 * MS, message_cpu_s=0.35 * MS)
        rates = [simulate("allreduce", cluster, 200, seed=s).summary(32)["examples_per_second"] for s in range(4)]
        return workers * 32 / (sum(rates) / len(rates))

    unthrottled = 1.8 * MS / 0.3  # compute at the share, were the share smooth
    two, four = step_s(2), step_s(4)
    assert two > unthrottled * 0.5 and four > two * 1.2


def test_a_fixed_straggler_is_a_node_at_a_smaller_share():
    slow = quota_cluster(1, 0.5, cpu_period_s=10 * MS, straggler=parse_straggler("fixed:0:2"), bandwidth=1e15)
    quarter = quota_cluster(1, 0.25, cpu_period_s=10 * MS, bandwidth=1e15)
    assert simulate("allreduce", slow, 30).wall_s == pytest.approx(simulate("allreduce", quarter, 30).wall_s)


def test_an_async_shard_under_a_quota_bounds_the_pushes_per_second():
    # Each push costs the shard 1 ms + 0.25 ms per message: at half a core, 400 pushes a second.
    cluster = quota_cluster(
        8, 0.5, compute_s=0.1 * MS, cpu_period_s=10 * MS, ps_message_s=1 * MS, message_cpu_s=0.25 * MS, bandwidth=1e12
    )
    summary = simulate("ps-async", cluster, 400, seed=2).summary(32)
    assert summary["examples_per_second"] == pytest.approx(400 * 32, rel=0.03)


@pytest.mark.parametrize("strategy", ["ps-sync", "ps-async"])
def test_a_worker_s_own_cpu_a_push_is_its_quota_s_to_pay(strategy):
    """A worker under a quarter of a core pays its push and reply at its share: 2 ms of CPU a
    push (ps_worker_cpu_s) instead of the 0.5 ms a message costs the shard makes every step
    but the first (no reply to pay yet) 6 ms longer, within the quota's periods."""
    kw = dict(compute_s=10 * MS, cpu_period_s=10 * MS, message_cpu_s=0.5 * MS, bandwidth=1e15, latency=0.0)
    own = simulate(strategy, quota_cluster(1, 0.25, ps_worker_cpu_s=2 * MS, **kw), 50, seed=3).wall_s
    message = simulate(strategy, quota_cluster(1, 0.25, **kw), 50, seed=3).wall_s
    assert own - message == pytest.approx(49 * 1.5 * MS / 0.25, abs=3 * 10 * MS)


def test_many_nodes_at_once_are_each_node_alone():
    # ThrottledNodes (a ring hop on every node) against ThrottledCore.run node by node, on
    # nodes with their own shares, phases and quota already partly used, over several hops
    rng = np.random.default_rng(0)
    shares, phases = rng.uniform(0.1, 1.0, 50), rng.uniform(0, 10 * MS, 50)
    alone = [ThrottledCore(s, 10 * MS, p) for s, p in zip(shares, phases, strict=True)]
    together_cores = [ThrottledCore(s, 10 * MS, p) for s, p in zip(shares, phases, strict=True)]
    for core, twin in zip(alone[::2], together_cores[::2], strict=True):  # half have run before
        core.run(0.0, 2 * MS), twin.run(0.0, 2 * MS)
    t = rng.uniform(0, 30 * MS, 50)
    together = ThrottledNodes(together_cores)
    for work in (0.3 * MS, 4 * MS, 25 * MS, 0.0):
        expected = np.array([core.run(start, work) for core, start in zip(alone, t, strict=True)])
        t = together.run(t, work)
        assert np.array_equal(t, expected)  # the same arithmetic: exactly
    together.close()
    assert [(c._index, c._used) for c in together_cores] == [(c._index, c._used) for c in alone]
