"""The link between two processes of one host, as Gloo's all-reduce sees it: the rate and
the fixed cost a tensor-parallel replica's activations travel at when its processes share a
machine (calibrate.py writes them as ``host_link_gbps`` and ``host_step_us``; tensor.py's
``tp_bandwidth`` and ``tp_latency``).

Two processes (one thread each) all-reduce a tiny, a small and a large tensor. A 2-process
ring all-reduce of b bytes takes b / rate plus a fixed cost: the rate is the difference of
the two larger sizes over the difference of their times (the fixed cost cancelling out),
the fixed cost the tiny one's time, two ring steps of it; and the CPU the tiny one costs
the first process (every thread of it), which is what a CPU quota charges."""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = (2**12, 2**20, 2**24)
"""Bytes all-reduced: 4 KiB (the fixed cost), 1 MiB and 16 MiB (the rate)."""


def host_link(repeats: int = 10) -> tuple[float, float, float]:
    """(gigabits a second, microseconds a ring step, CPU microseconds a ring step) between two
    processes of this host, as a 2-process Gloo all-reduce sees them."""
    with tempfile.TemporaryDirectory(prefix="paratrain-link-") as folder:
        out = Path(folder) / "times"
        mp.start_processes(_probe, args=(folder, repeats), nprocs=2, start_method="spawn")
        tiny, small, large, tiny_cpu = (float(x) for x in out.read_text().split())
    gbps = max((SIZES[2] - SIZES[1]) / max(large - small, 1e-9) * 8 / 1e9, 0.0)
    return gbps, tiny / 2 * 1e6, tiny_cpu / 2 * 1e6


def _probe(rank: int, folder: str, repeats: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2)
    try:
        # the tiny all-reduce takes a fraction of a millisecond: more of them steady its median
        times = [_median_s(torch.zeros(size // 4), repeats * (5 if size == SIZES[0] else 1)) for size in SIZES]
        times.append(_cpu_s(torch.zeros(SIZES[0] // 4), repeats * 5))
        if rank == 0:
            (Path(folder) / "times").write_text(" ".join(f"{t:.9f}" for t in times))
    finally:
        dist.destroy_process_group()


def _cpu_s(tensor: Any, repeats: int) -> float:
    """CPU-seconds of this process (every thread) an all-reduce of ``tensor``, on average."""
    dist.all_reduce(tensor)  # warm-up
    dist.barrier()
    start = time.process_time()
    for _ in range(repeats):
        dist.all_reduce(tensor)
    return (time.process_time() - start) / repeats


def _median_s(tensor: Any, repeats: int) -> float:
    spent = []
    for i in range(repeats + 2):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(tensor)
        if i >= 2:  # two warm-up rounds
            spent.append(time.perf_counter() - start)
    return statistics.median(spent)
