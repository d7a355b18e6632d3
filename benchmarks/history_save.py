"""What a checkpoint's history costs a run that saves often: the time to serialise the
trainer's part of a checkpoint with a history of N epochs, as dicts (the form checkpoints
held before) and as the JSON text ``History.saved`` gives (each epoch encoded once), and
the mlp's steps/s in the first and last tenth of a run of many short epochs that saves
every 50 steps.

    python benchmarks/history_save.py --epochs 10,1000,4000 --run-epochs 4000

The serialising is what each process of a run pays at each save beside its model and
optimizer: ``torch.save`` into memory of ``{"history": ...}``, the median of ``--repeats``
saves after the history has reached N epochs (the JSON form's saves after the first reuse
its encoded epochs, as a run's do). The run is ``paratrain train --model mlp --strategy
single --checkpoint-every 50``: 44 steps an epoch on digits, each epoch evaluated, so the
history grows by an entry every 44 steps.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster_common import RESULTS, record  # noqa: E402
from processor import cpu_name  # noqa: E402

from paratrain.train.history import History  # noqa: E402

ENTRY = {
    "epoch": 1,
    "train_loss": 0.1234567,
    "train_seconds": 0.066,
    "examples_seen": 1408,
    "test_loss": 0.0987654,
    "test_accuracy": 0.9722,
    "wall_seconds": 12.5,
    "cpu_seconds": 11.9,
}


def save_ms(epochs: int, form: str, repeats: int) -> float:
    """Median milliseconds of one save of the trainer state's history of ``epochs`` epochs."""
    history = History([dict(ENTRY, epoch=i + 1, train_loss=1.0 / (i + 1)) for i in range(epochs)])
    history.saved()  # a run has saved before: the epochs until now are encoded
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        state = {"history": history.saved() if form == "json" else [dict(e) for e in history.epochs]}
        torch.save(state, io.BytesIO())
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def run_pace(epochs: int, checkpoints: bool) -> tuple[float, float]:
    """The mlp's steps/s (median over epochs) in the first and last tenth of a ``single`` run."""
    with tempfile.TemporaryDirectory(prefix="paratrain-history-") as folder:
        out = Path(folder) / "m.json"
        saves = ["--checkpoint-dir", f"{folder}/ckpt", "--checkpoint-every", "50"] if checkpoints else []
        command = [
            sys.executable,
            "-m",
            "paratrain",
            "train",
            "--model",
            "mlp",
            "--epochs",
            str(epochs),
            "--metrics-out",
            str(out),
            *saves,
        ]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        metrics = json.loads(out.read_text())
    steps = metrics["global_steps"] / len(metrics["history"])
    rates = [steps / entry["train_seconds"] for entry in metrics["history"]]
    tenth = max(len(rates) // 10, 1)
    return statistics.median(rates[:tenth]), statistics.median(rates[-tenth:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", default="10,1000,4000", help="history lengths to time saves at")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--run-epochs", type=int, default=1500, help="the mlp run's epochs (0: no run)")
    parser.add_argument("--out", default=str(RESULTS / "history_save"))
    args = parser.parse_args()
    lengths = [int(n) for n in args.epochs.split(",")]
    saves = [
        {"epochs": n, "dicts_ms": save_ms(n, "dicts", args.repeats), "json_ms": save_ms(n, "json", args.repeats)}
        for n in lengths
    ]
    lines = [
        "# A checkpoint's history: its cost at each save",
        "",
        "| epochs in the history | as dicts (ms a save) | as JSON, each epoch encoded once (ms a save) |",
        "| ---: | ---: | ---: |",
    ]
    lines += [f"| {s['epochs']} | {s['dicts_ms']:.2f} | {s['json_ms']:.2f} |" for s in saves]
    runs = []
    if args.run_epochs:
        for checkpoints in (False, True):
            first, last = run_pace(args.run_epochs, checkpoints)
            runs.append({"checkpoints": checkpoints, "first_tenth_steps_per_s": first, "last_tenth_steps_per_s": last})
        lines += [
            "",
            f"# The mlp under `single`, {args.run_epochs} epochs of 44 steps",
            "",
            "| checkpoints | steps/s, first tenth | steps/s, last tenth | last / first |",
            "| --- | ---: | ---: | ---: |",
        ]
        for run in runs:
            first, last = run["first_tenth_steps_per_s"], run["last_tenth_steps_per_s"]
            saving = "every 50 steps" if run["checkpoints"] else "none"
            lines.append(f"| {saving} | {first:.0f} | {last:.0f} | {last / first:.0%} |")
    lines += [
        "",
        f"Medians of {args.repeats} saves (`torch.save` into memory); the runs' steps/s are medians "
        f"over their epochs. Processor: {cpu_name()}.",
    ]
    setup = {"epochs": lengths, "repeats": args.repeats, "run_epochs": args.run_epochs, "processor": cpu_name()}
    record(Path(args.out), {"setup": setup, "saves": saves, "runs": runs}, lines)


if __name__ == "__main__":
    main()
