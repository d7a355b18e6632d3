"""Step time of paratrain's ``allreduce`` strategy against a plain DistributedDataParallel loop.

The measurement is ``paratrain.bench.allreduce`` (its docstring says what is timed and
how); ``paratrain bench --suites allreduce`` runs the same. Run (from the repository root):

    .venv/bin/python benchmarks/allreduce_overhead.py [--rounds 31] [--models mlp,cifar_cnn]
        [--batch-size 32] [--epochs-per-round 1] [--out benchmarks/results/allreduce_overhead.json]

It writes the JSON file and a Markdown table next to it (same name, ``.md``), and prints
the table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's paratrain, also in the spawned workers

from paratrain.bench.allreduce import markdown, measure  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=31, help="timed rounds per side")
    parser.add_argument("--models", default="mlp,cifar_cnn", help="comma-separated model names")
    parser.add_argument("--batch-size", type=int, default=32, help="per replica")
    parser.add_argument("--epochs-per-round", type=int, default=1, help="22 steps per epoch at batch 32")
    parser.add_argument("--out", default="benchmarks/results/allreduce_overhead.json")
    args = parser.parse_args()
    models = [m.strip() for m in args.models.split(",") if m.strip()]

    measured = measure(models, args.batch_size, args.rounds, args.epochs_per_round)
    document = {
        "benchmark": measured.pop("benchmark"),
        "command": " ".join(["python", "benchmarks/allreduce_overhead.py", *sys.argv[1:]]),
        **measured,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=2) + "\n")
    table = markdown(document)
    out.with_suffix(".md").write_text(table)
    print(table, end="")


if __name__ == "__main__":
    main()
