"""The options of ``pipeline`` and ``pipeline-ft``: a section of the run's TrainConfig (config.py), kept apart
from the strategy so that the configuration never imports a strategy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from paratrain.options import at_least, check_options, option
from paratrain.parallel.pipeline import SCHEDULES
from paratrain.parallel.split import BALANCES


@dataclass
class PipelineConfig:
    """Options of ``--strategy pipeline`` (and ``pipeline-ft``)."""

    strategies: ClassVar[tuple[str, ...]] = ("pipeline", "pipeline-ft")

    stages: int = option(2, "pipeline: stages the model is split into, one process each")
    microbatches: int = option(
        4, "pipeline: micro-batches per batch (--batch-size must be a multiple); wavefront: chunks of each sequence"
    )
    schedule: str = option(
        "1f1b",
        "pipeline: micro-batch schedule (gpipe, 1f1b), or wavefront: a stacked LSTM one layer a stage, along time",
        choices=tuple(SCHEDULES),
    )
    balance: str = option(
        "params", "pipeline: balance stages by parameter count or by measured time per layer", choices=BALANCES
    )
    split_points: str | None = option(
        None, "pipeline: layer indices where stages start, e.g. 3,7 (instead of --balance)"
    )

    def __post_init__(self) -> None:
        check_options(self)
        at_least("stages", self.stages, 1)
        at_least("microbatches", self.microbatches, 1)
