"""How a training process uses the CPU: the Trainer's ``cpu=CpuTuning(...)``, and the
callback that follows the process's share of the machine's cores between steps.

Each option makes CPU steps faster without changing what a step computes, and is on by
default; ``paratrain train`` sets them from its flags (``--no-pool-before-relu``,
``--onednn-layers``, ``--no-keep-host-memory``, ``--no-flush-denormal``,
``--threads-per-worker``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from paratrain.console import console
from paratrain.errors import ConfigError
from paratrain.launch.allocator import keep_freed_memory
from paratrain.launch.host_share import HostShare
from paratrain.launch.threads import share_cores
from paratrain.train.callbacks import Callback


@dataclass(frozen=True)
class CpuTuning:
    pool_before_relu: bool = True
    """A ReLU followed by a max-pooling in an ``nn.Sequential`` pools first: the same values
    and gradients, a quarter of the ReLU's work (``strategies/pool_relu.py``)."""

    onednn_layers: bool | None = None
    """On the CPU in float32, linear layers multiply through oneDNN and 2-d convolutions sum
    their bias gradient apart (``strategies/cpu_layers.py``). None: linear layers so on x86
    processors not Intel's, where MKL runs a slower path; True: on any; False: PyTorch's
    kernels. True on a GPU or under autocast is refused."""

    keep_host_memory: bool = True
    """This process's malloc keeps what CPU tensors free for the next step's tensors instead
    of unmapping and faulting it in again (``launch/allocator.py``); resident memory stays at
    its peak."""

    flush_denormal: bool = True
    """This process's CPU arithmetic flushes denormal numbers (below 1.2e-38 in float32) to
    zero, as TensorFlow's does (``torch.set_flush_denormal``): a gradient that fades through a
    long recurrence otherwise takes the processor's slow path for them."""

    threads: int | None = None
    """This process's compute threads. None: its share of the machine's cores with every
    paratrain process on it (``$PARATRAIN_THREADS_PER_WORKER`` if set), followed between steps
    as runs start and end (``launch/host_share.py``, ``FollowCoreShare``)."""

    def __post_init__(self) -> None:
        for name in ("pool_before_relu", "keep_host_memory", "flush_denormal"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ConfigError(f"CpuTuning.{name} must be True or False, got {value!r}")
        if self.onednn_layers is not None and not isinstance(self.onednn_layers, bool):
            raise ConfigError(f"CpuTuning.onednn_layers must be None, True or False, got {self.onednn_layers!r}")
        threads = self.threads
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ConfigError(f"CpuTuning.threads must be None or a whole number of at least 1, got {threads!r}")

    def apply_to_process(self) -> HostShare:
        """Set this process's threads, malloc and denormal flushing; returns its share of the
        machine's cores, to follow between steps."""
        cores = share_cores(self.threads)
        if self.keep_host_memory:
            keep_freed_memory()
        torch.set_flush_denormal(self.flush_denormal)
        return cores

    def onednn_layers_for(self, device: str, precision: str) -> bool | None:
        """The step recipe's ``onednn_layers`` for a run on ``device`` at ``precision``: False
        off the CPU and under autocast, where layers compute as PyTorch's own; asked for
        there, refused."""
        if self.onednn_layers is False:
            return False
        if device == "cpu" and precision == "fp32":
            return self.onednn_layers
        if self.onednn_layers:
            where = f"this run's device is {device}" if device != "cpu" else f"this run's precision is {precision}"
            raise ConfigError(f"--onednn-layers: oneDNN's kernels serve float32 CPU runs; {where}")
        return False


class FollowCoreShare(Callback):
    """Before every step, the compute threads this process's share of the machine's cores
    says now, as other runs start and end (taken between two steps, on the compute thread);
    the chief says so in one line whenever they change."""

    def __init__(self, share: HostShare):
        self.share = share

    def on_batch_begin(self, step: int, logs: dict[str, Any]) -> None:
        before = self.share.threads
        if self.share.apply() and self.trainer.strategy.is_chief:
            now = self.share.threads
            console.print(
                f"paratrain: step {step + 1}: {self.share.sharing} paratrain processes on this machine's "
                f"{self.share.usable} cores: {now} compute thread{'s' if now > 1 else ''} a process now (was {before})"
            )
