"""Pipelines and 3-D meshes in the simulator: ``--strategy pipeline --stages S [--tensor-parallel T]``.

W processes make D = W/(S*T) replicas of S stages of T processes each (the (replica, stage,
shard) mesh of ``paratrain train --strategy pipeline``, strategies/pipeline/). The model is
cut where train cuts it (its layers balanced by parameters, or ``--split-points``), and what
each stage computes, holds and sends is measured here on one local batch with the model
whole (tensor_shape.measure_stages):

| piece | model |
| --- | --- |
| a stage's micro-batch | ``compute_s`` x its share of the forward FLOPs / M, scaled as tensor.py scales a split model when T > 1; plus its activation collectives on 1/M of the batch and its split modules' fixed cost (tensor.py), for each micro-batch |
| between stages | each micro-batch's activations sent to the next stage and their gradient sent back: one message each way on the cluster's link (``bandwidth``, ``latency``) |
| the schedule | GPipe and 1F1B take the same time, ``sum_s u_s + (M - 1) max_s u_s`` for the per-micro-batch stage times u (the fill and drain of M + S - 1 slots when stages are balanced; 1F1B holds fewer activations, not less time) |
| replicas | after the last micro-batch each process all-reduces its stage's part of the gradient over the D replicas on the cluster's link (strategies/pipeline: not overlapped); the slowest stage's all-reduce ends the step |
| one process | W = 1 is one process of the whole model: ``compute_s``, nothing sent |

Left out: a tied weight held by two stages has its gradient summed between them (one
all-reduce of the tie over 2 processes); the first step's shape inference.
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
