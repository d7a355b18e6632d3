"""DiLoCo and local SGD against allreduce with the same examples: accuracy and bytes.

    .venv/bin/python benchmarks/diloco.py [--workers 2] [--epochs 40] [--seeds 0,1,2]

Every run trains the MLP on digits for the same ``--epochs`` (the same examples, the same
global batch of 32 x workers) through ``paratrain.launch``, as ``paratrain train`` does,
with the inner optimizer DiLoCo's paper uses (AdamW, lr 0.003, weight decay 0.01) for
every mode:

- ``allreduce``: the gradient all-reduced every step (the fully synchronous baseline);
- ``local-sgd --sync-every H``: parameters averaged every H steps;
- ``diloco --sync-every H``: outer Nesterov SGD (lr 0.7, momentum 0.9, the paper's) on the
  averaged delta every H steps; also with ``--compression int8`` on the delta and with
  ``--fragments 2`` (Streaming DiLoCo; the mlp has 4 parameter tensors).

Records the test accuracy (mean and range over ``--seeds``) and the bytes each mode sent,
against allreduce's. The shape to reproduce (Douillard et al. 2023): at H >= 20, DiLoCo
within a point of the synchronous baseline, with H times fewer bytes.

Writes benchmarks/results/diloco.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

INNER = {"optimizer": "adamw", "lr": 0.003, "weight_decay": 0.01}


def settings(h_values: list[int]) -> list[tuple[str, dict]]:
    rows = [("allreduce", {})]
    for h in h_values:
        rows.append((f"local-sgd H={h}", {"strategy": "local-sgd", "sync_every": h}))
        rows.append((f"diloco H={h}", {"strategy": "diloco", "sync_every": h}))
    h = max(h_values)
    rows.append((f"diloco H={h} int8", {"strategy": "diloco", "sync_every": h, "compression": "int8"}))
    rows.append((f"diloco H={h} 2 fragments", {"strategy": "diloco", "sync_every": h, "fragments": 2}))
    return rows


def run(options: dict, workers: int, epochs: int, seed: int) -> dict:
    from paratrain.config import TrainConfig
    from paratrain.launch.local import run_locally

    config = TrainConfig(
        **{"strategy": "allreduce", **options},
        **INNER,
        workers=workers,
        epochs=epochs,
        seed=seed,
        device="cpu",
        progress=False,
        log_every=0,
    )
    metrics = run_locally(config)
    return {
        "test_accuracy": metrics["test_accuracy"],
        "bytes_sent": metrics["bytes_sent"],
        "global_steps": metrics["global_steps"],
    }


def markdown(document: dict) -> str:
    base = document["rows"][0]
    lines = [
        f"DiLoCo and local SGD against allreduce: MLP on digits, {document['workers']} workers, batch 32 per worker, "
        f"{document['epochs']} epochs ({base['global_steps']} steps, the same examples for every mode), inner AdamW "
        f"(lr 0.003, weight decay 0.01); diloco's outer Nesterov SGD lr 0.7, momentum 0.9. Test accuracy: mean "
        f"(min-max) over seeds {document['seeds']}.",
        "",
        "| mode | test accuracy | vs allreduce (points) | bytes sent | bytes vs allreduce |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for row in document["rows"]:
        accuracies = row["test_accuracy"]
        mean = statistics.mean(accuracies)
        lines.append(
            f"| {row['mode']} | {100 * mean:.2f}% ({100 * min(accuracies):.2f}-{100 * max(accuracies):.2f}) "
            f"| {100 * (mean - statistics.mean(base['test_accuracy'])):+.2f} | {row['bytes_sent'] / 2**20:.1f} MiB "
            f"| 1/{base['bytes_sent'] / row['bytes_sent']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--sync-every", default="20,50", help="H values, comma-separated")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/diloco.json"))
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    seeds = [int(s) for s in args.seeds.split(",")]
    rows = []
    for mode, options in settings([int(h) for h in args.sync_every.split(",")]):
        runs = [run(options, args.workers, args.epochs, seed) for seed in seeds]
        row = {
            "mode": mode,
            "options": options,
            "test_accuracy": [r["test_accuracy"] for r in runs],
            "bytes_sent": runs[0]["bytes_sent"],
            "global_steps": runs[0]["global_steps"],
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    document = {
        "command": " ".join(["python", "benchmarks/diloco.py", *(argv if argv is not None else sys.argv[1:])]),
        "workers": args.workers,
        "epochs": args.epochs,
        "seeds": seeds,
        "inner": INNER,
        "rows": rows,
        "environment": {"torch": torch.__version__, "python": platform.python_version()},
    }
    out = Path(args.out)
    out.write_text(json.dumps(document, indent=2) + "\n")
    table = markdown(document)
    out.with_suffix(".md").write_text(table)
    print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
