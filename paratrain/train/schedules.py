"""Learning-rate schedules: callables from the global step to a learning rate.

Each is chosen by name (``--lr-schedule``) from the SCHEDULES table and applied by the
LearningRateScheduler callback before every step.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from paratrain.config import TrainConfig


class Constant:
    """The same rate at every step."""

    def __init__(self, lr: float):
        self.lr = lr

    def __call__(self, step: int) -> float:
        return self.lr

    @classmethod
    def from_config(cls, config: TrainConfig, steps_per_epoch: int) -> Constant:
        return cls(config.lr)


class ExponentialDecay:
    """``lr * decay_rate ** (step / decay_steps)``; with ``staircase`` the exponent is
    floored, so the rate drops by ``decay_rate`` every ``decay_steps`` steps, as in the
    TensorFlow CIFAR-10 multi-GPU recipe (0.1, x0.1 every 350 epochs)."""

    def __init__(self, lr: float, decay_steps: int, decay_rate: float, staircase: bool = True):
        self.lr = lr
        self.decay_steps = decay_steps
        self.decay_rate = decay_rate
        self.staircase = staircase

    def __call__(self, step: int) -> float:
        exponent = step / self.decay_steps
        if self.staircase:
            exponent = math.floor(exponent)
        return self.lr * self.decay_rate**exponent

    @classmethod
    def from_config(cls, config: TrainConfig, steps_per_epoch: int) -> ExponentialDecay:
        return cls(config.lr, config.lr_decay_steps, config.lr_decay_rate, config.staircase)


class LinearScalingWarmup:
    """Linear scaling with gradual warm-up (Goyal et al. 2017, "Accurate, Large Minibatch
    SGD"): the rate for a global batch ``kB`` is ``k`` times the rate for ``B``
    (``reference_batch``), reached linearly from the unscaled rate over ``warmup_steps``
    so that the first, large updates do not blow the model up."""

    def __init__(self, lr: float, global_batch: int, reference_batch: int = 256, warmup_steps: int = 0):
        self.base = lr
        self.target = lr * global_batch / reference_batch
        self.warmup_steps = warmup_steps

    def __call__(self, step: int) -> float:
        if step >= self.warmup_steps:
            return self.target
        return self.base + (self.target - self.base) * step / self.warmup_steps

    @classmethod
    def from_config(cls, config: TrainConfig, steps_per_epoch: int) -> LinearScalingWarmup:
        warmup = round(config.warmup_epochs * steps_per_epoch)
        return cls(config.lr, config.global_batch, config.reference_batch, warmup)
