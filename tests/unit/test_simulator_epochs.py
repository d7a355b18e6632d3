"""An epoch's end in the simulator (cluster.py's ``epoch_batches``, ``eval_s``,
``collective_step_s``): what Trainer.fit does between two epochs, in closed forms where the
engine has them, and the waiting that CPU quotas add to it."""

import dataclasses

import numpy as np
import pytest

from paratrain.simulate.cluster import Cluster
from paratrain.simulate.simulator import simulate

MS = 1e-3
US = 1e-6
MB = 1e6


def whole_cores(workers, **kw):
    kw = {"compute_s": 2 * MS, "model_bytes": 1 * MB, "bandwidth": 1e9, "latency": 20 * US, **kw}
    return Cluster(workers=workers, **kw)


def added_s(strategy, cluster, steps, **options):
    """Wall seconds the epochs' ends add to ``steps`` steps of ``strategy`` (``seed`` in ``options``)."""
    bare = dataclasses.replace(cluster, epoch_batches=0)
    return simulate(strategy, cluster, steps, **options).wall_s - simulate(strategy, bare, steps, **options).wall_s


@pytest.mark.parametrize(("strategy", "options"), [("allreduce", {}), ("fsdp", {}), ("local-sgd", {"period": 4})])
@pytest.mark.parametrize("workers", [2, 4])
def test_a_collective_epoch_end_is_a_share_of_the_evaluation_between_two_small_all_reduces(strategy, options, workers):
    # 40 batches an epoch: 40 / workers steps each; 80 steps are 80 * workers / 40 epochs, with
    # an end between each two
    cluster = whole_cores(workers, epoch_batches=40, eval_s=6 * MS, collective_step_s=150 * US)
    epochs = 80 * workers // 40 - 1
    small = 2 * (workers - 1) * (20 * US + 150 * US)  # a ring all-reduce of a few values
    assert added_s(strategy, cluster, 80, **options) == pytest.approx(epochs * (6 * MS / workers + 2 * small), rel=1e-9)


def test_ps_sync_rounds_wait_for_the_chief_s_evaluation_and_every_worker_pulls_for_the_next_epoch():
    # 10 rounds an epoch; links fast enough that the pushes hardly queue at the shard (a late
    # chief's push would find the link free, which takes their queueing off its delay)
    cluster = whole_cores(3, epoch_batches=30, eval_s=5 * MS, bandwidth=1e14)
    pull = 2 * 20 * US  # the request and the whole model back
    assert added_s("ps-sync", cluster, 40) == pytest.approx(3 * (5 * MS + pull), rel=1e-4)


def test_without_epochs_in_the_cluster_nothing_is_added():
    cluster = whole_cores(4, eval_s=6 * MS, collective_step_s=150 * US)  # epoch_batches 0: no data known
    assert added_s("allreduce", cluster, 40) == 0.0


def quota(workers, share, **kw):
    return whole_cores(workers, cpu_share=share, cpu_period_s=10 * MS, **kw)


@pytest.mark.parametrize("workers", [2, 3, 4])
def test_an_unthrottled_node_s_epoch_end_is_the_whole_core_one(workers):
    # a share of 1: no quota ever runs out, and the epoch end's collectives' steps are their
    # wire latency and CPU, as on whole cores
    cluster = quota(workers, 1.0, epoch_batches=12 * workers, eval_s=3 * MS, collective_step_s=100 * US)
    small = 2 * (workers - 1) * (20 * US + 100 * US)
    for strategy, options in (("allreduce", {}), ("local-sgd", {"period": 5})):
        assert added_s(strategy, cluster, 60, **options) == pytest.approx(4 * (3 * MS / workers + 2 * small), rel=1e-9)


def test_under_quotas_an_epoch_end_s_small_all_reduces_wait_for_throttled_peers():
    # Each step spends most of a period's quota (3.5 ms of 4 ms), so a node reaching the epoch's
    # end is mostly throttled and a small all-reduce's step waits for the next period of a node
    # on its way; once every node has had a fresh quota the steps run at full speed. Unthrottled,
    # the two all-reduces of 4 nodes are 12 steps of 0.1 ms; a wait is at most a 10 ms period.
    cluster = quota(4, 0.4, compute_s=3.5 * MS, epoch_batches=40, collective_step_s=100 * US, latency=0.0)
    per_epoch = np.mean([added_s("local-sgd", cluster, 100, period=50, seed=seed) for seed in range(4)]) / 9
    assert 2 * 12 * 100 * US < per_epoch < 12 * 100 * US + 10 * MS


def test_a_parameter_server_s_chief_evaluates_on_its_node_and_the_others_go_on():
    cluster = quota(3, 1.0, compute_s=1 * MS, epoch_batches=30, eval_s=4 * MS, bandwidth=1e14)
    chief = 4 * MS + 2 * 20 * US  # its evaluation, its pull's way there and back
    # ps-sync waits for the chief between each two epochs (10 rounds each)
    assert added_s("ps-sync", cluster, 40) == pytest.approx(3 * chief, rel=1e-4)
    # ps-async: the others push on meanwhile; the same pushes take less than the chief's time
    assert 0 < added_s("ps-async", cluster, 40) < 3 * chief


@pytest.mark.parametrize(("cores", "evaluation"), [(4, 6 * MS / 4), (1, 6 * MS)])
def test_on_one_shared_host_the_replicas_evaluations_share_its_cores(cores, evaluation):
    # 4 workers on a host of 4 cores evaluate their quarters at once; on 1 core, one after another
    cluster = whole_cores(4, host_cores=cores, epoch_batches=40, eval_s=6 * MS, collective_step_s=150 * US)
    small = 2 * 3 * (20 * US + 150 * US)
    assert added_s("allreduce", cluster, 40) == pytest.approx(3 * (evaluation + 2 * small), rel=1e-9)
