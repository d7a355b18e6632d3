"""The user's optimizer rebuilt on a shard: its class, each parameter group's
hyper-parameters and the constructor's own defaults, over the shard's slice of the
parameters; refused in one line where it cannot step there."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from paratrain.errors import ConfigError


def shard_optimizer(
    optimizer: torch.optim.Optimizer,
    pieces: list[Any],
    params: torch.Tensor,
    grad: torch.Tensor,
    group_of: dict[int, int],
) -> torch.optim.Optimizer:
    """The user's optimizer class and hyper-parameters over a shard's ``pieces`` of the flat
    ``params`` (and their gradients in ``grad``), each piece in its parameter group."""
    check_rebuildable(optimizer)
    groups: list[dict[str, Any]] = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": []} for group in optimizer.param_groups
    ]
    for piece in pieces:
        param = nn.Parameter(params[piece.offset : piece.offset + piece.numel])  # shares storage: steps update params
        param.grad = grad[piece.offset : piece.offset + piece.numel]
        groups[group_of[piece.index]]["params"].append(param)
    if not pieces:  # a shard of tables only: an optimizer over nothing, which steps as a no-op
        empty = nn.Parameter(params[:0])
        empty.grad = grad[:0]
        groups[0]["params"].append(empty)
    return type(optimizer)([g for g in groups if g["params"]], **constructor_defaults(optimizer))


def check_rebuildable(optimizer: torch.optim.Optimizer) -> None:
    """ConfigError for an optimizer a shard cannot step: one whose ``step`` needs a closure
    (LBFGS re-evaluates the loss, which lives on the workers)."""
    closure = inspect.signature(type(optimizer).step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise ConfigError(
            f"{type(optimizer).__name__} steps with a closure that re-evaluates the loss; parameter-server shards "
            "step without the data (every other torch.optim optimizer works): use --strategy allreduce"
        )


def constructor_defaults(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's defaults that its class's constructor takes: a subclass may keep more
    in ``defaults`` than it accepts (``AdamW`` keeps Adam's ``decoupled_weight_decay``, which
    it sets itself); the groups carry every key anyway."""
    parameters = inspect.signature(type(optimizer).__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in parameters}
