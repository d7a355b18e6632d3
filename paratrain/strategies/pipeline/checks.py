"""The checks of a pipeline run's options and model, made before any process starts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from paratrain.errors import ConfigError
from paratrain.parallel.pipeline import SCHEDULES
from paratrain.parallel.split import (
    BALANCES,
    bounds_from_split_points,
    check_num_parts,
    parse_split_points,
    sequential_layers,
)
from paratrain.parallel.traced import check_split_names, default_split_names
from paratrain.strategies.pipeline.mesh import TensorStages, check_mesh_config
from paratrain.strategies.pipeline.stages import is_layered
from paratrain.strategies.pipeline.wavefront import wavefront_parts

if TYPE_CHECKING:
    from paratrain.config import TrainConfig

#: A plan given to a pipeline whose stages are not split: refused rather than left unused.
UNSPLIT_PLAN = "--tp-plan splits a pipeline's stages over --tensor-parallel T processes: give T > 1, or drop --tp-plan"


def check_pipeline_config(config: TrainConfig) -> None:
    """What the run's options must be for a pipeline (pipeline-ft checks them too)."""
    options, workers = config.pipeline, config.workers
    stages, tensor = options.stages, config.tensor.degree(config.strategy)
    if stages < 2:
        raise ConfigError(f"--strategy pipeline needs --stages S >= 2, got {stages}")
    if tensor == 1 and config.tensor.tp_plan is not None:
        raise ConfigError(UNSPLIT_PLAN)
    if tensor > 1:
        check_mesh_config(config)
        if workers > 1 and workers % (stages * tensor):
            raise ConfigError(
                f"--workers {workers} is not a multiple of --stages {stages} x --tensor-parallel {tensor}: the run "
                f"has workers / (stages x T) pipeline replicas of {stages * tensor} processes each (e.g. --workers "
                f"{stages * tensor})"
            )
    if workers > 1 and workers % stages:
        raise ConfigError(
            f"--workers {workers} is not a multiple of --stages {stages}: the run has workers / stages "
            f"pipeline replicas of {stages} processes each (e.g. --workers {2 * stages})"
        )
    if options.schedule == "wavefront":
        check_wavefront_config(config)
    elif config.batch_size % options.microbatches:
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


def check_strategy_options(
    num_stages: int, num_microbatches: int, schedule: str, balance: str, tensor_parallel: int, tp_plan: Any = None
) -> None:
    """What a PipelineStrategy's own arguments must be (from Python as from the options)."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if balance not in BALANCES:
        raise ConfigError(f"--balance must be params or time, got {balance!r}")
    if schedule == "1f1b" and num_microbatches < num_stages:
        # PyTorch's Schedule1F1B needs its warm-up of num_stages micro-batches.
        raise ConfigError(f"schedule 1f1b needs num_microbatches >= num_stages, got {num_microbatches} < {num_stages}")
    if not isinstance(tensor_parallel, int) or tensor_parallel < 1:
        raise ConfigError(f"tensor_parallel must be a whole number >= 1, got {tensor_parallel!r}")
    if tp_plan is not None and tensor_parallel == 1:
        raise ConfigError(UNSPLIT_PLAN)
    TensorStages.check(tensor_parallel, schedule, balance)


def check_wavefront_config(config: TrainConfig) -> None:
    """The wavefront puts one LSTM layer on each stage and cuts along time: the options that
    choose a split, or a per-step fault-tolerant pipeline, are refused."""
    options = config.pipeline
    if options.split_points is not None or options.balance != "params":
        raise ConfigError("--schedule wavefront puts one LSTM layer on each stage: drop --split-points and --balance")
    if config.strategy != "pipeline":
        raise ConfigError(f"--schedule wavefront runs under --strategy pipeline, not {config.strategy}")


def check_pipeline_model(model: nn.Module, config: TrainConfig) -> None:
    """The split must give every stage a layer (a block, for a traced model): said before
    the stages start. Layers that share a parameter (tied weights) may go to different
    stages: their copies are kept one (parallel/shared.py)."""
    options = config.pipeline
    if config.tensor.degree(config.strategy) > 1:
        TensorStages.check_model(model, config)
    if options.schedule == "wavefront":
        wavefront_parts(model, options.stages)
        return
    points = parse_split_points(options.split_points) if options.split_points is not None else None
    if not is_layered(model, points):
        traced_split(model, points, options.stages, options.balance)
        return
    layers = sequential_layers(model)
    check_num_parts(len(layers), options.stages)
    if points is not None:
        bounds_from_split_points(points, len(layers), options.stages)


def traced_split(model: nn.Module, points: list[str] | None, num_stages: int, balance: str) -> list[str]:
    """The modules where the stages of a model that is not an nn.Sequential start: the
    names given, or its blocks shared out by parameters."""
    if balance == "time":
        raise ConfigError(
            f"--balance time times the layers of an nn.Sequential; {type(model).__name__} is split at "
            "modules: use --balance params (its blocks shared out by parameters) or --split-points NAME,..."
        )
    names = list(points or default_split_names(model, num_stages))
    check_split_names(model, names, num_stages)
    return names


def saved_place(stage: int, shard: int, tensor: int) -> dict[str, Any]:
    """Where a process's checkpoint part sits in the mesh: its stage (and its shard of T)."""
    return {"stage": stage, **({"shard": [shard, tensor]} if tensor > 1 else {})}


def check_saved_place(state: dict[str, Any], stage: int, shard: int, tensor: int) -> None:
    """ConfigError where a checkpoint part was written by another place in the mesh: a
    pipeline resumes on the mesh it was written by."""
    if state.get("stage") != stage:
        raise ConfigError(f"checkpoint holds stage {state.get('stage')}, this process runs stage {stage}")
    saved = list(state.get("shard", [0, 1]))
    if saved != [shard, tensor]:
        raise ConfigError(
            f"checkpoint holds shard {saved[0]} of {saved[1]} of stage {stage}, this process runs shard {shard} of "
            f"{tensor}: a pipeline resumes on the mesh that wrote it (the same --stages and --tensor-parallel)"
        )
