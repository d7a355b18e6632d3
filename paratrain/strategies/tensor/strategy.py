"""``tensor``: tensor parallelism, each layer split over ``--tensor-parallel T`` processes (Megatron-LM's split
through DTensor; parallel/tensor.py says how a plan splits a model).

The T processes of a replica compute one step together, each holding 1/T of every split weight, gradient
and optimizer state; a block costs two all-reduces of its activations forward and two backward. ``--workers
W`` makes W/T data-parallel replicas on a (replica, shard) mesh whose shard dimension holds neighbouring
ranks; gradients are all-reduced over replicas, so a step is one step of the global batch. ``loss_parallel``
(on by default, as torchtitan) computes a cross-entropy on each process's vocabulary slice
(parallel/vocabulary.py), with no all-gather of the logits. Checkpoints go through
``torch.distributed.checkpoint`` (strategies/sharded_files.py). See docs/tensor_parallel.md.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from paratrain.comm.flat import mean_gradients
from paratrain.comm.transport import cluster_from_env, default_backend
from paratrain.console import console
from paratrain.errors import ConfigError
from paratrain.parallel.sharding import fsdp_units, gradient_sync_off
from paratrain.parallel.tensor import matching, output_layer, parallelize, plan_for, summary
from paratrain.parallel.vocabulary import LOSS_ALL_REDUCES, LOSS_VALUE_BYTES, split_logits, whole
from paratrain.strategies.base import DEFAULT_TIMEOUT_S, Strategy
from paratrain.strategies.device import resolve_device
from paratrain.strategies.local_step import local_step
from paratrain.strategies.numerics import finite_on_every_process, sharded_gradients, sharded_parameters
from paratrain.strategies.recipe import StepRecipe
from paratrain.strategies.sharded_files import ShardedModelFiles
from paratrain.strategies.spec import process_options
from paratrain.strategies.step import LossFn, StepOutput
from paratrain.strategies.tensor.loss import own_loss_splits, plain_loss, takes_split_logits
from paratrain.strategies.tensor.topology import TensorTopology

if TYPE_CHECKING:
    from paratrain.config import TrainConfig


#: Why a run whose replicas shard their parts (FSDP2 x TP) writes no checkpoint here: a packed
#: projection's part is a strided shard of a strided shard, which torch 2.13 gathers wrong
#: (a resume in that layout fails; in another, GPT-2's query-key-value bias comes back off).
SHARDED_CHECKPOINTS = (
    "--checkpoint-dir with --shard-replicas: checkpoints of replicas sharded over tensor-parallel splits are not "
    "written correctly in this PyTorch; to checkpoint, leave out --shard-replicas (each process then holds "
    "1/T of the model, the replicas all-reduce)"
)


class TensorParallelStrategy(Strategy):
    name = "tensor"
    scaler_missing = "tensor's split gradients do not have here"
    compiles = takes_channels_last = False  # DTensor parameters: neither compiled nor in channels-last order
    reshards = True  # DCP loads the model into another degree or mesh

    def __init__(
        self,
        tensor_parallel: int = 2,
        plan: dict[str, str] | None = None,
        shard_replicas: bool = False,
        *,
        loss_parallel: bool = True,
        sequence_parallel: bool = False,
        device: str = "auto",
        timeout: float = DEFAULT_TIMEOUT_S,
        workers: int | None = None,
    ):
        super().__init__(device=device, timeout=timeout, workers=workers)
        if not isinstance(tensor_parallel, int) or tensor_parallel < 1:
            raise ConfigError(f"tensor_parallel must be a whole number >= 1, got {tensor_parallel!r}")
        self.tensor_parallel = tensor_parallel
        self.plan = plan
        self.shard_replicas = shard_replicas
        self.loss_parallel = loss_parallel
        self.sequence_parallel = sequence_parallel
        self.mesh: Any = None
        self._replica_group: Any = None
        self._grad_bytes = 0
        self._activation_bytes = 0  # what the row-split layers all-reduce, per step, forward
        self._logits_bytes = 0.0  # what the output layer's logits (or the loss on their slices) send
        self._splits = False  # whether a loss may take the logits split (loss_parallel, an output layer)
        self._own_loss_splits = False  # whether the model's own loss takes them split (loss.py)

    @classmethod
    def from_config(cls, config: TrainConfig) -> TensorParallelStrategy:
        tensor = config.tensor
        return cls(
            tensor.degree(cls.name),
            tensor.plan(),
            tensor.shard_replicas,
            loss_parallel=tensor.loss_parallel,
            sequence_parallel=tensor.sequence_parallel,
            **process_options(config),
        )

    @classmethod
    def topology_for(cls, config: TrainConfig) -> TensorTopology:
        """``--workers`` counts processes; the default 1 means one replica of T processes."""
        return TensorTopology.of(config.workers, config.tensor.degree(cls.name))

    @classmethod
    def check_config(cls, config: TrainConfig) -> None:
        if config.tensor.shard_replicas and config.checkpoint_dir:
            raise ConfigError(SHARDED_CHECKPOINTS)
        tensor = config.tensor.degree(cls.name)
        if config.tensor.sequence_parallel and config.dataset.startswith("text-lm") and config.seq_len % tensor:
            raise ConfigError(
                f"--sequence-parallel over {tensor} processes splits each sequence by position: --seq-len "
                f"{config.seq_len} is not a multiple of {tensor}"
            )

    @classmethod
    def check_model(cls, model: nn.Module, config: TrainConfig) -> None:
        matching(model, plan_for(model, config.tensor.plan()), config.tensor.degree(cls.name))

    def planned_topology(self) -> TensorTopology:
        return TensorTopology.of(self.workers, self.tensor_parallel)

    def describe(self) -> dict[str, Any]:
        facts = super().describe()
        facts.update(workers=self.topology.num_processes, replicas=self.num_replicas)  # --workers counts processes
        facts.update(tensor_parallel=self.tensor_parallel, shard_replicas=self.shard_replicas)
        facts.update(loss_parallel=self.loss_parallel, sequence_parallel=self.sequence_parallel)
        return facts

    # ----- process -----------------------------------------------------------------------
    def setup(self) -> None:
        """Join the run and lay its processes out as a (replica, shard) device mesh."""
        if not self._ready:
            cluster = cluster_from_env()
            self.device = resolve_device(self.device_preference, cluster.local_rank if cluster else 0)
            self._join_group(default_backend(self.device))
            world, tensor = dist.get_world_size(), self.tensor_parallel
            if world % tensor:
                raise ConfigError(f"the run has {world} processes, not a multiple of --tensor-parallel {tensor}")
            self.process_rank = dist.get_rank()
            self.topology = TensorTopology(num_replicas=world // tensor, tensor=tensor)
            self.mesh = init_device_mesh(self.device.type, (world // tensor, tensor), mesh_dim_names=("dp", "tp"))
            self._replica_group = self.mesh["dp"].get_group() if world > tensor else None
        super().setup()

    def teardown(self) -> None:
        self.mesh = self._replica_group = None
        super().teardown()

    # ----- model -------------------------------------------------------------------------
    def prepare(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, recipe: StepRecipe | None = None
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Split ``model`` in place over this replica's processes (its plan: parallel/tensor.py)
        and point ``optimizer`` at the split parameters."""
        model, optimizer = super().prepare(model, optimizer, recipe)
        if optimizer.state:
            raise ConfigError(
                "tensor splits the parameters the optimizer steps: give it an optimizer that has not stepped yet "
                "(load optimizer state through a checkpoint, after prepare)"
            )
        names = {id(p): name for name, p in model.named_parameters()}
        groups = [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
        chosen = parallelize(model, self.mesh["tp"], plan_for(model, self.plan), self.sequence_parallel)
        self._grad_bytes = sum(
            p.to_local().numel() * p.element_size() for p in model.parameters() if p.requires_grad
        )  # this process's part
        if self._sharded:  # FSDP2 over the replicas, unit by unit, the root last
            for unit in fsdp_units(model):
                fully_shard(unit, mesh=self.mesh["dp"])
            self.track(fully_shard(model, mesh=self.mesh["dp"]))
        split = dict(model.named_parameters())
        for group, names_of_group in zip(optimizer.param_groups, groups):
            group["params"] = [split[name] for name in names_of_group]
        modules = dict(model.named_modules())
        for name, style in chosen.items():
            if style.kind == "rowwise":
                modules[name].register_forward_hook(self._count_activation)
        logits = output_layer(model, chosen)
        if logits is not None:
            modules[logits].register_forward_hook(self._count_logits)
        self._splits = self.loss_parallel and logits is not None
        self._own_loss_splits = self._splits and own_loss_splits(model)
        if self.is_chief:
            split = f"; {logits}'s logits split by vocabulary for a cross-entropy" if self._splits else ""
            split += "; the activations between them split by position" if self.sequence_parallel else ""
            console.print(
                f"paratrain: tensor parallel over {self.tensor_parallel} processes, {self.num_replicas} "
                f"replica(s): {len(chosen)} modules split ({summary(chosen)}){split}; ranks "
                f"{_layout(self.topology)}"
            )
        return model, optimizer

    def _count_activation(self, module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
        """A row-wise layer's output, whole: all-reduced, or (sequence parallel, a linear
        layer's) reduce-scattered to a process's positions, the same bytes."""
        if module.training:
            scattered = self.sequence_parallel and not isinstance(module, nn.Embedding)
            self._activation_bytes += (
                output.numel() * output.element_size() * (self.tensor_parallel if scattered else 1)
            )

    def _count_logits(self, module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
        """The output layer's sends, as a ring makes them: its logits all-gathered whole, or
        split (a DTensor), the loss's all-reduces of a few values a position."""
        if not module.training:
            return
        tensor = self.tensor_parallel
        if isinstance(output, DTensor):
            positions = output.numel() // output.shape[-1]
            self._logits_bytes += LOSS_ALL_REDUCES * positions * LOSS_VALUE_BYTES * 2 * (tensor - 1) / tensor
        else:
            self._logits_bytes += output.numel() * output.element_size() * (tensor - 1) / tensor

    # ----- step and evaluation -------------------------------------------------------------
    def train_step(
        self, model: nn.Module, loss_fn: LossFn, optimizer: torch.optim.Optimizer, inputs: Any, targets: Any
    ) -> StepOutput:
        """One step of this replica's batch (local_step.py); where the loss takes the logits
        split by vocabulary, inside ``split_logits()``: its outputs are then the split logits
        (DTensors; ``full_tensor()`` makes them whole)."""
        if not self._takes_split(loss_fn, targets):
            return local_step(self, model, loss_fn, optimizer, inputs, targets)
        with split_logits():
            return local_step(self, model, plain_loss(loss_fn), optimizer, inputs, targets)

    def score(self, model: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn, metrics: list[LossFn]) -> Any:
        """Evaluation of one batch: where the loss takes the logits split, it computes on them
        and the metrics (any callable) are given them whole, gathered batch by batch."""
        if not self._takes_split(loss_fn, targets):
            return super().score(model, inputs, targets, loss_fn, metrics)
        with split_logits():
            outputs = self.forward(model, inputs)
            loss = plain_loss(loss_fn)(outputs, targets)
        gathered = whole(outputs) if metrics else outputs
        return [loss, *(metric(gathered, targets) for metric in metrics)]

    def _takes_split(self, loss_fn: LossFn, targets: Any) -> bool:
        return self._splits and takes_split_logits(loss_fn, targets, self._own_loss_splits)

    @property
    def _sharded(self) -> bool:
        """Whether FSDP2 shards over the replicas (and reduce-scatters their gradients)."""
        return self.shard_replicas and self.num_replicas > 1

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        return gradient_sync_off(model) if self._sharded else contextlib.nullcontext()

    def reduce_gradients(self, model: nn.Module) -> None:
        """Sum each process's part of the gradient over the replicas, then divide (Gloo's
        AVG is unreliable: pytorch #162338); sharded over the replicas, FSDP2 has done it."""
        if self._replica_group is None or self._sharded:
            return
        # trained parameters only: a frozen one given a zero gradient would be stepped
        # (weight decay, momentum) where no other strategy steps it
        mean_gradients([p for p in model.parameters() if p.requires_grad], self._replica_group, self.num_replicas)

    def gradients_finite(self, optimizer: torch.optim.Optimizer) -> bool:
        return finite_on_every_process(sharded_gradients(optimizer), self.device)

    def parameters_finite(self, model: nn.Module) -> bool:
        return finite_on_every_process(sharded_parameters(model), self.device)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the replicas: the processes of one replica hold the same loss and counts."""
        if self._replica_group is not None:
            dist.all_reduce(tensor, group=self._replica_group)
        return tensor

    @property
    def model_files(self) -> ShardedModelFiles:
        if self._sharded:
            raise ConfigError(SHARDED_CHECKPOINTS)
        return ShardedModelFiles()

    # ----- accounting ----------------------------------------------------------------------
    def _step_bytes(self) -> float:
        """What one process hands to its collectives per step, as a ring sends it: the row-split
        layers' outputs all-reduced forward and as many activation gradients backward, over
        the T processes; the output layer's logits gathered, or the loss's all-reduces on their
        slices; its part of the gradient over the replicas."""
        steps = max(self._steps, 1)
        tensor, replicas = self.tensor_parallel, self.num_replicas
        activations = 2 * self._activation_bytes / steps * 2 * (tensor - 1) / tensor + self._logits_bytes / steps
        gradient = self._grad_bytes * (3 if self._sharded else 2) * (replicas - 1) / replicas  # ZeRO-3: 1.5x
        return activations + gradient

    def step_counters(self) -> dict[str, float]:
        return {"bytes_sent": self._step_bytes() * self._steps, "wait_seconds": self.wait_seconds, "staleness": 0}

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "bytes_sent": int(self._step_bytes() * self._steps * self.topology.num_processes)}


def _layout(topology: TensorTopology) -> str:
    groups = [list(range(r * topology.tensor, (r + 1) * topology.tensor)) for r in range(topology.num_replicas)]
    return " | ".join(f"replica {r}: {group}" for r, group in enumerate(groups))
