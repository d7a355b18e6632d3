"""The options of ``local-sgd`` and ``diloco``: a section of the run's TrainConfig (config.py), kept apart
from the strategy so that the configuration never imports a strategy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from paratrain.errors import ConfigError
from paratrain.options import at_least, check_options, option


@dataclass
class AveragingConfig:
    """Options of the strategies that synchronize every H steps (``local-sgd``, ``diloco``)."""

    strategies: ClassVar[tuple[str, ...]] = ("local-sgd", "diloco", "local-sgd-ft", "diloco-ft")

    sync_every: int = option(8, "local-sgd, diloco: local steps H between synchronizations")
    local_after: int = option(
        0,
        "local-sgd, diloco: steps of plain gradient all-reduce before the local steps begin (post-local SGD)",
        strategies=("local-sgd", "diloco"),
    )
    outer_lr: float = option(
        0.7, "diloco: outer learning rate on the averaged parameter delta", strategies=("diloco", "diloco-ft")
    )
    outer_momentum: float = option(
        0.9, "diloco: outer Nesterov momentum (0: plain outer SGD)", strategies=("diloco", "diloco-ft")
    )
    fragments: int = option(
        1, "local-sgd, diloco: parameter fragments synchronized in turn, one every H/F steps (Streaming DiLoCo)"
    )

    def __post_init__(self) -> None:
        check_options(self)
        at_least("sync_every", self.sync_every, 1)
        at_least("fragments", self.fragments, 1)
        at_least("local_after", self.local_after, 0)
        at_least("outer_momentum", self.outer_momentum, 0)
        if not self.outer_lr > 0:
            raise ConfigError(f"--outer-lr must be > 0, got {self.outer_lr}")
        if self.outer_momentum >= 1:
            raise ConfigError(f"--outer-momentum must be < 1, got {self.outer_momentum}")
        if self.sync_every % self.fragments:
            raise ConfigError(
                f"--fragments {self.fragments} must divide --sync-every {self.sync_every} "
                "(one fragment is synchronized every H/F steps)"
            )
