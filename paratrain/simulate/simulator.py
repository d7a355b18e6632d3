"""Discrete-event model of one training run on a simulated cluster.

Synchronous strategies are rounds: every round is a function of the (steps, workers)
matrix of compute times, so they are vectorised with numpy (a round ends at a max, or
an order statistic, over workers). Only ``ps-async`` is a real event queue (a heap),
because there every push changes what the next pull sees.

| ``--strategy`` | one round / event |
| --- | --- |
| ``allreduce`` | slowest worker's backward fills 25 MiB buckets; each bucket is ring-all-reduced as soon as it is full and the link is free (DDP's overlap, Li et al. 2020) |
| ``ps-sync`` | all N push to the P shards (FIFO at each shard's link), the shards average, all N pull |
| ``ps-backup`` | N+K workers compute, the first N pushes make the update, K are dropped (Chen et al. 2016) |
| ``ps-async`` | each push is applied on arrival; staleness = versions since its pull; ``--staleness-bound S`` holds a worker S steps ahead of the slowest (Ho et al. 2013) |
| ``local-sgd`` | H local steps, then one ring all-reduce of the parameters (Lin et al. 2020) |
| ``diloco`` | local-sgd's rounds plus the outer optimizer step; ``--fragments F``: 1/F of the model every H/F steps |
| ``fsdp`` | per step: all-gather (forward), all-gather again (backward, when resharded) and reduce-scatter, each overlapped with its pass unit by unit but the first |

With ``host_cores`` set (every process on one machine, sharing its cores) or a
``sleep:`` straggler, ``simulate`` runs host.py's event-driven engine instead.

Every strategy can record a trace (``record=True``): which worker's gradient, computed on
which version, is applied at what time; virtual.py trains a real model on it.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from paratrain.errors import ConfigError
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


def _fifo(arrivals: np.ndarray, service: float, own: float) -> np.ndarray:
    """Finish times of messages through one shard's link (FIFO, ``service`` s each), sent
    from workers' own links (``own`` s each, in parallel); arrivals sorted along the last
    axis. The shard link is done with message k at l_k = max(l_{k-1}, a_k) + service,
    in closed form l_k = (k + 1) service + max_{j<=k} (a_j - j service); the message is
    complete at max(l_k, a_k + own)."""
    k = np.arange(arrivals.shape[-1]) * service
    link = k + service + np.maximum.accumulate(arrivals - k, axis=-1)
    return np.maximum(link, arrivals + own)


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


class AllReduceModel:
    name = "allreduce"

    def run(self, cluster: Cluster, steps: int, rng: np.random.Generator, record: bool, **_: Any) -> Outcome:
        n = cluster.workers
        compute = cluster.compute_times(rng, steps)
        slowest = compute.max(axis=1)
        step = allreduce_step_s(cluster, slowest)
        ends = np.cumsum(step)
        trace = [Update(float(t), list(range(n)), [r] * n) for r, t in enumerate(ends)] if record else []
        return Outcome(self.name, n, steps, float(ends[-1]), steps * n, float((step - slowest).sum()), trace=trace)


class SyncPSModel:
    """ps-sync and ps-backup: rounds of N (+K) pushes and pulls through the P shards."""

    def __init__(self, name: str):
        self.name = name

    def run(
        self, cluster: Cluster, steps: int, rng: np.random.Generator, record: bool, backup: int = 0, **_: Any
    ) -> Outcome:
        n = cluster.workers
        total = n + backup
        compute = cluster.compute_times(rng, steps, total)
        codec_s = cluster.codec.cost_s(cluster.model_bytes)
        order = np.argsort(compute, axis=1, kind="stable")
        arrive = np.take_along_axis(compute, order, axis=1) + codec_s  # encode before the push
        own, shard = cluster.push_times()
        pushed = _fifo(arrive, shard, own) + cluster.latency
        # The shard then works on the pushes one at a time, in arrival order (a second queue).
        handled = _fifo(pushed, cluster.ps_message_s, 0.0) if cluster.ps_message_s else pushed
        first = np.argsort(handled, axis=1, kind="stable")[:, :n]  # the first N to arrive
        closed = np.take_along_axis(handled, first[:, -1:], axis=1)[:, 0]  # the N-th closes the round
        update = closed + codec_s + cluster.ps_update_s  # decode, then one optimizer step
        # Every worker pulls the new version at once: the shard's link sends `total` slices.
        pull_own, pull_shard = cluster.pull_times()
        step = update + cluster.latency + max(pull_own, total * pull_shard)
        contributors = np.take_along_axis(order, first, axis=1)
        waited = np.take_along_axis(compute, contributors, axis=1).max(axis=1)
        ends = np.cumsum(step)
        trace = [Update(float(t), contributors[r].tolist(), [r] * n) for r, t in enumerate(ends)] if record else []
        return Outcome(
            self.name,
            n,
            steps,
            float(ends[-1]),
            steps * n,
            float((step - waited).sum()),
            dropped=steps * backup,
            staleness={0: steps * n},
            trace=trace,
        )


class AsyncPSModel:
    """ps-async: a heap of events, one per push (and the pull that answers it)."""

    name = "ps-async"

    def run(
        self,
        cluster: Cluster,
        steps: int,
        rng: np.random.Generator,
        record: bool,
        staleness_bound: int | None = None,
        stale_policy: str = "none",
        max_staleness: int = 4,
        **_: Any,
    ) -> Outcome:
        from paratrain.strategies.ps.policies import StalePolicy

        policy = StalePolicy(stale_policy, max_staleness)
        n = cluster.workers
        pushes = steps * n  # the same work as `steps` synchronous rounds
        rows = 2 * steps + 2
        compute = cluster.compute_times(rng, rows, n)
        codec_s = cluster.codec.cost_s(cluster.model_bytes)
        own, shard = cluster.push_times()
        pull_own, pull_shard = cluster.pull_times()
        lat = cluster.latency
        own_push = codec_s + own  # a push can go no faster than the worker's own link
        pull = max(pull_shard, pull_own)
        check_policy = stale_policy != "none"
        # When the shards' links are next free (the shards are symmetric), in each direction:
        # a link is full duplex, so pushes come in while replies go out (an update waits for
        # the replies, sent from the parameters it rewrites).
        free = out_free = 0.0
        shard_free = 0.0  # when the shards are done with the last message they took
        message_s, update_s = cluster.ps_message_s, cluster.ps_update_s
        version = 0
        pulled = [0] * n  # the version each worker computes on
        clock = [0] * n  # steps each worker has pushed
        at_clock = [0] * (pushes + 2)  # how many workers have each clock (for the slowest one, O(1))
        at_clock[0] = n
        slowest = 0
        waiting: list[int] = []
        ready_at = [0.0] * n  # when each worker has its reply
        # One event per push: (time its compute ends, seq, worker). The shards' links serve
        # a push and then its reply, as ShardServer handles one message at a time; so
        # arrivals come in the order computes end, and the version can be bumped here.
        heap: list[tuple[float, int, int]] = []
        times = compute.T.tolist()  # times[w][k]: plain floats, the loop's hot path
        for w in range(n):
            heap.append((times[w][0], w, w))
        heapq.heapify(heap)
        seq = issued = n
        staleness: dict[int, int] = {}
        dropped = applied = 0
        trace: list[Update] = []
        busy = 0.0  # summed compute seconds (for the communication share)
        now = 0.0
        while heap:
            computed, _, w = heapq.heappop(heap)
            start = computed + codec_s  # encode, then queue at the shard links
            if free > start:
                start = free
            free = start + shard  # the shard's link is busy with this slice
            done = free if free > computed + own_push else computed + own_push
            s = version - pulled[w]
            factor = policy.factor(s) if check_policy else 1.0
            # arrived, then the shard works on it (one message at a time) and decodes it:
            # applied at once, or dropped
            work = message_s + (update_s if factor is not None else 0.0)
            begin = done + lat if done + lat > shard_free else shard_free
            if factor is not None and out_free > begin:
                begin = out_free  # the update rewrites the parameters the replies in flight are sent from
            now = begin + work + codec_s
            shard_free = now
            staleness[s] = staleness.get(s, 0) + 1
            if factor is None:
                dropped += 1
            else:
                applied += 1
                if record:
                    trace.append(Update(now, [w], [pulled[w]], factor))
                version += 1
            at_clock[clock[w]] -= 1
            clock[w] += 1
            at_clock[clock[w]] += 1
            while at_clock[slowest] == 0:
                slowest += 1
            # the reply: current parameters through the same links
            reply = now if now > out_free else out_free
            out_free = reply + pull_shard
            ready = reply + pull + lat
            pulled[w] = version
            ready_at[w] = ready
            if staleness_bound is None:  # no one ever waits: start the next step at once
                if issued < pushes:
                    c = times[w][clock[w] % rows]
                    busy += c
                    heapq.heappush(heap, (ready + c, seq, w))
                    seq += 1
                    issued += 1
                continue
            waiting.append(w)
            still = []
            for v in waiting:
                if issued >= pushes:
                    break
                if staleness_bound is not None and clock[v] - slowest > staleness_bound:
                    still.append(v)  # stale-synchronous parallel: wait for the slowest
                    continue
                c = times[v][clock[v] % rows]
                busy += c
                heapq.heappush(heap, ((now if now > ready_at[v] else ready_at[v]) + c, seq, v))
                seq += 1
                issued += 1
            waiting = still
        busy += float(compute[0].sum())
        comm = max(now - busy / n, 0.0)
        return Outcome(
            self.name,
            n,
            steps,
            now,
            applied,
            comm,
            dropped=dropped,
            staleness=staleness,
            trace=trace,
        )


class LocalSGDModel:
    """local-sgd and diloco: H local steps per worker, then the parameter deltas are averaged
    by a ring all-reduce (no overlap: averaging starts after the last local step) and, for
    diloco, an outer optimizer step follows on every worker (``ps_update_s``). With F
    fragments, 1/F of the model is averaged every H/F steps."""

    def __init__(self, name: str, outer_step: bool = False):
        self.name, self.outer_step = name, outer_step

    def run(
        self,
        cluster: Cluster,
        steps: int,
        rng: np.random.Generator,
        record: bool,
        period: int = 8,
        fragments: int = 1,
        **_: Any,
    ) -> Outcome:
        if fragments < 1 or period % fragments:
            raise ConfigError(f"--fragments {fragments} must divide --period {period}")
        n = cluster.workers
        share = 1 / fragments
        period //= fragments  # steps between two synchronizations, of one fragment each
        periods = -(-steps // period)
        compute = cluster.compute_times(rng, periods * period).reshape(periods, period, n).sum(axis=1)
        slowest = compute.max(axis=1)
        average = cluster.ring_allreduce_s(cluster.codec.wire_bytes(cluster.model_bytes * share))
        if n > 1:
            average += cluster.codec.cost_s(cluster.model_bytes * share)
        if self.outer_step:
            average += cluster.ps_update_s * share
        step = slowest + average
        ends = np.cumsum(step)
        trace = [Update(float(t), list(range(n)), [r] * n) for r, t in enumerate(ends)] if record else []
        return Outcome(
            self.name,
            n,
            periods * period,
            float(ends[-1]),
            periods * period * n,
            float((step - slowest).sum()),
            trace=trace,
            period=period,
        )


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


class FSDPModel:
    """fsdp: rounds like allreduce, with fsdp_step_s's all-gathers and reduce-scatter."""

    name = "fsdp"

    def run(
        self,
        cluster: Cluster,
        steps: int,
        rng: np.random.Generator,
        record: bool,
        reshard: bool = True,
        units: int = FSDP_UNITS,
        **_: Any,
    ) -> Outcome:
        n = cluster.workers
        slowest = cluster.compute_times(rng, steps).max(axis=1)
        step = fsdp_step_s(cluster, slowest, reshard, units)
        ends = np.cumsum(step)
        trace = [Update(float(t), list(range(n)), [r] * n) for r, t in enumerate(ends)] if record else []
        return Outcome(self.name, n, steps, float(ends[-1]), steps * n, float((step - slowest).sum()), trace=trace)


