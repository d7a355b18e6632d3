"""The options of ``local-sgd`` and ``diloco``: a section of the run's TrainConfig (config.py), kept apart
from the strategy so that the configuration never imports a strategy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from paratrain.errors import ConfigError
from paratrain.options import at_least, check_options, option, option_fields, refuse_untaken, takers


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


def taken_options(config: Any, strategy: str) -> dict[str, Any]:
    """The options of a run's averaging section (``config``: a TrainConfig) that ``strategy``
    takes, as its keyword arguments."""
    options = config.averaging
    return {f.name: getattr(options, f.name) for f in option_fields(options) if strategy in takers(options, f.name)}


def outer_options(
    strategy: str, default: tuple[float, float], outer_lr: float | None, outer_momentum: float | None, **rounds: int
) -> tuple[float, float]:
    """The outer optimizer's (lr, momentum) of ``strategy``: its ``default`` where not given;
    refused where the strategy takes none, checked with the rounds' options (``rounds``)."""
    given = [name for name, value in (("outer_lr", outer_lr), ("outer_momentum", outer_momentum)) if value is not None]
    refuse_untaken(strategy, AveragingConfig, given)
    lr = default[0] if outer_lr is None else outer_lr
    momentum = default[1] if outer_momentum is None else outer_momentum
    AveragingConfig(outer_lr=lr, outer_momentum=momentum, **rounds)
    return lr, momentum
