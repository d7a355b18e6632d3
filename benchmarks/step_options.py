"""Step time of the step options on ``cifar_cnn`` (the CIFAR-10 recipe's 24x24 crops), one
process: the host allocator's setting (``--keep-host-memory``, on by default), then
``--channels-last`` (the CLI default for conv nets on the CPU), ``--precision bf16`` and
``--compile`` (``torch.compile``: inductor's CPU backend, its first steps compiling are in
the warm-up).

    python benchmarks/step_options.py [--model cifar_cnn|plain_cnn] [--steps 30] [--repeats 5] [--batch-size 128]

``plain_cnn`` is the plain conv net of benchmarks/tensorflow_mirrored.py, an ``nn.Sequential``
as a user writes it (its ReLUs after the poolings run first: the Trainer's default).

Each case runs in a process of its own (the allocator's setting is the process's) and
trains ``--steps`` steps of SGD with momentum on fixed random batches (only the step's
cost matters here, not the data), after ``--warmup`` steps, ``--repeats`` times; the
median step time is reported, with the spread (min..max) of the repeats. Writes
``benchmarks/results/step_options.json`` and ``.md``. Timings are the machine's: the
device and thread count are recorded with them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from recorded_table import cpu_name

import paratrain
from paratrain.data.datasets import DataSpec
from paratrain.models import build_model

RESULTS = Path(__file__).resolve().parent / "results"
SYSTEM_MALLOC = {"cpu": paratrain.CpuTuning(keep_host_memory=False)}
CONTIGUOUS = {"channels_last": False}  # the Trainer's own rule would take channels-last for a conv net
CASES = {
    "fp32, malloc as it is": {**CONTIGUOUS, **SYSTEM_MALLOC},
    "fp32 (contiguous)": CONTIGUOUS,
    "fp32 + channels-last, malloc as it is": {"channels_last": True, **SYSTEM_MALLOC},
    "fp32 + channels-last": {"channels_last": True},
    "bf16": {"precision": "bf16", **CONTIGUOUS},
    "bf16 + channels-last": {"precision": "bf16", "channels_last": True},
    "fp32 + channels-last + compile": {"channels_last": True, "compile": True},
    "fp32 (contiguous) + compile": {**CONTIGUOUS, "compile": True},
}


def step_times(options: dict, args: argparse.Namespace) -> list[float]:
    """Seconds per step of each repeat."""
    torch.manual_seed(0)
    if args.model == "plain_cnn":
        from tensorflow_mirrored import plain_cnn  # this folder's; TensorFlow is imported only to run its side

        model = plain_cnn()
    else:
        model = build_model("cifar_cnn", DataSpec(input_shape=(3, 24, 24), num_classes=10))
    strategy = paratrain.SingleDeviceStrategy(device=args.device)
    trainer = paratrain.Trainer(
        model, "cross_entropy", torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), strategy=strategy, **options
    )
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(args.batch_size, 3, 24, 24, generator=generator).to(strategy.device)
    targets = torch.randint(0, 10, (args.batch_size,), generator=generator).to(strategy.device)

    def steps(count: int) -> None:
        for _ in range(count):
            trainer.strategy.train_step(trainer.model, trainer.loss_fn, trainer.optimizer, inputs, targets)
        if strategy.device.type == "cuda":
            torch.cuda.synchronize()

    steps(args.warmup)
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        steps(args.steps)
        times.append((time.perf_counter() - start) / args.steps)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("cifar_cnn", "plain_cnn"), default="cifar_cnn")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument(
        "--out", default=None, help="results' path less its suffix (default: results/step_options[_MODEL])"
    )
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)  # one case, its times on stdout
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.case:
        print(json.dumps(step_times(CASES[args.case], args)))
        return
    rows = []
    for name, options in CASES.items():
        times = json.loads(
            subprocess.run(
                [sys.executable, *sys.argv, "--case", name], capture_output=True, text=True, check=True
            ).stdout.splitlines()[-1]
        )
        rows.append(
            {
                "case": name,
                "options": options,
                "median_ms": 1000 * statistics.median(times),
                "min_ms": 1000 * min(times),
                "max_ms": 1000 * max(times),
            }
        )
        print(f"{name:38} {rows[-1]['median_ms']:8.1f} ms/step  ({rows[-1]['min_ms']:.1f}..{rows[-1]['max_ms']:.1f})")
    base = rows[0]["median_ms"]
    for row in rows:
        row["vs_default"] = row["median_ms"] / base
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else cpu_name()
    meta = {
        "model": args.model,
        "torch": torch.__version__,
        "device": device,
        "threads": torch.get_num_threads(),
        "batch_size": args.batch_size,
        "steps": args.steps,
        "repeats": args.repeats,
    }
    out = Path(args.out or RESULTS / ("step_options" + ("" if args.model == "cifar_cnn" else f"_{args.model}")))
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = [
        f"# Step options on {args.model} (24x24, batch {args.batch_size}), {args.device}: {device}",
        "",
        f"torch {meta['torch']}, {meta['threads']} threads; median of {args.repeats} repeats of {args.steps} steps "
        f"(`python benchmarks/step_options.py --model {args.model}`).",
        "",
        "| case | ms/step (median) | min..max | vs the first |",
        "| --- | ---: | ---: | ---: |",
    ]
    for row in rows:
        lines.append(
            f"| {row['case']} | {row['median_ms']:.1f} | {row['min_ms']:.1f}..{row['max_ms']:.1f} "
            f"| {row['vs_default']:.2f}x |"
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
