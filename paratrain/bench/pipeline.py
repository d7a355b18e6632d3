"""Pipeline bubble and activation memory: GPipe vs 1F1B, measured against the theory.

For ``stages`` Gloo processes running the ``pipeline`` strategy on a stack of Linear+ReLU blocks, for each
schedule and micro-batch count M, it reports the step time (the best of ``repeats`` windows of ``steps``
steps), where a stage's step goes (forward, backward, wait, other; timed around the schedule's own calls),
the bubble (wait / step time) against the theoretical (S-1)/(M+S-1) (GPipe, Huang et al. 2019), the CPU
share of compute (below 1: the stage had no core), and the peak activation memory per stage (counted with
autograd's saved-tensor hooks). PyTorch's 1F1B needs M >= S; smaller M runs GPipe only. The defaults make
a micro-batch's compute large next to its fixed costs, the regime the theory describes.

``benchmarks/pipeline.py`` and ``paratrain bench --suites pipeline`` run it.
"""

from __future__ import annotations

import os
import platform
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import schedules

from paratrain.comm.transport import ensure_process_group
from paratrain.launch.local import launch
from paratrain.session.teardown import destroy_groups
from paratrain.strategies.pipeline.strategy import PipelineStrategy


def build(layers: int, width: int) -> nn.Sequential:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*blocks[:-1], nn.Linear(width, 10))


class SavedActivations:
    """Bytes of tensors autograd saves for backward, alive now and at peak (weights excluded)."""

    def __init__(self, module: nn.Module):
        self.weights = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self.live = self.peak = 0

    def pack(self, tensor: torch.Tensor):
        if tensor.untyped_storage().data_ptr() in self.weights:
            return tensor
        return _Held(self, tensor)

    @staticmethod
    def unpack(held):
        return held.tensor if isinstance(held, _Held) else held


class _Held:
    def __init__(self, counter: SavedActivations, tensor: torch.Tensor):
        self.counter = counter
        self.tensor = tensor
        self.nbytes = tensor.numel() * tensor.element_size()
        counter.live += self.nbytes
        counter.peak = max(counter.peak, counter.live)

    def __del__(self):
        self.counter.live -= self.nbytes


def _microbatch_saved_bytes(module: nn.Module, stage: int, micro: torch.Tensor, width: int) -> int:
    """Bytes saved for backward by one micro-batch's forward on this stage, alone."""
    x = micro if stage == 0 else torch.randn(len(micro), width, requires_grad=True)
    counter = SavedActivations(module)
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        y = module(x)
    saved = counter.peak
    del y
    return saved


class StageClock:
    """Wall seconds one stage spends in the schedule's compute calls and in its waits on
    neighbours, and the CPU seconds of its compute, by wrapping those calls."""

    def __init__(self, schedule):
        self.reset()
        stage = schedule._stage  # PyTorch's PipelineStage of this rank
        stage.forward_one_chunk = self._timed(stage.forward_one_chunk, "forward")
        stage.backward_one_chunk = self._timed(stage.backward_one_chunk, "backward")
        schedule._maybe_compute_loss = self._timed(schedule._maybe_compute_loss, "forward")  # last stage
        # The schedules look this module-level function up at each call.
        self._wait = schedules._wait_batch_p2p
        schedules._wait_batch_p2p = self._timed(self._wait, "wait")

    def reset(self) -> None:
        self.seconds = {"forward": 0.0, "backward": 0.0, "wait": 0.0}
        self.cpu = 0.0

    def _timed(self, fn, field: str):
        def timed(*args, **kwargs):
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[field] += time.perf_counter() - start
                if field != "wait":
                    self.cpu += time.thread_time() - cpu

        return timed

    def detach(self) -> None:
        schedules._wait_batch_p2p = self._wait


