"""The RNN wavefront's bubble: how much of a step each stage waits, against (S-1)/(C+S-1).

    python benchmarks/wavefront.py [--quick]

A stacked LSTM (2 layers of 256 hidden units over 64-dimensional inputs, sequences of 128
steps, batch 32) split one layer per process (2 processes, one core and one thread each),
each sequence in C chunks (C = 1, 2, 4, 8, 16, 32). Per chunk count: 20 timed steps after 2
of warm-up, each a forward and a backward wave with a gradient of ones on the last stage's
outputs. Measured per stage: the step's wall time and the time its layer computed
(``WavefrontStage.busy_seconds``); the bubble is 1 - busy / wall (mean over stages and
steps), beside the formula's. One process computing both layers unsplit gives the time a
step of the whole model takes on one core. Writes benchmarks/results/wavefront.json and .md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.recorded_table import record  # noqa: E402
from paratrain.parallel.wavefront import WavefrontStage, bubble, split_lstm  # noqa: E402
from paratrain.testing import run_distributed  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "wavefront"
STAGES = 2
FEATURES = 64
HIDDEN = 256
BATCH = 32


def _lstm() -> nn.LSTM:
    torch.manual_seed(0)
    return nn.LSTM(FEATURES, HIDDEN, num_layers=STAGES, batch_first=True)


def _stage(length: int, chunks: int, steps: int) -> dict:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        stage = WavefrontStage(split_lstm(_lstm())[rank], rank, list(range(STAGES)), chunks)
        x = torch.randn(BATCH, length, FEATURES)
        walls, busy = [], []
        for step in range(steps + 2):
            dist.barrier()
            began, before = time.perf_counter(), stage.busy_seconds
            out = stage.forward(x if rank == 0 else None, BATCH, length)
            stage.backward(torch.ones_like(out) if stage.is_last else None)
            if step >= 2:
                walls.append(time.perf_counter() - began)
                busy.append(stage.busy_seconds - before)
        return {"wall": walls, "busy": busy}
    finally:
        dist.destroy_process_group()


def _unsplit(length: int, steps: int) -> float:
    torch.set_num_threads(1)
    lstm, x = _lstm(), torch.randn(BATCH, length, FEATURES)
    times = []
    for step in range(steps + 2):
        began = time.perf_counter()
        out, _ = lstm(x)
        out.backward(torch.ones_like(out))
        if step >= 2:
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter sequences, fewer steps (a trial, under /tmp)")
    args = parser.parse_args()
    length, steps = (32, 3) if args.quick else (128, 20)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    one = _unsplit(length, steps)
    rows = []
    for chunks in (1, 2, 4, 8, 16, 32):
        stages = run_distributed(_stage, length, chunks, steps, world_size=STAGES)
        walls = [statistics.median(s["wall"]) for s in stages]
        measured = statistics.mean(1 - sum(s["busy"]) / sum(s["wall"]) for s in stages)
        rows.append({"chunks": chunks, "step_s": max(walls), "bubble": measured, "formula": bubble(STAGES, chunks)})
    lines = [
        f"| chunks C | step (2 stages) | bubble measured | (S-1)/(C+S-1) | speed-up over one process ({one * 1e3:.0f} ms) |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['chunks']} | {r['step_s'] * 1e3:.0f} ms | {r['bubble']:.2f} | {r['formula']:.2f} | {one / r['step_s']:.2f}x |"
        )
    out = Path("/tmp/wavefront") if args.quick else RESULTS
    document = {
        "stages": STAGES,
        "length": length,
        "batch": BATCH,
        "hidden": HIDDEN,
        "one_process_s": one,
        "rows": rows,
    }
    record(out, document, lines)


if __name__ == "__main__":
    main()
