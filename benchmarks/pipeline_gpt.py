"""The built-in gpt pipelined against allreduce at one global batch: tokens/s and test loss.

    .venv/bin/python benchmarks/pipeline_gpt.py [--rounds 3] [--epochs 1]

Every side trains the gpt (4 layers, width 128, 64 tokens; its output layer tied to its
token embedding) on the built-in corpus with AdamW (lr 1e-3) on 2 processes over Gloo, a
global batch of 32 sequences, one epoch per run, from the same initial weights:
``allreduce --workers 2 --batch-size 16``, and ``pipeline --stages 2 --batch-size 32``
with 2 and with 4 micro-batches (each stage holding half the blocks; the tied embedding and
output layer on the first and the last stage, their gradients summed every step). Each
side's ``tokens_per_second`` is its metrics file's (training steps only). The sides take
turns, in a rotated order each round; the median of each side is reported. Writes
benchmarks/results/pipeline_gpt.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SIZES = {"gpt_layers": 4, "gpt_width": 128, "gpt_heads": 4, "seq_len": 64}
GLOBAL_BATCH, LR = 32, 1e-3
SIDES = {
    "allreduce, 2 workers x 16": ["--strategy", "allreduce", "--workers", "2", "--batch-size", "16"],
    "pipeline, 2 stages, M=2": ["--strategy", "pipeline", "--stages", "2", "--microbatches", "2", "--batch-size", "32"],
    "pipeline, 2 stages, M=4": ["--strategy", "pipeline", "--stages", "2", "--microbatches", "4", "--batch-size", "32"],
}


def run(flags: list[str], epochs: int, folder: Path) -> dict[str, float]:
    out = folder / "metrics.json"
    sizes = [f"--{k.replace('_', '-')}={v}" for k, v in SIZES.items()]
    command = [
        sys.executable,
        "-m",
        "paratrain",
        "train",
        *flags,
        "--model",
        "gpt",
        "--dataset",
        "text-lm",
        *sizes,
        "--optimizer",
        "adamw",
        "--lr",
        str(LR),
        "--epochs",
        str(epochs),
        "--log-every",
        "0",
        "--no-progress",
        "--seed",
        "0",
        "--metrics-out",
        str(out),
    ]
    subprocess.run(command, check=True, cwd=ROOT, capture_output=True)
    metrics = json.loads(out.read_text())
    return {key: metrics[key] for key in ("tokens_per_second", "test_loss", "bytes_sent", "global_steps")}


def measure(sides: dict[str, list[str]], rounds: int, epochs: int) -> tuple[list[dict], dict[str, dict]]:
    """Each side once a round, in a rotated order; every round's results and each side's medians."""
    names, results = list(sides), []
    with tempfile.TemporaryDirectory() as folder:
        for index in range(rounds):
            order = names[index % len(names) :] + names[: index % len(names)]
            result = {name: run(sides[name], epochs, Path(folder)) for name in order}
            results.append(result)
            print(json.dumps(result), flush=True)
    medians = {
        name: {key: statistics.median(r[name][key] for r in results) for key in results[0][name]} for name in names
    }
    return results, medians


def speed_rows(medians: dict[str, dict]) -> list[str]:
    """The table, its header and a row per side, each against the first (allreduce)."""
    base = next(iter(medians.values()))["tokens_per_second"]
    rows = ["| side | tokens/s | vs allreduce | test loss | MB sent per step |", "| --- | ---: | ---: | ---: | ---: |"]
    for name, m in medians.items():
        per_step = m["bytes_sent"] / m["global_steps"] / 1e6
        rows.append(
            f"| {name} | {m['tokens_per_second']:.0f} | {m['tokens_per_second'] / base:.2f}x | "
            f"{m['test_loss']:.4f} | {per_step:.2f} |"
        )
    return rows


def write_table(out: Path, lines: list[str]) -> None:
    """The results' table beside their JSON (``out`` with .md), and on the terminal."""
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results/pipeline_gpt.json")
    args = parser.parse_args()
    import torch

    rounds, medians = measure(SIDES, args.rounds, args.epochs)
    document = {
        "rounds": rounds,
        "medians": medians,
        "settings": {
            **vars(args),
            **SIZES,
            "global_batch": GLOBAL_BATCH,
            "lr": LR,
            "torch": torch.__version__,
            "cores": os.cpu_count(),
        },
    }
    out = Path(args.out)
    out.write_text(json.dumps(document, indent=1) + "\n")
    heading = (
        f"# gpt ({SIZES['gpt_layers']}x{SIZES['gpt_width']}, {SIZES['seq_len']} tokens), global batch {GLOBAL_BATCH}, "
        f"AdamW, 2 processes, {args.rounds} rounds (medians)"
    )
    write_table(out, [heading, "", *speed_rows(medians)])


if __name__ == "__main__":
    main()
