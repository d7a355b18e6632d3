"""Tensor parallelism and meshes in the simulator: ``--strategy tensor --tensor-parallel T``.

W processes make D = W/T replicas of T processes, as ``paratrain train --strategy tensor`` lays them out. The
costs come from the user's model and plan, measured on one local batch: each process computes
``compute_s x (1 - f + f/T)``, f the split modules' share of the forward FLOPs; the plan's activation
collectives are ring collectives over T on ``tp_bandwidth``/``tp_latency``, not overlapped (DTensor's block);
after the backward each process all-reduces its gradient part over D replicas (or FSDP2 with
``shard_replicas``); each split module adds ``module_s`` (calibrate.py's ``tp_module_us``). The hooks count
what the plan gives: a Megatron block costs two all-reduces forward and two backward; W = 1 sends nothing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from paratrain.errors import ConfigError
from paratrain.simulate.cluster import Cluster
from paratrain.simulate.costs import FSDP_UNITS, Outcome, Update, fsdp_step_s
from paratrain.strategies.topology import replicas_of


@dataclass(frozen=True)
class TensorShape:
    """What tensor parallelism over ``size`` processes does to one model's step, measured on
    one local batch with the model whole (tensor_shape.py)."""

    size: int
    split_bytes: float
    """Parameters of the modules the plan splits (fp32): each process holds 1/T of them."""
    whole_bytes: float
    """Every other trainable parameter: each process holds all of it."""
    split_share: float
    """f: the share of the forward pass's FLOPs inside the modules split."""
    all_reduce_bytes: tuple[float, ...] = ()
    """Each activation all-reduce of a step (forward and backward), the whole tensor's bytes."""
    all_gather_bytes: tuple[float, ...] = ()
    """Each all-gather of a step (a ``colwise_rep`` output), the whole tensor's bytes."""
    modules: int = 0

    def part_bytes(self, tensor: int) -> float:
        """The parameters one process holds when each replica is split ``tensor`` ways."""
        return self.split_bytes / tensor + self.whole_bytes

    def describe(self, model_name: str) -> str:
        sent = (sum(self.all_reduce_bytes) + sum(self.all_gather_bytes)) / 1e6
        total = self.split_bytes + self.whole_bytes
        return (
            f"paratrain: tensor plan of {model_name}: {self.modules} modules split, {self.split_bytes / total:.0%} "
            f"of the parameters, {self.split_share:.0%} of the forward FLOPs; a step all-reduces "
            f"{len(self.all_reduce_bytes)} activations and gathers {len(self.all_gather_bytes)} ({sent:.3g} MB whole)"
        )


# ----- a step -------------------------------------------------------------------------------------
def activation_s(shape: TensorShape, tensor: int, bandwidth: float, step_latency: float, scale: float = 1.0) -> float:
    """Seconds a process spends in a step's activation collectives over ``tensor`` processes:
    ring all-reduces (2(T-1) steps of 1/T of the tensor) and all-gathers (T-1 steps); with
    ``scale`` (a pipeline's micro-batch: 1/M) of the bytes measured."""
    if tensor <= 1:
        return 0.0
    share = (tensor - 1) / tensor * scale
    reduce_s = sum(2 * share * b / bandwidth + 2 * (tensor - 1) * step_latency for b in shape.all_reduce_bytes)
    gather_s = sum(share * b / bandwidth + (tensor - 1) * step_latency for b in shape.all_gather_bytes)
    return reduce_s + gather_s


def replica_link(cluster: Cluster, bandwidth: float | None, step_latency: float | None) -> tuple[float, float]:
    """The link among the T processes that split a layer (bytes/s, seconds a ring step):
    the given ones, else the cluster's (its ring step latency, else its message latency)."""
    ring = cluster.latency if cluster.ring_latency is None else cluster.ring_latency
    return bandwidth or cluster.bandwidth, ring if step_latency is None else step_latency


def compute_scale(shape: TensorShape, tensor: int) -> float:
    """A process's compute over the whole model's: (1 - f) + f / T."""
    return 1 - shape.split_share + shape.split_share / tensor


