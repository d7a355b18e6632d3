"""Processes that share one host's cores: an event-driven model of a single-machine run.

``paratrain train --workers N`` starts every process (workers, parameter-server shards)
on one machine. With more processes than cores they take turns, and what a step costs
depends on who else wants a core at that moment; simulator.py's round models, in which
every node has a machine of its own, cannot say that. Here every process is simulated
event by event, with the same cost model (cluster.py: links, latency, codecs, ring
all-reduce, the shard's work per message) plus:

| piece | model |
| --- | --- |
| cores | ``host_cores`` C shared by processor sharing: while k processes want a core, each runs at min(1, C / k) of one (a fair scheduler, to first order; Kleinrock 1967), or at speedup(k) / k with a measured ``host_speedup`` curve; a process blocked in a receive or asleep wants none |
| what wants a core | a worker's compute (its whole step apart from waiting: forward, backward, optimizer, the loop); a shard's work on each message and update |
| shard | one message at a time, in arrival order (ShardServer's receiver thread), after the bytes have come through its link; the same rules as the real server (ps_policies.py): sync/backup hold a version's first N gradients and drop later ones, async applies each at once, with ``--staleness-bound`` |
| straggler ``sleep:W:F`` | after each step worker W sleeps (F - 1) times the step's duration, like ``paratrain train --straggler W:F`` (train/faults.py): for allreduce the step ends with the all-reduce, for a parameter server with the push handed to the transport |

``host_cores=None`` gives every process a core of its own; then this engine and
simulator.py agree on the closed forms (tests/unit/test_simulator_host.py).
"""

from __future__ import annotations

import functools
import heapq
import math
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

import numpy as np

