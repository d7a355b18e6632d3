"""Pipeline bubble and activation memory: GPipe vs 1F1B, measured against the theory.

What it measures, for ``stages`` S processes (Gloo, CPU, one thread each) running
paratrain's ``pipeline`` strategy on a stack of ``layers`` Linear+ReLU blocks of width
``width``, batch ``batch``, for each schedule and each micro-batch count M:

- step time: wall time of ``strategy.train_step`` (after a barrier), median over
  ``steps`` steps after two untimed ones;
- busy time: the CPU time of the process's main thread during that step
  (``time.thread_time``): the stage's forward and backward passes, which run in that
  thread on the CPU, while time blocked waiting for a neighbour's activations or
  gradients is not counted (Gloo waits block, they do not spin); median over steps;
- bubble (idle share of stage time) = 1 - busy / step time, per stage, against the
  theoretical (S-1)/(M+S-1) of a pipeline of S equal stages (GPipe, Huang et al. 2019).
  Time runnable but not running (other processes on a shared machine) counts as idle
  too, so the measured bubble is an upper bound on a busy machine;
- activation memory per stage: the peak bytes of tensors saved for backward (weights
  excluded) alive at once during one step, counted with autograd's saved-tensor hooks,
  and that peak in micro-batches' worth. GPipe keeps all M micro-batches' activations
  until the backward passes start; 1F1B keeps at most S - stage of them. (PyTorch's
  1F1B needs M >= S; smaller M runs GPipe only.)
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
        self.counter, self.tensor, self.nbytes = counter, tensor, tensor.numel() * tensor.element_size()
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


def measure(stages: int, counts: list[int], steps: int, layers: int, width: int, batch: int) -> list[dict]:
    """One stage's process: every schedule and micro-batch count; this stage's rows."""
    from paratrain.comm.transport import destroy_process_group, ensure_process_group
    from paratrain.strategies.pipeline import PipelineStrategy

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
            step_times, busy_times, peak = [], [], 0
            for i in range(steps + 2):  # two untimed steps: shape exchange, warm-up
                dist.barrier()
                counter = SavedActivations(module)
                start, cpu = time.perf_counter(), time.thread_time()
                with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
                    strategy.train_step(module, loss_fn, optimizer, x, y)
                if i >= 2:
                    busy_times.append(time.thread_time() - cpu)
                    step_times.append(time.perf_counter() - start)
                    peak = max(peak, counter.peak)
            per_micro = _microbatch_saved_bytes(module, strategy.stage, x[: batch // m], width)
            step, busy = statistics.median(step_times), statistics.median(busy_times)
            rows.append({
                "schedule": schedule, "microbatches": m, "stage": strategy.stage,
                "step_ms": step * 1e3, "busy_ms": busy * 1e3,
                "bubble": max(0.0, 1 - busy / step), "theory": (stages - 1) / (m + stages - 1),
                "activation_bytes": peak, "microbatch_bytes": per_micro,
            })
            dist.barrier()
            strategy.teardown()
    destroy_process_group()
    return rows


def table(rows: list[dict], meta: dict) -> str:
    lines = [
        f"paratrain `pipeline`: {meta['stages']} stages on {meta['stages']} Gloo processes (CPU, 1 thread each), "
        f"{meta['layers']} Linear({meta['width']}) blocks, batch {meta['batch_size']}, median of {meta['steps']} steps "
        f"(torch {meta['torch']}, {meta['cpus']} CPU cores, shared machine: load average {meta['load_average_1min']} "
        "at the end of the run).",
        "",
        "| schedule | M | stage | step ms | busy ms | bubble measured | bubble theory (S-1)/(M+S-1) "
        "| peak activations KiB | in micro-batches |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['schedule']} | {r['microbatches']} | {r['stage']} | {r['step_ms']:.2f} | {r['busy_ms']:.2f} "
            f"| {r['bubble']:.3f} | {r['theory']:.3f} | {r['activation_bytes'] / 1024:.0f} "
            f"| {r['activation_bytes'] / max(r['microbatch_bytes'], 1):.1f} |"
        )
    return "\n".join(lines) + "\n"


def run(stages: int = 2, counts: tuple[int, ...] = (1, 2, 4, 8), steps: int = 10, layers: int = 8, width: int = 512,
        batch: int = 64) -> dict[str, Any]:
    """The whole measurement on ``stages`` local processes: {"meta", "rows"}."""
    from paratrain.launch.torchrun import launch

    results = launch(measure, stages, list(counts), steps, layers, width, batch, num_processes=stages)
    rows = sorted((r for rank in results for r in rank), key=lambda r: (r["schedule"], r["microbatches"], r["stage"]))
    rows.sort(key=lambda r: r["schedule"] != "gpipe")
    meta = {
        "stages": stages, "layers": layers, "width": width, "batch_size": batch,
        "steps": steps, "torch": torch.__version__, "cpus": os.cpu_count(), "platform": platform.platform(),
        "load_average_1min": round(os.getloadavg()[0], 2),
    }
    return {"meta": meta, "rows": rows}

