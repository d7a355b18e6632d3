"""Processes that share one host's cores: an event-driven model of a single-machine run.

With more processes than cores, what a step costs depends on who else wants a core at that moment, which
simulator.py's rounds (a machine per node) cannot say. Here every process is simulated event by event with
cluster.py's cost model, plus: ``host_cores`` C shared by processor sharing (each of k wanting processes runs
at min(1, C/k), Kleinrock 1967, or a measured ``host_speedup`` curve); shards serving one message at a time in
arrival order under the real server's rules (ps_policies.py); and ``sleep:W:F`` stragglers as
``paratrain train --straggler W:F``. ``host_cores=None`` gives every process a core, and then this engine and
simulator.py agree on the closed forms (tests/unit/test_simulator_host.py).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from paratrain.simulate.cluster import Cluster
from paratrain.simulate.costs import Outcome, Update, allreduce_step_s, fsdp_step_s
from paratrain.simulate.engine import HostRun
from paratrain.simulate.host_ps import ParameterServerHost
from paratrain.simulate.quota import ThrottledNodes, ring_on_nodes


class AllReduceHost(HostRun):
    """allreduce and fsdp (``period`` 1), local-sgd and diloco: every ``period`` steps the
    workers wait for each other and communicate; the step's duration runs to the end of
    its communication (``step_s``: from the slowest worker's compute)."""

    def __init__(
        self,
        cluster: Cluster,
        rng: np.random.Generator,
        steps: int,
        period: int,
        record: bool,
        step_s: Callable[[Cluster, float], float] | None = None,
    ):
        super().__init__(cluster, rng, steps * period, cluster.workers)
        self.step_s = step_s or _allreduce_step
        self.rounds = steps
        self.period = period
        self.record = record
        self.done_rounds = 0
        self.arrived: list[tuple[float, float]] = []  # (compute end, compute start) this round
        self.started = [0.0] * self.n
        self.trace: list[Any] = []
        self.wall = 0.0
        self.epoch_steps = cluster.epoch_steps(self.n)
        self.at_epoch_end: dict[int, float] = {}  # when each worker reached the epoch's end

    def begin(self, t: float, w: int) -> None:
        if (self.step_of[w] + 1) % self.period == 0:
            self.started[w] = t  # the step that ends with the all-reduce
        self.compute(t, w, self.computed)

    def computed(self, t: float, w: int, started: float) -> None:
        if self.step_of[w] % self.period:  # a local step: no waiting, then sleep if injected
            self.stepped(t + self.sleep[w] * (t - started), w)
            return
        self.arrived.append((t, started, w))
        if len(self.arrived) < self.n:
            return
        if self.cluster.cpu_share is not None:
            ends = self._ring_on_nodes({w: end for end, _, w in self.arrived})
            self.arrived = []
            self.reduced(max(ends), ends)
            return
        last_end, last_start, _ = max(self.arrived)
        end = last_start + float(self.step_s(self.cluster, last_end - last_start))
        self.arrived = []
        self.at(end, self.reduced)

    def _ring_on_nodes(self, computed: dict[int, float]) -> list[float]:
        """A ring all-reduce of the gradients (after the backward pass) across nodes under CPU
        quotas: each node's fixed CPU of the collective (``ring_fixed_cpu_s``: its launch and
        finish), then hop by hop: 2(N-1) steps, in each of which every node sends a 1/N slice
        to the next and works ``message_cpu_s`` on the slice it receives, when its quota lets
        it, while the slice's bytes arrive (quota.ring_on_nodes).
        When each node has the result."""
        cluster, n = self.cluster, self.n
        wire = cluster.codec.wire_bytes(cluster.model_bytes)
        hop_s, fixed_s = cluster.message_cpu_s, cluster.ring_fixed_cpu_s
        # a step's time on whole cores less its CPU (a 2-process ring's: the fixed CPU over its 2
        # steps) is waiting (Gloo's threads handing the slice over), which a quota does not stretch
        waiting = max(cluster.latency, (cluster.ring_latency or 0.0) - hop_s - fixed_s / 2)
        before_s = cluster.codec.cost_s(cluster.model_bytes) + fixed_s  # the codec, the fixed CPU
        nodes = ThrottledNodes(self.nodes[:n])
        done = np.array([computed[w] for w in range(n)])
        if before_s:
            done = nodes.run(done, before_s)
        done = ring_on_nodes(nodes, done, waiting, hop_s, wire / n / cluster.bandwidth)
        nodes.close()
        return done.tolist()

    def reduced(self, t: float, ends: list[float] | None = None) -> None:
        """A round is complete at ``t``; each worker goes on at ``ends[w]`` (default ``t``)."""
        self.done_rounds += 1
        self.wall = t
        if self.record:
            self.trace.append(Update(t, list(range(self.n)), [self.done_rounds - 1] * self.n))
        if self.done_rounds < self.rounds:
            for w in range(self.n):
                end = t if ends is None else ends[w]
                self.stepped(end + self.sleep[w] * (end - self.started[w]), w)

    def stepped(self, t: float, w: int) -> None:
        """Worker ``w`` is through a step at ``t``: the next, or first the epoch's end."""
        if not self.epoch_steps or self.step_of[w] % self.epoch_steps:
            self.at(t, self.begin, w)
            return
        self.at_epoch_end[w] = t
        if len(self.at_epoch_end) == self.n:
            self._epoch_end([self.at_epoch_end.pop(v) for v in range(self.n)])

    def _epoch_end(self, arrived: list[float]) -> None:
        """Every worker at an epoch's end (``arrived``): the loss's all-reduce, each worker's
        share of the evaluation, the sums' all-reduce (Trainer.fit); then the next epoch.
        Under CPU quotas each collective's steps wait for the nodes' quotas, as the ring's do;
        on a shared host the evaluations are jobs on its cores."""
        cluster, n = self.cluster, self.n
        share = cluster.eval_s / n
        if cluster.cpu_share is not None:
            nodes = ThrottledNodes(self.nodes[:n])
            done = ring_on_nodes(nodes, np.array(arrived), cluster.latency, cluster.collective_step_s)  # the loss
            done = nodes.run(done, share)
            done = ring_on_nodes(nodes, done, cluster.latency, cluster.collective_step_s)  # the evaluation's sums
            nodes.close()
            for w, end in enumerate(done.tolist()):
                self.at(end, self.begin, w)
            return
        left = [n]

        def evaluate(t: float) -> None:
            for w in range(n):
                self.nodes[w].start(t, share, evaluated)

        def evaluated(end: float) -> None:
            left[0] -= 1
            if not left[0]:
                for w in range(n):
                    self.at(end + cluster.small_allreduce_s(n), self.begin, w)

        self.at(max(arrived) + cluster.small_allreduce_s(n), evaluate)


def _allreduce_step(cluster: Cluster, slowest: float) -> float:
    return allreduce_step_s(cluster, np.float64(slowest))


def _fsdp_step(cluster: Cluster, slowest: float, **options: Any) -> float:
    return fsdp_step_s(cluster, np.float64(slowest), **options)


def simulate_on_host(
    strategy: str, cluster: Cluster, steps: int, rng: np.random.Generator, record: bool, **options: Any
):
    """``simulate`` for the event-driven engine: the same Outcome as simulator.py's models."""
    if strategy in ("allreduce", "local-sgd", "diloco", "fsdp", "tensor", "pipeline"):
        period = options.get("period", 8) if strategy in ("local-sgd", "diloco") else 1
        rounds = -(-steps // period)
        step_s = _allreduce_step
        replicas = cluster.workers
        name = strategy
        if strategy == "fsdp":
            step_s = functools.partial(_fsdp_step, **{k: options[k] for k in ("reshard", "units") if k in options})
        if strategy in ("tensor", "pipeline"):  # each process computes its part; one update per replica
            mesh = options["mesh"]
            replicas = mesh.replicas(cluster.workers)
            name = mesh.label()
            step_s = mesh.step_s
            cluster = dataclasses.replace(cluster, compute_s=cluster.compute_s * mesh.scale(cluster.workers))
        run: Any = AllReduceHost(cluster, rng, rounds, period, record, step_s)
        for w in range(run.n):
            run.begin(0.0, w)
        run.run()
        n = run.n
        return Outcome(
            name,
            n,
            rounds * period,
            run.wall,
            rounds * period * replicas,
            max(run.wall - run.computing_s / n, 0.0),
            trace=run.trace,
            period=period,
        )
    mode = strategy.removeprefix("ps-")
    keys = ("backup", "staleness_bound", "stale_policy", "max_staleness")
    run = ParameterServerHost(mode, cluster, rng, steps, record, **{k: options[k] for k in keys if k in options})
    run.go()
    return Outcome(
        strategy,
        cluster.workers,
        steps if mode == "async" else run.version,
        run.wall,
        run.applied,
        max(run.wall - run.computing_s / run.n, 0.0),
        dropped=run.dropped,
        staleness=dict(run.staleness),
        trace=run.trace,
    )
