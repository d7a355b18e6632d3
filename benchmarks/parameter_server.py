"""Parameter-server training against all-reduce, and under a straggler.

The measurement is ``paratrain.bench.ps`` (its docstring says what is measured and the
targets); ``paratrain bench --suites ps`` runs the same.

    .venv/bin/python benchmarks/parameter_server.py [--models mlp,cifar_cnn] [--epochs 4] [--repeats 3]

Writes benchmarks/results/parameter_server.json and .md, and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from paratrain.bench import ps  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,cifar_cnn")
    parser.add_argument("--workers", default="2,3")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--straggler-workers", type=int, default=4)
    parser.add_argument("--factor", type=float, default=2.0)
    parser.add_argument("--out", default="benchmarks/results/parameter_server.json")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    log = lambda line: print(line, flush=True)  # noqa: E731
    scaling = ps.scaling(
        args.models.split(","), [int(w) for w in args.workers.split(",")], args.epochs, args.repeats, log
    )
    straggler = ps.straggler(args.straggler_workers, args.factor, args.epochs, args.repeats, log)
    document = {
        "scaling": scaling,
        "straggler": straggler,
        "settings": {
            **vars(args),
            "torch": torch.__version__,
            "cores": os.cpu_count(),
            "python": platform.python_version(),
        },
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=2) + "\n")
    table = ps.markdown(scaling, straggler, args.straggler_workers, args.factor)
    out.with_suffix(".md").write_text(table)
    print(table, end="")


if __name__ == "__main__":
    main()
