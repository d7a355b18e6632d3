"""allreduce-ft's session (strategies/fault_tolerant/session.py) against a fake torchft Manager and
gradient group, in one process, as torchft tests its Manager: quorums, commits and redos, heals,
leaving and the run's record, each protocol property without spawning replicas.

The fakes stand where torchft stands: ``FakeManager`` plays a script of quorums (what the Lighthouse
would form for this replica), ``FakeGroup`` is the Manager's gradient group, whose sum adds what the
quorum's other participants send, and ``Loop`` is the Trainer as a strategy sees it (roles.FitLoop).
"""

import copy
import dataclasses
import signal
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn.functional import cross_entropy

pytest.importorskip("torchft")

from torchft.manager import ExceptionWithTraceback  # noqa: E402

from paratrain.errors import ReplicaLeft, StateLost, WorkerLost  # noqa: E402
from paratrain.strategies.fault_tolerant.replicas import ReplicaGroups, batch_mark  # noqa: E402
from paratrain.strategies.fault_tolerant.strategy import FaultTolerantAllReduceStrategy  # noqa: E402


@dataclasses.dataclass
class Quorum:
    """One quorum as the Lighthouse forms it for this replica."""

    rank: int | None = 0
    """This replica's rank among the participants (None: not participating)."""
    size: int = 1
    """The participants."""
    heal: "FakeManager | None" = None
    """A peer whose step and live state this replica takes, where it is behind the peer."""
    lost: bool = False
    """A member is lost: the quorum's sums fail."""
    commit: bool = True
    """Whether the other participants vote to commit the step."""
    peers: Callable[[torch.Tensor], torch.Tensor] | None = None
    """What the other participants add to a sum; None: each sends what this replica sends."""


class FakeManager:
    """torchft's Manager as paratrain drives it (``use_async_quorum=False``: a heal's state is
    loaded inside ``start_quorum``), over a script of quorums whose last one repeats. A step
    tried more than ``max_retries`` times raises, as torchft's does (here rather than hang)."""

    def __init__(self, load_state_dict, state_dict, *quorums: Quorum, max_retries: int = 3):
        self._load_state_dict = load_state_dict
        self._state_dict = state_dict
        self.script = list(quorums) or [Quorum()]
        self.max_retries = max_retries
        self.quorum: Quorum | None = None
        self.step = 0
        self.quorums = 0
        self.tries = 0  # quorums since the last commit
        self.error: ExceptionWithTraceback | None = None
        self.shut = False

    def start_quorum(self) -> None:
        self.tries += 1
        if self.tries > self.max_retries + 1:
            raise RuntimeError(f"step {self.step + 1} failed {self.max_retries} times, exceeding max_retries")
        self.quorum = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        self.quorums += 1
        self.error = None
        peer = self.quorum.heal
        if peer is not None and peer.step > self.step:  # behind: the peer's step, then its state (a copy)
            self.step = peer.step
            self._load_state_dict(copy.deepcopy(peer._state_dict()))

    def wait_quorum(self) -> None:
        pass

    def current_step(self) -> int:
        return self.step

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]

    def participating_rank(self) -> int | None:
        return None if self.quorum is None else self.quorum.rank

    def num_participants(self) -> int:
        return 0 if self.quorum is None else self.quorum.size

    def is_participating(self) -> bool:
        return self.participating_rank() is not None

    def report_error(self, error: Exception) -> None:
        self.error = ExceptionWithTraceback(error)

    def errored(self) -> ExceptionWithTraceback | None:
        return self.error

    def should_commit(self) -> bool:
        commit = self.error is None and self.quorum.commit
        if commit:
            self.step += 1
            self.tries = 0
        return commit

    def shutdown(self, wait: bool = True) -> None:
        self.shut = True


class _Work:
    def __init__(self, future: torch.futures.Future):
        self.future = future

    def get_future(self) -> torch.futures.Future:
        return self.future


class FakeGroup:
    """The Manager's gradient group: a sum over the current quorum, done at once."""

    shared = None  # no shared-memory buffer: the sums go to allreduce
    via: dict = {}

    def __init__(self, manager: FakeManager):
        self.manager = manager

    def allreduce(self, tensors, opts) -> _Work:
        quorum = self.manager.quorum
        future = torch.futures.Future()
        if quorum.lost:
            future.set_exception(RuntimeError("a member of the quorum was lost"))
            return _Work(future)
        for tensor in tensors:
            tensor.add_(quorum.peers(tensor) if quorum.peers else tensor * (quorum.size - 1))
        future.set_result(tensors)
        return _Work(future)


