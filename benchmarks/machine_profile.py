"""This machine as the cluster simulator models it, measured by short runs of the real code:
a worker's compute per step, a parameter-server shard's CPU per push and per update,
loopback latency and bandwidth, the ring all-reduce step as training meets it, and how much
work k processes do at once on these cores (simulator_validation.py's step 1, also read by
cluster_validation.py). Every function here runs paratrain from this checkout (the caller
puts it on ``sys.path``); the launched ones run in processes of their own.
"""

from __future__ import annotations

import os
import statistics
import time

#: Also validated (``--strategies local-sgd,diloco,fsdp``): at the default --sync-every 8,
#: each profiled by its own 1-worker run.
MORE_STRATEGIES = ("local-sgd", "diloco", "fsdp")


def _process_cpu() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def profiled_job(config) -> dict:
    """One process of a profiling run: ``job.run`` with the process's CPU time counted over
    training (``Trainer.fit`` less evaluation) or serving (a shard's fit), and per update."""
    from paratrain.strategies.ps.protocol.server import ShardServer
    from paratrain.train import job
    from paratrain.train.trainer import Trainer

    counts = {
        "cpu": 0.0,
        "eval_cpu": 0.0,
        "wall": 0.0,
        "eval_wall": 0.0,
        "steps": 0,
        "updates": 0,
        "update_cpu": 0.0,
        "pushes": 0,
    }
    fit = Trainer.fit
    evaluate = Trainer.evaluate
    apply = ShardServer._apply
    on_push = ShardServer._on_push

    def timed_fit(self, *args, **kwargs):
        start, wall = _process_cpu(), time.perf_counter()
        try:
            return fit(self, *args, **kwargs)
        finally:
            counts["cpu"] += _process_cpu() - start
            counts["wall"] += time.perf_counter() - wall
            counts["steps"] = self.global_step

    def timed_evaluate(self, *args, **kwargs):
        start, wall = _process_cpu(), time.perf_counter()
        try:
            return evaluate(self, *args, **kwargs)
        finally:
            counts["eval_cpu"] += _process_cpu() - start
            counts["eval_wall"] += time.perf_counter() - wall

    def timed_apply(self, *args, **kwargs):
        start = time.thread_time()  # the receiver thread's own CPU
        try:
            return apply(self, *args, **kwargs)
        finally:
            counts["update_cpu"] += time.thread_time() - start
            counts["updates"] += 1

    def counted_push(self, *args, **kwargs):
        counts["pushes"] += 1
        return on_push(self, *args, **kwargs)

    Trainer.fit = timed_fit
    Trainer.evaluate = timed_evaluate
    ShardServer._apply = timed_apply
    ShardServer._on_push = counted_push
    metrics = job.run(config)
    return {**counts, "role": metrics.get("role", "worker")}


def profile_strategy(strategy: str, epochs: int, workers: int = 1) -> list[dict]:
    from paratrain.config import TrainConfig
    from paratrain.launch.local import launch

    config = TrainConfig(strategy=strategy, workers=workers, epochs=epochs, progress=False, log_every=0, device="cpu")
    return launch(profiled_job, config, topology=config.topology)


def _busy(seconds: float) -> None:
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        pass


def ping_pong(sizes: list[int], repeats: int, gap_s: float, reduce_bytes: int) -> dict | None:
    """Rank 0: mean seconds of Gloo transfers, with ``gap_s`` of CPU work before each message
    (a training step's compute: the receiver has been waiting that long, as in training):
    one way of a send/recv ping-pong per message size (bytes), and an all-reduce of
    ``reduce_bytes`` (a model's gradient)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, out = dist.get_rank(), {}
    for size in sizes:
        message = torch.zeros(max(size // 4, 1))
        times = []
        for i in range(repeats + 10):
            start = time.perf_counter()
            if rank == 0:
                _busy(gap_s)
                dist.send(message, 1)
                dist.recv(message, 1)
            else:
                dist.recv(message, 0)
                _busy(gap_s)
                dist.send(message, 0)
            if i >= 10:  # warm-up: connections, buffers
                times.append((time.perf_counter() - start - 2 * gap_s) / 2)
        out[size] = statistics.mean(times)
    scalar, times = torch.zeros(max(reduce_bytes // 4, 1)), []
    for i in range(repeats + 10):
        _busy(gap_s)
        start = time.perf_counter()
        dist.all_reduce(scalar)
        if i >= 10:
            times.append(time.perf_counter() - start)
    out["all_reduce"] = statistics.mean(times)
    dist.destroy_process_group()
    return out if rank == 0 else None


def _steps_per_second(seconds: float, barrier, queue) -> None:
    """In a fresh process: mlp steps per second over ``seconds``, all processes at once."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    from paratrain.data.datasets import load_digits
    from paratrain.models import build_model

    torch.set_num_threads(1)
    data = load_digits()
    inputs, targets = data.train.tensors[0][:32], data.train.tensors[1][:32]
    model = build_model("mlp", data.spec)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(inputs), targets).backward()
        optimizer.step()

    for _ in range(50):  # warm-up
        step()
    barrier.wait()  # every process imported and warm: start together
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        step()
        steps += 1
    queue.put(steps / (time.perf_counter() - start))


