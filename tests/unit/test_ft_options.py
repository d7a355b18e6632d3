"""allreduce-ft without processes: its options, its slices of the global batch, and how a
joining replica reads a peer's state."""

import pickle
from datetime import timedelta

import pytest
import torch

from paratrain.comm.transport import ClusterEnv
from paratrain.config import TrainConfig
from paratrain.data.batch import part_of
from paratrain.errors import ConfigError
from paratrain.strategies.fault_tolerant.replicas import ReplicaGroups


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"strategy": "allreduce-ft", "workers": 2, "min_replicas": 3},
            "--min-replicas 3 is more than --workers 2: no step could commit",
        ),
        ({"strategy": "allreduce-ft", "min_replicas": 0}, "--min-replicas must be >= 1, got 0"),
        (
            {"strategy": "allreduce-ft", "lighthouse": "host:29510"},
            "--lighthouse must be an address like http://HOST:29510, got 'host:29510'",
        ),
        (
            {"strategy": "allreduce-ft", "replica_heartbeat_timeout": 0.0},
            "--replica-heartbeat-timeout must be > 0, got 0.0",
        ),
        (
            {"strategy": "allreduce", "min_replicas": 2},
            "--min-replicas applies to --strategy allreduce-ft, pipeline-ft, local-sgd-ft, diloco-ft and fsdp-ft, not to --strategy allreduce",
        ),
        (
            {"strategy": "pipeline-ft", "workers": 4, "min_replicas": 3},
            "--min-replicas 3 is more than the run's 2 pipeline replicas (--workers 4 / --stages 2): no step could commit",
        ),
        (
            {"strategy": "pipeline-ft", "workers": 4, "balance": "time"},
            "--strategy pipeline-ft splits by --balance params or --split-points: a replacement takes its stage from a peer before any batch, when a split by time is not known yet",
        ),
        (
            {"strategy": "pipeline-ft", "workers": 3},
            "--workers 3 is not a multiple of --stages 2: the run has workers / stages pipeline replicas of 2 processes each (e.g. --workers 4)",
        ),
        (
            {"strategy": "pipeline-ft", "compression": "int8"},
            "--strategy pipeline-ft sums each step's gradient in one all-reduce: --compression must be one of none, fp16, bf16 (payloads that add up), got 'int8'",
        ),
        (
            {"strategy": "allreduce-ft", "precision": "fp16"},
            "--precision fp16 needs a gradient scaler beside the optimizer, which --strategy allreduce-ft runs elsewhere; use --precision bf16, or --strategy single or allreduce",
        ),
    ],
)
def test_refused_with_one_line(options, message):
    with pytest.raises(ConfigError) as caught:
        TrainConfig(**options)
    assert str(caught.value) == message


def test_replacements_need_no_checkpoint_folder():
    config = TrainConfig(strategy="allreduce-ft", workers=3, max_restarts=2, min_replicas=2)
    assert config.topology == ReplicaGroups(num_replicas=3)
    assert config.topology.expendable_ranks == frozenset({0, 1, 2})
    assert config.global_batch == 3 * 32  # the global batch of allreduce, whoever is alive
    with pytest.raises(ConfigError, match="--max-restarts needs --checkpoint-dir"):
        TrainConfig(strategy="allreduce", workers=2, max_restarts=1)


def test_pipeline_replicas_are_replaced_as_units_and_keep_the_global_batch():
    from paratrain.strategies.fault_tolerant.pipeline import PipelineReplicaGroups

    config = TrainConfig(strategy="pipeline-ft", stages=2, workers=6, max_restarts=1, batch_size=8, microbatches=4)
    assert config.topology == PipelineReplicaGroups(num_replicas=3, num_stages=2)
    assert config.topology.replaces_lost and config.topology.expendable_ranks == frozenset(range(6))
    assert config.topology.rank_name(3) == "stage 1 of replica 1"
    assert config.global_batch == 3 * 8
    config.topology.check_cluster(ClusterEnv(0, 2, 0, "127.0.0.1", 29500), "pipeline-ft")
    with pytest.raises(ConfigError, match="one torchrun job per replica, of --stages 2 processes"):
        config.topology.check_cluster(ClusterEnv(0, 6, 0, "127.0.0.1", 29500), "pipeline-ft")


def test_under_torchrun_each_replica_is_a_job_of_one_process():
    topology = ReplicaGroups(num_replicas=2)
    topology.check_cluster(ClusterEnv(0, 1, 0, "127.0.0.1", 29500), "allreduce-ft")
    with pytest.raises(ConfigError, match="one torchrun job per replica"):
        topology.check_cluster(ClusterEnv(0, 2, 0, "127.0.0.1", 29500), "allreduce-ft")


def _transport():
    pytest.importorskip("torchft")
    from paratrain.comm.live_state import LiveStateTransport

    return LiveStateTransport(timedelta(seconds=10), "127.0.0.1")


def test_a_peer_state_travels_whole_and_is_read_without_unpickling_code():
    transport = _transport()
    try:
        model = torch.nn.Linear(3, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.ones(4, 3)).sum().backward()
        optimizer.step()
        state = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "trainer": {"epoch": 2, "rng": (3, (1, 2))},
        }
        transport.send_checkpoint([1], step=7, state_dict=state, timeout=timedelta(seconds=10))
        assert transport.metadata().startswith("http://127.0.0.1:")
        received = transport.recv_checkpoint(0, transport.metadata(), 7, timedelta(seconds=10))
        assert torch.equal(received["model"]["weight"], model.weight.detach())
        momentum = optimizer.state_dict()["state"][0]["momentum_buffer"]
        assert torch.equal(received["optimizer"]["state"][0]["momentum_buffer"], momentum)
        assert received["trainer"] == {"epoch": 2, "rng": (3, (1, 2))}
        # A peer that sends an object of some class (code, on load) is refused.
        transport.send_checkpoint([1], step=8, state_dict={"x": _Payload()}, timeout=timedelta(seconds=10))
        with pytest.raises(pickle.UnpicklingError, match="Unsupported global"):
            transport.recv_checkpoint(0, transport.metadata(), 8, timedelta(seconds=10))
    finally:
        transport.shutdown()


class _Payload:
    pass


@pytest.mark.parametrize("participants", [1, 2, 3, 4])
def test_the_parts_of_a_global_batch_weighted_by_their_share_give_its_mean_gradient(participants):
    """What each participant sums: its part's mean-loss gradient times (part size / global
    batch). Their sum is the global batch's mean-loss gradient whoever takes part."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    x, y = torch.randn(30, 5), torch.randint(0, 3, (30,))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    whole = model.weight.grad.clone()
    total = torch.zeros_like(whole)
    covered = []
    for part in range(participants):
        piece = part_of(30, part, participants)
        lo, hi = piece.start, piece.stop
        assert abs((hi - lo) - 30 / participants) < 1
        covered += range(lo, hi)
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x[lo:hi]), y[lo:hi]).backward()
        total += model.weight.grad * (hi - lo) / 30
    assert covered == list(range(30))  # every example once
    torch.testing.assert_close(total, whole, rtol=1e-5, atol=1e-7)
