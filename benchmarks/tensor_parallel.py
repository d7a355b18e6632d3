"""Tensor parallelism on the built-in gpt: what each process holds at T = 1, 2, 4, and the
speed of T = 2 against allreduce, fsdp and a 2-stage pipeline at one global batch.

    .venv/bin/python benchmarks/tensor_parallel.py [--rounds 3] [--epochs 1]

Memory: a gpt of 8 layers, width 256 (6.4M parameters, its output layer tied to its token
embedding) is split over T processes (``TensorParallelStrategy``, through paratrain.launch)
and takes one AdamW step; each process counts the bytes it holds of parameters, gradients
and Adam's two moments (the local parts of the DTensors). Beside it the prediction: the
bytes of the split parameters over T plus those of the replicated ones (norms, embeddings
the plan leaves whole), each parameter 16 bytes (fp32 weight, gradient, two moments). From
the per-layer bytes, the deepest gpt of that width whose state fits 64 MiB per process.

Speed: the gpt of benchmarks/pipeline_gpt.py (4 layers, width 128, 64 tokens) on the
built-in corpus with AdamW (lr 1e-3) on 2 processes over Gloo, a global batch of 32
sequences, one epoch per run: ``allreduce --workers 2 --batch-size 16``, ``fsdp --workers 2
--batch-size 16``, ``tensor --workers 2 --tensor-parallel 2 --batch-size 32`` and ``pipeline
--workers 2 --stages 2 --microbatches 4 --batch-size 32``. Each
side's ``tokens_per_second`` is its metrics file's (training steps only). The sides take
turns, in a rotated order each round; the median of each side is reported.

Beside each side, ``paratrain simulate``'s prediction on the user's path, no number given
by hand: ``--calibrate`` here at each side's batch per process (16 and 32), then
``--calibration`` for the side's strategy and workers (tensor: the mesh of 1 replica of 2,
its link inside the replica the calibration's host link; pipeline: 1 replica of 2 stages,
its sends on the simulator's default link). Writes
benchmarks/results/tensor_parallel.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from pipeline_gpt import SIZES, measure, speed_rows, write_table  # noqa: E402  (the same runs, the same table)

SIDES = {
    "allreduce, 2 workers x 16": ["--strategy", "allreduce", "--workers", "2", "--batch-size", "16"],
    "fsdp, 2 workers x 16": ["--strategy", "fsdp", "--workers", "2", "--batch-size", "16"],
    "tensor, T=2, batch 32": ["--strategy", "tensor", "--workers", "2", "--tensor-parallel", "2", "--batch-size", "32"],
    "pipeline, S=2, M=4, batch 32": [
        "--strategy",
        "pipeline",
        "--workers",
        "2",
        "--stages",
        "2",
        "--microbatches",
        "4",
        "--batch-size",
        "32",
    ],
}
MEMORY_LAYERS = 8
MEMORY_WIDTH = 256
CAP_MIB = 64
#: Each side as ``paratrain simulate`` asks it: the batch per process, and the flags.
PREDICTED = {
    "allreduce, 2 workers x 16": (16, ["--strategy", "allreduce", "--workers", "2"]),
    "fsdp, 2 workers x 16": (16, ["--strategy", "fsdp", "--workers", "2"]),
    "tensor, T=2, batch 32": (32, ["--strategy", "tensor", "--workers", "2", "--tensor-parallel", "2"]),
    "pipeline, S=2, M=4, batch 32": (32, ["--strategy", "pipeline", "--workers", "2", "--stages", "2"]),
}


def predict() -> dict[str, dict[str, float]]:
    """Each side's simulated tokens/s, from a calibration measured here at its batch size
    (the gpt's defaults are SIZES: 4 layers of 128, 64 tokens)."""
    simulate = [sys.executable, "-m", "paratrain", "simulate", "--model", "gpt", "--dataset", "text-lm"]
    found = {}
    with tempfile.TemporaryDirectory(prefix="paratrain-tp-sim-") as folder:
        for batch in sorted({batch for batch, _ in PREDICTED.values()}):
            calibration = f"{folder}/cal-{batch}.json"
            subprocess.run(
                [*simulate, "--batch-size", str(batch), "--calibrate", calibration, "--workers", "2"],
                check=True,
                cwd=ROOT,
                capture_output=True,
            )
        for side, (batch, flags) in PREDICTED.items():
            out = f"{folder}/sim.json"
            subprocess.run(
                [
                    *simulate,
                    "--batch-size",
                    str(batch),
                    "--calibration",
                    f"{folder}/cal-{batch}.json",
                    *flags,
                    "--json-out",
                    out,
                ],
                check=True,
                cwd=ROOT,
                capture_output=True,
            )
            row = json.loads(Path(out).read_text())["results"][0]
            found[side] = {"tokens_per_second": row["examples_per_second"] * SIZES["seq_len"], "batch": batch}
        found["calibrations"] = {
            batch: json.loads(Path(f"{folder}/cal-{batch}.json").read_text())["costs"]
            for batch in sorted({batch for batch, _ in PREDICTED.values()})
        }
    return found


def held(tensor: int) -> dict[str, float]:
    """One AdamW step of the memory gpt split ``tensor`` ways: the state bytes this process
    holds, and the prediction from the whole model's split and replicated parameters."""
    import torch

    import paratrain
    from paratrain.data.spec import DataSpec
    from paratrain.models.gpt import build_gpt
    from paratrain.models.gpt_config import GPTConfig

    strategy = paratrain.TensorParallelStrategy(tensor, device="cpu")
    strategy.setup()
    torch.manual_seed(0)
    spec = DataSpec(input_kind="tokens", input_shape=(32,), num_classes=256, vocab_size=256, per_position=True)
    sizes = GPTConfig(gpt_layers=MEMORY_LAYERS, gpt_width=MEMORY_WIDTH, gpt_heads=8, gpt_dropout=0.0)
    model = build_gpt(spec, sizes)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = strategy.prepare(model, optimizer)
    ids = torch.randint(0, 256, (2, 32))
    loss = torch.nn.functional.cross_entropy(model(ids).reshape(-1, 256), ids.reshape(-1))
    loss.backward()
    optimizer.step()
    parts = [p for p in model.parameters()]
    local = sum(p.to_local().numel() for p in parts)
    split = sum(p.numel() for p in parts if not p.placements[0].is_replicate())
    whole = sum(p.numel() for p in parts if p.placements[0].is_replicate())
    state = sum(
        value.to_local().numel() if hasattr(value, "to_local") else value.numel()
        for per_param in optimizer.state.values()
        for value in per_param.values()
        if torch.is_tensor(value) and value.dim() > 0
    )
    measured = 4 * (local + local + state)  # fp32 weights, gradients, Adam's moments
    predicted = 16 * (split / tensor + whole)
    strategy.teardown()
    return {"measured_bytes": measured, "predicted_bytes": predicted, "split": split, "whole": whole}


def memory() -> list[dict[str, float]]:
    import paratrain

    rows = []
    for tensor in (1, 2, 4):
        result = paratrain.launch(held, tensor, num_processes=tensor)[0]
        per_layer = 16 * result["split"] / MEMORY_LAYERS / tensor  # every split parameter is in a block
        fixed = 16 * result["whole"]
        deepest = int((CAP_MIB * 2**20 - fixed) // per_layer)
        rows.append({"tensor": tensor, **result, "deepest_gpt_within_cap": deepest})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results/tensor_parallel.json")
    args = parser.parse_args()
    import torch

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    held_rows = memory()
    predicted = predict()
    rounds, medians = measure(SIDES, args.rounds, args.epochs)
    result = {
        "predicted": predicted,
        "torch": torch.__version__,
        "cores": os.cpu_count(),
        "speed": {"sizes": SIZES, "rounds": rounds, "medians": medians},
        "memory": {"layers": MEMORY_LAYERS, "width": MEMORY_WIDTH, "cap_mib": CAP_MIB, "rows": held_rows},
    }
    out = ROOT / args.out
    out.write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"# tensor parallelism on the gpt ({os.cpu_count()} cores, Gloo, torch {torch.__version__})",
        "",
        f"## State per process: gpt {MEMORY_LAYERS}x{MEMORY_WIDTH}, AdamW, after one step",
        "",
        f"| T | held (MB) | predicted: split/T + whole (MB) | held / predicted | deepest gpt within {CAP_MIB} MiB |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in held_rows:
        lines.append(
            f"| {row['tensor']} | {row['measured_bytes'] / 1e6:.1f} | {row['predicted_bytes'] / 1e6:.1f} | "
            f"{row['measured_bytes'] / row['predicted_bytes']:.3f} | {row['deepest_gpt_within_cap']} layers |"
        )
    speed = f"## Speed: gpt 4x128, 64 tokens, global batch 32, AdamW, 2 processes, {args.rounds} rounds (medians)"
    write_table(out, [*lines, "", speed, "", *speed_rows(medians), "", *prediction_rows(medians, predicted)])


def prediction_rows(medians: dict[str, dict], predicted: dict[str, dict]) -> list[str]:
    """Each side's measured tokens/s beside the simulator's, calibrated here."""
    rows = [
        "## paratrain simulate beside each side (calibrated here: --calibrate, then --calibration)",
        "",
        "| side | measured tokens/s | simulated tokens/s | simulated / measured |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, m in medians.items():
        sim = predicted[name]["tokens_per_second"]
        rows.append(f"| {name} | {m['tokens_per_second']:.0f} | {sim:.0f} | {sim / m['tokens_per_second']:.2f} |")
    return rows


if __name__ == "__main__":
    main()
