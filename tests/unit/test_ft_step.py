"""allreduce-ft's step loop against a fake torchft Manager, in one process (as torchft tests
its Manager): a protocol bug shows here without spawning replicas."""

import pytest
import torch
from torch import nn

pytest.importorskip("torchft")

from paratrain.strategies.fault_tolerant.strategy import FaultTolerantAllReduceStrategy  # noqa: E402


class _Work:
    """A collective of a quorum of one: done at once."""

    def get_future(self) -> torch.futures.Future:
        future = torch.futures.Future()
        future.set_result(None)
        return future


class FakeGroup:
    shared = None  # no shared-memory buffer: the sums go to allreduce

    def allreduce(self, tensors, opts) -> _Work:
        return _Work()


class FakeManager:
    """One replica's Manager: ``heal_to`` makes the next quorum a heal to that step (the peers
    committed it while this replica could not); every commit advances the step."""

    def __init__(self):
        self.step = 0
        self.quorums = 0
        self.heal_to = None

    def current_step(self) -> int:
        return self.step

    def start_quorum(self) -> None:
        self.quorums += 1
        if self.heal_to is not None:
            self.step, self.heal_to = self.heal_to, None

    def participating_rank(self) -> int:
        return 0

    def num_participants(self) -> int:
        return 1

    def wait_quorum(self) -> None:
        pass

    def is_participating(self) -> bool:
        return True

    def errored(self):
        return None

    def should_commit(self) -> bool:
        self.step += 1
        return True


def _strategy():
    strategy = FaultTolerantAllReduceStrategy(device="cpu")
    strategy.device = torch.device("cpu")
    strategy.use_recipe(None)
    strategy.session.manager = FakeManager()
    strategy.session.membership.group = FakeGroup()
    return strategy


def test_a_replica_healed_behind_its_peers_trains_the_next_step_in_the_quorum_that_healed_it():
    """The peers committed step 1 while this replica could not; the quorum that healed it
    (to step 1) is the peers' quorum for step 2, whose all-reduce they are already in. This
    replica's step 2 must run in that quorum: a quorum of its own would leave the peers
    waiting out --timeout in the all-reduce (the allreduce-ft hang after a first replica's
    loss)."""
    strategy = _strategy()
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 0, 1])
    manager = strategy.session.manager
    manager.heal_to = 1
    out = strategy.train_step(model, nn.functional.cross_entropy, optimizer, x, y)
    assert manager.quorums == 1 and manager.step == 1 and strategy.session.behind_heals == 1 and out.logits is None
    before = model.weight.detach().clone()
    strategy.train_step(model, nn.functional.cross_entropy, optimizer, x, y)
    assert manager.quorums == 1  # step 2 ran in the quorum that healed the replica
    assert manager.step == 2 and not torch.equal(model.weight, before)
    strategy.train_step(model, nn.functional.cross_entropy, optimizer, x, y)
    assert manager.quorums == 2  # and every later step forms its own
