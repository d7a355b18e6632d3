"""paratrain's allreduce against Hugging Face accelerate on the same language model: tokens/s.

    .venv/bin/pip install accelerate      # not a dependency of paratrain
    .venv/bin/python benchmarks/accelerate_gpt.py [--rounds 3] [--epochs 1]

Both sides train the built-in gpt (2 layers, width 128, 64 tokens) on the built-in corpus
with AdamW (lr 1e-3), 16 examples per process on 2 processes over Gloo, one epoch per run,
from the same initial weights: paratrain as ``paratrain train --strategy allreduce
--workers 2`` (its metrics file's ``tokens_per_second``: training steps only), accelerate
as the loop in ``--side accelerate`` below (an ``Accelerator(cpu=True)`` preparing the
model, optimizer and a ``DataLoader``; timed over the same training steps) on 2 processes
started by ``torchrun``, as ``accelerate launch --multi_gpu`` starts them: on CPUs,
``accelerate launch --cpu --num_processes 2`` runs one process (its multi-CPU mode needs
MPI). The sides alternate, ``--rounds`` runs each; the median of each side and
of the paired ratios is reported. Writes benchmarks/results/accelerate_gpt.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIZES = {"gpt_layers": 2, "gpt_width": 128, "gpt_heads": 4, "seq_len": 64}
BATCH = 16
LR = 1e-3
PROCESSES = 2


def accelerate_side(epochs: int) -> None:
    """Runs in each process of ``accelerate launch``: the plain accelerate loop."""
    import torch
    import torch.nn.functional as F
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from paratrain.config import TrainConfig
    from paratrain.data.datasets import load_dataset
    from paratrain.models import build_model

    accelerator = Accelerator(cpu=True)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // accelerator.num_processes))
    config = TrainConfig(model="gpt", dataset="text-lm", **SIZES)
    splits = load_dataset(config)
    torch.manual_seed(0)
    model = build_model("gpt", splits.spec, options=config.model_options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    loader = DataLoader(splits.train, batch_size=BATCH, shuffle=True, drop_last=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    steps, seconds = 0, 0.0
    for _ in range(epochs):
        accelerator.wait_for_everyone()
        start = time.perf_counter()
        for inputs, targets in loader:
            outputs = model(inputs)
            loss = F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
        accelerator.wait_for_everyone()
        seconds += time.perf_counter() - start
    if accelerator.is_main_process:
        tokens = steps * BATCH * accelerator.num_processes * SIZES["seq_len"]
        print(
            json.dumps({"tokens_per_second": tokens / seconds, "steps": steps, "processes": accelerator.num_processes}),
            flush=True,
        )


def run_paratrain(epochs: int, folder: Path) -> float:
    out = folder / "paratrain.json"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in SIZES.items()]
    command = [
        sys.executable,
        "-m",
        "paratrain",
        "train",
        "--strategy",
        "allreduce",
        "--workers",
        str(PROCESSES),
        "--model",
        "gpt",
        "--dataset",
        "text-lm",
        *flags,
        "--optimizer",
        "adamw",
        "--lr",
        str(LR),
        "--batch-size",
        str(BATCH),
        "--epochs",
        str(epochs),
        "--log-every",
        "0",
        "--no-progress",
        "--metrics-out",
        str(out),
    ]
    subprocess.run(command, check=True, cwd=ROOT, capture_output=True)
    return json.loads(out.read_text())["tokens_per_second"]


def run_accelerate(epochs: int) -> float:
    launcher = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    command = [
        launcher,
        "--nproc-per-node",
        str(PROCESSES),
        str(Path(__file__).resolve()),
        "--side",
        "accelerate",
        "--epochs",
        str(epochs),
    ]
    result = subprocess.run(command, check=True, cwd=ROOT, capture_output=True, text=True)
    document = json.loads([line for line in result.stdout.splitlines() if line.startswith("{")][-1])
    if document["processes"] != PROCESSES:
        raise RuntimeError(f"accelerate ran {document['processes']} processes, not {PROCESSES}")
    return document["tokens_per_second"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", choices=("accelerate",), help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results/accelerate_gpt.json")
    args = parser.parse_args()
    if args.side == "accelerate":
        accelerate_side(args.epochs)
        return
    import accelerate
    import torch

    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for index in range(args.rounds):
            sides = [
                ("paratrain", lambda: run_paratrain(args.epochs, Path(folder))),
                ("accelerate", lambda: run_accelerate(args.epochs)),
            ]
            result = dict((name, fn()) for name, fn in (sides if index % 2 == 0 else sides[::-1]))
            rows.append(result)
            print(json.dumps(result), flush=True)
    ours = statistics.median(r["paratrain"] for r in rows)
    theirs = statistics.median(r["accelerate"] for r in rows)
    ratio = statistics.median(r["paratrain"] / r["accelerate"] for r in rows)
    document = {
        "rounds": rows,
        "paratrain_tokens_per_second": ours,
        "accelerate_tokens_per_second": theirs,
        "paired_ratio_median": ratio,
        "settings": {
            **vars(args),
            **SIZES,
            "batch_per_process": BATCH,
            "processes": PROCESSES,
            "lr": LR,
            "torch": torch.__version__,
            "accelerate": accelerate.__version__,
            "cores": os.cpu_count(),
        },
    }
    out = Path(args.out)
    out.write_text(json.dumps(document, indent=1) + "\n")
    table = [
        f"# gpt ({SIZES['gpt_layers']}x{SIZES['gpt_width']}, {SIZES['seq_len']} tokens), {PROCESSES} processes x "
        f"{BATCH}, AdamW, {args.rounds} alternating rounds",
        "",
        "| side | tokens/s (median) |",
        "| --- | --- |",
        f"| paratrain allreduce | {ours:.0f} |",
        f"| accelerate {accelerate.__version__} | {theirs:.0f} |",
        "",
        f"paratrain / accelerate, median of the paired rounds: {ratio:.2f}x",
    ]
    out.with_suffix(".md").write_text("\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