class Loop:
    """The Trainer as a strategy sees it: its model, optimizer and position."""

    def __init__(self, seed: int = 0, global_step: int = 0):
        torch.manual_seed(seed)
        self.module = nn.Linear(3, 2)
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=0.1, momentum=0.9)
        self.global_step = global_step
        self.epoch = 0
        self.batch = 0

    def state_dict(self) -> dict:
        return {"global_step": self.global_step, "epoch": self.epoch, "batch": self.batch}

    def load_state_dict(self, state: dict) -> None:
        self.global_step = state["global_step"]
        self.epoch = state["epoch"]
        self.batch = state["batch"]


X = torch.randn(6, 3, generator=torch.Generator().manual_seed(1))
Y = torch.tensor([0, 1, 0, 1, 1, 0])


@pytest.fixture
def replica():
    """``replica(*quorums)``: an allreduce-ft replica over a fake Manager, begun on ``loop``
    (a fresh Loop by default; the session holds it as its ``trainer``)."""
    made = []

    def make(*quorums: Quorum, loop: Loop | None = None, incarnation: int = 0, replicas: int = 1):
        strategy = FaultTolerantAllReduceStrategy(device="cpu")
        strategy.use_recipe(None)
        strategy.topology = ReplicaGroups(num_replicas=replicas)
        session = strategy.session
        session.incarnation = incarnation
        session.manager = FakeManager(session._load_live_state, session._live_state, *quorums)
        session.membership.group = FakeGroup(session.manager)
        made.append(strategy)
        session.begin(loop or Loop(), group=None)  # the Manager is made: no group to meet in
        return strategy

    yield make
    for strategy in reversed(made):  # each puts back the SIGTERM handler it found
        strategy.session.stop()


def _step(strategy, x=X, y=Y):
    """One step of the loop, as the Trainer takes it."""
    loop = strategy.session.trainer
    loop.batch += 1
    out = strategy.train_step(loop.module, cross_entropy, loop.optimizer, x, y)
    if out.position is not None:
        loop.load_state_dict(out.position)
    else:
        loop.global_step += 1
    return out


def _trained(replica, steps: int):
    """A peer (its model from another seed) that committed ``steps`` steps alone and waits in
    the quorum of its next."""
    peer = replica(loop=Loop(seed=7))
    for _ in range(steps):
        _step(peer)
    peer.session.trainer.batch += 1
    return peer


