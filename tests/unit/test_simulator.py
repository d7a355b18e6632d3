"""The cluster simulator: closed-form cases, determinism, and the published shapes."""

import math
import time

import numpy as np
import pytest

from paratrain.simulate.cluster import BUCKET_BYTES, Cluster, make_codec, parse_straggler
from paratrain.simulate.pipeline import PipelineMesh, StageShape
from paratrain.simulate.simulator import STRATEGIES, simulate
from paratrain.simulate.tensor import Mesh, TensorShape

C = 0.1  # seconds of compute per step
MB = 1e6


def cluster(workers=1, model_bytes=10 * MB, **kw):
    return Cluster(workers=workers, compute_s=C, model_bytes=model_bytes, **kw)


def step_s(strategy, c, steps=20, **options):
    return simulate(strategy, c, steps, **options).summary(32)["step_seconds"]


# ----- closed forms --------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["allreduce", "local-sgd"])
def test_one_worker_only_computes(strategy):
    assert step_s(strategy, cluster(1)) == pytest.approx(C, rel=1e-12)


def test_one_worker_parameter_server_pushes_and_pulls_the_whole_model():
    c = cluster(1, bandwidth=1e9, latency=1e-4)
    expected = C + 2 * c.model_bytes / c.bandwidth + 2 * c.latency
    assert step_s("ps-sync", c) == pytest.approx(expected, rel=1e-12)
    # Async: the same cycle, but the run ends with the last push (no final pull).
    wall = simulate("ps-async", c, 20).wall_s
    assert wall == pytest.approx(20 * expected - c.model_bytes / c.bandwidth - c.latency, rel=1e-12)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_infinite_bandwidth_and_no_latency_leave_only_compute(strategy):
    c = cluster(16, bandwidth=math.inf, latency=0.0)
    options = {"backup": 2} if strategy == "ps-backup" else {}
    if strategy == "tensor":  # nothing of the compute split: each process computes all of it
        shape = TensorShape(size=2, split_bytes=1e6, whole_bytes=1e6, split_share=0.0, all_reduce_bytes=(1e6,))
        options = {"mesh": Mesh(shape, 2)}
    if strategy == "pipeline":  # one stage, one micro-batch: no bubble
        shape = TensorShape(size=1, split_bytes=0.0, whole_bytes=1e6, split_share=0.0)
        options = {"mesh": PipelineMesh((StageShape(shape, 1.0, 0.0),), microbatches=1)}
    summary = simulate(strategy, c, 40, **options).summary(32)
    assert summary["step_seconds"] == pytest.approx(C, rel=1e-12)
    assert summary["comm_share"] == pytest.approx(0.0, abs=1e-12)


def test_ring_allreduce_of_one_bucket_follows_the_formula():
    c = cluster(8, model_bytes=10 * MB, bandwidth=1e9, latency=1e-5)
    n, nbytes = 8, 10 * MB
    ring = 2 * (n - 1) / n * nbytes / c.bandwidth + 2 * (n - 1) * c.latency
    assert c.ring_allreduce_s(nbytes) == pytest.approx(ring)
    assert step_s("allreduce", c) == pytest.approx(C + ring, rel=1e-12)  # one bucket: ready at the end


def test_buckets_overlap_with_backward_leaving_only_the_last_one():
    # 4 buckets of 25 MiB; each takes less than the backward time between two buckets.
    c = cluster(4, model_bytes=4 * BUCKET_BYTES, bandwidth=100e9, latency=0.0)
    assert len(c.buckets()) == 4
    last = c.ring_allreduce_s(BUCKET_BYTES)
    assert last < C * 2 / 3 / 4
    assert step_s("allreduce", c) == pytest.approx(C + last, rel=1e-12)


def test_ps_sync_without_stragglers_queues_every_push_at_the_shard():
    n, shards = 8, 2
    c = cluster(n, ps_shards=shards, bandwidth=1e9, latency=1e-5)
    slice_s = c.model_bytes / shards / c.bandwidth
    own = c.model_bytes / c.bandwidth
    # The shard's link takes n slices one after another; each worker's link sends its own.
    push = max(n * slice_s, own)
    expected = C + push + c.latency + c.latency + push
    assert step_s("ps-sync", c) == pytest.approx(expected, rel=1e-12)


def test_local_sgd_pays_one_average_per_period():
    c = cluster(8, bandwidth=1e9, latency=1e-5)
    assert step_s("local-sgd", c, steps=64, period=8) == pytest.approx(C + c.ring_allreduce_s(c.model_bytes) / 8)


def test_async_staleness_is_workers_minus_one_without_stragglers():
    s = simulate("ps-async", cluster(8, bandwidth=math.inf, latency=0.0), 50).summary(32)["staleness"]
    assert s["max"] == 7 and s["mean"] == pytest.approx(7, abs=0.2)


def test_codec_byte_ratios():
    shapes = [(256, 64), (256,)]
    assert make_codec("fp16", shapes).ratio == 2
    assert make_codec("int8", shapes).ratio == pytest.approx(3.94, abs=0.01)
    assert make_codec("topk", shapes, topk_ratio=0.01).ratio == pytest.approx(50)
    sent = (256 + 64) * 4 + 256
    assert make_codec("powersgd", shapes, powersgd_rank=4).ratio == pytest.approx((256 * 64 + 256) / sent)