def host_speedup(max_processes: int, seconds: float = 2.0) -> list[float]:
    """Throughput of k processes running mlp steps at once, relative to one, k = 1..max:
    the host's cores as the simulator's ``host_speedup`` curve."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    rates = []
    for k in range(1, max_processes + 1):
        queue, barrier = context.Queue(), context.Barrier(k)
        processes = [context.Process(target=_steps_per_second, args=(seconds, barrier, queue)) for _ in range(k)]
        for process in processes:
            process.start()
        rates.append(sum(queue.get() for _ in range(k)))
        for process in processes:
            process.join()
    return [r / rates[0] for r in rates]


SMALL, LARGE = 4, 4 * 2**20  # bytes of the ping-pongs for latency and for bandwidth


GAP_S = 1e-3  # CPU work between messages: about a digits step


def measure_link(pings: int, model_bytes: int) -> dict:
    """Loopback latency (s), bandwidth (bytes/s) and ring all-reduce step (s) from one launch."""
    from paratrain.launch.local import launch

    one_way = launch(ping_pong, [SMALL, LARGE], pings, GAP_S, model_bytes, num_processes=2)[0]
    latency = one_way[SMALL]
    bandwidth = (LARGE - SMALL) / max(one_way[LARGE] - latency, 1e-9)
    return {
        "latency_s": latency,
        "bandwidth_bytes_per_s": bandwidth,
        # at n = 2 a ring all-reduce is bytes / B plus 2 (n - 1) = 2 steps
        "pingpong_ring_latency_s": max(one_way["all_reduce"] - model_bytes / bandwidth, 0.0) / 2,
    }


def profile(epochs: int, pings: int, model_bytes: int, max_processes: int, strategies: list[str]) -> dict:
    links = [measure_link(pings, model_bytes) for _ in range(3)]
    # local-sgd, diloco, fsdp: their own 1-worker step (fsdp's hooks and copies are compute here).
    own = {}
    for strategy in (s for s in strategies if s in MORE_STRATEGIES):
        run = next(r for r in profile_strategy(strategy, epochs) if r["role"] == "worker")
        own[strategy] = (run["cpu"] - run["eval_cpu"]) / run["steps"]
    speedup = host_speedup(max_processes)
    allreduce = next(r for r in profile_strategy("allreduce", epochs) if r["role"] == "worker")
    pair = profile_strategy("allreduce", epochs, workers=2)
    ps = profile_strategy("ps-async", epochs)
    shard = next(r for r in ps if r["role"] == "ps")
    worker = next(r for r in ps if r["role"] == "worker")
    update_s = shard["update_cpu"] / shard["updates"]
    compute = (allreduce["cpu"] - allreduce["eval_cpu"]) / allreduce["steps"]
    link = {key: statistics.median(x[key] for x in links) for key in links[0]}
    # The ring step as training meets it: a 2-worker allreduce run's mean step (evaluation
    # excluded), less its compute on two processes sharing the host, less the bytes' time,
    # over the ring's 2 (n - 1) = 2 steps. A ping-pong all-reduce misses what training adds
    # (DDP's bucket copies, a peer's late wake-up); it stays in ``links`` for comparison.
    step2 = statistics.mean((r["wall"] - r["eval_wall"]) / r["steps"] for r in pair)
    shared = compute * 2 / min(speedup[1], 2.0) if len(speedup) > 1 else compute
    ring = max(step2 - shared - model_bytes / link["bandwidth_bytes_per_s"], 0.0) / 2
    return {
        "cores": len(os.sched_getaffinity(0)),
        **link,
        "ring_latency_s": ring,
        "allreduce_step2_s": step2,
        "compute_s": {"allreduce": compute, "ps": (worker["cpu"] - worker["eval_cpu"]) / worker["steps"], **own},
        "ps_message_s": (shard["cpu"] - shard["updates"] * update_s) / shard["pushes"],
        "ps_update_s": update_s,
        "links": links,
        "host_speedup": speedup,
    }


def median_profile(profiles: list[dict]) -> dict:
    """Every measured number's median over the profiles (the host speedup curve point by point)."""

    def median(values: list) -> object:
        first = values[0]
        if isinstance(first, dict):
            return {key: median([v[key] for v in values]) for key in first}
        if isinstance(first, list) and first and not isinstance(first[0], dict):
            return [statistics.median(column) for column in zip(*values)]
        if isinstance(first, (int, float)):
            return statistics.median(values)
        return first

    return median(profiles)
