"""A parameter-server run on one host's shared cores, event by event (host.py's engine): the
shard serves one message at a time in arrival order with the real server's rules
(sync/backup hold a version's first N gradients and drop later ones, async applies each at
once, ``--staleness-bound``)."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from typing import Any

import numpy as np

from paratrain.simulate.cluster import Cluster
from paratrain.simulate.costs import Update
from paratrain.simulate.engine import HostRun
from paratrain.strategies.ps.policies import StalePolicy


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
        quota = cluster.cpu_share is not None
        self.message_cpu = cluster.message_cpu_s if quota else 0.0  # the shard's, a push
        worker = cluster.message_cpu_s if cluster.ps_worker_cpu_s is None else cluster.ps_worker_cpu_s
        self.worker_cpu = worker if quota else 0.0  # a worker's, a push and its reply
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
        # An epoch is shard 0's batches, whole rounds of every worker's (batches.py)
        self.epoch_batches = cluster.epoch_batches // self.n * self.n
        self.epoch = [0] * self.n  # the epoch each worker is in

    # ----- workers ---------------------------------------------------------------------------
    def begin(self, t: float, w: int) -> None:
        extra = self.worker_cpu if self.clock[w] else 0.0  # its last push and the reply, then the step
        epoch = self.issued // self.epoch_batches if self.epoch_batches else 0
        self.issued += 1
        if epoch > self.epoch[w]:  # shard 0 hands out the next epoch's batches: this worker's epoch ends
            self.epoch[w] = epoch  # it pulls the parameters for the next, and the chief evaluates
            extra += self.worker_cpu + (self.cluster.eval_s if w == 0 else 0.0)
            self.at(t + self.cluster.epoch_pull_s(), self.compute, w, self.pushed, extra)
            return
        self.compute(t, w, self.pushed, extra)

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