# ----- determinism ---------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["allreduce", "ps-backup", "ps-async"])
def test_deterministic_per_seed(strategy):
    c = cluster(16, straggler=parse_straggler("lognormal:0.5"), failure_rate=50.0, recovery_s=1.0)
    runs = [simulate(strategy, c, 30, seed=seed, backup=2).summary(32) for seed in (3, 3, 4)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


# ----- the published shapes -----------------------------------------------------------------
@pytest.mark.parametrize("straggler", ["lognormal:0.3", "lognormal:0.5", "fixed:3:3"])
def test_backup_workers_beat_sync_under_stragglers(straggler):
    """Chen et al. 2016: N + k workers, first N gradients, faster than waiting for all N."""
    for n in (4, 16, 64):
        c = cluster(n, ps_shards=4, straggler=parse_straggler(straggler))
        sync = simulate("ps-sync", c, 200, seed=1).summary(32)["examples_per_second"]
        backup = simulate("ps-backup", c, 200, seed=1, backup=2).summary(32)["examples_per_second"]
        assert backup > 1.03 * sync, (n, sync, backup)


def _efficiency(workers=64, **kw):
    base = simulate("allreduce", cluster(1, **kw), 50).summary(32)["examples_per_second"]
    return simulate("allreduce", cluster(workers, **kw), 50).summary(32)["examples_per_second"] / (workers * base)


def test_allreduce_efficiency_falls_as_bandwidth_falls():
    effs = [_efficiency(model_bytes=100 * MB, bandwidth=gbps * 1e9 / 8) for gbps in (100, 10, 1)]
    assert effs[0] > effs[1] > effs[2]


def test_allreduce_efficiency_falls_as_the_model_grows():
    effs = [_efficiency(model_bytes=mb * MB, bandwidth=10e9 / 8) for mb in (10, 100, 1000)]
    assert effs[0] > effs[1] > effs[2]


def test_staleness_bound_caps_the_clock_gap():
    c = cluster(8, model_bytes=1 * MB, straggler=parse_straggler("fixed:0:4"))
    free = simulate("ps-async", c, 100).summary(32)
    bounded = simulate("ps-async", c, 100, staleness_bound=0).summary(32)
    assert bounded["staleness"]["max"] < free["staleness"]["max"]
    assert bounded["examples_per_second"] < free["examples_per_second"]


def test_a_thousand_workers_simulate_in_seconds():
    start = time.perf_counter()
    for strategy in ("allreduce", "ps-sync", "local-sgd"):
        simulate(strategy, cluster(1024, straggler=parse_straggler("lognormal:0.3")), 300)
    assert time.perf_counter() - start < 2
    start = time.perf_counter()
    simulate("ps-async", cluster(1024, straggler=parse_straggler("lognormal:0.3")), 100)
    assert time.perf_counter() - start < 10


def test_failures_slow_sync_rounds_more_than_backup_rounds():
    c = cluster(16, failure_rate=200.0, recovery_s=1.0)
    sync = simulate("ps-sync", c, 200, seed=0).summary(32)["examples_per_second"]
    backup = simulate("ps-backup", c, 200, seed=0, backup=2).summary(32)["examples_per_second"]
    assert backup > sync
    assert np.isfinite(sync)


# ----- local-sgd, diloco, fsdp ------------------------------------------------------------------
def test_diloco_is_local_sgd_plus_the_outer_step_and_fragments_spread_the_traffic():
    c = cluster(4, bandwidth=1e8, latency=0.0)
    average = c.ring_allreduce_s(c.model_bytes)
    assert step_s("local-sgd", c, steps=16, period=8) == pytest.approx(C + average / 8, rel=1e-12)
    assert step_s("diloco", c, steps=16, period=8) == pytest.approx(C + average / 8, rel=1e-12)
    with_outer = cluster(4, bandwidth=1e8, latency=0.0, ps_update_s=0.01)
    assert step_s("diloco", with_outer, steps=16, period=8) == pytest.approx(C + (average + 0.01) / 8, rel=1e-12)
    # Four fragments: a quarter of the model every 2 steps: the same bytes per step.
    assert step_s("diloco", c, steps=16, period=8, fragments=4) == pytest.approx(C + average / 8, rel=1e-12)


def test_fsdp_moves_one_and_a_half_all_reduces_per_step_and_hides_all_but_a_unit():
    c = cluster(4, bandwidth=1e10, latency=0.0)
    allreduce = c.ring_allreduce_s(c.model_bytes)
    # Communication far longer than compute: everything shows, 1.5 all-reduces (ZeRO-3)...
    slow = cluster(4, bandwidth=1e6, latency=0.0)
    ar_slow = slow.ring_allreduce_s(slow.model_bytes)
    assert step_s("fsdp", slow) == pytest.approx(1.5 * ar_slow, rel=1e-9)
    assert step_s("fsdp", slow, reshard=False) == pytest.approx(1.0 * ar_slow, rel=1e-9)
    # ...and compute far longer than communication: only the first gather and last scatter show.
    fast = step_s("fsdp", c, units=4)
    assert fast == pytest.approx(C + allreduce / 2 / 4 + allreduce / 4, rel=1e-9)
    assert step_s("fsdp", cluster(1)) == pytest.approx(C, rel=1e-12)


def test_the_host_engine_runs_the_new_strategies():
    for strategy in ("local-sgd", "diloco", "fsdp"):
        outcome = simulate(strategy, cluster(2, host_cores=2.0), 16, period=4)
        assert outcome.wall_s >= 16 * C
