"""3-D parallelism: tensor parallelism inside the stages of a pipeline, over data-parallel replicas
(torchtitan's PP x TP x DP), composed into ``pipeline`` by ``--tensor-parallel T``.

W processes make a (dp, pp, tp) mesh of W/(S*T) replicas of S stages of T processes, global rank ``(replica *
S + stage) * T + shard`` (topology.py): a stage's T processes are neighbours, on the fastest links, since they
talk at every split layer. Each stage is split by the ``tensor`` plan (parallel/tensor_stages.py). Row-wise
layers give whole outputs, so the pipeline's sends carry whole activations between the same shard of
consecutive stages (a "pp" group). After the backward a tied parameter's gradient is summed between the
stages holding it (gradients.py), and each (stage, shard) averages its part over the replicas (a "dp" group).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from paratrain.console import console
from paratrain.errors import ConfigError
from paratrain.parallel.local_state import hold_local_parts
from paratrain.parallel.shared import SplitStage
from paratrain.parallel.tensor import Style, matching, parallelize, plan_for, planned, split_only, summary
from paratrain.parallel.tensor_stages import put_layers, split_shaped, stage_plan
from paratrain.parallel.traced import trace
from paratrain.strategies.pipeline.topology import PipelineTopology
from paratrain.strategies.recipe import StepRecipe

if TYPE_CHECKING:
    from paratrain.config import TrainConfig

#: How a refusal names the mode (``check_mesh_config``, ``TensorStages.check``).
NOT_IN_3D = "--strategy pipeline --tensor-parallel (3-D)"


def replica_groups(topology: PipelineTopology, rank: int) -> tuple[Any, Any]:
    """The process groups of ``rank`` in a pipeline without tensor parallelism: its replica's
    stages (the activations) and its stage's replicas (the gradients' average). Every rank
    creates every group, in the same order (new_group is collective)."""
    mine = {}
    for dim in ("pp", "dp"):
        for ranks in topology.groups()[dim]:
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[dim] = group
    return mine["pp"], mine["dp"]


def check_mesh_config(config: TrainConfig) -> None:
    """The options a pipeline whose stages are split (``--tensor-parallel T`` > 1) refuses:
    those it does not run, in one line each, before any process starts."""
    tensor = config.tensor.degree("pipeline")
    refused = {
        "--channels-last": bool(config.channels_last),
        f"--activation-checkpointing {config.activation_checkpointing}": config.activation_checkpointing != "none",
        f"--precision {config.precision}": config.precision != "fp32",
    }
    for option, given in refused.items():
        if given:
            raise ConfigError(
                f"{option} is not available with {NOT_IN_3D} yet; leave it out, or drop --tensor-parallel"
            )
    TensorStages.check(tensor, config.pipeline.schedule, config.pipeline.balance)


class TensorStages:
    """The tensor-parallel part of a pipeline process: the mesh, its stage split over the
    "tp" group, the layout printed, the bytes its split layers send."""

    def __init__(self, size: int, plan: dict[str, str] | None = None):
        self.size, self.plan = size, plan
        self.mesh: DeviceMesh | None = None
        self.bytes = 0.0  # what the split layers' collectives sent, this process, so far
        self._chosen: dict[str, Style] | None = None  # the whole model's modules split, by their names
        self._shaped: nn.Module | None = None  # the copy of a traced model traced with split shapes

    @staticmethod
    def check(size: int, schedule: str, balance: str) -> None:
        """ConfigError for a schedule or balance the split stages do not take."""
        if size > 1 and schedule == "wavefront":
            raise ConfigError(
                f"--schedule wavefront is not available with {NOT_IN_3D}: an LSTM layer a stage is not split; "
                "use --schedule gpipe or 1f1b"
            )
        if size > 1 and balance == "time":
            raise ConfigError(
                f"--balance time is not available with {NOT_IN_3D}: it times the layers whole, not split; use "
                "--balance params or --split-points"
            )

    @staticmethod
    def check_step(recipe: StepRecipe, optimizer: torch.optim.Optimizer) -> None:
        """ConfigError for the step options the split stages do not take (as check_mesh_config),
        and for an optimizer that has stepped (its state would not fit the split parameters)."""
        if recipe.precision != "fp32" or recipe.channels_last or recipe.activation_checkpointing != "none":
            raise ConfigError(
                f"{NOT_IN_3D} computes in fp32, in the parameters' own memory order and without activation "
                "checkpointing here"
            )
        if optimizer.state:
            raise ConfigError(
                f"{NOT_IN_3D} splits the parameters the optimizer steps: give it an optimizer that has not stepped yet"
            )

    @staticmethod
    def check_model(model: nn.Module, config: TrainConfig) -> None:
        """The plan must apply to the whole model (a pattern naming none of its modules is refused)."""
        matching(model, plan_for(model, config.tensor.plan()), config.tensor.degree("pipeline"))

    # ----- process -----------------------------------------------------------------------
    def place(self, world: int, num_stages: int, device: torch.device) -> tuple[PipelineTopology, Any, Any]:
        """The run's topology and device mesh; this process's "pp" group (the activations) and
        "dp" group (the gradients' average)."""
        if world % (num_stages * self.size):
            raise ConfigError(
                f"the run has {world} processes, not a multiple of --stages {num_stages} x --tensor-parallel "
                f"{self.size}"
            )
        replicas = world // (num_stages * self.size)
        topology = PipelineTopology(num_replicas=replicas, num_stages=num_stages, tensor=self.size)
        self.mesh = init_device_mesh(device.type, (replicas, num_stages, self.size), mesh_dim_names=("dp", "pp", "tp"))
        return topology, self.mesh["pp"].get_group(), self.mesh["dp"].get_group()

    @property
    def group(self) -> Any:
        """This stage's "tp" group: the processes that split its layers."""
        return self.mesh["tp"].get_group()

    # ----- model -------------------------------------------------------------------------
    def chosen(self, model: nn.Module) -> dict[str, Style]:
        """The modules of the whole ``model`` that the plan splits (or whose heads it counts),
        by their names in it: matched once, so that a pattern naming modules of another stage
        only is no error on this one."""
        if self._chosen is None:
            self._chosen = split_only(planned(model, plan_for(model, self.plan), self.size))
        return self._chosen

    def trace(self, model: nn.Module, keys: Any, example: Any, names: list[str], train: bool = True) -> Any:
        """``traced.trace`` of ``model`` as split (a copy of it with the split layers' shapes),
        each stage holding ``model``'s own layers where the plan splits them."""
        chosen = self.chosen(model)
        if self._shaped is None:
            self._shaped = split_shaped(model, chosen, self.size)
        pipe = trace(self._shaped, keys, example, names, train)
        for index in range(pipe.num_stages):
            put_layers(pipe.get_stage_module(index), model, chosen)
        return pipe

    def split(self, stage: SplitStage, model: nn.Module, topology: PipelineTopology, chief: bool) -> SplitStage:
        """``stage`` of ``model`` with its module split over the "tp" group (in place), and its
        parameters (the copies of the user's) the split ones; the layout printed by the chief."""
        before = {id(p): name for name, p in stage.module.named_parameters(remove_duplicate=False)}
        plan = stage_plan(model, self.chosen(model), stage.module)
        split = parallelize(stage.module, self.mesh["tp"], plan)
        modules = dict(stage.module.named_modules())
        for name, style in split.items():
            if style.kind == "rowwise" or style.gather:
                modules[name].register_forward_hook(self._counter(style))
        after = dict(stage.module.named_parameters(remove_duplicate=False))

        def new(params: list[nn.Parameter]) -> list[nn.Parameter]:
            return [after[before[id(p)]] for p in params]

        copies = {user: new(params) for user, params in stage.copies.items()}
        tied = [(new(params), stages) for params, stages in stage.tied]
        if chief:
            console.print(self.layout(topology, model))
        return SplitStage(stage.module, stage.index, copies, tied, stage.shared_by)

    @staticmethod
    def hold_parts(module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """The stage's and its optimizer's state dicts hold this process's parts of the split
        parameters: its checkpoint part, resumed on the same mesh (parallel/local_state.py)."""
        hold_local_parts(module, optimizer)

    def replicate(self, module: nn.Module) -> nn.Module:
        """An evaluation stage traced beside a training stage already split: its layers are
        the split ones, the parameters it holds whole become replicated DTensors, as the
        training stage's (then shared with it by name)."""
        parallelize(module, self.mesh["tp"], {})
        self._shaped = None  # both stages traced: the copy is no longer needed
        return module

    def layout(self, topology: PipelineTopology, model: nn.Module) -> str:
        """What the chief prints at start: the mesh, the modules split, the groups' ranks."""
        groups = "; ".join(
            f"{dim} groups {' '.join(str(ranks) for ranks in every)}" for dim, every in topology.groups().items()
        )
        return (
            f"paratrain: pipeline x tensor parallel: {topology.num_replicas} replica(s) x {topology.num_stages} "
            f"stages x {self.size} shards (mesh dp x pp x tp); {len(self.chosen(model))} modules of "
            f"{type(model).__name__} split ({summary(self.chosen(model))}); ranks {groups}"
        )

    def _counter(self, style: Style) -> Any:
        """A forward hook counting a layer's collectives as a ring makes them: a row-wise
        layer's output all-reduced forward and as many bytes of activation gradient backward;
        an output layer's logits all-gathered."""
        share = (self.size - 1) / self.size

        def count(module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
            if module.training and torch.is_grad_enabled():
                whole = output.numel() * output.element_size()
                self.bytes += whole * share if style.gather else 2 * whole * 2 * share

        return count
