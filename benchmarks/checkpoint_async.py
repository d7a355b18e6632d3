"""What checkpoints cost a run's speed, written on the training thread or from a thread of
their own (``--checkpoint-async``): the steps per second of one run without checkpoints,
one that saves every N steps, and one that saves every N steps in the background.

    python benchmarks/checkpoint_async.py [--model cifar_cnn] [--strategy allreduce]
        [--workers 2] [--every 20] [--epochs 4] [--repeats 3]

Each repeat runs the three once, in an order that turns by one each repeat (so that no
setting always runs first on a machine whose speed drifts); a row is the median over the
repeats, with their lowest and highest. Steps per second are the run's steps over its
epochs' training time (the saves made during the epochs included; the end's save and the
evaluations not), and the run's whole time is the command's. cifar_cnn trains on digits at
3x32x32 (``cluster_common.digits32``) with Adam, as in ``ft_recovery.py``, whose restarts save
every 20 steps. Writes benchmarks/results/checkpoint_async.json and .md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster_common import RESULTS, record  # noqa: E402
from recorded_table import cpu_name  # noqa: E402

MODELS = {
    "mlp": ["--model", "mlp"],
    "cifar_cnn": [
        "--model",
        "cifar_cnn",
        "--dataset",
        "benchmarks.cluster_common:digits32",
        "--optimizer",
        "adam",
        "--lr",
        "0.001",
    ],
}
SETTINGS = ("none", "every N steps", "every N steps, async")


def run(args: argparse.Namespace, setting: str, folder: Path) -> dict:
    """One ``paratrain train`` of ``setting``: its steps/s over training time and its seconds."""
    out = folder / "m.json"
    saves = []
    if setting != "none":
        saves = ["--checkpoint-dir", str(folder / "ckpt"), "--checkpoint-every", str(args.every)]
        saves += ["--checkpoint-async"] if setting.endswith("async") else []
    command = [
        sys.executable,
        "-m",
        "paratrain",
        "train",
        *MODELS[args.model],
        "--strategy",
        args.strategy,
        "--workers",
        str(args.workers),
        "--epochs",
        str(args.epochs),
        "--no-progress",
        "--log-every",
        "0",
        "--metrics-out",
        str(out),
        *saves,
    ]
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, cwd=Path(__file__).resolve().parents[1])
    seconds = time.perf_counter() - start
    metrics = json.loads(out.read_text())
    train = sum(entry["train_seconds"] for entry in metrics["history"])
    saved = len(list((folder / "ckpt").glob("ckpt-*"))) if saves else 0
    return {
        "steps_per_second": metrics["global_steps"] / train,
        "seconds": seconds,
        "steps": metrics["global_steps"],
        "checkpoints_kept": saved,
    }


def spread(values: list[float], digits: int) -> str:
    middle = f"{statistics.median(values):.{digits}f}"
    return middle if len(values) < 2 else f"{middle} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="cifar_cnn", choices=tuple(MODELS))
    parser.add_argument("--strategy", default="allreduce")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--every", type=int, default=20, help="steps between checkpoints")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS / "checkpoint_async"))
    args = parser.parse_args()
    names = list(SETTINGS)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for repeat in range(args.repeats):
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
            with tempfile.TemporaryDirectory(prefix="paratrain-ckpt-async-") as folder:
                runs[name].append(run(args, name, Path(folder)))
            print(f"repeat {repeat + 1}, {name}: {runs[name][-1]['steps_per_second']:.2f} steps/s", flush=True)
    plain = statistics.median(r["steps_per_second"] for r in runs["none"])
    lines = [
        f"# Checkpoints' cost: {args.model} under {args.strategy}, {args.workers} workers, {args.epochs} epochs",
        "",
        "| checkpoints | steps/s | of the run without | the run's seconds |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name in names:
        rates = [r["steps_per_second"] for r in runs[name]]
        label = name.replace("N", str(args.every))
        lines.append(
            f"| {label} | {spread(rates, 2)} | {statistics.median(rates) / plain:.0%} | "
            f"{spread([r['seconds'] for r in runs[name]], 1)} |"
        )
    lines += [
        "",
        f"Medians of {args.repeats} runs of each (lowest and highest in brackets), the three taking turns. "
        f"Steps/s: the run's steps over its epochs' training time (the saves during the epochs included). "
        f"Processor: {cpu_name()}.",
    ]
    setup = {**vars(args), "processor": cpu_name()}
    record(Path(args.out), {"setup": setup, "runs": runs}, lines)


if __name__ == "__main__":
    main()
