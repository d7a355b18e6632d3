"""The simulated cluster: workers (compute time, stragglers, failures), links, codecs.

Everything here is a cost model with the arithmetic in the open; simulator.py turns it into step times.
Units: seconds and bytes throughout (flags take ms, us, Gb/s, MB). Every worker needs ``compute_s`` a step
times its straggler factor (``lognormal:SIGMA`` of mean 1 per worker and step, ``fixed:W:F``, or ``sleep:W:F``
as ``paratrain train --straggler``); failures are Poisson per worker (``failure_rate`` an hour, each costing
``recovery_s``). Every node has one full-duplex link of ``bandwidth`` bytes/s and ``latency`` s a message; a
codec divides the gradient's bytes and adds its coding time; a shard spends ``ps_message_s`` on each push and
``ps_update_s`` on each update, one message at a time; ``host_cores`` shares one host's cores (host.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from paratrain.errors import ConfigError

BUCKET_BYTES = 25 * 2**20
"""DistributedDataParallel's default bucket size (bucket_cap_mb=25)."""
BACKWARD_SHARE = 2 / 3
"""Backward is about twice the forward pass (Kaplan et al. 2020: 2N vs 4N FLOPs per token)."""


# ----- stragglers ----------------------------------------------------------------------------
class NoStragglers:
    spec = "none"

    def factors(self, rng: np.random.Generator, steps: int, workers: int) -> np.ndarray:
        return np.ones((steps, workers))


class LognormalStragglers:
    """Per-step slowdowns with a heavy right tail, as measured on shared clusters
    (Dean & Barroso 2013, "The tail at scale"); mean 1, so the mean compute is kept."""

    def __init__(self, sigma: float):
        if not sigma >= 0:
            raise ConfigError(f"--straggler lognormal:SIGMA needs SIGMA >= 0, got {sigma}")
        self.sigma = sigma
        self.spec = f"lognormal:{sigma:g}"

    def factors(self, rng: np.random.Generator, steps: int, workers: int) -> np.ndarray:
        z = rng.standard_normal((steps, workers))
        return np.exp(self.sigma * z - self.sigma**2 / 2)


class FixedStraggler:
    """One worker always ``factor`` times slower (a slow or overloaded machine)."""

    form = "fixed"

    def __init__(self, worker: int, factor: float):
        if worker < 0 or not factor >= 1:
            raise ConfigError(
                f"--straggler {self.form}:WORKER:FACTOR needs WORKER >= 0 and FACTOR >= 1, got {worker}:{factor}"
            )
        self.worker, self.factor = worker, factor
        self.spec = f"{self.form}:{worker}:{factor:g}"

    def factors(self, rng: np.random.Generator, steps: int, workers: int) -> np.ndarray:
        out = np.ones((steps, workers))
        if self.worker < workers:
            out[:, self.worker] = self.factor
        return out


class SleepStraggler(FixedStraggler):
    """The straggler ``paratrain train --straggler WORKER:FACTOR`` injects: after each step
    that worker sleeps (FACTOR - 1) times the step's duration (train/faults.py). Its compute
    is not slower, and it uses no core while it sleeps; the step's duration includes what
    the strategy waits for inside a step (the all-reduce). Modelled by host.py only."""

    form = "sleep"

    def factors(self, rng: np.random.Generator, steps: int, workers: int) -> np.ndarray:
        return np.ones((steps, workers))

    def sleep_factor(self, worker: int) -> float:
        """Seconds slept after a step, per second of the step."""
        return self.factor - 1 if worker == self.worker else 0.0


STRAGGLER_FORMS = "none, lognormal:SIGMA (e.g. lognormal:0.3), fixed:WORKER:FACTOR (e.g. fixed:0:3) or sleep:WORKER:FACTOR (e.g. sleep:1:2)"


def parse_straggler(text: str | None):
    """``--straggler`` text -> a straggler model; ConfigError naming the valid forms."""
    if text in (None, "", "none"):
        return NoStragglers()
    name, _, rest = text.partition(":")
    worker, _, factor = rest.partition(":")
    try:
        if name == "lognormal":
            sigma = float(rest)
        elif name in ("fixed", "sleep"):
            worker_index, slowdown = int(worker), float(factor)
        else:
            raise ValueError
    except ValueError:
        raise ConfigError(f"--straggler must be {STRAGGLER_FORMS}; got {text!r}") from None
    if name == "lognormal":
        return LognormalStragglers(sigma)
    return (SleepStraggler if name == "sleep" else FixedStraggler)(worker_index, slowdown)


