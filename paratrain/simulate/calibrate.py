"""``paratrain simulate --calibrate FILE``: measure on this machine the costs the simulator's model needs for
the user's model, and write them for later predictions (``--calibration FILE``; calibration.py reads them).

A distributed step costs far more than its bytes on the wire (DDP's buckets, Gloo's threads, the shard's
bookkeeping), so the costs come from real ``paratrain train`` runs of ``--model`` on ``--dataset`` with the
prediction's optimizer flags, one thread a process on a core of its own. Each cost is the median over
``--calibrate-rounds`` rounds run back to back (a shared machine's speed drifts); each round's own costs and
the CPU steal during the rounds are kept too. The fields: ``compute_ms`` (a ``single`` step), ``ring_step_us``
(what a 2-worker ``allreduce`` step adds, per ring step), ``ps_push_us`` (what a 1-worker ``ps-sync`` step
adds) with the CPU at each end, ``epoch_end_ms``, ``ps_update_us`` (the shard's optimizer step),
``codec_gbps``, the host link's rate and fixed cost, and ``tp_module_us`` (what each tensor-split module adds).
``--across-hosts`` runs the runs that send messages between emulated hosts, so that a message crosses a
network stack at both ends. docs/simulator.md explains how a prediction uses them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from paratrain.config import TrainConfig
from paratrain.cpu_steal import cpu_times, stolen_share
from paratrain.data.datasets import load_dataset
from paratrain.errors import ConfigError
from paratrain.models import build_model
from paratrain.registry import OPTIMIZERS
from paratrain.simulate.calibration import FORMAT, VERSION
from paratrain.simulate.link_probe import host_link


def calibrate(args: Any, model: Any, splits: Any) -> dict[str, Any]:
    """Every cost of the module docstring for ``model`` (built for ``args.model`` on
    ``args.dataset``)."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters() if p.requires_grad]).float()
    hosts: list[str] = []  # where the runs across hosts ran: paratrain cluster's line for each
    before = cpu_times()
    rounds = _step_costs(args, splits, hosts)
    steal = stolen_share(before, cpu_times())
    update = _update_s(flat, args)
    each = [_round_costs(measured, update) for measured in rounds]
    costs = {name: statistics.median(r[name] for r in each) for name in each[0]}
    costs |= {"ps_update_us": update * 1e6, "codec_gbps": _codec_gbps(args, model, flat)}
    module = _tensor_module_s(args, model, splits, costs["compute_ms"] / 1e3, costs)
    if module is not None:
        costs["tp_module_us"] = module * 1e6
    return {
        "format": FORMAT,
        "version": VERSION,
        "measured": {
            "host": platform.node(),
            "at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__,
            "threads": 1,
            "cores": os.cpu_count(),
            "runs": f"paratrain train {' '.join(training_flags(args))} with "
            + "; ".join(" ".join(flags) for flags, _, _ in (SINGLE, RING, RING3, PUSH))
            + (
                "; allreduce and ps-sync between 2 emulated hosts (allreduce with 3 workers between 3)"
                if args.across_hosts
                else ""
            ),
            "across_hosts": hosts[0] if hosts else None,
            "steal": steal,
        },
        "model": {
            "model": args.model,
            "dataset": args.dataset,
            "batch_size": args.batch_size,
            "compression": args.compression,
            "optimizer": args.optimizer,
            "gradient_bytes": flat.numel() * 4,
        },
        "costs": costs,
        "rounds": each,
    }


def _round_costs(measured: tuple[float, ...], update: float) -> dict[str, float]:
    """One round's costs in the file's units, from ``_step_costs``'s seconds (the shard's CPU
    a push less its update, measured apart). A ring's CPU is a fixed part and one per hop:
    the CPU a step of ``allreduce`` adds is F + 2H with 2 processes (2 hops) and F + 4H with 3,
    so H is half the difference and F the rest (each at least 0)."""
    single, ring, ring_cpu, ring3_cpu, push, epoch_end, shard_cpu, worker_cpu, link = measured
    fixed = min(max(2 * ring_cpu - ring3_cpu, 0.0), ring_cpu)  # a noisy round: 3 workers' CPU below 2's
    return {
        "compute_ms": single * 1e3,
        "ring_step_us": ring * 1e6,
        "message_cpu_us": (ring_cpu - fixed) / 2 * 1e6,
        "ring_fixed_cpu_us": fixed * 1e6,
        "ps_push_us": push * 1e6,
        "shard_push_cpu_us": max(shard_cpu - update, 0.0) * 1e6,
        "ps_worker_cpu_us": worker_cpu * 1e6,
        "epoch_end_ms": epoch_end * 1e3,
        "host_link_gbps": link[0],
        "host_step_us": link[1],
        "host_step_cpu_us": link[2],
    }


#: Steps each measuring run takes, about (whole epochs).
RUN_STEPS = 400