def _params(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def _reference_step(x=X, y=Y) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The model and loss of one single-process step on the whole batch."""
    loop = Loop()
    loss = cross_entropy(loop.module(x), y)
    loss.backward()
    loop.optimizer.step()
    return _params(loop.module), loss.detach()


def test_a_step_the_quorum_does_not_commit_changes_nothing_and_is_redone_with_the_next_quorum_s_part(replica):
    """Step 1's sum fails (its peer is lost): the Manager does not commit, the optimizer is not
    stepped, and the step is done again in the next quorum, now of one, on the whole batch."""
    strategy = replica(Quorum(rank=0, size=2, lost=True), Quorum(rank=0, size=1))
    out = _step(strategy)
    params, loss = _reference_step()
    for mine, reference in zip(strategy.session.trainer.module.parameters(), params, strict=True):
        torch.testing.assert_close(mine.detach(), reference)
    assert float(out.loss) == pytest.approx(float(loss))
    manager = strategy.session.manager
    assert manager.quorums == 2 and manager.step == 1 and strategy.session.uncommitted_steps == 1
    assert strategy.session.record.spans == [[1, 1, 1]]  # the failed try is no committed step


def test_each_participant_computes_its_part_of_the_global_batch_weighted_by_its_share(replica):
    """Rank 1 of 3 computes the middle third of the batch of 6, weighted 1/3; with its peers'
    thirds the committed step is the single-process step on the whole batch."""
    loop = Loop()

    def peers(sent: torch.Tensor) -> torch.Tensor:
        params = list(loop.module.parameters())
        added = torch.zeros_like(sent)
        for part in (slice(0, 2), slice(4, 6)):
            loss = cross_entropy(loop.module(X[part]), Y[part])
            grads = torch.autograd.grad(loss, params)
            tail = torch.stack([loss.detach(), torch.tensor(float(batch_mark(1, Y)))])
            added += torch.cat([*(g.reshape(-1) / 3 for g in grads), tail * torch.tensor([1 / 3, 1.0])])
        return added

    strategy = replica(Quorum(rank=1, size=3, peers=peers), loop=loop)
    out = _step(strategy)
    params, loss = _reference_step()
    for mine, reference in zip(loop.module.parameters(), params, strict=True):
        torch.testing.assert_close(mine.detach(), reference)
    assert float(out.loss) == pytest.approx(float(loss))


def test_participants_that_hold_different_batches_end_the_step_with_one_line(replica):
    """Each participant adds its batch's mark to the sum; a peer at another step or batch (a
    position not carried over) makes the marks disagree, and the replica stops."""

    def elsewhere(sent: torch.Tensor) -> torch.Tensor:
        peer = sent.clone()
        peer[-1] += 1
        return peer

    strategy = replica(Quorum(rank=0, size=2, peers=elsewhere))
    with pytest.raises(WorkerLost, match="disagree on the global batch of step 1"):
        _step(strategy)


def test_the_record_holds_each_committed_step_s_participants(replica):
    """Two replicas commit steps 1-40; the peer is lost in step 41's sum, and the survivor does
    it again alone, then 42-50: the record is [[1, 40, 2], [41, 50, 1]], the failed try is an
    uncommitted step, and the bytes sent count every participant of every committed step."""
    strategy = replica(*[Quorum(size=2)] * 40, Quorum(size=2, lost=True), Quorum(size=1))
    for _ in range(50):
        _step(strategy)
    stats = strategy.stats()
    assert stats["participants"]["per_step"] == [[1, 40, 2], [41, 50, 1]]
    assert stats["participants"]["histogram"] == {"1": 10, "2": 40}
    assert stats["uncommitted_steps"] == 1 and stats["quorums"] == 51
    assert strategy.session.step_bytes == (3 * 2 + 2) * 4  # nn.Linear(3, 2)'s gradient in float32
    assert stats["bytes_sent"] == strategy.session.step_bytes * (40 * 2 + 10)


def test_a_replacement_takes_a_live_peer_s_state_and_position_in_its_first_quorum(replica):
    """A replacement (its model from another seed) meets a peer that committed 3 steps and waits
    in step 4's quorum: it takes the peer's model, optimizer, record and loss, its loop goes on
    at step 3 one batch before the peer's, and its first step is step 4 in that same quorum."""
    peer = _trained(replica, 3)
    joiner = replica(Quorum(rank=1, size=2, heal=peer.session.manager), incarnation=1, replicas=2)
    session = joiner.session
    loop = session.trainer
    served = peer.session._live_state()
    assert session.manager.step == 3 and (loop.global_step, loop.batch) == (3, 3)
    for mine, theirs in zip(loop.module.state_dict().values(), served["model"].values(), strict=True):
        assert torch.equal(mine, theirs)
    mine, theirs = (list(o["state"].values()) for o in (loop.optimizer.state_dict(), served["optimizer"]))
    assert len(mine) == 2 and all(torch.equal(a["momentum_buffer"], b["momentum_buffer"]) for a, b in zip(mine, theirs))
    assert session.last_loss == served["strategy"]["last_loss"]
    assert session.record.recoveries[-1]["from_step"] == 0 and session.record.recoveries[-1]["to_step"] == 3
    _step(joiner)
    assert session.manager.quorums == 1 and session.manager.step == 4
    assert session.record.spans == [[1, 3, 1], [4, 4, 2]]  # the peer's record, and the step taken together


def test_a_replica_healed_one_step_behind_trains_the_next_step_in_the_quorum_that_healed_it(replica):
    """The peers committed step 3 while this replica could not; the quorum that healed it (to
    step 3) is the peers' quorum for step 4, whose all-reduce they are already in. This
    replica's step 4 must run in that quorum: a quorum of its own would leave the peers
    waiting out --timeout in the all-reduce (the allreduce-ft hang after a first replica's
    loss)."""
    peer = _trained(replica, 3).session.manager
    strategy = replica(Quorum(size=2), Quorum(size=2), Quorum(rank=1, size=2, heal=peer), Quorum(size=2))
    _step(strategy)
    _step(strategy)
    manager = strategy.session.manager
    out = _step(strategy)  # step 3: taken from the peer
    assert manager.quorums == 3 and manager.step == 3 and strategy.session.behind_heals == 1
    assert out.logits is None and out.position is None  # one step behind: the loop's next batch is the peers'
    before = _params(strategy.session.trainer.module)
    _step(strategy)
    assert manager.quorums == 3  # step 4 ran in the quorum that healed the replica
    assert manager.step == 4 and not torch.equal(strategy.session.trainer.module.weight, before[0])
    _step(strategy)
    assert manager.quorums == 4  # and every later step forms its own


