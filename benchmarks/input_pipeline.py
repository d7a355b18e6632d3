"""Does the input pipeline keep up with the step? Loader wait and throughput, with and
without the prefetch thread, on CIFAR-10-format records (the recipe's distortions) and
on digits (plain in-memory tensors).

    python benchmarks/input_pipeline.py [--steps 60] [--records 2000]

One process, CPU; the CIFAR data is written in the binary format to a temporary folder
(random pixels: only the cost of reading and distorting matters here). Prints the table and
writes it to ``--out`` (benchmarks/results/input_pipeline.md).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

import paratrain
from paratrain.data.datasets import load_dataset, load_digits
from paratrain.data.sharding import ShardedBatches, TransformedTensors
from paratrain.models import build_model
from paratrain.testing import write_cifar10


def measure(model_name: str, splits, dataset, batch_size: int, steps: int, prefetch: int) -> dict[str, float]:
    torch.manual_seed(0)
    strategy = paratrain.SingleDeviceStrategy(device="cpu")
    model = build_model(model_name, splits.spec)
    model, optimizer = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    loss_fn = torch.nn.CrossEntropyLoss()
    batches = ShardedBatches(dataset, batch_size, prefetch=prefetch)
    done, epoch = 0, 0
    start = time.perf_counter()
    while done < steps:
        batches.set_epoch(epoch)
        for inputs, targets in batches:
            strategy.train_step(model, loss_fn, optimizer, inputs, targets)
            done += 1
            if done == steps:
                break
        epoch += 1
    seconds = time.perf_counter() - start
    return {"examples/s": steps * batch_size / seconds, "wait s": batches.wait_seconds, "wall s": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--records", type=int, default=2000, help="CIFAR records per training file (5 files)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "input_pipeline.md"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        write_cifar10(tmp, per_batch=args.records, num_test=10)
        cifar = load_dataset("cifar10", data_dir=tmp, download=False)
        digits = load_digits()
        x, y = digits.train.tensors
        cases = [
            ("cifar10 + distortions, cifar_cnn, batch 128", "cifar_cnn", cifar, cifar.train, 128),
            ("digits, mlp, batch 32 (plain tensors)", "mlp", digits, digits.train, 32),
            # The same tensors behind an identity transform: the thread is used.
            (
                "digits, mlp, batch 32 (identity transform)",
                "mlp",
                digits,
                TransformedTensors(x, y, lambda inputs, generator: inputs),
                32,
            ),
        ]
        print(f"{'data':48} {'prefetch':>8} {'examples/s':>11} {'wait s':>7} {'wall s':>7}")
        rows = []
        for label, model, splits, dataset, batch in cases:
            for prefetch in (0, 2):
                steps = args.steps if model == "cifar_cnn" else args.steps * 20
                result = measure(model, splits, dataset, batch, steps, prefetch)
                print(
                    f"{label:48} {prefetch:>8} {result['examples/s']:>11.0f} {result['wait s']:>7.2f} "
                    f"{result['wall s']:>7.2f}"
                )
                rows.append(
                    f"| {label} | {prefetch} | {result['examples/s']:.0f} | {result['wait s']:.2f} | {result['wall s']:.2f} |"
                )
    lines = [
        "# Input pipeline: loader wait with and without the prefetch thread",
        "",
        f"`python benchmarks/input_pipeline.py --steps {args.steps} --records {args.records}` "
        f"(one process, one thread per op, CPU; {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}).",
        "",
        "| data | prefetch | examples/s | wait s | wall s |",
        "| --- | ---: | ---: | ---: | ---: |",
        *rows,
    ]
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
