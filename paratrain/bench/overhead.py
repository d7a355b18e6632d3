"""What each mode costs per step, against the plain PyTorch loop it replaces.

Two kinds of rows, each a real multi-process run on this machine (Gloo over loopback). *Against PyTorch*:
``single``, ``allreduce``, ``fsdp`` and ``local-sgd`` against a hand-written loop, a DDP loop, an FSDP2 loop and
PyTorch's ``PeriodicModelAverager``, run in the same processes on the same batches and weights, in rounds
that alternate the sides; the overhead is the median over rounds of the ratio. *Against another mode*:
``ps-sync`` and ``ps-async`` against ``allreduce``, ``pipeline`` against ``single``, whole runs alternating at the
same global batch. With fewer cores than processes the absolute numbers measure the scheduler as much as
paratrain; the side-by-side ratios are the result.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain.bench.allreduce import SEED, model_and_optimizer, raw_batches
from paratrain.config import TrainConfig
from paratrain.data.datasets import load_digits
from paratrain.launch.factory import make_strategy
from paratrain.launch.local import launch, run_locally
from paratrain.parallel.sharding import fsdp_units
from paratrain.strategies.fsdp.strategy import fsdp_mesh
from paratrain.testing import flat_parameters
from paratrain.train.trainer import Trainer

#: mode -> (the plain PyTorch loop it is compared with, processes)
AGAINST_PYTORCH = {
    "single": ("a plain loop", 1),
    "allreduce": ("DistributedDataParallel", 2),
    "fsdp": ("fully_shard (FSDP2)", 2),
    "local-sgd": ("PeriodicModelAverager", 2),
}
#: mode -> (the mode it is compared with, its options, the reference's options)
AGAINST_MODES = {
    "ps-sync": ("allreduce", {"workers": 2}, {"workers": 2}),
    "ps-async": ("allreduce", {"workers": 2}, {"workers": 2}),
    "pipeline": ("single", {"stages": 2}, {}),
}
SYNC_EVERY = 2  # local-sgd's H on both sides: it divides an epoch's steps, so no fit ends mid-round


def _plain(mode: str, model: nn.Module, device: torch.device) -> tuple[nn.Module, Callable[[nn.Module], None]]:
    """The plain PyTorch counterpart of ``mode``: the model to step, and what to do after
    each optimizer step."""
    if mode == "allreduce":
        return nn.parallel.DistributedDataParallel(model), _nothing
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        mesh = fsdp_mesh(device)
        for module in fsdp_units(model):  # the same units as paratrain's fsdp
            fully_shard(module, mesh=mesh)
        return fully_shard(model, mesh=mesh), _nothing
    if mode == "local-sgd":
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

        averager = PeriodicModelAverager(period=SYNC_EVERY, warmup_steps=0)
        averager.step = 1  # count steps from 1, as paratrain does: average after step H, 2H, ...
        return model, lambda m: averager.average_parameters(m.parameters())
    return model, _nothing


def _nothing(model: nn.Module) -> None:
    pass


def _timed(run: Callable[[], None]) -> float:
    import time

    if dist.is_initialized():
        dist.barrier()
    start = time.perf_counter()
    run()
    if dist.is_initialized():
        dist.barrier()
    return time.perf_counter() - start


def pair_worker(mode: str, models: list[str], batch_size: int, rounds: int) -> dict | None:
    """One rank: for each model, paratrain's ``mode`` and its plain loop in alternating rounds."""
    torch.set_num_threads(1)
    options = {"sync_every": SYNC_EVERY} if mode == "local-sgd" else {}
    strategy = make_strategy(mode, device="cpu", **options)
    strategy.setup()
    rank, world = strategy.process_rank, strategy.num_replicas
    data = load_digits()
    results = {}
    for name in models:
        model, optimizer = model_and_optimizer(name, data.spec)
        trainer = Trainer(model, "cross_entropy", optimizer, strategy=strategy)
        raw_model, _ = model_and_optimizer(name, data.spec)
        plain, after_step = _plain(mode, raw_model, strategy.device)
        raw_optimizer = torch.optim.SGD(plain.parameters(), lr=optimizer.defaults["lr"], momentum=0.9)
        loss_fn = nn.CrossEntropyLoss()
        raw_epoch = 0

        def run_paratrain() -> None:
            trainer.fit(data.train, epochs=trainer.epoch + 1, batch_size=batch_size, seed=SEED, verbose=0, log_every=0)

        def run_plain() -> None:
            nonlocal raw_epoch
            for inputs, targets in raw_batches(data.train, batch_size, rank, world, raw_epoch):
                raw_optimizer.zero_grad(set_to_none=True)
                loss_fn(plain(inputs), targets).backward()
                raw_optimizer.step()
                after_step(plain)
            raw_epoch += 1

        sides = {"paratrain": run_paratrain, "plain": run_plain}
        for run in sides.values():  # warm-up, untimed
            run()
        seconds: dict[str, list[float]] = {side: [] for side in sides}
        for index in range(rounds):
            for side in list(sides) if index % 2 == 0 else list(reversed(sides)):
                seconds[side].append(_timed(sides[side]))
        steps = len(data.train) // (batch_size * world)
        paired = [p / r for p, r in zip(seconds["paratrain"], seconds["plain"])]
        # The same steps on the same batches from the same weights: the same model at the end.
        difference = (flat_parameters(trainer.module) - flat_parameters(plain)).abs().max().item()
        results[name] = {
            "max_weight_difference_at_end": difference,
            "mode_ms_per_step": statistics.median(seconds["paratrain"]) / steps * 1e3,
            "reference_ms_per_step": statistics.median(seconds["plain"]) / steps * 1e3,
            "overhead": statistics.median(paired),
            "steps_per_round": steps,
        }
    strategy.teardown()
    return results if rank == 0 else None


