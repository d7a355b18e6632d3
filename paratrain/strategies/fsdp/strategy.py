"""``fsdp``: fully sharded data parallelism (ZeRO-3) with PyTorch's FSDP2 (``fully_shard``).

Every replica holds 1/N of each parameter, gradient and optimizer state; a layer's parameters are
all-gathered for its forward and backward and its gradient reduce-scattered. Numerically it is ``allreduce``;
what it saves is memory. A model that names its blocks (``_no_split_modules``) is sharded block by block,
any other by each module holding parameters, the root last (it keeps shared parameters).
``--no-reshard-after-forward`` keeps gathered parameters until the backward. Only ``--compression fp16`` /
``bf16`` are taken (as the reduce dtype): a reduce-scatter adds payloads element by element, which int8, topk
and powersgd do not allow. Checkpoints are sharded through ``torch.distributed.checkpoint`` (``model/``), so no
process holds the whole state, and resume on any number of processes. See docs/fsdp.md.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from paratrain.comm.codec_config import as_codec
from paratrain.comm.codecs import Codec
from paratrain.errors import ConfigError
from paratrain.parallel.sharding import fsdp_units, gradient_sync_off
from paratrain.strategies.accounting import staleness_summary
from paratrain.strategies.base import DEFAULT_TIMEOUT_S
from paratrain.strategies.numerics import finite_on_every_process, sharded_gradients, sharded_parameters
from paratrain.strategies.recipe import StepRecipe
from paratrain.strategies.replica import ReplicaStrategy
from paratrain.strategies.sharded_files import ShardedModelFiles
from paratrain.strategies.spec import process_options
from paratrain.strategies.step import uncompiled

if TYPE_CHECKING:
    from paratrain.config import TrainConfig

#: The codecs a reduce-scatter carries (the type gradients are reduced in).
REDUCE_DTYPES = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}


class FSDPStrategy(ReplicaStrategy):
    name = "fsdp"
    scaler_missing = "fsdp's sharded gradients do not have here"
    takes_compression = True
    takes_channels_last = False
    compiles = False
    reshards: ClassVar[bool] = True

    def __init__(
        self,
        device: str = "auto",
        timeout: float = DEFAULT_TIMEOUT_S,
        reshard_after_forward: bool = True,
        compression: str | Codec = "none",
        workers: int | None = None,
    ):
        super().__init__(device=device, timeout=timeout, workers=workers)
        self.reshard_after_forward = reshard_after_forward
        self.codec = as_codec(compression)
        if self.codec.name not in REDUCE_DTYPES:
            raise ConfigError(_codec_refusal(self.codec.name))
        self._grad_bytes = 0
        self._units = 0

    @classmethod
    def check_config(cls, config: TrainConfig) -> None:
        if config.codec.compression not in REDUCE_DTYPES:
            raise ConfigError(_codec_refusal(config.codec.compression))

    @classmethod
    def from_config(cls, config: TrainConfig) -> FSDPStrategy:
        reshard = config.fsdp.reshard_after_forward
        return cls(**process_options(config), reshard_after_forward=reshard, compression=config.codec.build())

    # ----- model ---------------------------------------------------------------------------------
    def prepare(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, recipe: StepRecipe | None = None
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Shard ``model`` in place (each module with parameters of its own one unit, the root
        last) and point ``optimizer``'s parameter groups at the sharded parameters."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        model, optimizer = super().prepare(model, optimizer, recipe)
        model = uncompiled(model)
        names = {id(p): name for name, p in model.named_parameters()}
        groups = [{"params": [names[id(p)] for p in group["params"]]} for group in optimizer.param_groups]
        self._grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        policy = MixedPrecisionPolicy(reduce_dtype=REDUCE_DTYPES[self.codec.name])
        # The mesh on this strategy's device: FSDP2's default takes the GPU wherever one is
        # visible, even for a run on the CPU.
        mesh = fsdp_mesh(self.device)
        units = fsdp_units(model)
        for unit in units:
            fully_shard(unit, mesh=mesh, reshard_after_forward=self.reshard_after_forward, mp_policy=policy)
        self.track(fully_shard(model, mesh=mesh, reshard_after_forward=self.reshard_after_forward, mp_policy=policy))
        self._units = len(units) + 1
        if optimizer.state:
            raise ConfigError(
                "fsdp shards the parameters the optimizer steps: give it an optimizer that has not stepped yet "
                "(load optimizer state through a checkpoint, after prepare)"
            )
        sharded = dict(model.named_parameters())
        for group, names_of_group in zip(optimizer.param_groups, groups):
            group["params"] = [sharded[name] for name in names_of_group["params"]]
        return model, optimizer

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        return gradient_sync_off(uncompiled(model))

    def gradients_finite(self, optimizer: torch.optim.Optimizer) -> bool:
        return finite_on_every_process(sharded_gradients(optimizer), self.device)

    def parameters_finite(self, model: nn.Module) -> bool:
        return finite_on_every_process(sharded_parameters(model), self.device)

    # ----- accounting ----------------------------------------------------------------------------------
    def _step_bytes(self) -> int:
        """What one replica hands to its collectives per step: the parameters all-gathered
        for the forward and (resharded after it) again for the backward, its gradient to
        the reduce-scatter (in the codec's type)."""
        reduce_dtype = REDUCE_DTYPES[self.codec.name]
        grad = self._grad_bytes // 2 if reduce_dtype is not None else self._grad_bytes
        gathers = 2 if self.reshard_after_forward else 1
        return (gathers * self._grad_bytes + grad) // self.num_replicas

    def step_counters(self) -> dict[str, float]:
        return {"bytes_sent": self._step_bytes() * self._steps, "wait_seconds": self.wait_seconds, "staleness": 0}

    def stats(self) -> dict[str, Any]:
        total = self._steps * self.num_replicas
        return {
            "bytes_sent": self._step_bytes() * total,
            "dropped_gradients": 0,
            "staleness": staleness_summary({0: total}),
        }

    # ----- sharded checkpoints -------------------------------------------------------------------------
    @property
    def model_files(self) -> ShardedModelFiles:
        return ShardedModelFiles()


def fsdp_mesh(device: torch.device) -> Any:
    """A one-dimensional device mesh over the default process group, of ``device``'s type."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(dist.group.WORLD, device_type=device.type)


def _codec_refusal(name: str) -> str:
    return (
        f"--compression {name}: fsdp reduce-scatters gradients, which only none, fp16 and bf16 can be "
        "(a coded payload cannot be summed shard by shard); use one of those, or --strategy allreduce"
    )
