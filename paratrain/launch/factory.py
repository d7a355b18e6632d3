"""Strategies by name, with the options of ``paratrain train``: for scripts that let the
same command-line flags choose how they are distributed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from paratrain.config import TrainConfig
from paratrain.launch.flags import parse_train_config
from paratrain.registry import STRATEGIES
from paratrain.strategies.base import Strategy


def make_strategy(name: str = "single", **options: Any) -> Strategy:
    """The strategy ``--strategy name`` runs, with TrainConfig options by their flat names:
    ``make_strategy("ps-async", ps_shards=2, staleness_bound=4, workers=3)``. With
    ``workers`` given, ``paratrain.launch(fn, strategy=...)`` knows how many to start."""
    config = TrainConfig(strategy=name, **options)
    return _from_config(config, "workers" in options)


def strategy_from_flags(argv: Sequence[str]) -> Strategy:
    """The strategy ``paratrain train ARGV`` would run: ``strategy_from_flags(sys.argv[1:])``
    with ``--strategy ps-sync --ps-shards 2``, say (other training flags are checked and
    otherwise ignored). Bad flags raise ConfigError naming them."""
    argv = list(argv)
    config = parse_train_config(argv)
    return _from_config(config, "--workers" in argv or any(a.startswith("--workers=") for a in argv))


def _from_config(config: Any, sized: bool) -> Strategy:
    strategy = STRATEGIES.get(config.strategy).from_config(config)
    strategy.on_nan = config.on_nan
    if sized:
        strategy.workers = config.workers
    return strategy
