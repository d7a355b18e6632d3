"""``local-sgd`` and ``diloco``: replicas train on their own and synchronize every H steps.

Each replica holds the whole model and steps its own optimizer (the *inner* one, the run's
``--optimizer``) on its own slice of every global batch, without communicating. Every
``--sync-every H`` steps the replicas average the change of their parameters since the
last synchronization and apply it to the model they share (the *anchor*) with an *outer*
optimizer, then go on from the new anchor:

    delta_i = anchor - params_i                      (each replica's pseudo-gradient)
    anchor  = OuterSGD(anchor, mean_i delta_i)       (one collective per H steps)
    params_i = anchor

- ``local-sgd`` (Lin et al. 2020, "Don't use large mini-batches, use local SGD"): the
  outer step is plain averaging (outer SGD, lr 1, no momentum: anchor = mean of the
  replicas' parameters). With H = 1 and plain SGD it is ``allreduce``. Post-local SGD:
  ``--local-after S`` steps of gradient all-reduce first, local steps after.
- ``diloco`` (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of
  Language Models"): the outer step is Nesterov SGD (``--outer-lr 0.7``, ``--outer-momentum
  0.9``, the paper's); the inner optimizer is the run's (the paper's is AdamW:
  ``--optimizer adamw``). ``--fragments F`` synchronizes the parameters in F fragments in
  turn, one every H/F steps, each still every H steps (Streaming DiLoCo, Douillard et al.
  2025): the traffic of one synchronization is spread over the round.

Either sends a delta, not a gradient, through the run's codec (``--compression``: fp16 and
bf16 add payloads in an all-reduce; int8, topk and powersgd all-gather and decode, see
``comm/average.py``): bytes per step are the model's (or less, coded) divided by H.

Replicas differ between synchronizations, so each checkpoint holds every replica's own
model and optimizer (``rank-<i>.pt``), and evaluation scores the shared model (the anchor).
Training ends with a plain average of whatever changed since the last synchronization
(no outer step on a part of a round): the model a run returns and saves last is one model.
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
from paratrain.errors import ConfigError
from paratrain.options import refuse_untaken, takers
from paratrain.strategies.accounting import staleness_summary
from paratrain.strategies.averaging.config import AveragingConfig
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
        refuse_untaken(self.name, AveragingConfig, [name for name, value in (("outer_lr", outer_lr),
                       ("outer_momentum", outer_momentum)) if value is not None])  # fmt: skip
        outer_lr = self.outer[0] if outer_lr is None else outer_lr
        outer_momentum = self.outer[1] if outer_momentum is None else outer_momentum
        AveragingConfig(sync_every=sync_every, local_after=local_after, fragments=fragments,
                        outer_lr=outer_lr, outer_momentum=outer_momentum)  # fmt: skip
        self.sync_every, self.local_after, self.fragments = sync_every, local_after, fragments
        self.outer_lr, self.outer_momentum = outer_lr, outer_momentum
        self.codec = as_codec(compression)
        self.syncs = 0
        """Synchronizations done (of one fragment each, with ``fragments`` > 1)."""
        self._params: list[nn.Parameter] = []
        self._names: list[str] = []
        self._groups: list[list[int]] = []  # parameter indices of each fragment
        self._anchors: list[torch.Tensor] = []
        self._outer: list[torch.optim.SGD] = []
        self._synced_at: list[int] = []  # the step each fragment was last synchronized at
        self._bytes = 0
        self._pending: dict[str, Any] | None = None  # state loaded before prepare()

    @classmethod
    def topology_of(cls, num_replicas: int) -> Topology:
        return AveragingTopology(num_replicas=num_replicas)

    @classmethod
    def from_config(cls, config: TrainConfig) -> PeriodicAveragingStrategy:
        options = config.averaging
        kwargs = {name: getattr(options, name) for name in ("sync_every", "local_after", "fragments")}
        if cls.name in takers(AveragingConfig, "outer_lr"):
            kwargs.update(outer_lr=options.outer_lr, outer_momentum=options.outer_momentum)
        return cls(**process_options(config), compression=config.codec.build(), **kwargs)

    # ----- model ---------------------------------------------------------------------------------
    def prepare(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, recipe: StepRecipe | None = None
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        model, optimizer = super().prepare(model, optimizer, recipe)
        with torch.no_grad():  # every replica starts from rank 0's model
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor.data, src=0)
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self._names = [name for name, _ in named]
        self._params = [p for _, p in named]
        if len(self._params) < self.fragments:
            raise ConfigError(
                f"--fragments {self.fragments}: the model has only {len(self._params)} parameter tensors to split"
            )
        self._groups = _fragments([p.numel() for p in self._params], self.fragments)
        self._anchors = [p.detach().clone() for p in self._params]
        nesterov = self.outer_momentum > 0
        self._outer = [
            torch.optim.SGD(
                [self._anchors[i] for i in group], lr=self.outer_lr, momentum=self.outer_momentum, nesterov=nesterov
            )
            for group in self._groups
        ]
        self._synced_at = [self.local_after] * len(self._groups)
        if self._pending is not None:
            self._load_outer(self._pending)
            self._pending = None
        return model, optimizer

    def reduce_gradients(self, model: nn.Module) -> None:
        """During the first ``local_after`` steps: the gradient's mean over the replicas."""
        if self.steps_taken >= self.local_after:
            return
        with span("allreduce", COMM):
            self._bytes += mean_gradients([p for p in self._params if p.grad is not None], None, self.num_replicas)

    def train_step(self, model, loss_fn, optimizer, inputs, targets):  # noqa: ANN001, ANN201 - Strategy's
        out = super().train_step(model, loss_fn, optimizer, inputs, targets)
        step = self.steps_taken
        if step == self.local_after:  # the replicas are equal here: the anchor starts from them
            self._reset_anchors()
        elif step > self.local_after:
            interval = self.sync_every // self.fragments
            local = step - self.local_after
            if local % interval == 0:
                self.synchronize((local // interval - 1) % self.fragments)
        return out

    @torch.no_grad()
    def synchronize(self, fragment: int, outer: bool = True) -> None:
        """The outer step of one fragment: average the replicas' deltas from the anchor,
        step the anchor with the outer optimizer (``outer=False``: plain averaging), and go
        on from it. Every replica calls it at the same step."""
        group = self._groups[fragment]
        params = [self._params[i] for i in group]
        anchors = [self._anchors[i] for i in group]
        deltas = [anchor - p.detach() for anchor, p in zip(anchors, params)]
        with span("synchronize", COMM, fragment=fragment):
            means, sent = average(deltas, self.codec, [self._names[i] for i in group])
        self._bytes += sent
        if outer:
            for anchor, mean in zip(anchors, means):
                anchor.grad = mean
            self._outer[fragment].step()
        else:
            torch._foreach_sub_(anchors, means)
        for anchor, p in zip(anchors, params):
            anchor.grad = None
            p.copy_(anchor)
        self._synced_at[fragment] = self.steps_taken
        self.syncs += 1

    @torch.no_grad()
    def _reset_anchors(self) -> None:
        for anchor, p in zip(self._anchors, self._params):
            anchor.copy_(p.detach())
        self._synced_at = [self.steps_taken] * len(self._groups)

    def finish(self, model: nn.Module) -> None:
        """The end of training: average every fragment that changed since its last
        synchronization (plainly: an outer step with momentum on a part of a round would
        overshoot), so that the replicas end as one model."""
        for fragment, synced in enumerate(self._synced_at):
            if self.steps_taken > max(synced, self.local_after):
                self.synchronize(fragment, outer=False)

    @contextlib.contextmanager
    def evaluating(self, model: nn.Module) -> Iterator[None]:
        """Evaluation scores the model the replicas share (the anchor), not this replica's."""
        if self.steps_taken <= self.local_after or not self._anchors:
            yield  # the replicas are equal
            return
        with torch.no_grad():
            own = [p.detach().clone() for p in self._params]
            for p, anchor in zip(self._params, self._anchors):
                p.copy_(anchor)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, mine in zip(self._params, own):
                    p.copy_(mine)

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
        if not self._anchors and self._pending is not None:
            return self._pending
        return {
            **super().state_dict(),
            "compression": self.codec.name,
            "anchors": [a.detach().clone() for a in self._anchors],
            "outer": [opt.state_dict() for opt in self._outer],
            "synced_at": list(self._synced_at),
            "syncs": self.syncs,
            "bytes": self._bytes,
            "codec": self.codec.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        check_saved_codec(state, self.codec)
        self.syncs, self._bytes = int(state["syncs"]), int(state["bytes"])
        self.codec.load_state_dict(state.get("codec", {}))
        if self._anchors:
            self._load_outer(state)
        else:
            self._pending = state

    @torch.no_grad()
    def _load_outer(self, state: dict[str, Any]) -> None:
        if len(state["anchors"]) != len(self._anchors) or len(state["outer"]) != len(self._outer):
            raise ConfigError("checkpoint holds the outer state of another model or another --fragments")
        for anchor, saved in zip(self._anchors, state["anchors"]):
            anchor.copy_(saved)
        for opt, saved in zip(self._outer, state["outer"]):
            opt.load_state_dict(saved)
        self._synced_at = [int(s) for s in state["synced_at"]]


class LocalSGDStrategy(PeriodicAveragingStrategy):
    """``local-sgd``: the replicas' parameters are averaged every ``sync_every`` steps."""

    name = "local-sgd"


class DiLoCoStrategy(PeriodicAveragingStrategy):
    """``diloco``: an outer Nesterov step on the averaged delta every ``sync_every`` steps."""

    name = "diloco"
    outer = (0.7, 0.9)


def _fragments(sizes: list[int], count: int) -> list[list[int]]:
    """Indices 0..len(sizes)-1 (at least ``count`` of them) in ``count`` contiguous groups of
    about equal total size."""
    total, groups, current, filled = sum(sizes), [], [], 0
    for index, size in enumerate(sizes):
        current.append(index)
        filled += size
        remaining_groups = count - len(groups) - 1
        remaining_tensors = len(sizes) - index - 1
        if remaining_groups and (filled >= total * (len(groups) + 1) / count or remaining_tensors == remaining_groups):
            groups.append(current)
            current = []
    if current:
        groups.append(current)
    return groups
