"""``allreduce`` (alias ``mirrored``): synchronous data parallelism.

Every replica holds the whole model, computes gradients on its own slice of the
global batch, and DistributedDataParallel averages them with an all-reduce (bucketed
and overlapped with the backward pass), so every replica applies the same update.
With per-replica batch ``b`` on ``N`` replicas this is one step of batch ``N*b``: the
"towers" of the classic multi-GPU recipes. NCCL between GPUs, Gloo on the CPU.

``compression=`` (a CODECS name or a Codec) puts a gradient codec on the wire as a DDP
communication hook (``comm/hooks.py``); ``none`` keeps DDP's own all-reduce.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from paratrain import timeline
from paratrain.comm.codec_config import as_codec, check_saved_codec
from paratrain.comm.codecs import Codec
from paratrain.comm.hooks import CommHook, make_hook
from paratrain.comm.shared_memory import SharedMemoryAllReduce, shared_memory_hook
from paratrain.console import console
from paratrain.strategies.accounting import staleness_summary
from paratrain.strategies.base import DEFAULT_TIMEOUT_S
from paratrain.strategies.recipe import StepRecipe
from paratrain.strategies.replica import ReplicaStrategy
from paratrain.strategies.spec import process_options
from paratrain.strategies.step import uncompiled

if TYPE_CHECKING:
    from paratrain.config import TrainConfig


class AllReduceStrategy(ReplicaStrategy):
    name = "allreduce"
    takes_compression = True
    reshards = True  # every replica holds the whole model: any number can go on from it

    def __init__(
        self,
        device: str = "auto",
        timeout: float = DEFAULT_TIMEOUT_S,
        bucket_cap_mb: float = 25.0,
        compression: str | Codec = "none",
        workers: int | None = None,
        shared_memory: bool = True,
    ):
        super().__init__(device=device, timeout=timeout, workers=workers)
        self.bucket_cap_mb = bucket_cap_mb
        self.shared_memory = shared_memory
        """On the CPU, with every process on this machine: sum through /dev/shm (comm/shared_memory.py)."""
        self.codec = as_codec(compression)
        self.hook: CommHook | None = None
        self._hook_state: dict[str, Any] | None = None  # loaded before prepare() made the hook
        self._grad_bytes = 0
        self.via: str | None = None
        """What sums the gradients: "shared memory", or the process group's backend (prepare)."""

    @classmethod
    def from_config(cls, config: TrainConfig) -> AllReduceStrategy:
        return cls(
            **process_options(config),
            bucket_cap_mb=config.allreduce.bucket_cap_mb,
            compression=config.codec.build(),
            shared_memory=config.allreduce.shared_memory,
        )

    def prepare(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, recipe: StepRecipe | None = None
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        model, optimizer = super().prepare(model, optimizer, recipe)
        self._grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        ddp = self.track(
            DistributedDataParallel(
                model,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                bucket_cap_mb=self.bucket_cap_mb,
                # Gradients live in DDP's buckets: one copy fewer per step.
                gradient_as_bucket_view=True,
            )
        )
        self.hook = make_hook(self.codec)
        shared = None
        if self.hook is None and self.shared_memory and self.device.type == "cpu":
            shared = SharedMemoryAllReduce.create(timeout=self.timeout)
        self.via = "shared memory" if shared is not None else dist.get_backend()
        if shared is not None:
            # Every process on this machine: the sums go through shared memory, not loopback TCP.
            ddp.register_comm_hook(shared, shared_memory_hook)
        elif self.hook is None and timeline.recorder() is not None:
            # Only with --timeline: DDP's own all-reduce, timed per bucket on the comm track.
            ddp.register_comm_hook(None, _timed_allreduce_hook)
        if self.hook is not None:
            self.hook.register(ddp)
            if self._hook_state is not None:
                self.hook.load_state_dict(self._hook_state)
                self._hook_state = None
        return ddp, optimizer

    def unwrap(self, model: nn.Module) -> nn.Module:
        model = uncompiled(model)
        return model.module if isinstance(model, DistributedDataParallel) else model

    def no_sync(self, model: nn.Module) -> Any:
        model = uncompiled(model)
        return model.no_sync() if isinstance(model, DistributedDataParallel) else super().no_sync(model)

    def step_counters(self) -> dict[str, float]:
        return {"bytes_sent": self._grad_bytes * self._steps, "wait_seconds": self.wait_seconds, "staleness": 0}

    def stats(self) -> dict[str, Any]:
        # Each rank hands its whole gradient to the all-reduce every step; the
        # algorithm's own traffic (ring: 2(n-1)/n of it) is the backend's business.
        # A codec's hook counts what this rank handed to its collectives, exactly.
        total_steps = self._steps * self.num_replicas
        if self.hook is None:
            bytes_sent = self._grad_bytes * total_steps
        else:
            counter = torch.tensor([self.hook.bytes_sent], dtype=torch.int64, device=self.device)
            bytes_sent = int(self.all_reduce_sum(counter).item())
        return {
            "bytes_sent": bytes_sent,
            "dropped_gradients": 0,
            "staleness": staleness_summary({0: total_steps}),
            "allreduce_via": self.via,
        }

    def reshard_state(self, state: dict[str, Any], saved_replicas: int) -> dict[str, Any]:
        """On another number of replicas, a codec's per-rank state (error-feedback residuals,
        PowerSGD's factors) belongs to ranks that no longer read the same data: it starts empty."""
        if saved_replicas == self.num_replicas or not state.get("hook"):
            return state
        if self.is_chief:
            console.print(
                f"paratrain: the {self.codec.name} state of {saved_replicas} replicas starts empty on {self.num_replicas}"
            )
        return {**state, "hook": {}}

    def state_dict(self) -> dict[str, Any]:
        """Adds the codec's name and this rank's hook state (error-feedback residuals and
        PowerSGD's P and Q are per rank: save every rank's, or lose them on resume)."""
        hook_state = self.hook.state_dict() if self.hook is not None else self._hook_state
        return {**super().state_dict(), "compression": self.codec.name, "hook": hook_state or {}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        check_saved_codec(state, self.codec)
        if self.hook is not None:
            self.hook.load_state_dict(state.get("hook", {}))
        else:
            self._hook_state = state.get("hook") or None


def _timed_allreduce_hook(state, bucket):  # noqa: ANN001 - DDP checks the real annotations, not strings
    """DDP's default all-reduce hook, with a span from the bucket's launch to its result."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    recorder = timeline.recorder()
    future = allreduce_hook(state, bucket)
    if recorder is None:
        return future
    start = recorder.now_us()
    size = bucket.buffer().numel() * bucket.buffer().element_size()

    def done(fut: Any) -> torch.Tensor:
        recorder.add("allreduce", start, recorder.now_us(), timeline.COMM, bucket=bucket.index(), bytes=size)
        return fut.value()

    return future.then(done)
