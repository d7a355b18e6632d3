"""Pipelines and 3-D meshes in the simulator: ``--strategy pipeline --stages S [--tensor-parallel T]``.

W processes make D = W/(S*T) replicas of S stages of T processes. The model is cut where train cuts it, and
each stage's compute, memory and messages are measured on one local batch (tensor_shape.measure_stages). A
stage's micro-batch costs its share of ``compute_s`` / M (split as tensor.py when T > 1); activations and their
gradients cross the cluster's link once each way per micro-batch. GPipe and 1F1B take the same time,
``sum_s u_s + (M - 1) max_s u_s`` (1F1B holds fewer activations, not less time); the replicas' gradient
all-reduce follows, not overlapped. Left out: a tied weight's sum between two stages, and the first step's
shape inference.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from paratrain.simulate.cluster import Cluster
from paratrain.simulate.tensor import TensorShape, activation_s, compute_scale, replica_link
from paratrain.strategies.topology import replicas_of


@dataclass(frozen=True)
class StageShape:
    """One part of a model cut into stages, measured on one local batch."""

    shape: TensorShape
    """The stage's own parameters, split share and activation collectives (size 1: not split)."""
    compute_share: float
    """The share of the model's forward FLOPs computed in this stage."""
    boundary_bytes: float
    """The activations that enter this stage from the previous one for a local batch (0 for the first)."""


@dataclass(frozen=True)
class PipelineMesh:
    """One layout of W processes: replicas of ``len(stages)`` stages of ``tensor`` processes."""

    stages: tuple[StageShape, ...]
    tensor: int = 1
    microbatches: int = 4
    tp_bandwidth: float | None = None
    tp_latency: float | None = None
    module_s: float = 0.0

    @property
    def size(self) -> int:
        """Processes a replica takes: S x T."""
        return len(self.stages) * self.tensor

    def label(self) -> str:
        return f"pipeline S={len(self.stages)}" + (f" x T={self.tensor}" if self.tensor > 1 else "")

    def scale(self, workers: int) -> float:
        """The compute of the slowest process over the whole model's, as the engine applies it
        before ``step_s``: 1, since ``step_s`` shares the compute out stage by stage."""
        return 1.0

    def busy_s(self, slowest: Any, workers: int) -> Any:
        """The seconds of a step the busiest stage's process computes (the rest of the step is
        sends, collectives and the bubble)."""
        if workers == 1:
            return slowest
        return slowest * max(s.compute_share * compute_scale(s.shape, self.tensor) for s in self.stages)

    def held_bytes(self, workers: int) -> float:
        """The parameter bytes the fullest stage's process holds at ``workers`` processes."""
        if workers == 1:
            return sum(s.shape.split_bytes + s.shape.whole_bytes for s in self.stages)
        return max(s.shape.part_bytes(self.tensor) for s in self.stages)

    def replicas(self, workers: int) -> int:
        return replicas_of(workers, self.size, "--stages x --tensor-parallel")

    def stage_s(self, cluster: Cluster, slowest: Any) -> list[Any]:
        """Seconds each stage spends on one micro-batch, forward and backward, with its sends."""
        m, t = self.microbatches, self.tensor
        link, step_latency = replica_link(cluster, self.tp_bandwidth, self.tp_latency)
        found = []
        for k, stage in enumerate(self.stages):
            busy = slowest * stage.compute_share * compute_scale(stage.shape, t) / m
            if t > 1:
                busy = busy + activation_s(stage.shape, t, link, step_latency, scale=1 / m)
                busy = busy + stage.shape.modules * self.module_s
            if k + 1 < len(self.stages):  # activations forward, their gradient back
                busy = busy + 2 * (self.stages[k + 1].boundary_bytes / m / cluster.bandwidth + cluster.latency)
            found.append(busy)
        return found

    def step_s(self, cluster: Cluster, slowest: Any) -> Any:
        """Seconds of a step given the slowest process's compute of the whole model."""
        if cluster.workers == 1:
            return slowest
        per_stage = np.stack([np.asarray(u, dtype=float) for u in self.stage_s(cluster, slowest)])
        busy = per_stage.sum(axis=0) + (self.microbatches - 1) * per_stage.max(axis=0)
        replicas = self.replicas(cluster.workers)
        if replicas == 1:
            return busy
        across = dataclasses.replace(cluster, workers=replicas)
        sync = max(
            across.ring_allreduce_s(across.codec.wire_bytes(s.shape.part_bytes(self.tensor))) for s in self.stages
        )
        return busy + sync
