"""The checks of a parameter-server run's options, made before any process starts."""

from __future__ import annotations

from typing import TYPE_CHECKING

from paratrain.errors import ConfigError
from paratrain.strategies.ps.modes import PSMode, check_mode, survives_lost_worker

if TYPE_CHECKING:
    from paratrain.config import TrainConfig


def check_run(config: TrainConfig) -> None:
    """ConfigError for a run option a parameter-server run cannot honour."""
    mode = PSMode.of(config.strategy)
    check_mode(mode, config.ps)
    if config.early_stopping:
        raise ConfigError(f"--early-stopping is not available with --strategy {config.strategy}")
    if config.ps.join and (config.checkpoint_dir or config.max_restarts):
        raise ConfigError(
            "--join adds a worker to a running run, whose shards keep its checkpoints: drop "
            "--checkpoint-dir and --max-restarts"
        )
    check_tables(config)
    fail = config.faults.fail_at
    if fail and fail[0] == 0 and survives_lost_worker(mode, config.ps):
        raise ConfigError("--fail names worker 0, the chief (it evaluates and writes the metrics); name another worker")


def check_tables(config: TrainConfig) -> None:
    """ConfigError for a table option without tables, or a run option tables cannot honour."""
    ps = config.ps
    if not ps.holds_tables:
        for name, default in (("table_sharding", "mod"), ("table_optimizer", "auto"), ("dense", "ps")):
            if getattr(ps, name) != default:
                raise ConfigError(f"--{name.replace('_', '-')} applies to tables on the shards: give --tables too")
        return
    if ps.dense == "allreduce":
        for given, flag in (
            (config.checkpoint_dir, "--checkpoint-dir"),
            (config.max_restarts, "--max-restarts"),
            (ps.join, "--join"),
            (config.codec.compression != "none", "--compression"),
        ):
            if given:
                raise ConfigError(
                    f"{flag} is not available with --dense allreduce (the dense layers live on the workers, the "
                    "shards hold the tables): drop it, or keep the dense layers on the shards (--dense ps)"
                )
    if config.clip_grad_norm:
        raise ConfigError(
            "--clip-grad-norm needs the whole gradient's norm; with --tables the rows' gradients go straight to "
            "the shards: drop --clip-grad-norm or --tables"
        )
