"""``local-sgd`` and ``diloco``: replicas train on their own and synchronize every H steps.

Each replica steps its own (*inner*) optimizer on its slice of every global batch; every ``--sync-every H``
steps the replicas average the change of their parameters and apply it to the shared *anchor*::

    delta_i = anchor - params_i                      (each replica's pseudo-gradient)
    anchor  = OuterSGD(anchor, mean_i delta_i)       (one collective per H steps)
    params_i = anchor

``local-sgd`` (Lin et al. 2020) averages plainly (outer SGD, lr 1); ``diloco`` (Douillard et al. 2023) takes a
Nesterov outer step, ``--fragments F`` syncing 1/F of the model every H/F steps (Streaming DiLoCo). Deltas go
through the run's codec (``comm/average.py``). Checkpoints hold every replica's model (``rank-<i>.pt``);
evaluation scores the anchor, and training ends with a plain average so that a run returns one model.
See docs/local_sgd.md and docs/diloco.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain.comm.average import average
from paratrain.comm.codec_config import as_codec, check_saved_codec
from paratrain.comm.codecs import Codec
from paratrain.comm.flat import mean_gradients
from paratrain.strategies.accounting import staleness_summary
from paratrain.strategies.averaging.anchors import Anchors, fragment_due
from paratrain.strategies.averaging.config import outer_options, taken_options
from paratrain.strategies.base import DEFAULT_TIMEOUT_S
from paratrain.strategies.recipe import StepRecipe
from paratrain.strategies.replica import ReplicaStrategy
from paratrain.strategies.spec import process_options
from paratrain.strategies.topology import Topology
from paratrain.timeline import COMM, span

if TYPE_CHECKING:
    from paratrain.config import TrainConfig


@dataclass(frozen=True)
class AveragingTopology(Topology):
    """Replicas that differ between synchronizations: each saves its own model."""

    def model_part(self, rank: int) -> str | None:
        return f"rank-{rank}"


class PeriodicAveragingStrategy(ReplicaStrategy):
    """Local steps, and every ``sync_every`` steps an outer step on the averaged delta."""

    name = "periodic-averaging"
    takes_compression = True
    #: The outer optimizer's (lr, momentum) when not given.
    outer: tuple[float, float] = (1.0, 0.0)

    def __init__(
        self,
        device: str = "auto",
        timeout: float = DEFAULT_TIMEOUT_S,
        sync_every: int = 8,
        local_after: int = 0,
        fragments: int = 1,
        outer_lr: float | None = None,
        outer_momentum: float | None = None,
        compression: str | Codec = "none",
        workers: int | None = None,
    ):
        super().__init__(device=device, timeout=timeout, workers=workers)
        self.outer_lr, self.outer_momentum = outer_options(
            self.name,
            self.outer,
            outer_lr,
            outer_momentum,
            sync_every=sync_every,
            local_after=local_after,
            fragments=fragments,
        )
        self.sync_every = sync_every
        self.local_after = local_after
        self.fragments = fragments
        self.codec = as_codec(compression)
        self.syncs = 0
        """Synchronizations done (of one fragment each, with ``fragments`` > 1)."""
        self.anchors: Anchors | None = None
        """The model the replicas share, with its outer optimizers (anchors.py); made by ``prepare``."""
        self._bytes = 0
        self._pending: dict[str, Any] | None = None  # state loaded before prepare()
        self._statistics: list[torch.Tensor] = []  # floating buffers (BatchNorm's running statistics)

    @classmethod
    def topology_of(cls, num_replicas: int) -> Topology:
        return AveragingTopology(num_replicas=num_replicas)

    @classmethod
    def from_config(cls, config: TrainConfig) -> PeriodicAveragingStrategy:
        return cls(**process_options(config), compression=config.codec.build(), **taken_options(config, cls.name))

    # ----- model ---------------------------------------------------------------------------------
    def prepare(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, recipe: StepRecipe | None = None
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        model, optimizer = super().prepare(model, optimizer, recipe)
        with torch.no_grad():  # every replica starts from rank 0's model
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor.data, src=0)
        self._statistics = [b for b in model.buffers() if b.is_floating_point()]
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self.anchors = Anchors(named, self.fragments, self.outer_lr, self.outer_momentum, self.local_after)
        if self._pending is not None:
            self.anchors.load_state_dict(self._pending)
            self._pending = None
        return model, optimizer

    def reduce_gradients(self, model: nn.Module) -> None:
        """During the first ``local_after`` steps: the gradient's mean over the replicas."""
        if self.steps_taken >= self.local_after:
            return
        with span("allreduce", COMM):
            self._bytes += mean_gradients(
                [p for p in self.anchors.params if p.grad is not None], None, self.num_replicas
            )

    def train_step(self, model, loss_fn, optimizer, inputs, targets):  # noqa: ANN001, ANN201 - Strategy's
        out = super().train_step(model, loss_fn, optimizer, inputs, targets)
        step = self.steps_taken
        if step == self.local_after:  # the replicas are equal here: the anchor starts from them
            self.anchors.reset(step)
            if step:
                self._average_statistics()  # the warm-up's own (its gradients were averaged, not they)
        else:
            fragment = fragment_due(step, self.local_after, self.sync_every, self.fragments)
            if fragment is not None:
                self.synchronize(fragment)
        return out

    @torch.no_grad()
    def synchronize(self, fragment: int, outer: bool = True) -> None:
        """The outer step of one fragment: average the replicas' deltas from the anchor,
        step the anchor with the outer optimizer (``outer=False``: plain averaging), and go
        on from it. Every replica calls it at the same step."""
        with span("synchronize", COMM, fragment=fragment):
            means, sent = average(self.anchors.deltas(fragment), self.codec, self.anchors.keys(fragment))
        self._bytes += sent
        self.anchors.step(fragment, means, outer, self.steps_taken)
        if fragment == 0:
            self._average_statistics()
        self.syncs += 1

    @torch.no_grad()
    def _average_statistics(self) -> None:
        """The floating buffers (running statistics) averaged over the replicas, plainly, once
        a round: each replica's drift apart from its own batches as its parameters do, and
        the model the replicas share (and the one a run ends with) has one of each."""
        if not self._statistics:
            return
        means, sent = average(self._statistics, as_codec("none"), range(len(self._statistics)))
        self._bytes += sent
        for buffer, mean in zip(self._statistics, means):
            buffer.copy_(mean)

    def finish(self, model: nn.Module) -> None:
        """The end of training: average every fragment that changed since its last
        synchronization (plainly: an outer step with momentum on a part of a round would
        overshoot), so that the replicas end as one model."""
        due = [f for f, synced in enumerate(self.anchors.synced_at) if self.steps_taken > max(synced, self.local_after)]
        for fragment in due:
            self.synchronize(fragment, outer=False)
        if due and 0 not in due:
            self._average_statistics()

    @contextlib.contextmanager
    def evaluating(self, model: nn.Module) -> Iterator[None]:
        """Evaluation scores the model the replicas share (the anchor), not this replica's."""
        if self.steps_taken <= self.local_after or self.anchors is None:
            yield  # the replicas are equal
            return
        with self.anchors.swapped_in():
            yield

    # ----- accounting and state ------------------------------------------------------------------------
    def step_counters(self) -> dict[str, float]:
        return {"bytes_sent": self._bytes, "wait_seconds": self.wait_seconds, "staleness": 0}

    def stats(self) -> dict[str, Any]:
        counter = torch.tensor([self._bytes], dtype=torch.int64, device=self.device)
        return {
            "bytes_sent": int(self.all_reduce_sum(counter).item()),
            "dropped_gradients": 0,
            "staleness": staleness_summary({0: self._steps * self.num_replicas}),
            "synchronizations": self.syncs,
        }

    def state_dict(self) -> dict[str, Any]:
        if self.anchors is None and self._pending is not None:
            return self._pending
        return {
            **super().state_dict(),
            **self.anchors.state_dict(),
            "compression": self.codec.name,
            "syncs": self.syncs,
            "bytes": self._bytes,
            "codec": self.codec.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        check_saved_codec(state, self.codec)
        self.syncs, self._bytes = int(state["syncs"]), int(state["bytes"])
        self.codec.load_state_dict(state.get("codec", {}))
        if self.anchors is not None:
            self.anchors.load_state_dict(state)
        else:
            self._pending = state


class LocalSGDStrategy(PeriodicAveragingStrategy):
    """``local-sgd``: the replicas' parameters are averaged every ``sync_every`` steps."""

    name = "local-sgd"


class DiLoCoStrategy(PeriodicAveragingStrategy):
    """``diloco``: an outer Nesterov step on the averaged delta every ``sync_every`` steps."""

    name = "diloco"
    outer = (0.7, 0.9)
