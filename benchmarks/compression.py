"""Gradient compression with allreduce: bytes per step, step time and accuracy per codec.

    python benchmarks/compression.py                        # mlp, cifar_cnn, lstm x every codec, 2 workers
    python benchmarks/compression.py --formulas             # bytes per step from the codecs' formulas only
    python benchmarks/compression.py --models mlp --codecs none,int8 --epochs 1 --out /tmp/c.json

The measurement is ``paratrain.bench.codecs`` (its docstring says what is reported and
the targets); ``paratrain bench --suites codecs`` runs the same. Results go to ``--out``
as JSON and to stdout as a table; the JSON records the command and the environment it
ran in.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from typing import Any

import torch

from paratrain.bench.codecs import CODECS, COLUMNS, MODELS, check_targets, formula_bytes, measure, table


def _setting(item: str) -> tuple[str, Any]:
    key, _, text = item.partition("=")
    try:
        return key.replace("-", "_"), json.loads(text)
    except ValueError:
        return key.replace("-", "_"), text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--codecs", default=",".join(CODECS))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--compression-ratio", type=float, default=0.01, help="top-k's R")
    parser.add_argument("--powersgd-rank", type=int, default=2)
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other run setting, e.g. --set lr_schedule=exponential --set lr_decay_steps=250",
    )
    parser.add_argument("--out", default="benchmarks/results/compression.json")
    parser.add_argument("--formulas", action="store_true", help="print bytes per step from the formulas; train nothing")
    args = parser.parse_args(argv)
    models, codecs = args.models.split(","), args.codecs.split(",")
    if "none" not in codecs:
        codecs.insert(0, "none")  # the reference every ratio is taken against

    if args.formulas:
        rows = []
        for model in models:
            for codec in codecs:
                sent, full = formula_bytes(model, codec)
                rows.append(
                    {
                        "model": model,
                        "compression": codec,
                        "bytes_per_step": sent,
                        "uncompressed": full,
                        "bytes_ratio": full / sent,
                    }
                )
        print(
            table(
                rows,
                [
                    ("model", "model", "s"),
                    ("codec", "compression", "s"),
                    ("bytes/step/rank", "bytes_per_step", "d"),
                    ("uncompressed", "uncompressed", "d"),
                    ("fewer bytes", "bytes_ratio", ".2f"),
                ],
            )
        )
        print("\n".join(check_targets(rows)))
        return 0

    extra = dict(_setting(item) for item in args.set)
    rows = measure(
        models,
        codecs,
        args.workers,
        args.epochs,
        **extra,
        seed=args.seed,
        optimizer=args.optimizer,
        lr=args.lr,
        compression_ratio=args.compression_ratio,
        powersgd_rank=args.powersgd_rank,
    )
    print(table(rows, COLUMNS))
    targets = check_targets(rows)
    print("\n".join(targets))
    document = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "environment": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "backend": "gloo",
        },
        "settings": vars(args),
        "rows": rows,
        "targets": targets,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump(document, handle, indent=2)
        handle.write("\n")
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
