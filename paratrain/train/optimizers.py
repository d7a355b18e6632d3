"""Optimizer factories of the OPTIMIZERS table: ``(parameters, config) -> Optimizer``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from paratrain.config import TrainConfig


def make_sgd(params: Iterable[torch.nn.Parameter], config: TrainConfig) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)


def make_adam(params: Iterable[torch.nn.Parameter], config: TrainConfig) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=config.lr, weight_decay=config.weight_decay)


def make_adamw(params: Iterable[torch.nn.Parameter], config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW (decoupled weight decay): DiLoCo's inner optimizer."""
    return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)


def make_adagrad(params: Iterable[torch.nn.Parameter], config: TrainConfig) -> torch.optim.Optimizer:
    """Adagrad: the classic optimizer of sparse models (row-wise on tables on the parameter server)."""
    return torch.optim.Adagrad(params, lr=config.lr, weight_decay=config.weight_decay)
