"""The link between two processes of one host, as Gloo's all-reduce sees it: the rate that
a tensor-parallel replica's activations travel at when its processes share a machine
(calibrate.py writes it as ``host_link_gbps``; tensor.py's ``tp_bandwidth``).

Two processes (one thread each) all-reduce a small and a large tensor; a 2-process ring
all-reduce of b bytes takes b / rate plus a fixed cost, so the rate is the difference of
the sizes over the difference of the times, the fixed cost cancelling out."""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = (2**20, 2**24)
"""Bytes all-reduced: 1 MiB and 16 MiB."""


def host_link_gbps(repeats: int = 10) -> float:
    """Gigabits a second between two processes of this host (a 2-process Gloo all-reduce)."""
    with tempfile.TemporaryDirectory(prefix="paratrain-link-") as folder:
        out = Path(folder) / "times"
        mp.start_processes(_probe, args=(folder, repeats), nprocs=2, start_method="spawn")
        small, large = (float(x) for x in out.read_text().split())
    return max((SIZES[1] - SIZES[0]) / max(large - small, 1e-9) * 8 / 1e9, 0.0)


def _probe(rank: int, folder: str, repeats: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2)
    try:
        times = [_median_s(torch.zeros(size // 4), repeats) for size in SIZES]
        if rank == 0:
            (Path(folder) / "times").write_text(" ".join(f"{t:.9f}" for t in times))
    finally:
        dist.destroy_process_group()


def _median_s(tensor: Any, repeats: int) -> float:
    spent = []
    for i in range(repeats + 2):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(tensor)
        if i >= 2:  # two warm-up rounds
            spent.append(time.perf_counter() - start)
    return statistics.median(spent)