from paratrain.simulate.cluster import Cluster
from paratrain.simulate.costs import Outcome, Update, allreduce_step_s, fsdp_step_s
from paratrain.simulate.quota import ThrottledCore, ThrottledNodes
from paratrain.strategies.ps.policies import StalePolicy


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
        self.rounds, self.period, self.record = steps, period, record
        self.done_rounds = 0
        self.arrived: list[tuple[float, float]] = []  # (compute end, compute start) this round
        self.started = [0.0] * self.n
        self.trace: list[Any] = []
        self.wall = 0.0

    def begin(self, t: float, w: int) -> None:
        if (self.step_of[w] + 1) % self.period == 0:
            self.started[w] = t  # the step that ends with the all-reduce
        self.compute(t, w, self.computed)

    def computed(self, t: float, w: int, started: float) -> None:
        if self.step_of[w] % self.period:  # a local step: no waiting, then sleep if injected
            self.at(t + self.sleep[w] * (t - started), self.begin, w)
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
        quotas, hop by hop: 2(N-1) steps, in each of which every node sends a 1/N slice to the
        next and works ``message_cpu_s`` on the slice it receives, when its quota lets it.
        When each node has the result."""
        cluster, n = self.cluster, self.n
        wire = cluster.codec.wire_bytes(cluster.model_bytes)
        transfer = wire / n / cluster.bandwidth + cluster.latency
        hop_s = cluster.message_cpu_s
        codec_s = cluster.codec.cost_s(cluster.model_bytes)
        nodes = ThrottledNodes(self.nodes[:n])
        done = np.array([computed[w] for w in range(n)])
        if codec_s:
            done = nodes.run(done, codec_s)
        for _ in range(2 * (n - 1)):
            done = nodes.run(np.maximum(np.roll(done, 1) + transfer, done), hop_s)
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
                self.at(end + self.sleep[w] * (end - self.started[w]), self.begin, w)


def _allreduce_step(cluster: Cluster, slowest: float) -> float:
    return allreduce_step_s(cluster, np.float64(slowest))


def _fsdp_step(cluster: Cluster, slowest: float, **options: Any) -> float:
    return fsdp_step_s(cluster, np.float64(slowest), **options)


class ParameterServerHost(HostRun):
    """ps-sync, ps-backup, ps-async: workers compute, push to the shards and wait for the
    reply; the shards take the pushes through their links, then work on them one at a time
    and apply the strategy's rule. The P shards are symmetric: every message costs each of
    them its slice, so one queue stands for all and each message is P jobs on the cores."""

    def __init__(
        self,
        mode: str,
        cluster: Cluster,
        rng: np.random.Generator,
        steps: int,
        record: bool,
        backup: int = 0,
        staleness_bound: int | None = None,
        stale_policy: str = "none",
        max_staleness: int = 4,
    ):
        super().__init__(cluster, rng, steps, cluster.workers + backup)
        self.mode, self.record = mode, record
        self.required = cluster.workers  # sync/backup: gradients per version
        self.target = steps * cluster.workers if mode == "async" else steps  # pushes, or versions
        self.policy, self.bound = StalePolicy(stale_policy, max_staleness), staleness_bound
        self.codec_s = cluster.codec.cost_s(cluster.model_bytes)
        self.message_cpu = cluster.message_cpu_s if cluster.cpu_share is not None else 0.0
        self.push_own, self.push_shard = cluster.push_times()
        self.pull_own, self.pull_shard = cluster.pull_times()
        self.version = 0
        self.pulled = [0] * self.n  # the version each worker computes on
        self.clock = [0] * self.n  # pushes each worker has made
        self.issued = 0
        # The shards' links, one message after another in each direction (full duplex): pushes
        # come in while replies go out, but an update waits for the replies in flight
        # (ShardServer sends them from the parameters the update rewrites).
        self.link_in_free = self.link_out_free = 0.0
        self.queue: deque[tuple[int, int]] = deque()  # pushes waiting for the shard: (worker, version)
        self.busy = False
        self.held: list[int] = []
        self.waiting: list[tuple[int, int]] = []  # (worker, version wanted) for a reply
        self.awake_at = [0.0] * self.n  # when a sleeping straggler wakes
        self.version_sent = [0] * self.n  # the version in the reply on its way to each worker
        self.staleness: Counter[int] = Counter()
        self.dropped = self.applied = 0
        self.trace: list[Any] = []
        self.wall = 0.0

    # ----- workers ---------------------------------------------------------------------------
    def begin(self, t: float, w: int) -> None:
        self.issued += 1
        self.compute(t, w, self.pushed, self.message_cpu if self.clock[w] else 0.0)  # the reply, then the step

    def pushed(self, t: float, w: int, started: float) -> None:
        # The push is handed to the transport: the step (as --straggler times it) ends here.
        self.awake_at[w] = t + self.sleep[w] * (t - started)
        sent = t + self.codec_s
        start = max(sent, self.link_in_free)
        self.link_in_free = start + self.push_shard
        arrived = max(self.link_in_free, sent + self.push_own) + self.cluster.latency
        self.at(arrived, self.receive, w, self.pulled[w])

    def replied(self, t: float, w: int) -> None:
        self.pulled[w] = self.version_sent[w]
        if self.mode != "async":
            self.wall = max(self.wall, t)  # a round ends when its parameters are back
        more = self.issued < self.target if self.mode == "async" else self.version < self.target
        if more:
            self.at(max(t, self.awake_at[w]), self.begin, w)

    # ----- the shard ---------------------------------------------------------------------------
    def receive(self, t: float, w: int, version: int) -> None:
        self.queue.append((w, version))
        self._next(t)

    def _next(self, t: float) -> None:
        if self.busy or not self.queue:
            return
        self.busy = True
        w, version = self.queue.popleft()
        factor = self.policy.factor(self.version - version) if self.mode == "async" else 1.0
        work = self.cluster.ps_message_s + self.codec_s + self.message_cpu
        if self.mode == "async" and factor is not None:
            work += self.cluster.ps_update_s
            # The update rewrites the parameters the replies are sent from: it waits for them.
            self.at(max(t, self.link_out_free), self._on_shards, work, self.handled, w, version, factor)
            return
        self._on_shards(t, work, self.handled, w, version, factor)

    def _on_shards(self, t: float, work: float, done: Callable[..., None], *args: Any) -> None:
        """``work`` on every shard at once; ``done(end, *args)`` when the last is through."""
        shards = self.cluster.ps_shards
        left = [shards]

        def one_done(end: float) -> None:
            left[0] -= 1
            if not left[0]:
                done(end, *args)

        for shard in range(shards):
            self.nodes[self.n + shard].start(t, work, one_done)

    def handled(self, t: float, w: int, version: int, factor: float | None) -> None:
        self.clock[w] += 1
        if self.mode == "async":
            if factor is None:
                self.dropped += 1
            else:
                self._apply(t, [w], [version], factor)
            self.waiting.append((w, 0))
            self._answer(t)
            return
        self.waiting.append((w, version + 1))
        if version != self.version:
            self.dropped += 1  # late: a version was published since it pulled
        else:
            self.held.append(w)
        if len(self.held) >= self.required:  # the round is complete: one optimizer step, once
            # the replies in flight (sent from the parameters it rewrites) are out
            self.at(max(t, self.link_out_free), self._on_shards, self.cluster.ps_update_s, self.published)
            return
        self._answer(t)

    def published(self, t: float) -> None:
        self._apply(t, self.held, [self.version] * len(self.held), 1.0)
        self.held = []
        self._answer(t)

    def _apply(self, t: float, workers: list[int], versions: list[int], factor: float) -> None:
        for v in versions:
            self.staleness[self.version - v] += 1
        self.applied += len(workers)
        self.version += 1
        self.wall = t
        if self.record:
            self.trace.append(Update(t, list(workers), list(versions), factor))

    def _answer(self, t: float) -> None:
        """Reply to every worker whose pull may go now, then take the next message."""
        still = []
        for w, wanted in self.waiting:
            if self._may_pull(w, wanted):
                self._reply(t, w)
            else:
                still.append((w, wanted))
        self.waiting = still
        self.busy = False
        self._next(t)

    def _may_pull(self, w: int, wanted: int) -> bool:
        if self.mode != "async":
            return self.version >= wanted
        if self.bound is None or self.issued >= self.target:
            return True
        return self.clock[w] - min(self.clock) <= self.bound

    def _reply(self, t: float, w: int) -> None:
        start = max(t, self.link_out_free)
        self.link_out_free = start + self.pull_shard
        self.version_sent[w] = self.version
        self.at(max(self.link_out_free, t + self.pull_own) + self.cluster.latency, self.replied, w)

    def go(self) -> None:
        for w in range(self.n):
            self.begin(0.0, w)
        self.run()


def simulate_on_host(
    strategy: str, cluster: Cluster, steps: int, rng: np.random.Generator, record: bool, **options: Any
):
    """``simulate`` for the event-driven engine: the same Outcome as simulator.py's models."""
    if strategy in ("allreduce", "local-sgd", "diloco", "fsdp"):
        period = options.get("period", 8) if strategy in ("local-sgd", "diloco") else 1
        rounds = -(-steps // period)
        step_s = _allreduce_step
        if strategy == "fsdp":
            step_s = functools.partial(_fsdp_step, **{k: options[k] for k in ("reshard", "units") if k in options})
        run: Any = AllReduceHost(cluster, rng, rounds, period, record, step_s)
        for w in range(run.n):
            run.begin(0.0, w)
        run.run()
        n = run.n
        return Outcome(
            strategy,
            n,
            rounds * period,
            run.wall,
            rounds * period * n,
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
