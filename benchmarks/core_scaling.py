"""Whether this machine's cores train independently: one training process of one thread
alone, then one such process on each core at once (each pinned to its own core), and the
same for a convolution alone (forward, no training step around it).

    python benchmarks/core_scaling.py [--model plain_cnn] [--seconds 4] [--out DIR]

The training step's FLOPs (PyTorch's flop counter) turn its rate into GFLOP/s, beside
the convolution's. A model whose step keeps its speed when every core runs one is bound by each core's own
units; one whose step slows is bound by something the cores share (memory bandwidth, a
shared cache, a host that gives the virtual machine less than its cores). Data parallelism
on one machine cannot beat that: two processes on two cores then train little faster than
one. ``--model``: ``plain_cnn`` (benchmarks/tensorflow_mirrored.py's plain conv net, batch
128) or a built-in model (``cifar_cnn``, ``mlp``, ...). The training runs use paratrain's
``single`` on synthetic batches (SGD momentum 0.9), the median examples/s of 3 epochs after
a first one. Writes DIR/core_scaling.json and .md (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from processor import cpu_name  # noqa: E402

SHAPES = {"plain_cnn": (3, 24, 24), "cifar_cnn": (3, 24, 24), "mlp": (1, 28, 28)}


def benchmark_model(name: str) -> tuple[object, tuple[int, ...]]:
    """``name``'s model (the plain conv net, or a built-in one for 10 classes) and its input shape."""
    shape = SHAPES.get(name, (3, 24, 24))
    if name == "plain_cnn":
        from tensorflow_mirrored import plain_cnn

        return plain_cnn(), shape
    from paratrain.data.datasets import DataSpec
    from paratrain.models import build_model

    return build_model(name, DataSpec(shape, 10)), shape


def train_rate(model_name: str, batch: int, steps: int) -> float:
    """In a process of one thread: the median examples/s of paratrain single's epochs 2-4."""
    import torch

    import paratrain

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, shape = benchmark_model(model_name)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    trainer = paratrain.Trainer(model, "cross_entropy", optimizer, strategy=paratrain.SingleDeviceStrategy("cpu"))
    x, y = torch.randn(batch * steps, *shape), torch.randint(0, 10, (batch * steps,))
    history = trainer.fit((x, y), epochs=4, batch_size=batch, verbose=0, log_every=0)
    return statistics.median(e["examples_per_second"] for e in history.epochs[1:])


def conv_rate(seconds: float) -> float:
    """In a process of one thread: GFLOP/s of a 5x5 convolution of 64 to 64 channels on
    128 images of 12x12 (the plain conv net's second one), forward, channels-last."""
    import torch

    torch.set_num_threads(1)
    conv = torch.nn.Conv2d(64, 64, 5, padding=2).to(memory_format=torch.channels_last)
    x = torch.randn(128, 64, 12, 12).to(memory_format=torch.channels_last)
    with torch.no_grad():
        for _ in range(3):
            conv(x)
        start, calls = time.perf_counter(), 0
        while time.perf_counter() - start < seconds:
            conv(x)
            calls += 1
        elapsed = time.perf_counter() - start
    return calls * 128 * 12 * 12 * 64 * 64 * 25 * 2 / elapsed / 1e9


def step_flops(model_name: str, batch: int = 128) -> float:
    """FLOPs of one training example (forward and backward) by PyTorch's flop counter."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    model, shape = benchmark_model(model_name)
    with FlopCounterMode(display=False) as counter:
        torch.nn.functional.cross_entropy(model(torch.randn(batch, *shape)), torch.randint(0, 10, (batch,))).backward()
    return counter.get_total_flops() / batch


def _child(kind: str, model: str, seconds: float) -> float:
    return conv_rate(seconds) if kind == "conv" else train_rate(model, 128, 30)


def at_once(kind: str, model: str, seconds: float, cores: list[int]) -> list[float]:
    """One process a core, started together: each one's rate."""
    # One compute thread: the Trainer takes $PARATRAIN_THREADS_PER_WORKER, not its share of the cores
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PARATRAIN_THREADS_PER_WORKER": "1", "PYTHONPATH": str(ROOT)}

    def command(core: int) -> list[str]:
        child = [sys.executable, __file__, "--child", kind, "--model", model, "--seconds", str(seconds)]
        return ["taskset", "-c", str(core), *child]

    processes = [
        subprocess.Popen(command(core), stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT) for core in cores
    ]
    return [float(p.communicate()[0].split()[-1]) for p in processes]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="plain_cnn")
    parser.add_argument("--seconds", type=float, default=4.0, help="the convolution's timed seconds")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--child", choices=("conv", "train"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(_child(args.child, args.model, args.seconds))
        return 0
    cores = sorted(os.sched_getaffinity(0))
    rows = []
    for kind, unit in (("train", "examples/s"), ("conv", "GFLOP/s")):
        alone = at_once(kind, args.model, args.seconds, cores[:1])[0]
        together = at_once(kind, args.model, args.seconds, cores)
        rows.append(
            {
                "what": kind,
                "unit": unit,
                "alone": alone,
                "each_at_once": together,
                "kept": statistics.mean(together) / alone,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    flops = step_flops(args.model)
    document = {
        "processor": cpu_name(),
        "cores": len(cores),
        "model": args.model,
        "train_flops_per_example": flops,
        "rows": rows,
    }
    out = Path(args.out)
    (out / "core_scaling.json").write_text(json.dumps(document, indent=1) + "\n")
    what = {"train": f"training step of {args.model} (batch 128, paratrain single)", "conv": "5x5 convolution 64->64"}
    lines = [
        f"# One process of one thread alone, then one on each of the {len(cores)} cores at once ({cpu_name()})",
        "",
        "| what | unit | alone | each, all cores at once | kept |",
        "| --- | --- | ---: | --- | ---: |",
    ]
    for row in rows:
        each = ", ".join(f"{v:,.0f}" for v in row["each_at_once"])
        lines.append(f"| {what[row['what']]} | {row['unit']} | {row['alone']:,.0f} | {each} | {row['kept']:.0%} |")
    train = rows[0]
    lines += [
        "",
        f"A training example of {args.model} is {flops / 1e6:.1f} MFLOP (PyTorch's flop counter): alone, the step "
        f"computes {train['alone'] * flops / 1e9:.0f} GFLOP/s on its core, against {rows[1]['alone']:.0f} for the "
        "convolution alone.",
    ]
    (out / "core_scaling.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