# ----- codecs ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Codec:
    """Bytes on the wire = dense fp32 bytes / ``ratio``; encode+decode at ``throughput``
    bytes/s of dense gradient (an assumption of this model; 0 = free)."""

    name: str
    ratio: float
    throughput: float

    def wire_bytes(self, dense_bytes: float) -> float:
        return dense_bytes / self.ratio

    def cost_s(self, dense_bytes: float) -> float:
        return dense_bytes / self.throughput if self.throughput else 0.0


def make_codec(
    name: str, param_shapes: list[tuple[int, ...]], topk_ratio: float = 0.01, powersgd_rank: int = 4
) -> Codec:
    """The codec named ``--compression``; byte ratios as paratrain's codecs send them."""
    if name not in CODECS:
        raise ConfigError(f"--compression must be one of {', '.join(CODECS)}; got {name!r}")
    return CODECS[name](param_shapes, topk_ratio, powersgd_rank)


def _powersgd_ratio(shapes: list[tuple[int, ...]], rank: int) -> float:
    # PowerSGD (Vogels et al. 2019) sends P (n x r) and Q (m x r) for every matrix
    # reshaped to n x m, and 1-D tensors (biases) uncompressed.
    dense = sent = 0
    for shape in shapes:
        numel = math.prod(shape)
        dense += numel
        if len(shape) >= 2:
            n, m = shape[0], numel // shape[0]
            sent += min((n + m) * rank, numel)
        else:
            sent += numel
    return dense / max(sent, 1)


def _check_topk(ratio: float) -> float:
    if not 0 < ratio <= 0.5:
        raise ConfigError(f"--topk-ratio must be in (0, 0.5], got {ratio}")
    return ratio


CODECS = {
    "none": lambda shapes, k, r: Codec("none", 1.0, 0.0),
    "fp16": lambda shapes, k, r: Codec("fp16", 2.0, 20e9),
    "bf16": lambda shapes, k, r: Codec("bf16", 2.0, 20e9),
    # int8 with one fp32 scale per 256 values: 4 / (1 + 4/256) = 3.94.
    "int8": lambda shapes, k, r: Codec("int8", 4 / (1 + 4 / 256), 10e9),
    # Top-k sends k values and k int32 indices: (4 + 4) k bytes for 4 n, ratio 1/(2 k/n).
    "topk": lambda shapes, k, r: Codec("topk", 1 / (2 * _check_topk(k)), 2e9),
    "powersgd": lambda shapes, k, r: Codec("powersgd", _powersgd_ratio(shapes, r), 5e9),
}


