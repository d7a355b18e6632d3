"""The event-driven engine of processes sharing one host's cores (host.py): the cores, shared
by processor sharing (``SharedCores``), and one run's clock, event queue and workers
(``HostRun``), which the strategies' hosts (host.py, host_ps.py) extend."""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from paratrain.simulate.cluster import Cluster
from paratrain.simulate.quota import ThrottledCore


class SharedCores:
    """Processor sharing, by virtual time: while k jobs run, each gets capacity(k) / k of a
    core (capacity(k) = min(k, cores) for ideal cores), so every running job has received
    the same service since it started; a job of ``work`` seconds started at virtual time V
    ends when the virtual clock reaches V + work, and jobs end in the order of those marks."""

    def __init__(self, cores: float | None, capacity: Callable[[int], float] | None = None):
        self.cores = math.inf if cores is None else cores
        self.capacity = capacity or (lambda k: min(float(k), self.cores))
        self.now = 0.0
        self.virtual = 0.0  # service per running job since time 0
        self.jobs: list[tuple[float, int, Callable[..., None], tuple]] = []
        self._seq = 0

    def rate(self) -> float:
        """Share of a core each running job gets now."""
        return min(1.0, self.capacity(len(self.jobs)) / len(self.jobs)) if self.jobs else 1.0

    def advance(self, t: float) -> None:
        if self.jobs:
            self.virtual += (t - self.now) * self.rate()
        self.now = t

    def start(self, t: float, work: float, done: Callable[..., None], *args: Any) -> None:
        """Start a job of ``work`` seconds of one core at time ``t``; ``done(end, *args)`` at its end."""
        self.advance(t)
        heapq.heappush(self.jobs, (self.virtual + work, self._seq, done, args))
        self._seq += 1

    def next_end(self) -> float:
        if not self.jobs:
            return math.inf
        return self.now + max(self.jobs[0][0] - self.virtual, 0.0) / self.rate()

    def pop(self, t: float) -> tuple[Callable[..., None], tuple]:
        self.advance(t)
        mark, _, done, args = heapq.heappop(self.jobs)
        self.virtual = max(self.virtual, mark)
        return done, args


class HostRun:
    """The event loop: timed events (messages, wake-ups) and jobs on the shared cores."""

    def __init__(self, cluster: Cluster, rng: np.random.Generator, steps: int, workers: int):
        self.cluster, self.n = cluster, workers
        if cluster.cpu_share is None:
            shared = SharedCores(cluster.host_cores, cluster.host_capacity if cluster.host_cores is not None else None)
            self.nodes: list[Any] = [shared] * (workers + cluster.ps_shards)
            self.cores = [shared]
        else:  # a node each (workers, then shards), each under its CPU quota
            period = cluster.cpu_period_s
            self.nodes = [
                ThrottledCore(cluster.node_share(i), period, float(rng.uniform(0, period)))
                for i in range(workers + cluster.ps_shards)
            ]
            self.cores = []  # their jobs' ends are kept in a heap instead (``ends``)
            for i, node in enumerate(self.nodes):
                node.on_end = functools.partial(self._node_end, i)
        self.events: list[tuple[float, int, Callable[..., None], tuple]] = []
        self._seq = 0
        # (end, sequence, node) of each node's running job as it was set: an entry stands while
        # its node's running job ends then (O(log N) an event, where the minimum over the
        # nodes would be O(N): hundreds of nodes)
        self.ends: list[tuple[float, int, int]] = []
        self.rows = 2 * steps + 2
        self.demand = cluster.compute_times(rng, self.rows, workers).T.tolist()  # demand[w][k]
        self.sleep = [cluster.sleep_factor(w) for w in range(workers)]
        self.step_of = [0] * workers
        self.computing_s = 0.0  # summed wall seconds of compute, for the communication share

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self.events, (t, self._seq, fn, args))
        self._seq += 1

    def compute(self, t: float, w: int, done: Callable[..., None], extra: float = 0.0) -> None:
        """Worker ``w`` starts a step's compute (and ``extra`` CPU-seconds) at ``t``;
        ``done(end, w, started)``."""
        work = self.demand[w][self.step_of[w] % self.rows] + extra
        self.step_of[w] += 1
        self.nodes[w].start(t, work, self._computed, done, w, t)

    def _computed(self, end: float, done: Callable[..., None], w: int, started: float) -> None:
        self.computing_s += end - started
        done(end, w, started)

    def _node_end(self, number: int, node: ThrottledCore) -> None:
        heapq.heappush(self.ends, (node.next_end(), self._seq, number))
        self._seq += 1

    def _next_job(self) -> tuple[float, Any]:
        """The earliest end of a running job, and its core (``math.inf``, None: none)."""
        if self.cores:
            t_job, first = min((c.next_end(), i) for i, c in enumerate(self.cores))
            return t_job, self.cores[first]
        while self.ends:
            end, _, number = self.ends[0]
            node = self.nodes[number]
            if node.jobs and node.next_end() == end:
                return end, node
            heapq.heappop(self.ends)  # that job has ended, its node moved on
        return math.inf, None

    def run(self) -> None:
        while True:
            t_job, core = self._next_job()
            t_event = self.events[0][0] if self.events else math.inf
            if t_job == math.inf and t_event == math.inf:
                return
            if t_job <= t_event:
                self._advance(t_job)
                done, args = core.pop(t_job)
                done(t_job, *args)
            else:
                t, _, fn, args = heapq.heappop(self.events)
                self._advance(t)
                fn(t, *args)

    def _advance(self, t: float) -> None:
        for core in self.cores:
            core.advance(t)