#: The measuring runs' own flags, the workers each trains with, and its processes (ps-sync's
#: shard is one besides its worker): across hosts, a process a host. The rings sum over Gloo
#: (``--no-shared-memory``), as between the simulated cluster's nodes: on one machine
#: ``allreduce`` would sum through /dev/shm, whose waits spin, so that a ring's CPU would be
#: that of processes polling, not of messages received (3 workers on 2 cores: anything).
SINGLE = (["--strategy", "single"], 1, 1)
RING = (["--strategy", "allreduce", "--workers", "2", "--no-shared-memory"], 2, 2)
RING3 = (["--strategy", "allreduce", "--workers", "3", "--no-shared-memory"], 3, 3)
PUSH = (["--strategy", "ps-sync", "--workers", "1"], 1, 2)

# Each round (``--calibrate-rounds``, 3 by default) runs the four measuring runs (single,
# allreduce with 2 and 3 workers, ps-sync) and the host's link probe back to back, so that the
# machine's drift hits all of them alike; each cost is its median over the rounds. (One probe
# is not enough on a shared machine: on a 2-core virtual machine, seven calibrations of the mlp
# probed once each found a bare all-reduce's CPU at 301-806 us.)


def _step_costs(args: Any, splits: Any, hosts: list[str]) -> list[tuple[float, ...]]:
    """For each of ``args.calibrate_rounds`` rounds: seconds of a step of ``single`` (T1); of a ring step of
    ``allreduce`` with 2 workers ((T2 - T1) / 2); the CPU-seconds a step of ``allreduce`` adds
    to T1's on a process, with 2 workers and with 3; of what ``ps-sync`` with 1 worker adds
    (Tp - T1); of an epoch's end in ``single``; the shard's CPU-seconds a push (its update
    included) and what the worker's CPU a step adds to T1's; and the host's link
    (link_probe.host_link: its rate, a bare ring step's time and CPU). A small cost (a push
    of a small model: a tenth of a millisecond) can come out below 0 in a round on a noisy
    machine: it counts as 0 there."""
    rounds = []
    across = hosts if args.across_hosts else None
    for _ in range(args.calibrate_rounds):
        single, single_cpu, end, _ = _step_s(args, splits, *SINGLE)
        ring, ring_cpu, _, _ = _step_s(args, splits, *RING, across)
        _, ring3_cpu, _, _ = _step_s(args, splits, *RING3, [] if across is not None else None)
        push, push_cpu, _, shard_cpu = _step_s(args, splits, *PUSH, across)
        rounds.append(
            (
                single,
                max(ring - single, 0.0) / 2,
                max(ring_cpu - single_cpu, 0.0),
                max(ring3_cpu - single_cpu, 0.0),
                max(push - single, 0.0),
                end,
                shard_cpu,
                max(push_cpu - single_cpu, 0.0),
                host_link(),
            )
        )
    return rounds


def _step_s(
    args: Any, splits: Any, flags: list[str], workers: int, processes: int, across: list[str] | None = None
) -> tuple[float, float, float, float]:
    """Seconds a step of a real ``paratrain train`` with ``flags`` takes, one thread a process
    (given ``across``: its ``processes`` on emulated hosts, a host each, whose names it appends there);
    CPU-seconds the first process spends a step (every thread of it: Gloo's too); and
    seconds an epoch's end takes there (its evaluation and the next epoch's start: the wall
    clock between two epochs' ends less the second's steps); and under a parameter server,
    its shard's CPU-seconds while it served per push (0 for the others)."""
    per_epoch = max(len(splits.train) // (args.batch_size * workers), 1)
    epochs = max(2, math.ceil(RUN_STEPS / per_epoch))
    with tempfile.TemporaryDirectory(prefix="paratrain-calibrate-") as folder:
        out = Path(folder) / "metrics.json"
        command = [
            sys.executable,
            "-m",
            "paratrain",
            "train",
            *flags,
            *training_flags(args),
            "--epochs",
            str(epochs),
            "--no-progress",
            "--log-every",
            "0",
            "--metrics-out",
            str(out),
        ]
        if across is not None:
            command[3:3] = ["cluster", "run", "--hosts", str(processes), "--logs", folder, "--", "paratrain"]
        env = {**os.environ, "PARATRAIN_THREADS_PER_WORKER": "1", "OMP_NUM_THREADS": "1"}
        run = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600)
        if run.returncode != 0 or not out.exists():
            last = (run.stderr.strip().splitlines() or ["no output"])[-1]
            raise ConfigError(f"--calibrate: the measuring run paratrain train {' '.join(flags)} failed: {last}")
        metrics = json.loads(out.read_text())
        history = metrics["history"]
        if across is not None:
            across += [
                line.removeprefix("paratrain cluster: ")
                for line in run.stderr.splitlines()
                if line.startswith("paratrain cluster: cluster ")
            ][:1]
    # Past the first epoch (its warm-up): examples over the epochs' steps' seconds.
    first = history[0]
    last = history[-1]
    steady = history[1:]
    training = sum(epoch["train_seconds"] for epoch in steady)
    steps = (last["examples_seen"] - first["examples_seen"]) / (args.batch_size * workers)
    end = (last["wall_seconds"] - first["wall_seconds"] - training) / len(steady)
    served = (metrics.get("shard_cpu_seconds") or [None])[0]  # a push a step with one worker
    shard = served / metrics["global_steps"] if served is not None and metrics.get("global_steps") else 0.0
    return training / steps, (last["cpu_seconds"] - first["cpu_seconds"]) / steps, max(end, 0.0), shard