# ----- the cluster ---------------------------------------------------------------------------
@dataclass
class Cluster:
    """One simulated cluster: ``workers`` identical nodes plus ``ps_shards`` server nodes."""

    workers: int
    compute_s: float
    """Seconds of forward+backward for one local batch on one worker."""
    model_bytes: float
    """Dense fp32 gradient (= parameter) bytes."""
    bandwidth: float = 10e9 / 8
    """Bytes/s of every node's link (each direction)."""
    latency: float = 10e-6
    """Seconds per message on a link."""
    ring_latency: float | None = None
    """Seconds per step of a ring all-reduce; None: ``latency``. A collective library's step
    can cost more than a message (Gloo hands each collective to a thread of its own and back)."""
    ps_shards: int = 1
    codec: Codec = Codec("none", 1.0, 0.0)
    straggler: object = NoStragglers()
    failure_rate: float = 0.0
    """Failures per worker per hour."""
    recovery_s: float = 60.0
    """Seconds a failed worker needs before it computes again."""
    ps_message_s: float = 0.0
    """Seconds a ps shard works on one push: decode, accumulate or hold, and its reply."""
    ps_update_s: float = 0.0
    """Seconds a ps shard works on one update (the optimizer step on its slice)."""
    host_cores: float | None = None
    """None: every node has its own machine. A number: every process (workers and shards)
    runs on one host with this many cores, shared fairly while more want one (host.py)."""
    host_speedup: tuple[float, ...] | None = None
    """Measured throughput of k processes computing at once on the host, relative to one
    alone, for k = 1, 2, ... (the last value holds for more); None: min(k, host_cores).
    Cores that share caches or a physical core, and context switches, make it less."""
    cpu_share: float | None = None
    """None: every node has whole cores. A share of one core: every node is limited to it by a
    CPU quota (cgroup CPU bandwidth control, as Kubernetes' CPU limits and ``paratrain
    cluster --cpu``): full speed until ``cpu_share * cpu_period_s`` is spent in a period,
    then nothing until the next (quota.py). ``compute_s``, ``ps_message_s``, ``ps_update_s``
    are then CPU-seconds at a full core's speed, ``latency`` the wire's alone, and each
    message costs its receiver ``message_cpu_s`` on top (a hop of a ring all-reduce, a push
    at a shard, a reply at a worker). A ``fixed:W:F`` straggler is a node at 1/F of the
    share (a slow machine)."""
    cpu_period_s: float = 0.1
    """The quota's period (the kernel's default, and Kubernetes', is 100 ms)."""
    message_cpu_s: float = 0.0
    """With ``cpu_share``: CPU-seconds a node spends on each message it receives (the
    transport's and the framework's work, which waits for the node's quota like any other)."""
    ring_fixed_cpu_s: float = 0.0
    """With ``cpu_share``: CPU-seconds each node spends once per ring all-reduce beyond its
    hops' (the framework's launch and finish: DDP's buckets and hooks), before the first hop."""
    ps_worker_cpu_s: float | None = None
    """With ``cpu_share``, under a parameter server: CPU-seconds a worker spends on a push and
    its reply (None: ``message_cpu_s``); the shard's on a push are ``ps_message_s`` plus
    ``message_cpu_s``."""
    epoch_batches: int = 0
    """Local batches in an epoch of the training split (0: the run has no epoch ends). At each
    end, as ``Trainer.fit`` does, the replicas of a collective strategy all-reduce the epoch's
    loss, evaluate the test split between them and all-reduce the sums; under a parameter
    server each worker pulls the parameters for the next epoch and the chief evaluates."""
    eval_s: float = 0.0
    """Seconds an epoch's end costs one process at a full core: the test split's evaluation and
    the next epoch's start (CPU-seconds under ``cpu_share``)."""
    collective_step_s: float = 0.0
    """Seconds a step of a collective of a few values costs beyond ``latency`` (Gloo's fixed
    cost of a ring step; CPU-seconds under ``cpu_share``)."""

    def __post_init__(self) -> None:
        if self.ring_latency is not None and not self.ring_latency >= 0:
            raise ConfigError(f"--ring-latency-us must be >= 0, got {self.ring_latency * 1e6}")
        if self.host_cores is not None and not self.host_cores > 0:
            raise ConfigError(f"--host-cores must be > 0, got {self.host_cores}")
        if self.host_speedup is not None and (not self.host_speedup or min(self.host_speedup) <= 0):
            raise ConfigError(
                f"--host-speedup must be throughputs > 0 for 1, 2, ... processes, got {self.host_speedup}"
            )
        if self.cpu_share is not None:
            if not 0 < self.cpu_share <= 1:
                raise ConfigError(f"--cpu-share must be in (0, 1] (a share of one core), got {self.cpu_share}")
            if self.host_cores is not None:
                raise ConfigError(
                    "--cpu-share (a node each, under a CPU quota) and --host-cores (one shared host) exclude each other"
                )
            if not self.message_cpu_s >= 0:
                raise ConfigError(f"--message-cpu-us must be >= 0, got {self.message_cpu_s * 1e6}")
            if not self.ring_fixed_cpu_s >= 0:
                raise ConfigError(f"--ring-fixed-cpu-us must be >= 0, got {self.ring_fixed_cpu_s * 1e6}")
            if self.ps_worker_cpu_s is not None and not self.ps_worker_cpu_s >= 0:
                raise ConfigError(f"--ps-worker-cpu-us must be >= 0, got {self.ps_worker_cpu_s * 1e6}")
            if not self.cpu_period_s > 0:
                raise ConfigError(f"--cpu-period-ms must be > 0, got {self.cpu_period_s * 1e3}")
        if self.epoch_batches < 0:
            raise ConfigError(f"a cluster's epoch_batches must be >= 0, got {self.epoch_batches}")
        for name in ("eval_s", "collective_step_s"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"a cluster's {name} must be >= 0, got {getattr(self, name)}")
        for name in ("ps_message_s", "ps_update_s"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"--{name[:-2].replace('_', '-')}-us must be >= 0, got {getattr(self, name) * 1e6}")

    def host_capacity(self, k: int) -> float:
        """Cores' worth of work done while k processes want one (host_cores set)."""
        if self.host_speedup is None:
            return min(float(k), self.host_cores)
        return self.host_speedup[min(k, len(self.host_speedup)) - 1]

    @property
    def event_driven(self) -> bool:
        """Whether host.py's engine is needed: processes share a host's cores, or a straggler
        sleeps between steps (neither fits simulator.py's rounds)."""
        return self.host_cores is not None or self.cpu_share is not None or isinstance(self.straggler, SleepStraggler)

    @property
    def _slow_node(self) -> bool:
        """Whether the straggler is a node at a smaller share (``fixed:`` under CPU quotas)
        rather than more compute."""
        return self.cpu_share is not None and type(self.straggler) is FixedStraggler

    def node_share(self, node: int) -> float:
        """Node ``node``'s share of a core under ``cpu_share`` (workers first, then shards)."""
        slow = self._slow_node and self.straggler.worker == node
        return self.cpu_share / (self.straggler.factor if slow else 1.0)

    def sleep_factor(self, worker: int) -> float:
        """Seconds ``worker`` sleeps after a step per second of the step (injected stragglers)."""
        return getattr(self.straggler, "sleep_factor", lambda w: 0.0)(worker)

    def compute_times(self, rng: np.random.Generator, steps: int, workers: int | None = None) -> np.ndarray:
        """(steps, workers) seconds of compute per step, stragglers and failures included."""
        workers = self.workers if workers is None else workers
        factors = self.straggler.factors(rng, steps, workers)
        if self._slow_node:
            factors = np.ones_like(factors)  # a slower node's smaller share (node_share), not more work
        times = self.compute_s * factors
        if self.failure_rate > 0:
            # P(at least one failure during a step of duration t) = 1 - exp(-rate t).
            p = 1 - np.exp(-self.failure_rate / 3600 * times)
            times = times + self.recovery_s * (rng.random((steps, workers)) < p)
        return times

    # --- epochs ---
    def epoch_steps(self, replicas: int) -> int:
        """Steps each of ``replicas`` takes in an epoch (0: no epoch ends)."""
        return self.epoch_batches // replicas if self.epoch_batches >= replicas else 0

    def epoch_ends(self, steps: int, replicas: int) -> np.ndarray:
        """Whether each of a worker's ``steps`` steps (from 0) ends an epoch that another
        follows (the run's last step ends training, not an epoch between two)."""
        every = self.epoch_steps(replicas)
        ends = (np.arange(steps) + 1) % every == 0 if every else np.zeros(steps, dtype=bool)
        ends[-1:] = False
        return ends

    def small_allreduce_s(self, n: int) -> float:
        """A ring all-reduce of a few values across ``n`` nodes on whole cores: 2(n-1) steps."""
        return 2 * (n - 1) * (self.latency + self.collective_step_s) if n > 1 else 0.0

    def epoch_end_s(self, replicas: int) -> float:
        """A collective strategy's epoch end on whole cores: the loss's all-reduce, each
        replica's share of the evaluation, the sums' all-reduce."""
        return self.eval_s / replicas + 2 * self.small_allreduce_s(replicas)

    def epoch_pull_s(self) -> float:
        """A parameter-server worker's pull at an epoch's start: its request and the reply."""
        return 2 * self.latency + self.pull_times()[0]

    # --- communication ---
    def ring_allreduce_s(self, nbytes: float, n: int | None = None) -> float:
        """Ring all-reduce of ``nbytes`` over n nodes: reduce-scatter then all-gather,
        2(n-1) steps of nbytes/n each (Patarasuk & Yuan 2009)."""
        n = self.workers if n is None else n
        if n <= 1:
            return 0.0
        step = self.latency if self.ring_latency is None else self.ring_latency
        return 2 * (n - 1) / n * nbytes / self.bandwidth + 2 * (n - 1) * step

    def buckets(self) -> list[float]:
        """Wire bytes of each all-reduce bucket, in the order backward fills them."""
        wire = self.codec.wire_bytes(self.model_bytes)
        dense_full = int(self.model_bytes // BUCKET_BYTES)
        sizes = [BUCKET_BYTES] * dense_full
        if self.model_bytes - dense_full * BUCKET_BYTES > 0 or not sizes:
            sizes.append(self.model_bytes - dense_full * BUCKET_BYTES)
        return [s / self.model_bytes * wire for s in sizes]

    def shard_bytes(self) -> float:
        return self.model_bytes / self.ps_shards

    def push_times(self) -> tuple[float, float]:
        """(own, shard): seconds a push needs on the worker's link (all shards' slices) and
        on one shard's link (its slice), encoded by the codec."""
        wire = self.codec.wire_bytes(self.model_bytes)
        return wire / self.bandwidth, wire / self.ps_shards / self.bandwidth

    def pull_times(self) -> tuple[float, float]:
        """(own, shard) for a pull: parameters travel dense (codecs apply to pushes)."""
        return self.model_bytes / self.bandwidth, self.shard_bytes() / self.bandwidth
