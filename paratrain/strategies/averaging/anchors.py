"""The model the replicas of ``local-sgd`` and ``diloco`` share between synchronizations (the
*anchor*), in fragments, with each fragment's outer optimizer: what a synchronization
steps, what evaluation scores, and what a checkpoint or a joining replica takes. How the
replicas' deltas are averaged stays the strategy's (a process group's collective in
``averaging/strategy.py``, the quorum of the live replicas in ``fault_tolerant/averaging.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from paratrain.errors import ConfigError


class Anchors:
    """The anchor of ``params`` (a replica's trainable parameters, named ``names``) in
    ``fragments`` contiguous groups of about equal size, each stepped by outer SGD (``lr``,
    Nesterov ``momentum``; lr 1 and no momentum is plain averaging)."""

    def __init__(self, named: list[tuple[str, nn.Parameter]], fragments: int, lr: float, momentum: float, step: int):
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        if len(self.params) < fragments:
            raise ConfigError(
                f"--fragments {fragments}: the model has only {len(self.params)} parameter tensors to split"
            )
        self.groups = fragment_groups([p.numel() for p in self.params], fragments)
        """The parameter indices of each fragment."""
        self.tensors = [p.detach().clone() for p in self.params]
        self.outer = [
            torch.optim.SGD([self.tensors[i] for i in group], lr=lr, momentum=momentum, nesterov=momentum > 0)
            for group in self.groups
        ]
        self.synced_at = [step] * len(self.groups)
        """The step each fragment was last synchronized at."""

    def deltas(self, fragment: int) -> list[torch.Tensor]:
        """This replica's pseudo-gradient of ``fragment``: its anchor minus its parameters."""
        return [self.tensors[i] - self.params[i].detach() for i in self.groups[fragment]]

    def keys(self, fragment: int) -> list[str]:
        return [self.names[i] for i in self.groups[fragment]]

    @torch.no_grad()
    def step(self, fragment: int, means: list[torch.Tensor], outer: bool, at: int) -> None:
        """The anchor of ``fragment`` moved by the replicas' mean delta, with its outer
        optimizer (``outer=False``: plain averaging); the parameters go on from it."""
        anchors = [self.tensors[i] for i in self.groups[fragment]]
        if outer:
            for anchor, mean in zip(anchors, means):
                anchor.grad = mean
            self.outer[fragment].step()
            for anchor in anchors:
                anchor.grad = None
        else:
            torch._foreach_sub_(anchors, means)
        for i in self.groups[fragment]:
            self.params[i].copy_(self.tensors[i])
        self.synced_at[fragment] = at

    @torch.no_grad()
    def reset(self, step: int) -> None:
        """The anchors start again from the parameters (equal on every replica here)."""
        for anchor, p in zip(self.tensors, self.params):
            anchor.copy_(p.detach())
        self.synced_at = [step] * len(self.groups)

    @torch.no_grad()
    def restart_from_anchors(self) -> None:
        """The parameters set to the anchors (a replica that took a peer's state starts its
        round there; evaluation scores them)."""
        for anchor, p in zip(self.tensors, self.params):
            p.copy_(anchor)

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The parameters hold the anchors for the block (evaluation scores the shared model)."""
        own = [p.detach().clone() for p in self.params]
        self.restart_from_anchors()
        try:
            yield
        finally:
            with torch.no_grad():
                for p, mine in zip(self.params, own):
                    p.copy_(mine)

    def state_dict(self) -> dict[str, Any]:
        return {
            "anchors": [a.detach().clone() for a in self.tensors],
            "outer": [opt.state_dict() for opt in self.outer],
            "synced_at": list(self.synced_at),
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["anchors"]) != len(self.tensors) or len(state["outer"]) != len(self.outer):
            raise ConfigError("checkpoint holds the outer state of another model or another --fragments")
        for anchor, saved in zip(self.tensors, state["anchors"]):
            anchor.copy_(saved)
        for opt, saved in zip(self.outer, state["outer"]):
            # its momentum buffers; the learning rate and momentum stay this run's (--outer-lr,
            # --outer-momentum), which torch's load_state_dict would take from the saved run
            own = [{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups]
            opt.load_state_dict(saved)
            for group, settings in zip(opt.param_groups, own):
                group.update(settings)
        self.synced_at = [int(s) for s in state["synced_at"]]


def fragment_groups(sizes: list[int], count: int) -> list[list[int]]:
    """Indices 0..len(sizes)-1 (at least ``count`` of them) in ``count`` contiguous groups of
    about equal total size."""
    total = sum(sizes)
    groups = []
    current = []
    filled = 0
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


def fragment_due(step: int, start: int, sync_every: int, fragments: int) -> int | None:
    """The fragment synchronized after ``step`` (local steps begin after step ``start``; one
    fragment every ``sync_every / fragments`` steps, in turn), or None."""
    interval, local = sync_every // fragments, step - start
    if local <= 0 or local % interval:
        return None
    return (local // interval - 1) % fragments
