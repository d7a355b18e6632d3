"""Pipeline bubble and activation memory: GPipe vs 1F1B, measured against the theory.

The measurement is ``paratrain.bench.pipeline`` (its docstring says what is timed and
counted); ``paratrain bench --suites pipeline`` runs the same. Run (from the repository root):

    .venv/bin/python benchmarks/pipeline.py [--stages 2] [--microbatches 1,2,4,8] [--steps 20] [--repeats 5]
        [--layers 8] [--width 1024] [--batch-size 256] [--out benchmarks/results/pipeline.json]

The defaults (8 blocks of width 1024, batch 256) make a micro-batch's compute large next
to the fixed costs of a micro-batch, the regime the theory describes. It writes the JSON
file and a Markdown table next to it (same name, ``.md``), and prints the table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's paratrain, also in the spawned workers

from paratrain.bench.pipeline import run, table  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--microbatches", default="1,2,4,8")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/pipeline.json"))
    args = parser.parse_args()
    counts = tuple(int(m) for m in args.microbatches.split(","))
    document = run(args.stages, counts, args.steps, args.repeats, args.layers, args.width, args.batch_size)
    document["meta"]["command"] = "benchmarks/pipeline.py " + " ".join(sys.argv[1:])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=2) + "\n")
    text = table(document["rows"], document["meta"])
    out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
