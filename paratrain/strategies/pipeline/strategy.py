"""``pipeline``: the layers of one model split into stages, one stage per process; micro-batches flow through
them (GPipe or 1F1B, from ``torch.distributed.pipelining``).

``--stages S`` and ``--workers N`` (a multiple of S) make N/S pipeline replicas, global rank ``replica * S +
stage``. A replica's ranks read the same batch (stage 0 feeds it, the last stage computes the loss); replicas
read different slices and each stage averages its gradients over them in its own group, so S stages x R
replicas of batch b equal one process with batch R*b. Metrics count each replica once (the last stage speaks
for it); the chief is the last stage of replica 0 (topology.py). Option checks are checks.py's;
``tensor_parallel`` T > 1 splits each stage over T processes (mesh.py). See docs/pipeline.md.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from paratrain.comm.flat import mean_gradients
from paratrain.comm.transport import cluster_from_env, default_backend, wire_device
from paratrain.errors import ConfigError
from paratrain.parallel.pipeline import forward_only, make_schedule, stage_module
from paratrain.parallel.shared import SplitStage, split_stage
from paratrain.parallel.split import (
    bounds_from_split_points,
    check_num_parts,
    parameter_bounds,
    parse_split_points,
    sequential_layers,
)
from paratrain.parallel.traced import sharing, stage_of, trace
from paratrain.strategies.accounting import staleness_summary
from paratrain.strategies.base import DEFAULT_TIMEOUT_S, Strategy
from paratrain.strategies.device import resolve_device
from paratrain.strategies.pipeline.checks import (
    check_pipeline_config,
    check_pipeline_model,
    check_saved_place,
    check_strategy_options,
    saved_place,
    traced_split,
)
from paratrain.strategies.pipeline.gradients import (
    TiedGradients,
    clip_over_stages,
    diverged_anywhere,
    nonfinite_anywhere,
)
from paratrain.strategies.pipeline.mesh import TensorStages, replica_groups
from paratrain.strategies.pipeline.stages import (
    MicrobatchTraffic,
    agreed_bounds,
    feed,
    forward_in_shape,
    is_layered,
    keep_stage_parameters,
    own_loss,
    scored,
    stage_loss,
)
from paratrain.strategies.pipeline.topology import PipelineTopology
from paratrain.strategies.pipeline.wavefront import WavefrontSchedule
from paratrain.strategies.recipe import StepRecipe
from paratrain.strategies.spec import process_options
from paratrain.strategies.step import LossFn, StepOutput

if TYPE_CHECKING:
    from paratrain.config import TrainConfig


class PipelineStrategy(Strategy):
    name = "pipeline"
    scales_loss = False  # no GradScaler across stages: bf16 needs none
    compiles = False  # stages are cut from the model's layers, not from a compiled graph
    topology_class: ClassVar[type[PipelineTopology]] = PipelineTopology

    def __init__(
        self,
        num_stages: int = 2,
        num_microbatches: int = 4,
        schedule: str = "1f1b",
        balance: str = "params",
        split_points: list[int] | list[str] | None = None,
        device: str = "auto",
        timeout: float = DEFAULT_TIMEOUT_S,
        workers: int | None = None,
        *,
        tensor_parallel: int = 1,
        tp_plan: dict[str, str] | None = None,
    ):
        """``workers`` counts processes, as --workers does: replicas x stages (x ``tensor_parallel``:
        the processes each stage is split over, by ``tp_plan`` or the model's own plan: mesh.py)."""
        super().__init__(device=device, timeout=timeout, workers=workers)
        check_strategy_options(num_stages, num_microbatches, schedule, balance, tensor_parallel, tp_plan)
        self.tensor_parallel = tensor_parallel
        self._tensor = TensorStages(tensor_parallel, tp_plan) if tensor_parallel > 1 else None
        self.num_stages, self.num_microbatches = num_stages, num_microbatches
        self.schedule_name = schedule
        self.balance = balance
        self.split_points = split_points
        self._stage_group: Any = None  # this stage across replicas: gradients are averaged here
        self._pipeline_group: Any = None  # the stages of this replica: activations flow here
        self.bounds: list[tuple[int, int]] | None = None
        self._module: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._schedule: Any = None
        self._loss_fn: LossFn | None = None
        self._bytes_sent = 0
        self._traffic: MicrobatchTraffic | None = None  # one micro-batch's bytes, once measured
        self._pending: tuple[nn.Module, torch.optim.Optimizer] | None = None
        self._loads: list[Callable[[], None]] = []  # a checkpoint's, once the stage is cut
        self._saved_bounds: list[tuple[int, int]] | None = None  # the resumed run's cut
        self._whole: nn.Module | None = None  # the user's model the stage was cut from
        self._split_names: list[str] | None = None  # where a traced model's stages start
        self._example: tuple[torch.Tensor, ...] | None = None  # the micro-batch it was traced on
        self._tied: TiedGradients | None = None  # its parameters held by several stages
        self._evaluation: nn.Module | None = None  # its stage traced in evaluation mode
        self._wave: WavefrontSchedule | None = None  # --schedule wavefront: one LSTM layer a stage

    # ----- configuration ---------------------------------------------------------------
    @classmethod
    def topology_for(cls, config: TrainConfig) -> PipelineTopology:
        """``--workers`` counts processes; the default 1 means one pipeline."""
        return cls.topology_class.of(config.workers, config.pipeline.stages, config.tensor.degree(config.strategy))

    @classmethod
    def check_config(cls, config: TrainConfig) -> None:
        check_pipeline_config(config)  # checks.py, with check_model's

    @classmethod
    def check_model(cls, model: nn.Module, config: TrainConfig) -> None:
        check_pipeline_model(model, config)

    @classmethod
    def from_config(cls, config: TrainConfig) -> PipelineStrategy:
        options = config.pipeline
        points = parse_split_points(options.split_points) if options.split_points else None
        sizes, tensor = (options.stages, options.microbatches), config.tensor
        return cls(
            *sizes,
            options.schedule,
            options.balance,
            points,
            **process_options(config),
            tensor_parallel=tensor.degree(cls.name),
            tp_plan=tensor.plan(),
        )

    def planned_topology(self) -> PipelineTopology:
        return self.topology_class.of(self.workers, self.num_stages, self.tensor_parallel)

    def describe(self) -> dict[str, Any]:
        split = [list(b) for b in self.bounds] if self.bounds else self._split_names
        return {
            **super().describe(),
            "workers": self.topology.num_processes,  # processes, as --workers counts
            "replicas": self.num_replicas,
            "stages": self.num_stages,
            "microbatches": self.num_microbatches,
            "schedule": self.schedule_name,
            "split": split,
            "tensor_parallel": self.tensor_parallel,
        }

    # ----- process -----------------------------------------------------------------------
    def setup(self) -> None:
        if self._ready:
            return
        cluster = cluster_from_env()
        self.device = resolve_device(self.device_preference, cluster.local_rank if cluster else 0)
        self._join_group(default_backend(self.device))
        self._place(dist.get_world_size())
        super().setup()

    def _place(self, world: int) -> None:
        """This process's place in a process group of ``world`` processes: the topology, its
        rank, and the groups of its replica's stages and of its stage's replicas."""
        self.process_rank = dist.get_rank()
        if self._tensor is not None:  # 3-D: the groups of a device mesh (mesh.py)
            placed = self._tensor.place(world, self.num_stages, self.device)
            self.topology, self._pipeline_group, self._stage_group = placed
            return
        if world % self.num_stages:
            raise ConfigError(f"the run has {world} processes, not a multiple of --stages {self.num_stages}")
        self.topology = PipelineTopology(num_replicas=world // self.num_stages, num_stages=self.num_stages)
        self._pipeline_group, self._stage_group = replica_groups(self.topology, self.process_rank)

    def teardown(self) -> None:
        """The schedule and its stage hold this run's process groups and pending sends: they go first,
        while the interpreter is whole (freed at shutdown, after the groups, they abort it)."""
        self._schedule = self._wave = None
        self._stage_group = self._pipeline_group = None
        gc.collect()
        super().teardown()

    @property
    def stage(self) -> int:
        return self.topology.stage(self.process_rank)

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.num_stages - 1

    # ----- model -------------------------------------------------------------------------
    def prepare(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, recipe: StepRecipe | None = None
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """This process's stage of ``model``; ``optimizer`` keeps only the stage's parameters.
        ``recipe.accumulate`` multiplies the micro-batches of a step (the same gradient).

        With ``balance="time"``, and for a model that is not an nn.Sequential (traced on a
        micro-batch: stages.py), the stage is made at the first batch."""
        self.setup()
        self.use_recipe(recipe)
        if self._tensor is not None:
            self._tensor.check_step(self.recipe, optimizer)
        model = self.recipe.prepare_model(model)
        if self.schedule_name == "wavefront":
            self._wave = WavefrontSchedule.of(self, model)
            self._wave.module.to(self.device)  # the stage's parameters, in place: the optimizer's own
            self._module = self._wave.module
            self._optimizer = self._wave.keep(optimizer)
            self._whole = model
            return self._module, optimizer
        self._pending = (model, optimizer)
        if is_layered(model, self.split_points):
            layers = sequential_layers(model)
            check_num_parts(len(layers), self.num_stages)
            if self.split_points is not None:
                bounds_from_split_points(self.split_points, len(layers), self.num_stages)
            if self.balance != "time":
                self._build(None)
        else:
            self._split_names = traced_split(model, self.split_points, self.num_stages, self.balance)
        return (self._module if self._module is not None else model), optimizer

    def _build(self, inputs: Any) -> None:
        model, optimizer = self._pending  # type: ignore[misc]
        self._whole = model
        copies = self._build_layers(model, inputs) if self._split_names is None else self._build_traced(model, inputs)
        keep_stage_parameters(optimizer, copies)
        if self._tensor is not None:
            self._tensor.hold_parts(self._module, optimizer)
        self._optimizer = optimizer
        self._pending = None
        for load in self._loads:
            load()
        self._loads.clear()

    def when_model_made(self, load: Callable[[], None]) -> None:
        """The stage cut at the first batch (``--balance time``, a traced model) takes a
        checkpoint's state then; cut already, at once."""
        if self._pending is not None and self._module is None:
            self._loads.append(load)
        else:
            load()

    def _build_layers(self, model: nn.Module, example: torch.Tensor | None) -> dict[int, list[nn.Parameter]]:
        layers = sequential_layers(model)
        if self._saved_bounds is not None:  # a resumed run cuts where the saved run did
            bounds = self._saved_bounds
        elif self.split_points is not None or self.balance == "params":
            bounds = parameter_bounds(layers, self.num_stages, self.split_points)
        else:
            bounds = agreed_bounds(layers, example, self.num_stages, self.num_microbatches, self.device)
        self.bounds = bounds
        holdings = [[(p, p) for layer in layers[a:b] for p in layer.parameters()] for a, b in bounds]
        stage = split_stage(stage_module(layers, bounds, self.stage), self.stage, holdings, list(model.parameters()))
        stage = self._placed(stage, model)
        self._tied = self._tie(stage) if stage.shared_by else None
        self._module = stage.module
        return stage.copies

    def _build_traced(self, model: nn.Module, inputs: Any) -> dict[int, list[nn.Parameter]]:
        """Trace ``model`` on the first micro-batch of ``inputs`` and keep this stage of it."""
        tensors, keys = feed(inputs)
        rows = max(1, len(tensors[0]) // self.batch_microbatches)
        self._example = tuple(t[:rows] for t in tensors)
        tracer = self._tensor.trace if self._tensor is not None else trace  # 3-D: traced with split shapes
        traced = self._placed(stage_of(tracer(model, keys, self._example, self._split_names), model, self.stage), model)
        self._tied = self._tie(traced)
        evaluation = tracer(model, keys, self._example, self._split_names, train=False).get_stage_module(self.stage)
        if self._tensor is not None:
            evaluation = self._tensor.replicate(evaluation.to(self.device))
        self._evaluation = sharing(evaluation, traced.module)  # no dropout, running statistics
        self._module = traced.module
        return traced.copies

    def _placed(self, stage: SplitStage, model: nn.Module) -> SplitStage:
        """``stage`` on this process's device; in 3-D, split over its tensor-parallel group."""
        stage.module.to(self.device)
        return stage if self._tensor is None else self._tensor.split(stage, model, self.topology, self.is_chief)

    def _tie(self, stage: SplitStage) -> TiedGradients:
        """Sums over this replica's stages (of this shard), in the run's process group."""
        return TiedGradients(stage, self.rank, self.num_replicas, self.num_stages, self.tensor_parallel, self.shard)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """This process's stage (the whole model until a time-balanced split is made)."""
        return self._module if self._module is not None else model

    def _schedule_for(self, loss_fn: LossFn, targets: Any) -> Any:
        if self._schedule is None or self._loss_fn is not loss_fn:
            self._loss_fn = loss_fn
            loss = stage_loss(self._whole, loss_fn, targets)
            made = make_schedule(
                self.schedule_name,
                self._module,
                self.stage,
                self.num_stages,
                self.device,
                self._pipeline_group,
                self.step_microbatches,
                loss,
            )
            self._schedule = self.track(made)
            self._traffic = MicrobatchTraffic(self._module, self.stage == 0, self.is_last_stage)
        return self._schedule

    def train_step(
        self, model: nn.Module, loss_fn: LossFn, optimizer: Optimizer, inputs: Any, targets: Any
    ) -> StepOutput:
        """One step of the schedule on this stage; the loss (batch mean) and the logits on
        the last stage, a zero loss and no logits on the others."""
        if self._wave is not None:
            return self._wave.train_step(self, loss_fn, optimizer, inputs, targets)
        inputs = self.recipe.prepare_inputs(inputs)
        if self._module is None:
            self._build(inputs)
        schedule = self._schedule_for(loss_fn, targets)
        optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        with self.recipe.autocast(self.device):
            if self.stage == 0:
                outputs = schedule.step(*feed(inputs)[0])
            elif self.is_last_stage:
                outputs = schedule.step(target=scored(inputs, targets), losses=losses)
            else:
                outputs = schedule.step()
        if self._tied is not None:
            self._bytes_sent += self._tied()
        self._bytes_sent += self.step_microbatches * self._traffic.bytes
        # Equal micro-batches: the mean of their mean losses is the batch's mean loss.
        loss = torch.stack([l.detach() for l in losses]).mean().to(self.device) if self.is_last_stage else None
        return self.finish_step(optimizer, loss, outputs)

    def finish_step(self, optimizer: Optimizer, loss: torch.Tensor | None, outputs: Any) -> StepOutput:
        """The end of every schedule's step, its gradients computed: averaged over replicas,
        clipped, a non-finite step skipped, the step; the loss and logits on the last stage."""
        if self.num_replicas > 1:
            self._average_gradients()
        self.steps_taken += 1
        if self.recipe.clip_grad_norm:
            self.clip_gradients(self._module)
        # Each stage sees only its own gradients: the processes agree in one all-reduce.
        skip = self.skip_nonfinite(self._module, float("nan"), lambda: not self._nonfinite_anywhere(optimizer))
        if not skip:
            optimizer.step()
            self._steps += 1
        if self.is_last_stage:
            return StepOutput(loss, outputs.detach(), skipped=skip)  # host memory over Gloo
        return StepOutput(torch.zeros((), device=self.device), torch.empty(0, device=self.device), skipped=skip)

    @property
    def step_microbatches(self) -> int:
        """Micro-batches per optimizer step: ``num_microbatches`` x the recipe's ``accumulate``."""
        return self.num_microbatches * self.recipe.accumulate

    batch_microbatches = step_microbatches  # micro-batches of one batch this process reads
    shard = property(lambda self: self.process_rank % self.tensor_parallel)  # its part of the stage's split layers
    first_rank = property(lambda self: self.rank * self.num_stages * self.tensor_parallel + self.shard)  # stage 0

    def clip_gradients(self, model: nn.Module) -> None:
        uncounted = self._tied.uncounted if self._tied is not None else frozenset()
        params, tensor = list(self._module.parameters()), self._tensor
        clip_over_stages(
            params,
            self.recipe.clip_grad_norm,
            self._pipeline_group,
            self.device,
            uncounted,
            tensor.group if tensor else None,
            self.shard,
        )

    def _nonfinite_anywhere(self, optimizer: torch.optim.Optimizer) -> bool:  # pipeline-ft's too
        return nonfinite_anywhere(optimizer, self.device)

    def parameters_finite(self, model: nn.Module) -> bool:
        return not diverged_anywhere(self.unwrap(model), self.device)

    def _average_gradients(self) -> None:
        """Mean of this stage's gradients across replicas: one all-reduce of one flat buffer."""
        params = [p for p in self._module.parameters() if p.grad is not None]
        if params:
            self._bytes_sent += mean_gradients(params, self._stage_group, self.num_replicas)

    def forward(self, model: nn.Module, inputs: Any) -> Any:
        """Evaluation's forward pass through every stage; outputs on the last stage only (a
        dict batch's: its logits and the model's own loss of them)."""
        if self._wave is not None:
            return self._wave.forward(self.recipe.prepare_inputs(inputs))
        inputs = self.recipe.prepare_inputs(inputs)
        if self._module is None:
            self._build(inputs)
        tensors, base = feed(inputs)[0], self.first_rank
        with self.recipe.autocast(self.device):
            if self._example is None:
                return self._forward_only(tensors, base)
            outputs = forward_in_shape(lambda chunk: self._forward_only(chunk, base), tensors, self._example)
        if outputs is None or not isinstance(inputs, Mapping):
            return outputs
        return {"logits": outputs, "loss": own_loss(self._whole)(outputs, scored(inputs, inputs))}

    def _forward_only(self, inputs: tuple[torch.Tensor, ...], base: int) -> Any:
        module, step = self._evaluation if self._evaluation is not None else self._module, self.tensor_parallel
        previous = base + (self.stage - 1) * step if self.stage > 0 else None  # the same shard of the stage before
        following = base + (self.stage + 1) * step if not self.is_last_stage else None
        return forward_only(module, inputs, self.stage, self.num_stages, previous, following, self.device)

    # ----- reductions, accounting, state ---------------------------------------------------
    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over replicas: the last stage of each replica contributes (its shard 0), the
        others add zeros (and receive the same sum)."""
        if not self.is_last_stage or self.shard:
            tensor.zero_()
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def stats(self) -> dict[str, Any]:
        sent = torch.tensor([self._bytes_sent + (self._tensor.bytes if self._tensor else 0.0)], dtype=torch.float64)
        sent = sent.to(wire_device(self.device))
        dist.all_reduce(sent)
        staleness = staleness_summary({0: self._steps * self.num_replicas})
        return {"bytes_sent": int(sent.item()), "dropped_gradients": 0, "staleness": staleness}

    def state_dict(self) -> dict[str, Any]:
        place = saved_place(self.stage, self.shard, self.tensor_parallel)
        return {**super().state_dict(), "bounds": [list(b) for b in self.bounds or []], **place}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        check_saved_place(state, self.stage, self.shard, self.tensor_parallel)
        bounds = [tuple(b) for b in state.get("bounds", [])]
        self._saved_bounds = bounds if len(bounds) == self.num_stages else None