def measure(
    stages: int, counts: list[int], steps: int, repeats: int, layers: int, width: int, batch: int
) -> list[dict]:
    ensure_process_group("gloo", 300.0)  # owned here, so that each strategy below reuses it
    torch.set_num_threads(1)
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 10, (batch,), generator=torch.Generator().manual_seed(2))
    loss_fn = nn.CrossEntropyLoss()
    rows = []
    for schedule in ("gpipe", "1f1b"):
        for m in counts:
            if schedule == "1f1b" and m < stages:
                continue  # PyTorch's 1F1B needs at least S micro-batches
            strategy = PipelineStrategy(num_stages=stages, num_microbatches=m, schedule=schedule, device="cpu")
            model = build(layers, width)
            module, optimizer = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-4))
            for _ in range(2):  # untimed: the first step exchanges shapes and makes the schedule
                strategy.train_step(module, loss_fn, optimizer, x, y)
            clock = StageClock(strategy._schedule)
            peak = 0
            windows = []
            for _ in range(repeats):
                # Steps back to back, as in training: a stage that finishes early waits for the
                # next step's inputs (or, after the last step, in the barrier: counted as wait).
                clock.reset()
                dist.barrier()
                start = time.perf_counter()
                for _ in range(steps):
                    counter = SavedActivations(module)
                    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
                        strategy.train_step(module, loss_fn, optimizer, x, y)
                    peak = max(peak, counter.peak)
                done = time.perf_counter()
                dist.barrier()
                end = time.perf_counter()
                windows.append({**clock.seconds, "step": end - start, "cpu": clock.cpu})
                windows[-1]["wait"] += end - done
            clock.detach()
            # The window in which the stages were least short of a core: the highest lowest
            # CPU share of compute across stages (the same window on every stage).
            shares = torch.tensor([w["cpu"] / (w["forward"] + w["backward"]) for w in windows])
            dist.all_reduce(shares, op=dist.ReduceOp.MIN)
            sums = windows[int(shares.argmax())]
            per_micro = _microbatch_saved_bytes(module, strategy.stage, x[: batch // m], width)
            ms = {key: 1e3 * value / steps for key, value in sums.items()}
            compute = ms["forward"] + ms["backward"]
            rows.append(
                {
                    "schedule": schedule,
                    "microbatches": m,
                    "stage": strategy.stage,
                    "step_ms": ms["step"],
                    "forward_ms": ms["forward"],
                    "backward_ms": ms["backward"],
                    "wait_ms": ms["wait"],
                    "other_ms": ms["step"] - compute - ms["wait"],
                    "bubble": ms["wait"] / ms["step"],
                    "theory": (stages - 1) / (m + stages - 1),
                    "compute_cpu_share": ms["cpu"] / compute,
                    "activation_bytes": peak,
                    "microbatch_bytes": per_micro,
                }
            )
            dist.barrier()
            strategy.teardown()
    destroy_groups()
    return rows


def table(rows: list[dict], meta: dict) -> str:
    lines = [
        f"paratrain `pipeline`: {meta['stages']} stages on {meta['stages']} Gloo processes (CPU, 1 thread each), "
        f"{meta['layers']} Linear({meta['width']}) blocks, batch {meta['batch_size']}; per step, the mean over "
        f"{meta['steps']} steps run back to back (of {meta['repeats']} such windows, the one of highest lowest "
        "compute CPU share) "
        f"(torch {meta['torch']}, {meta['cpus']} CPU cores, shared machine: load average "
        f"{meta['load_average_1min_start']} at the start of the run, {meta['load_average_1min']} at the end). "
        "Bubble measured = wait / step; other = step - forward - backward - wait.",
        "",
        "| schedule | M | stage | step ms | forward ms | backward ms | wait ms | other ms | bubble measured "
        "| bubble theory (S-1)/(M+S-1) | compute CPU share | peak activations KiB | in micro-batches |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['schedule']} | {r['microbatches']} | {r['stage']} | {r['step_ms']:.1f} | {r['forward_ms']:.1f} "
            f"| {r['backward_ms']:.1f} | {r['wait_ms']:.1f} | {r['other_ms']:.1f} | {r['bubble']:.3f} "
            f"| {r['theory']:.3f} | {r['compute_cpu_share']:.2f} | {r['activation_bytes'] / 1024:.0f} "
            f"| {r['activation_bytes'] / max(r['microbatch_bytes'], 1):.1f} |"
        )
    return "\n".join(lines) + "\n"


def run(
    stages: int = 2,
    counts: tuple[int, ...] = (1, 2, 4, 8),
    steps: int = 20,
    repeats: int = 5,
    layers: int = 8,
    width: int = 1024,
    batch: int = 256,
) -> dict[str, Any]:
    """The whole measurement on ``stages`` local processes: {"meta", "rows"}."""
    load_at_start = round(os.getloadavg()[0], 2)
    results = launch(measure, stages, list(counts), steps, repeats, layers, width, batch, num_processes=stages)
    rows = sorted((r for rank in results for r in rank), key=lambda r: (r["schedule"], r["microbatches"], r["stage"]))
    rows.sort(key=lambda r: r["schedule"] != "gpipe")
    meta = {
        "stages": stages,
        "layers": layers,
        "width": width,
        "batch_size": batch,
        "steps": steps,
        "repeats": repeats,
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "load_average_1min_start": load_at_start,
        "load_average_1min": round(os.getloadavg()[0], 2),
    }
    return {"meta": meta, "rows": rows}
