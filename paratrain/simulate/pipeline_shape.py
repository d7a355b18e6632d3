"""``simulate --strategy pipeline``'s meshes: the user's model cut where ``paratrain train
--strategy pipeline`` cuts it, each stage measured on the first local batch
(tensor_shape.measure_stages) for every ``--stages`` and ``--tensor-parallel`` asked."""

from __future__ import annotations

from typing import Any

from torch import nn

from paratrain.console import console
from paratrain.errors import ConfigError
from paratrain.parallel.split import check_num_parts, parameter_bounds, parse_split_points, sequential_layers
from paratrain.simulate.pipeline import PipelineMesh
from paratrain.simulate.tensor_shape import counts, first_inputs, measure_stages, split_link, tensor_sizes
from paratrain.strategies.pipeline.checks import traced_split
from paratrain.strategies.pipeline.stages import is_layered


def stage_starts(model: nn.Module, stages: int, split_points: str | None) -> list[str]:
    """The names of the modules where stages 2..S start, as train splits ``model``: an
    nn.Sequential's layers balanced by parameters (or cut at ``split_points``' indices),
    any other model's repeated blocks shared out by parameters (or cut at the modules named)."""
    points = parse_split_points(split_points) if split_points else None
    if not is_layered(model, points):
        return traced_split(model, points, stages, "params") if stages > 1 else []
    layers = sequential_layers(model)
    check_num_parts(len(layers), stages)
    bounds = parameter_bounds(layers, stages, points)
    return [str(start) for start, _ in bounds[1:]]


def pipeline_meshes(args: Any, model: nn.Module, splits: Any) -> list[PipelineMesh]:
    """One mesh for each ``--stages`` S and ``--tensor-parallel`` T (default 1), measured for
    ``model`` on the first local batch of ``splits`` (a replica's batch)."""
    from paratrain.strategies.tensor.config import TensorConfig  # deferred: reads --tp-plan as train does

    plan = TensorConfig(tp_plan=args.tp_plan).plan()
    inputs = first_inputs(splits, args.batch_size)
    microbatches = args.microbatches or 4
    if args.batch_size % microbatches:
        raise ConfigError(f"--batch-size {args.batch_size} must be a multiple of --microbatches {microbatches}")
    found = []
    for stages in counts(args.stages or "2", "--stages"):
        starts = stage_starts(model, stages, args.split_points)
        for tensor in tensor_sizes(args.tensor_parallel or "1"):
            # train's 3-D mesh gathers the logits whole (it refuses --loss-parallel)
            shapes = measure_stages(model, inputs, starts, plan, tensor, loss_parallel=False)
            found.append(PipelineMesh(tuple(shapes), tensor, microbatches, **split_link(args)))
            shares = ", ".join(f"{s.compute_share:.0%}" for s in shapes)
            console.print(
                f"paratrain: {args.model} in {stages} stages"
                + (f" of {tensor} processes" if tensor > 1 else "")
                + f": {shares} of the forward FLOPs; starts {', '.join(starts) or '(whole)'}"
            )
    return found