STRATEGIES = {
    "allreduce": AllReduceModel(),
    "ps-sync": SyncPSModel("ps-sync"),
    "ps-backup": SyncPSModel("ps-backup"),
    "ps-async": AsyncPSModel(),
    "local-sgd": LocalSGDModel("local-sgd"),
    "diloco": LocalSGDModel("diloco", outer_step=True),
    "fsdp": FSDPModel(),
}


def simulate(
    strategy: str,
    cluster: Cluster,
    steps: int,
    seed: int = 0,
    record: bool = False,
    **options: Any,
) -> Outcome:
    """One run of ``strategy`` on ``cluster`` for ``steps`` global steps; deterministic per seed.

    options: ``backup`` (ps-backup K), ``staleness_bound``, ``stale_policy``,
    ``max_staleness`` (ps-async), ``period`` (local-sgd, diloco H), ``fragments`` (diloco),
    ``reshard`` and ``units`` (fsdp).
    """
    if strategy not in STRATEGIES:
        raise ConfigError(f"--strategy must be one of {', '.join(STRATEGIES)}; got {strategy!r}")
    if strategy == "ps-backup" and options.get("backup", 0) < 1:
        raise ConfigError("--strategy ps-backup needs --backup-workers K >= 1 (K = 0 is ps-sync)")
    if strategy != "ps-backup":
        options["backup"] = 0
    if cluster.cpu_share is not None and strategy == "fsdp":
        raise ConfigError(
            "--cpu-share simulates allreduce, local-sgd, diloco and the parameter servers hop by hop; "
            "fsdp's all-gathers and reduce-scatters are not modelled under a CPU quota"
        )
    rng = np.random.default_rng(seed)
    if cluster.event_driven:
        from paratrain.simulate.host import simulate_on_host  # processes on one host: event by event

        return simulate_on_host(strategy, cluster, steps, rng, record, **options)
    return STRATEGIES[strategy].run(cluster, steps, rng, record, **options)
