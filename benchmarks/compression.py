"""Gradient compression with allreduce: bytes per step, step time and accuracy per codec.

    python benchmarks/compression.py                        # mlp, cifar_cnn, lstm x every codec, 2 workers
    python benchmarks/compression.py --formulas             # bytes per step from the codecs' formulas only
    python benchmarks/compression.py --models mlp --codecs none,int8 --epochs 1 --out /tmp/c.json

Every (model, codec) pair trains on digits with the same seed and settings through
``paratrain.train.job.run`` (the code path of ``paratrain train``), all of them inside one
launch of ``--workers`` processes. Reported per pair:

- bytes/step: ``bytes_sent`` of the metrics file (what every rank handed to the
  collectives, summed over ranks) divided by the global steps, and its ratio to the
  uncompressed run's (the first PowerSGD steps are plain all-reduces, counted), and
  the steady-state ratio from the codecs' formulas;
- step time: the global batch over the training examples/second (evaluation excluded);
- final test accuracy, and its difference from the uncompressed run in points.

Targets (the issue): fp16/bf16 2.0x fewer bytes, int8 >= 3.9x, top-k at 1% >= 30x,
PowerSGD rank 2 >= 30x on cifar_cnn. Results go to ``--out`` as JSON and to stdout as a
table; the JSON records the command and the environment it ran in.
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

MODELS = ("mlp", "cifar_cnn", "lstm")
CODECS = ("none", "fp16", "bf16", "int8", "topk", "powersgd")
# (codec, model or None for every model, minimum ratio of bytes/step to uncompressed)
TARGETS = [("fp16", None, 2.0), ("bf16", None, 2.0), ("int8", None, 3.9), ("topk", None, 30.0),
           ("powersgd", "cifar_cnn", 30.0)]


def formula_bytes(model_name: str, codec_name: str) -> tuple[int, int]:
    """(bytes one rank sends per step, uncompressed bytes) for a model on digits, from
    the codecs' formulas (PowerSGD: once compression has started)."""
    from paratrain.comm.codecs import make_codec
    from paratrain.comm.hooks import make_hook
    from paratrain.data.datasets import load_digits
    from paratrain.models import build_model

    model = build_model(model_name, load_digits().spec)
    full = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    hook = make_hook(make_codec(codec_name))
    return (full if hook is None else hook.step_bytes(model)), full


def run_all(jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """On every process of the launch: train each configuration in turn."""
    from paratrain.comm.transport import destroy_process_group, ensure_process_group
    from paratrain.config import TrainConfig
    from paratrain.train import job

    ensure_process_group("gloo", 300)
    rows = []
    for settings in jobs:
        config = TrainConfig(**settings)
        metrics = job.run(config)
        if "test_accuracy" not in metrics:  # only the chief gets the metrics document
            continue
        rows.append({
            "model": config.model,
            "compression": metrics["compression"],
            "bytes_per_step": metrics["bytes_per_step"],
            "bytes_sent": metrics["bytes_sent"],
            "global_steps": metrics["global_steps"],
            "step_seconds": config.global_batch / metrics["examples_per_second"],
            "test_accuracy": metrics["test_accuracy"],
            "wall_seconds": metrics["wall_seconds"],
        })
    destroy_process_group()
    return rows


def add_ratios(rows: list[dict[str, Any]]) -> None:
    baseline = {r["model"]: r for r in rows if r["compression"] == "none"}
    for r in rows:
        base = baseline.get(r["model"])
        r["bytes_ratio"] = base["bytes_per_step"] / r["bytes_per_step"] if base and r["bytes_per_step"] else None
        r["accuracy_points"] = 100 * (r["test_accuracy"] - base["test_accuracy"]) if base else None
        r["step_time_ratio"] = r["step_seconds"] / base["step_seconds"] if base else None


def check_targets(rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    for codec, model, minimum in TARGETS:
        for r in rows:
            if r["compression"] == codec and (model is None or r["model"] == model) and r.get("bytes_ratio"):
                verdict = "met" if r["bytes_ratio"] >= minimum else "MISSED"
                lines.append(f"{codec} on {r['model']}: {r['bytes_ratio']:.2f}x (target >= {minimum}x) {verdict}")
    return lines


def table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> str:
    head = "| " + " | ".join(title for title, _, _ in columns) + " |"
    rule = "| " + " | ".join("---" for _ in columns) + " |"
    body = ["| " + " | ".join("" if r.get(key) is None else format(r[key], spec) for _, key, spec in columns) + " |"
            for r in rows]
    return "\n".join([head, rule, *body])


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
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="any other run setting, e.g. --set lr_schedule=exponential --set lr_decay_steps=250")
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
                rows.append({"model": model, "compression": codec, "bytes_per_step": sent,
                             "uncompressed": full, "bytes_ratio": full / sent})
        print(table(rows, [("model", "model", "s"), ("codec", "compression", "s"),
                           ("bytes/step/rank", "bytes_per_step", "d"), ("uncompressed", "uncompressed", "d"),
                           ("fewer bytes", "bytes_ratio", ".2f")]))
        print("\n".join(check_targets(rows)))
        return 0

    from paratrain.launch.torchrun import launch

    extra = dict(_setting(item) for item in args.set)
    jobs = [dict(**extra, model=model, compression=codec, strategy="allreduce", workers=args.workers, epochs=args.epochs,
                 seed=args.seed, optimizer=args.optimizer, lr=args.lr, compression_ratio=args.compression_ratio, powersgd_rank=args.powersgd_rank,
                 progress=False, log_every=0)
            for model in models for codec in codecs]
    rows = launch(run_all, jobs, num_processes=args.workers)[0]
    add_ratios(rows)
    for r in rows:  # steady state: PowerSGD's first steps are plain all-reduces
        sent, full = formula_bytes(r["model"], r["compression"])
        r["formula_ratio"] = full / sent
    print(table(rows, [("model", "model", "s"), ("codec", "compression", "s"), ("bytes/step", "bytes_per_step", ".0f"),
                       ("fewer bytes", "bytes_ratio", ".2f"), ("formula", "formula_ratio", ".2f"),
                       ("step s", "step_seconds", ".4f"),
                       ("step time vs none", "step_time_ratio", ".2f"), ("test acc", "test_accuracy", ".4f"),
                       ("points vs none", "accuracy_points", "+.2f")]))
    targets = check_targets(rows)
    print("\n".join(targets))
    document = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "environment": {"torch": torch.__version__, "python": platform.python_version(),
                        "machine": platform.machine(), "cpus": os.cpu_count(), "backend": "gloo"},
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