def _step_ms(options: dict[str, Any], model: str, epochs: int) -> float:
    """A whole run's step time, in ms: its global batch over its training throughput
    (evaluation and start-up excluded)."""
    config = TrainConfig(model=model, epochs=epochs, progress=False, log_every=0, device="cpu", **options)
    metrics = run_locally(config)
    return config.global_batch / metrics["examples_per_second"] * 1e3


def measure(models: list[str], rounds: int, repeats: int, epochs: int, batch_size: int = 32) -> list[dict[str, Any]]:
    rows = []
    for mode, (reference, processes) in AGAINST_PYTORCH.items():
        results = launch(pair_worker, mode, models, batch_size, rounds, num_processes=processes)[0]
        for model, result in results.items():
            rows.append({"mode": mode, "against": reference, "model": model, "processes": processes, **result})
    for mode, (reference, own, theirs) in AGAINST_MODES.items():
        for model in models:
            sides = {"mode": {"strategy": mode, **own}, "reference": {"strategy": reference, **theirs}}
            times: dict[str, list[float]] = {side: [] for side in sides}
            for index in range(repeats):
                for side in list(sides) if index % 2 == 0 else list(reversed(sides)):
                    times[side].append(_step_ms(sides[side], model, epochs))
            paired = [m / r for m, r in zip(times["mode"], times["reference"])]
            rows.append(
                {
                    "mode": mode,
                    "against": f"paratrain {reference}",
                    "model": model,
                    "mode_ms_per_step": statistics.median(times["mode"]),
                    "reference_ms_per_step": statistics.median(times["reference"]),
                    "overhead": statistics.median(paired),
                }
            )
    return rows


def markdown(rows: list[dict[str, Any]], settings: dict[str, Any]) -> str:
    lines = [
        f"Per-step cost of each mode against what it replaces: digits, batch {settings['batch_size']} per replica, "
        f"SGD momentum 0.9, Gloo on this machine's CPU. Against PyTorch: median of {settings['rounds']} alternating "
        f"one-epoch rounds in the same processes; against another mode: median of {settings['repeats']} whole "
        f"runs each of {settings['epochs']} epochs. Overhead: the mode's time per step over the "
        "reference's (1.00: none).",
        "",
        "| mode | against | model | mode ms/step | reference ms/step | overhead |",
        "| --- | --- | --- | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['against']} | {r['model']} | {r['mode_ms_per_step']:.3f} "
            f"| {r['reference_ms_per_step']:.3f} | {r['overhead']:.2f}x |"
        )
    return "\n".join(lines) + "\n"
