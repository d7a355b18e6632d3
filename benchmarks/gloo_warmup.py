"""How long a fresh Gloo all-reduce between two processes takes to reach its pace: the
mean time of a gradient-sized all-reduce, second by second, from the start of a new pair
of processes and from the start of a new group between processes that have run for a while.

    python benchmarks/gloo_warmup.py --repeats 5 --seconds 12

Each process computes as a replica of the mlp does between its all-reduces (three small
matrix products, one thread) and then sums a tensor of the mlp's gradient (its parameters on
digits, by default) with the other over torch.distributed's Gloo on loopback; no paratrain
code runs in the loop. A fault-tolerant run pays the first seconds' pace after every loss:
its replacement is a new process and each quorum a new Gloo group (docs/reliability.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster_common import RESULTS, mlp_floats, record  # noqa: E402

from paratrain.comm.transport import free_port  # noqa: E402


def phase(floats: int, iterations: int, group: object) -> list[float]:
    """``iterations`` steps of compute and an all-reduce over ``group``; the all-reduce's
    mean milliseconds in each second from the first step (rank 0's clock)."""
    tensor, weights = torch.randn(floats), torch.randn(256, 256)
    began, sums = time.monotonic(), {}
    for _ in range(iterations):
        for _ in range(3):
            weights @ weights[:, :64]
        start = time.perf_counter()
        dist.all_reduce(tensor, group=group)
        taken = time.perf_counter() - start
        second = sums.setdefault(int(time.monotonic() - began), [0, 0.0])
        second[0] += 1
        second[1] += taken
    return [sums[k][1] / sums[k][0] * 1e3 for k in sorted(sums)]


def pair(rank: int, port: int, floats: int, iterations: int, out: mp.Queue) -> None:
    """One process of a pair: a phase on the default group (new processes), then a phase on
    a group made anew (processes that have run)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        fresh = phase(floats, iterations, None)
        renewed = phase(floats, iterations, dist.new_group([0, 1]))
        if rank == 0:
            out.put((fresh, renewed))
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="pairs of processes, one after another")
    parser.add_argument("--iterations", type=int, default=8000, help="steps of each phase (about 10 s here)")
    parser.add_argument("--floats", type=int, default=0, help="the all-reduced tensor's size (0: the mlp's)")
    parser.add_argument("--out", default=str(RESULTS / "gloo_warmup"))
    args = parser.parse_args()
    floats = args.floats or mlp_floats()
    context = mp.get_context("spawn")
    runs = []
    for _ in range(args.repeats):
        queue, port = context.Queue(), free_port()
        processes = [context.Process(target=pair, args=(r, port, floats, args.iterations, queue)) for r in (0, 1)]
        for process in processes:
            process.start()
        runs.append(queue.get(timeout=600))
        for process in processes:
            process.join()
            if process.exitcode:
                raise SystemExit(f"a process of the pair exited {process.exitcode}")
    seconds = min(len(r) for run in runs for r in run) - 1  # the last second is a partial one
    medians = [[statistics.median(run[k][s] for run in runs) for s in range(seconds)] for k in (0, 1)]
    lines = [
        f"# A Gloo all-reduce of {floats} floats between 2 processes on loopback, second by second",
        "",
        "| second | new processes (ms) | new group, processes that ran (ms) |",
        "| ---: | ---: | ---: |",
    ]
    lines += [f"| {s} | {medians[0][s]:.2f} | {medians[1][s]:.2f} |" for s in range(seconds)]
    lines += [
        "",
        f"The median over {args.repeats} pairs of each second's mean all-reduce time (rank 0's, the "
        f"wait for the other process's compute included); each step computes three 256x256 by 256x64 "
        f"products first, one thread per process. {os.cpu_count()} cores, torch {torch.__version__}.",
    ]
    record(Path(args.out), {"floats": floats, "setup": vars(args), "runs": runs, "medians": medians}, lines)


if __name__ == "__main__":
    main()
