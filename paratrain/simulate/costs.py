"""What the simulator's strategies share: a run's outcome and its trace of updates, and the
time a synchronous step takes on the cluster's links (all-reduce with DDP's bucket
overlap; fsdp's all-gathers and reduce-scatter), used by the rounds (simulator.py) and by
the event-driven engine of processes sharing one host's cores (host.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from paratrain.simulate.cluster import BACKWARD_SHARE, Cluster


@dataclass
class Update:
    """One parameter update of the trace: gradients of ``workers`` computed on ``versions``."""

    time: float
    workers: list[int]
    versions: list[int]
    lr_scale: float = 1.0


@dataclass
class Outcome:
    strategy: str
    workers: int
    steps: int
    """Global steps: rounds, or (async) pushes / workers."""
    wall_s: float
    examples: int
    """Examples whose gradients were applied."""
    comm_s: float
    """Seconds of the wall time not spent waiting for compute (exposed communication)."""
    dropped: int = 0
    staleness: dict[int, int] = field(default_factory=dict)
    trace: list[Update] = field(default_factory=list)
    period: int = 1
    """local-sgd: steps between averages (the trace holds one entry per average)."""

    def summary(self, batch_size: int) -> dict[str, Any]:
        total = sum(self.staleness.values())
        return {
            "strategy": self.strategy,
            "workers": self.workers,
            "steps": self.steps,
            "wall_seconds": self.wall_s,
            "step_seconds": self.wall_s / self.steps,
            "examples_per_second": self.examples * batch_size / self.wall_s if self.wall_s > 0 else float("inf"),
            "comm_share": self.comm_s / self.wall_s if self.wall_s > 0 else 0.0,
            "dropped_gradients": self.dropped,
            "staleness": {
                "mean": sum(s * c for s, c in self.staleness.items()) / total if total else 0.0,
                "max": max((s for s, c in self.staleness.items() if c), default=0),
            },
        }


def allreduce_step_s(cluster: Cluster, slowest: Any) -> Any:
    """Seconds from the start of a step to the end of its last bucket's all-reduce, given
    the slowest worker's compute time (array or float): gradients appear evenly through
    the backward pass, and each bucket is all-reduced once full and its predecessor done."""
    if cluster.workers == 1:
        return slowest
    buckets = cluster.buckets()
    finish = np.zeros_like(slowest)
    for i, wire in enumerate(buckets):
        ready = slowest * (1 - BACKWARD_SHARE + BACKWARD_SHARE * (i + 1) / len(buckets))
        cost = cluster.ring_allreduce_s(wire) + cluster.codec.cost_s(wire * cluster.codec.ratio)
        finish = np.maximum(finish, ready) + cost
    return np.maximum(slowest, finish)


#: FSDP units (all-gathers per pass) when a run does not say: one per layer of a small net.
FSDP_UNITS = 4


def fsdp_step_s(cluster: Cluster, slowest: Any, reshard: bool = True, units: int = FSDP_UNITS) -> Any:
    """Seconds of one fsdp step given the slowest worker's compute: the forward all-gathers
    every unit's parameters (ring all-gather: half an all-reduce's traffic), the backward
    all-gathers them again (when resharded after the forward) and reduce-scatters the
    gradients (half an all-reduce's bytes, in the codec's type); every unit's collective
    pays an all-reduce's latency of its own. Each pass overlaps its
    communication with its compute, unit by unit (FSDP2 prefetches the next unit's
    all-gather), except the first unit's all-gather and the last unit's reduce-scatter."""
    n = cluster.workers
    if n == 1:
        return slowest
    step = cluster.latency if cluster.ring_latency is None else cluster.ring_latency

    def ring_half(nbytes: float) -> float:
        # All-gather or reduce-scatter: half an all-reduce's bytes, but each unit's collective
        # pays a whole all-reduce's 2(n-1) steps of latency. Gloo's are not cheaper than its
        # all-reduce (2 processes here, 280 KB: all-reduce 1.15 ms, all-gather 1.0 ms,
        # reduce-scatter 1.6 ms); NCCL's ring halves would take n-1.
        return (n - 1) / n * nbytes / cluster.bandwidth + units * 2 * (n - 1) * step

    gather = ring_half(cluster.model_bytes)
    scatter = ring_half(cluster.codec.wire_bytes(cluster.model_bytes))
    forward, backward = slowest * (1 - BACKWARD_SHARE), slowest * BACKWARD_SHARE
    backward_comm = scatter + (gather if reshard else 0.0)
    return (
        np.maximum(forward, gather * (units - 1) / units)
        + gather / units
        + np.maximum(backward, backward_comm * (units - 1) / units)
        + backward_comm / units
    )
