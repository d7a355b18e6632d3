"""Discrete-event model of one training run on a simulated cluster.

Synchronous strategies are rounds, each a function of the (steps, workers) matrix of compute times, so they
are vectorised with numpy (a round ends at a max, or an order statistic, over workers). Only ``ps-async`` is
a real event queue (a heap), because there every push changes what the next pull sees (staleness; the
``--staleness-bound`` as in Ho et al. 2013). ``allreduce`` overlaps the slowest worker's backward with ring
all-reduces of 25 MiB buckets (DDP's overlap, Li et al. 2020); ``ps-backup`` keeps the first N of N+K pushes
(Chen et al. 2016); the other rounds are described on their classes, tensor.py and pipeline.py. With
``host_cores`` set (processes sharing one machine's cores) or a ``sleep:`` straggler, host.py's event-driven
engine runs instead. ``record=True`` keeps a trace of which gradient, computed on which version, is applied
when; virtual.py trains a real model on it. docs/simulator.md has more.
"""

from __future__ import annotations

import heapq
from typing import Any

import numpy as np

from paratrain.errors import ConfigError
from paratrain.simulate.cluster import Cluster
from paratrain.simulate.costs import FSDP_UNITS, Outcome, Update, allreduce_step_s, fsdp_step_s
from paratrain.simulate.host import simulate_on_host
from paratrain.simulate.tensor import MeshModel
from paratrain.strategies.ps.policies import StalePolicy


def _fifo(arrivals: np.ndarray, service: float, own: float) -> np.ndarray:
    """Finish times of messages through one shard's link (FIFO, ``service`` s each), sent
    from workers' own links (``own`` s each, in parallel); arrivals sorted along the last
    axis. The shard link is done with message k at l_k = max(l_{k-1}, a_k) + service,
    in closed form l_k = (k + 1) service + max_{j<=k} (a_j - j service); the message is
    complete at max(l_k, a_k + own)."""
    k = np.arange(arrivals.shape[-1]) * service
    link = k + service + np.maximum.accumulate(arrivals - k, axis=-1)
    return np.maximum(link, arrivals + own)


class AllReduceModel:
    name = "allreduce"

    def run(self, cluster: Cluster, steps: int, rng: np.random.Generator, record: bool, **_: Any) -> Outcome:
        n = cluster.workers
        compute = cluster.compute_times(rng, steps)
        slowest = compute.max(axis=1)
        step = allreduce_step_s(cluster, slowest) + cluster.epoch_ends(steps, n) * cluster.epoch_end_s(n)
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
        compute = with_epoch_ends(cluster, cluster.compute_times(rng, steps, total))
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
        policy = StalePolicy(stale_policy, max_staleness)
        n = cluster.workers
        pushes = steps * n  # the same work as `steps` synchronous rounds
        rows = 2 * steps + 2
        compute = with_epoch_ends(cluster, cluster.compute_times(rng, rows, n))
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
        epoch_ends = cluster.epoch_ends(periods * period, n).reshape(periods, period).sum(axis=1)
        slowest = slowest + epoch_ends * cluster.epoch_end_s(n)  # the epochs' ends in each period
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
        step = fsdp_step_s(cluster, slowest, reshard, units) + cluster.epoch_ends(steps, n) * cluster.epoch_end_s(n)
        ends = np.cumsum(step)
        trace = [Update(float(t), list(range(n)), [r] * n) for r, t in enumerate(ends)] if record else []
        return Outcome(self.name, n, steps, float(ends[-1]), steps * n, float((step - slowest).sum()), trace=trace)


def with_epoch_ends(cluster: Cluster, compute: np.ndarray) -> np.ndarray:
    """A parameter server's (steps, workers) compute with its epochs' ends: after an epoch's
    last step each worker pulls the parameters for the next, and the chief (worker 0)
    evaluates first."""
    ends = cluster.epoch_ends(compute.shape[0], compute.shape[1])
    compute[ends] += cluster.epoch_pull_s()
    compute[ends, 0] += cluster.eval_s
    return compute


STRATEGIES = {
    "allreduce": AllReduceModel(),
    "ps-sync": SyncPSModel("ps-sync"),
    "ps-backup": SyncPSModel("ps-backup"),
    "ps-async": AsyncPSModel(),
    "local-sgd": LocalSGDModel("local-sgd"),
    "diloco": LocalSGDModel("diloco", outer_step=True),
    "fsdp": FSDPModel(),
    "tensor": MeshModel("tensor"),
    "pipeline": MeshModel("pipeline"),
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
    ``reshard`` and ``units`` (fsdp), ``mesh`` (tensor: simulate/tensor.py's Mesh; pipeline:
    simulate/pipeline.py's PipelineMesh).
    """
    if strategy not in STRATEGIES:
        raise ConfigError(f"--strategy must be one of {', '.join(STRATEGIES)}; got {strategy!r}")
    if strategy == "ps-backup" and options.get("backup", 0) < 1:
        raise ConfigError("--strategy ps-backup needs --backup-workers K >= 1 (K = 0 is ps-sync)")
    if strategy != "ps-backup":
        options["backup"] = 0
    if cluster.cpu_share is not None and strategy in ("fsdp", "tensor", "pipeline"):
        raise ConfigError(
            "--cpu-share simulates allreduce, local-sgd, diloco and the parameter servers hop by hop; "
            f"{strategy}'s collectives are not modelled under a CPU quota"
        )
    rng = np.random.default_rng(seed)
    if cluster.event_driven:
        return simulate_on_host(strategy, cluster, steps, rng, record, **options)
    return STRATEGIES[strategy].run(cluster, steps, rng, record, **options)
