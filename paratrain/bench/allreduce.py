"""Step time of paratrain's ``allreduce`` strategy against a plain DistributedDataParallel loop.

One side is ``Trainer.fit`` with ``AllReduceStrategy``, what a library user gets; the other a hand-written
DDP loop reading the same per-replica batches, from the same initial weights, on the built-in ``digits``
data with 2 Gloo processes. After an untimed round each, ``rounds`` rounds alternate the sides (order flipped
each round), each of ``epochs_per_round`` epochs timed between barriers. It reports the median step time,
the ratio paratrain / raw DDP (target <= 1.05), the median of per-round ratios (steadier on a drifting
machine), and the largest weight difference at the end.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from paratrain.data.datasets import load_digits
from paratrain.launch.local import launch
from paratrain.models import build_model
from paratrain.strategies.allreduce.strategy import AllReduceStrategy
from paratrain.train.trainer import Trainer

NUM_WORKERS = 2
LR = 0.05
MOMENTUM = 0.9
SEED = 0


def model_and_optimizer(name: str, spec) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(SEED)  # same initial weights on both sides
    model = build_model(name, spec)
    return model, torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def raw_batches(data, batch_size: int, rank: int, world_size: int, epoch: int):
    """This replica's batches for ``epoch``: the global batch ``s`` is the ``s``-th slice of
    one seeded permutation, and replica ``rank`` reads its ``rank``-th block, incomplete
    global batches dropped (what paratrain's data sharding documents)."""
    inputs, targets = data.tensors
    order = torch.randperm(len(inputs), generator=torch.Generator().manual_seed(SEED + epoch))
    global_batch = batch_size * world_size
    for start in range(0, len(order) - global_batch + 1, global_batch):
        idx = order[start + rank * batch_size : start + (rank + 1) * batch_size]
        yield inputs.index_select(0, idx), targets.index_select(0, idx)


def timed(run) -> float:
    """Seconds ``run()`` takes, between barriers, so every rank starts and ends together."""
    dist.barrier()
    start = time.perf_counter()
    run()
    dist.barrier()
    return time.perf_counter() - start


def worker(model_names: list[str], batch_size: int, rounds: int, epochs_per_round: int) -> dict | None:
    """One rank: for each model, warm up and then alternate the two sides; rank 0's timings."""
    torch.set_num_threads(1)
    strategy = AllReduceStrategy(device="cpu")
    strategy.setup()  # joins the process group; the raw loop reuses it
    rank, world_size = dist.get_rank(), dist.get_world_size()
    data = load_digits()
    results = {}
    for name in model_names:
        model, optimizer = model_and_optimizer(name, data.spec)
        trainer = Trainer(model, "cross_entropy", optimizer, strategy=strategy)
        raw_model, raw_optimizer = model_and_optimizer(name, data.spec)
        ddp = DistributedDataParallel(raw_model)  # defaults
        loss_fn = nn.CrossEntropyLoss()
        raw_epoch = 0

        # Fairness check: both sides read the very same first batch.
        ours = next(iter(strategy.distribute(data.train, batch_size, seed=SEED)))
        mine = next(raw_batches(data.train, batch_size, rank, world_size, 0))
        assert all(torch.equal(a, b) for a, b in zip(ours, mine)), "batches differ"

        def run_paratrain() -> None:
            # fit continues from trainer.epoch, so ask for that many more epochs.
            trainer.fit(
                data.train,
                epochs=trainer.epoch + epochs_per_round,
                batch_size=batch_size,
                seed=SEED,
                verbose=0,
                log_every=0,
            )

        def run_raw() -> None:
            nonlocal raw_epoch
            for epoch in range(raw_epoch, raw_epoch + epochs_per_round):
                for inputs, targets in raw_batches(data.train, batch_size, rank, world_size, epoch):
                    raw_optimizer.zero_grad(set_to_none=True)
                    loss = loss_fn(ddp(inputs), targets)
                    loss.backward()
                    raw_optimizer.step()
            raw_epoch += epochs_per_round

        steps = epochs_per_round * (len(data.train) // (batch_size * world_size))
        sides = {"paratrain": run_paratrain, "raw_ddp": run_raw}
        for run in sides.values():  # warm-up round, untimed
            run()
        ms_per_step: dict[str, list[float]] = {side: [] for side in sides}
        for round_index in range(rounds):
            order = list(sides) if round_index % 2 == 0 else list(reversed(sides))
            for side in order:
                before = trainer.global_step
                ms_per_step[side].append(timed(sides[side]) / steps * 1e3)
                assert side != "paratrain" or trainer.global_step - before == steps
        weight_diff = max(
            (a - b).abs().max().item() for a, b in zip(trainer.module.parameters(), raw_model.parameters())
        )
        paratrain_ms = statistics.median(ms_per_step["paratrain"])
        raw_ms = statistics.median(ms_per_step["raw_ddp"])
        # The two sides of one round ran back to back: their ratio sees the same machine.
        paired = [p / r for p, r in zip(ms_per_step["paratrain"], ms_per_step["raw_ddp"])]
        results[name] = {
            "paratrain_ms_per_step": round(paratrain_ms, 4),
            "raw_ddp_ms_per_step": round(raw_ms, 4),
            "ratio": round(paratrain_ms / raw_ms, 4),
            "paired_ratio_median": round(statistics.median(paired), 4),
            "paired_ratio_quartiles": [round(q, 4) for q in _quartiles(paired)],
            "steps_per_round": steps,
            "rounds": rounds,
            "batch_size_per_replica": batch_size,
            "max_weight_difference_at_end": weight_diff,
            "rounds_ms_per_step": {k: [round(v, 4) for v in vs] for k, vs in ms_per_step.items()},
        }
    strategy.teardown()
    return results if rank == 0 else None


def _quartiles(values: list[float]) -> list[float]:
    return statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3


def measure(models: list[str], batch_size: int = 32, rounds: int = 31, epochs_per_round: int = 1) -> dict[str, Any]:
    """The whole comparison on ``NUM_WORKERS`` local processes: the results document."""
    results = launch(worker, models, batch_size, rounds, epochs_per_round, num_processes=NUM_WORKERS)[0]
    return {
        "benchmark": "allreduce_overhead",
        "workers": NUM_WORKERS,
        "backend": "gloo",
        "batch_size_per_replica": batch_size,
        "rounds": rounds,
        "epochs_per_round": epochs_per_round,
        "torch": torch.__version__,
        "machine": {"nproc": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "models": results,
    }


def markdown(document: dict) -> str:
    lines = [
        f"paratrain `allreduce` (Trainer.fit) vs a plain DDP loop: {NUM_WORKERS} Gloo workers on CPU, "
        f"digits, per-replica batch {document['batch_size_per_replica']}, median of "
        f"{document['rounds']} alternating rounds (torch {document['torch']}, "
        f"{document['machine']['nproc']} CPU cores).",
        "",
        "| model | steps/round | paratrain ms/step | raw DDP ms/step | ratio | per-round ratio: median (quartiles) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r in document["models"].items():
        lines.append(
            f"| {name} | {r['steps_per_round']} | {r['paratrain_ms_per_step']:.3f} | "
            f"{r['raw_ddp_ms_per_step']:.3f} | {r['ratio']:.3f} | {r['paired_ratio_median']:.3f} "
            f"({r['paired_ratio_quartiles'][0]:.3f}-{r['paired_ratio_quartiles'][2]:.3f}) |"
        )
    return "\n".join(lines) + "\n"
