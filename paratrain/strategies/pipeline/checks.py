"""The checks of a pipeline run's options and model, made before any process starts."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from paratrain.errors import ConfigError
from paratrain.parallel.split import (
    balanced_bounds,
    bounds_from_split_points,
    check_num_parts,
    check_shared_parameters,
    layer_costs,
    parse_split_points,
    sequential_layers,
)

if TYPE_CHECKING:
    from paratrain.config import TrainConfig


def check_pipeline_config(config: TrainConfig) -> None:
    """What the run's options must be for a pipeline (pipeline-ft checks them too)."""
    options, workers = config.pipeline, config.workers
    stages = options.stages
    if stages < 2:
        raise ConfigError(f"--strategy pipeline needs --stages S >= 2, got {stages}")
    if workers > 1 and workers % stages:
        raise ConfigError(
            f"--workers {workers} is not a multiple of --stages {stages}: the run has workers / stages "
            f"pipeline replicas of {stages} processes each (e.g. --workers {2 * stages})"
        )
    if config.batch_size % options.microbatches:
        raise ConfigError(
            f"--batch-size {config.batch_size} must be a multiple of --microbatches {options.microbatches} "
            "(every micro-batch has the same size)"
        )
    if options.schedule == "1f1b" and options.microbatches < stages:
        raise ConfigError(
            f"--schedule 1f1b needs --microbatches >= --stages ({options.microbatches} < {stages}); "
            "use more micro-batches or --schedule gpipe"
        )
    if options.split_points is not None:
        points = parse_split_points(options.split_points)
        if len(points) != stages - 1:
            raise ConfigError(
                f"--split-points {options.split_points} makes {len(points) + 1} stages, but --stages is {stages}"
            )
    if options.balance == "time" and options.split_points is not None:
        raise ConfigError("--balance time and --split-points both choose the split; give one of them")


def check_pipeline_model(model: nn.Module, config: TrainConfig) -> None:
    """The split must give every stage a layer: said before the stages start."""
    layers = sequential_layers(model)
    options = config.pipeline
    check_num_parts(len(layers), options.stages)
    if options.split_points is not None:
        bounds = bounds_from_split_points(parse_split_points(options.split_points), len(layers), options.stages)
    elif options.balance == "params":
        bounds = balanced_bounds(layer_costs(layers, "params"), options.stages)
    else:  # by time: known once the first batch is timed, and checked then
        return
    check_shared_parameters(layers, bounds)