@pytest.mark.parametrize("served_step", [5, 4], ids=["peer-position", "wrong-position"])
def test_a_replica_left_out_of_several_quorums_goes_on_from_its_peers_position_never_another(replica, served_step):
    """Behind by three steps (it missed the quorums of 3 and 4), the replica goes on from the
    position its peer served with its state; one that does not match the peer's step ends the
    replica instead of training from a wrong position."""
    peer = _trained(replica, 5)
    peer.session.trainer.global_step = served_step
    strategy = replica(Quorum(size=2), Quorum(size=2), Quorum(rank=1, size=2, heal=peer.session.manager))
    _step(strategy)
    _step(strategy)
    if served_step != 5:
        with pytest.raises(WorkerLost, match="fell 3 steps behind its peers"):
            _step(strategy)
        return
    out = _step(strategy)
    assert out.position == {"global_step": 5, "epoch": 0, "batch": 5}
    assert strategy.session.trainer.global_step == 5 and strategy.session.manager.step == 5
    assert strategy.session.record.spans == [[1, 5, 1]]  # the peer's record replaces its own


def test_a_replica_asked_to_leave_finishes_its_step_and_starts_no_other(replica):
    """SIGTERM during step 2's sum: the step commits and is applied, then the replica leaves
    the quorums (its Manager shut down). Asked between steps, it leaves before any quorum."""

    def asked(sent: torch.Tensor) -> torch.Tensor:
        session._sigterm._handle(signal.SIGTERM, None)  # the signal, arriving mid-step
        return torch.zeros_like(sent)  # a quorum of one: nothing to add

    strategy = replica(Quorum(), Quorum(peers=asked))
    session = strategy.session
    _step(strategy)
    manager, before = session.manager, _params(strategy.session.trainer.module)
    with pytest.raises(ReplicaLeft, match="left the run after step 2"):
        _step(strategy)
    assert manager.step == 2 and session.record.spans == [[1, 2, 1]]
    assert not torch.equal(strategy.session.trainer.module.weight, before[0])
    assert manager.shut and session.manager is None
    between = replica()
    _step(between)
    between.session._sigterm._handle(signal.SIGTERM, None)
    manager = between.session.manager
    with pytest.raises(ReplicaLeft, match="left the run after step 1"):
        _step(between)
    assert manager.quorums == 1 and manager.step == 1


def test_a_non_finite_gradient_from_any_participant_skips_the_update_and_the_step_still_commits(replica):
    """With on_nan="skip", a peer's NaN makes the summed gradient non-finite: this replica skips
    the update too (the check is on the sum, the same on every participant) and the step commits,
    so that the replicas stay at the same step and model."""

    def nan(sent: torch.Tensor) -> torch.Tensor:
        peer = sent.clone()
        peer[0] = float("nan")
        return peer

    strategy = replica(Quorum(size=2, peers=nan))
    strategy.on_nan = "skip"
    before = _params(strategy.session.trainer.module)
    out = _step(strategy)
    assert out.skipped and strategy.skipped_updates == 1
    assert all(torch.equal(a, b) for a, b in zip(strategy.session.trainer.module.parameters(), before, strict=True))
    assert strategy.session.manager.step == 1 and strategy.session.record.spans == [[1, 1, 2]]


def test_a_replacement_with_no_live_peer_at_step_0_fails_and_one_resumed_goes_on_from_its_checkpoint(replica):
    """A replacement alone in its first quorum at step 0 holds none of the run's state: it stops
    rather than train the run again from the start. One resumed from a checkpoint of step 20
    starts its Manager there, and its next step is step 21."""
    with pytest.raises(StateLost, match="found no live replica"):
        replica(Quorum(size=1), incarnation=1, replicas=2)
    resumed = replica(Quorum(size=1), loop=Loop(global_step=20), incarnation=1, replicas=2)
    assert resumed.session.manager.step == 20
    _step(resumed)
    assert resumed.session.record.spans == [[21, 21, 1]]


def test_evaluation_scores_its_part_and_every_example_when_the_quorum_s_sum_fails(replica):
    """After a step committed by 2 replicas each scores half of the 10 examples and the sums
    are added over the quorum; where that sum fails (the peer is gone) the replica scores
    every example itself: the same sums, later."""
    strategy = replica(Quorum(rank=1, size=2))
    _step(strategy)
    seen = []

    def sums_of(batches) -> torch.Tensor:
        seen.append(sum(len(targets) for _, targets in batches))
        return torch.tensor([float(seen[-1])], dtype=torch.float64)

    data = (torch.randn(10, 3), torch.zeros(10, dtype=torch.long))
    assert float(strategy.evaluation_sums(data, 4, sums_of)[0]) == 10 and seen == [5]
    manager = strategy.session.manager
    manager.quorum = dataclasses.replace(manager.quorum, lost=True)
    assert float(strategy.evaluation_sums(data, 4, sums_of)[0]) == 10 and seen == [5, 5, 10]
