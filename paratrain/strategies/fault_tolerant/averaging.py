"""``local-sgd-ft`` and ``diloco-ft`` (``--strategy local-sgd|diloco --fault-tolerant``): local SGD and DiLoCo
that keep training through a lost replica.

Each replica is one process and its own torchft replica group, and meets the others only to synchronize:
every ``--sync-every H`` steps the live replicas form a quorum, average their deltas from the anchor
(``averaging/anchors.py``) weighted by the share of the round's examples each trained on, and step the
anchor with the outer optimizer. A lost replica thus costs nothing between synchronizations, and without a
loss the run equals ``local-sgd``/``diloco`` (tested). A synchronization that did not commit is redone with
the new quorum from the same deltas; a replacement takes a live peer's state at a synchronization.
``--local-after`` and codecs that do not add up (int8, topk, powersgd) are refused: a synchronization is one
all-reduce over the quorum. docs/fault_tolerance.md has more.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim import Optimizer

from paratrain.data.batch import map_tensors, num_examples
from paratrain.errors import WorkerLost
from paratrain.strategies.averaging.anchors import Anchors, fragment_due
from paratrain.strategies.averaging.config import outer_options, taken_options
from paratrain.strategies.base import DEFAULT_TIMEOUT_S
from paratrain.strategies.fault_tolerant.options import session_options
from paratrain.strategies.fault_tolerant.reduce import sum_weighted
from paratrain.strategies.fault_tolerant.strategy import FaultTolerantAllReduceStrategy
from paratrain.strategies.local_step import local_step
from paratrain.strategies.recipe import StepRecipe
from paratrain.strategies.roles import FitLoop
from paratrain.strategies.step import LossFn, StepOutput

if TYPE_CHECKING:
    from paratrain.config import TrainConfig

#: A synchronization in progress: its fragment, whether it takes the outer step, and the
#: training step it follows.
Sync = tuple[int, bool, int]


class FaultTolerantAveragingStrategy(FaultTolerantAllReduceStrategy):
    """An ``allreduce-ft`` replica (one process, its session, the whole global batch) whose
    steps are local and whose quorums come at synchronizations."""

    name = "periodic-averaging-ft"
    #: The outer optimizer's (lr, momentum) when not given.
    outer: tuple[float, float] = (1.0, 0.0)

    def __init__(
        self,
        device: str = "auto",
        timeout: float = DEFAULT_TIMEOUT_S,
        workers: int | None = None,
        sync_every: int = 8,
        fragments: int = 1,
        outer_lr: float | None = None,
        outer_momentum: float | None = None,
        **session: Any,
    ):
        """``session``: ``lighthouse``, ``min_replicas``, ``heartbeat_timeout`` and
        ``compression`` (fault_tolerant/session.py)."""
        super().__init__(device=device, timeout=timeout, workers=workers, **session)
        self.outer_lr, self.outer_momentum = outer_options(
            self.name, self.outer, outer_lr, outer_momentum, sync_every=sync_every, fragments=fragments
        )
        self.sync_every, self.fragments = sync_every, fragments
        self.session.schedule = self  # quorums at synchronizations (live_position and the rest below)
        self.anchors: Anchors | None = None
        """The model the replicas share, with its outer optimizers; made by ``prepare``."""
        self.syncs = 0
        """Synchronizations committed (of one fragment each): the Manager's step."""
        self.trained = [0.0] * fragments
        """Global batches' worth of examples this replica trained on since each fragment's
        last synchronization: its delta's weight."""
        self._syncing: Sync | None = None
        self._joined: Sync | None = None  # the peers' synchronization a heal brought this replica into
        self._pending: dict[str, Any] | None = None  # checkpoint state loaded before prepare()

    @classmethod
    def from_config(cls, config: TrainConfig) -> FaultTolerantAveragingStrategy:
        return cls(**session_options(config), **taken_options(config, cls.name))

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "fault_tolerance": "per-synchronization", "sync_every": self.sync_every}

    def prepare(
        self, model: nn.Module, optimizer: Optimizer, recipe: StepRecipe | None = None
    ) -> tuple[nn.Module, Optimizer]:
        model, optimizer = super().prepare(model, optimizer, recipe)
        named = [(name, p) for name, p in self.unwrap(model).named_parameters() if p.requires_grad]
        self.anchors = Anchors(named, self.fragments, self.outer_lr, self.outer_momentum, 0)
        self.session.step_bytes = self.session.wire_bytes(self.anchors.params) // self.fragments
        if self._pending is not None:
            self.anchors.load_state_dict(self._pending)
            self._pending = None
        return model, optimizer

    def begin_fit(self, trainer: FitLoop) -> None:
        """The first quorum (session.py); a replacement healed in it takes part in the
        synchronization its peers are in before its first step."""
        self._joined = None
        super().begin_fit(trainer)
        if self._joined is not None:
            joined, self._joined = self._joined, None
            self._synchronize(*joined)

    # ----- the step ------------------------------------------------------------------------
    def train_step(
        self, model: nn.Module, loss_fn: LossFn, optimizer: Optimizer, inputs: Any, targets: Any
    ) -> StepOutput:
        """A local step on this participant's part of the global batch, then the
        synchronization of the fragment this step ends the round of, if any."""
        total = num_examples(targets)
        piece = self.session.part(total)
        x, y = map_tensors(inputs, lambda t: t[piece]), map_tensors(targets, lambda t: t[piece])
        out = local_step(self, model, loss_fn, optimizer, x, y)
        self.trained = [done + (piece.stop - piece.start) / total for done in self.trained]
        at = self.session.trainer.global_step + 1
        fragment = fragment_due(at, 0, self.sync_every, self.fragments)
        if fragment is not None:
            position = self._synchronize(fragment, True, at)
            if position is not None:  # healed from a peer: the loop goes on from its position
                return StepOutput(out.loss, None, position=position)
        return out

    def finish(self, model: nn.Module) -> None:
        """The end of training: a plain average of every fragment changed since its last
        synchronization, over the quorum, so that the replicas end as one model."""
        at = self.session.trainer.global_step
        for fragment, synced in enumerate(self.anchors.synced_at):
            if at > synced:
                self._synchronize(fragment, False, at)

    def _synchronize(self, fragment: int, outer: bool, at: int) -> dict[str, Any] | None:
        """One committed synchronization of ``fragment`` after training step ``at``, done
        again with a new quorum until it commits. The loop's position where this replica
        healed from a peer in it (it then took part in the peer's synchronization)."""
        session = self.session
        step = session.manager.current_step() + 1
        position = None
        self._syncing = (fragment, outer, at)
        try:
            while True:
                done = session.next_quorum(step)
                if done >= step:  # healed: the peer's state, in the peer's synchronization
                    position, session.joined_state = session.joined_state, None
                    (fragment, outer, at), step = self._joined, done + 1
                    self._syncing, self._joined = self._joined, None
                means, participants = self._mean_over_quorum(fragment, at, step)
                if session.commit(step):
                    break
                session.uncommitted_steps += 1
        finally:
            self._syncing = None
        if means is not None:
            self.anchors.step(fragment, means, outer, at)
        self.trained[fragment] = 0.0
        self.syncs += 1
        session.count_step(step, participants)
        session.leave_if_asked(at)
        return position

    @torch.no_grad()
    def _mean_over_quorum(self, fragment: int, at: int, step: int) -> tuple[list[torch.Tensor] | None, int]:
        """The participants' deltas of ``fragment``, weighted by the examples each trained on,
        over the weights' sum (None when no participant trained: the anchor stays), and the
        number of participants."""
        deltas = self.anchors.deltas(fragment)
        flat = torch.cat([d.reshape(-1) for d in deltas])
        # Weighted by the round's share (at most 1: a replica that trained every example of
        # the round alone), so that a 16-bit wire keeps its range.
        weight = self.trained[fragment] / self.sync_every
        mark = zlib.crc32(f"{at}:{fragment}".encode()) % 65536
        membership = self.session.membership
        total, weights = sum_weighted(membership, flat, torch.ones(()), weight, mark, self.session.wire_dtype, step)
        if weights is None:
            raise WorkerLost(
                f"worker {self.process_rank}: the replicas disagree on the synchronization after step {at} "
                "(a position was not carried over)"
            )
        participants = membership.manager.num_participants()
        if not float(weights) > 0:
            return None, participants
        means, offset = [], 0
        for delta in deltas:
            means.append(total[offset : offset + delta.numel()].view_as(delta).div(weights).to(delta.dtype))
            offset += delta.numel()
        return means, participants

    @contextlib.contextmanager
    def evaluating(self, model: nn.Module) -> Iterator[None]:
        """Evaluation scores the model the replicas share (the anchor), not this replica's."""
        with self.anchors.swapped_in():
            yield

    # ----- the session's schedule (session.QuorumSchedule) ------------------------------------
    def live_position(self, trainer: FitLoop) -> dict[str, Any]:
        """Served in a synchronization, after this replica's step (in the loop) or after the
        last (at the end): the joiner's first step is the next."""
        position = trainer.state_dict()
        if self._syncing is not None and self._syncing[2] > trainer.global_step:  # inside the step
            position["global_step"] = self._syncing[2]
        return position

    def committed_quorums(self, trainer: FitLoop) -> int:
        return self.syncs

    def take_live_state(self, state: dict[str, Any]) -> None:
        """A peer's anchor, outer optimizers and counts; this replica restarts its round from
        the anchor, having trained nothing of it."""
        self.load_state_dict(state)  # the counts, the run's record, the anchor and outer optimizers
        self.anchors.restart_from_anchors()
        self.trained = [0.0] * self.fragments
        self._joined = tuple(state["sync"])

    # ----- accounting and state --------------------------------------------------------------
    def step_counters(self) -> dict[str, float]:
        return {"bytes_sent": self.session.step_bytes * self.syncs, "wait_seconds": self.wait_seconds, "staleness": 0}

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "synchronizations": self.syncs}

    def state_dict(self) -> dict[str, Any]:
        if self.anchors is None and self._pending is not None:
            return self._pending
        return {
            **super().state_dict(),
            **self.anchors.state_dict(),
            "syncs": self.syncs,
            "trained": list(self.trained),
            "sync": self._syncing,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.syncs, self.trained = int(state["syncs"]), [float(t) for t in state["trained"]]
        if self.anchors is not None:
            self.anchors.load_state_dict(state)
        else:
            self._pending = state


class FaultTolerantLocalSGDStrategy(FaultTolerantAveragingStrategy):
    """``local-sgd-ft``: ``local-sgd``'s averaging every ``sync_every`` steps, over a quorum."""

    name = "local-sgd-ft"


class FaultTolerantDiLoCoStrategy(FaultTolerantAveragingStrategy):
    """``diloco-ft``: ``diloco``'s outer Nesterov step every ``sync_every`` steps, over a quorum."""

    name = "diloco-ft"
    outer = (0.7, 0.9)