def training_flags(args: Any) -> list[str]:
    """The ``paratrain train`` flags every measuring run shares: the prediction's model, data,
    batch, seed and optimizer (recorded in the calibration file, with the runs' own flags)."""
    return [
        "--model",
        args.model,
        "--dataset",
        args.dataset,
        "--batch-size",
        str(args.batch_size),
        "--seed",
        str(args.seed),
        "--optimizer",
        args.optimizer,
        "--lr",
        str(args.lr),
        "--momentum",
        str(args.momentum),
        "--weight-decay",
        str(args.weight_decay),
    ]


def model_and_data(args: argparse.Namespace) -> tuple[Any, Any]:
    """--model built (seeded) for --dataset, and the data set's splits."""
    config = TrainConfig(model=args.model, dataset=args.dataset, seed=args.seed, batch_size=args.batch_size)
    splits = load_dataset(config)
    torch.manual_seed(args.seed)
    return build_model(config.model, splits.spec, options=config.model_options), splits


def profile_compute_s(model: Any, splits: Any, batch_size: int, repeats: int = 5) -> float:
    """Median seconds of one forward+backward on a local batch, measured here."""
    from paratrain.train.scores import cross_entropy_loss  # deferred: the trainer's, a logit per position too

    loader = torch.utils.data.DataLoader(splits.train, batch_size=batch_size, shuffle=False)
    inputs, targets = next(iter(loader))
    times = []
    for i in range(repeats + 2):
        start = time.perf_counter()
        model.zero_grad(set_to_none=True)
        cross_entropy_loss(model(inputs), targets).backward()
        if i >= 2:  # two warm-up steps
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def write(path: str, calibration: dict[str, Any]) -> None:
    try:
        Path(path).write_text(json.dumps(calibration, indent=1) + "\n")
    except OSError as error:
        raise ConfigError(f"--calibrate {path}: cannot write it ({error.strerror})") from None


def _tensor_module_s(args: Any, model: Any, splits: Any, single: float, costs: dict[str, float]) -> float | None:
    """What each split module adds to a step of ``tensor`` split 2 ways beyond the model's
    share of the compute and its collectives' bare all-reduces (DTensor's dispatch of every
    op, the collectives' own work): a real 2-process step (T2) less that model's step, per
    module; None for a model without a tensor plan."""
    from paratrain.simulate.tensor import activation_s, compute_scale  # deferred: the engine
    from paratrain.simulate.tensor_shape import first_inputs, measure

    try:
        shape = measure(model, first_inputs(splits, args.batch_size), None, 2)
    except ConfigError:  # no plan, or one that does not split 2 ways
        return None
    tensor = _step_s(args, splits, ["--strategy", "tensor", "--workers", "2", "--tensor-parallel", "2"], 1, 2)
    link = costs["host_link_gbps"] * 1e9 / 8
    modelled = single * compute_scale(shape, 2) + activation_s(shape, 2, link, costs["host_step_us"] * 1e-6)
    return max(tensor - modelled, 0.0) / max(shape.modules, 1)


def _median_s(work: Any, repeats: int = 20) -> float:
    times = []
    for i in range(repeats + 3):
        start = time.perf_counter()
        work()
        if i >= 3:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _update_s(flat: torch.Tensor, args: Any) -> float:
    params = flat.clone().requires_grad_(True)
    params.grad = torch.randn_like(params)
    config = TrainConfig(optimizer=args.optimizer, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    return _median_s(OPTIMIZERS.get(config.optimizer)([params], config).step)


def _codec_gbps(args: Any, model: Any, flat: torch.Tensor) -> float:
    if args.compression == "none":
        return 0.0
    from paratrain.comm.codec_config import CodecConfig, make_codec
    from paratrain.comm.packing import PackedGradient

    options = CodecConfig(
        compression=args.compression, compression_ratio=args.topk_ratio, powersgd_rank=args.powersgd_rank
    )
    pieces = [(str(i), tuple(p.shape)) for i, p in enumerate(q for q in model.parameters() if q.requires_grad)]
    packer = PackedGradient(
        make_codec(args.compression, options), lambda: make_codec(args.compression, options), pieces
    )
    wire = torch.zeros(packer.nbytes, dtype=torch.uint8)
    out = torch.zeros_like(flat)
    seconds = _median_s(lambda: (packer.compress_into(flat, wire), packer.decompress_into(wire, out)))
    return flat.numel() * 4 / seconds / 1e9