@dataclass(frozen=True)
class Mesh:
    """One layout of W processes: ``tensor`` T a replica, W/T replicas, the replicas
    sharded (FSDP2) or all-reducing; ``tp_bandwidth`` the link inside a replica (bytes/s)."""

    shape: TensorShape
    tensor: int
    shard_replicas: bool = False
    tp_bandwidth: float | None = None
    tp_latency: float | None = None
    """Seconds a ring step inside a replica (None: the cluster's ring step latency)."""
    module_s: float = 0.0
    """Seconds each split module adds to a step beyond its collectives' bytes (DTensor's
    dispatch of its ops, the collectives' own work: a calibration's ``tp_module_us``)."""
    units: int = FSDP_UNITS

    @property
    def size(self) -> int:
        """Processes a replica takes: T."""
        return self.tensor

    def label(self) -> str:
        return f"tensor T={self.tensor}" + (" +fsdp" if self.shard_replicas else "")

    def scale(self, workers: int) -> float:
        """A process's compute over the whole model's at ``workers`` processes (compute_scale)."""
        return compute_scale(self.shape, self.degree(workers))

    def degree(self, workers: int) -> int:
        """T at ``workers`` processes: 1 for one process, the model whole (the scaling's baseline)."""
        return self.tensor if workers > 1 else 1

    def busy_s(self, slowest: Any, workers: int) -> Any:
        """The seconds of a step a process computes, given ``slowest`` scaled by ``scale``."""
        return slowest

    def held_bytes(self, workers: int) -> float:
        """The parameter bytes one process holds at ``workers`` processes."""
        part = self.shape.part_bytes(self.degree(workers))
        return part / self.replicas(workers) if self.shard_replicas else part

    def replicas(self, workers: int) -> int:
        return replicas_of(workers, self.tensor, "--tensor-parallel")

    def step_s(self, cluster: Cluster, slowest: Any) -> Any:
        """Seconds of a step given the slowest process's compute (already scaled by
        compute_scale): the activations' collectives, then the replicas' gradient sync."""
        tensor = self.degree(cluster.workers)
        replicas = self.replicas(cluster.workers)
        link, step_latency = replica_link(cluster, self.tp_bandwidth, self.tp_latency)
        busy = slowest + activation_s(self.shape, tensor, link, step_latency)
        if tensor > 1:
            busy = busy + self.shape.modules * self.module_s
        if replicas == 1:
            return busy
        across = dataclasses.replace(cluster, workers=replicas, model_bytes=self.shape.part_bytes(tensor))
        if self.shard_replicas:
            return fsdp_step_s(across, busy, reshard=True, units=self.units)
        return busy + across.ring_allreduce_s(across.codec.wire_bytes(across.model_bytes))


class MeshModel:
    """``tensor`` and ``pipeline``: rounds like allreduce, each process computing its part of
    the model (a Mesh here, a pipeline.PipelineMesh), one update a round for each replica."""

    def __init__(self, name: str):
        self.name = name

    def run(
        self, cluster: Cluster, steps: int, rng: np.random.Generator, record: bool, mesh: Any = None, **_: Any
    ) -> Outcome:
        if mesh is None:
            raise ConfigError(
                f"--strategy {self.name} needs the model's shape on its mesh (simulate measures it from --model)"
            )
        n = cluster.workers
        replicas = mesh.replicas(n)
        slowest = cluster.compute_times(rng, steps).max(axis=1) * mesh.scale(n)
        step = mesh.step_s(cluster, slowest)
        # an epoch's end: each process its share of its replica's evaluation, and the collectives
        epoch_end = cluster.eval_s / replicas * mesh.scale(n) + 2 * cluster.small_allreduce_s(n)
        step = step + cluster.epoch_ends(steps, replicas) * epoch_end
        ends = np.cumsum(step)
        trace = [Update(float(t), list(range(replicas)), [r] * replicas) for r, t in enumerate(ends)] if record else []
        return Outcome(
            mesh.label(),
            n,
            steps,
            float(ends[-1]),
            steps * replicas,
            float((step - mesh.busy_s(slowest, n)).sum()),
            trace=trace,
        )
