"""Gradient compression with allreduce: bytes per step, step time and accuracy per codec.

Every (model, codec) pair trains on digits with the same seed and settings through ``paratrain.train.job.run``,
inside one launch of ``workers`` processes. Per pair: bytes/step (``bytes_sent`` over global steps) and its
ratio to the uncompressed run's, measured and from the codecs' formulas; step time (global batch over
training examples/s); final test accuracy and its difference in points. Targets: fp16/bf16 2.0x fewer bytes,
int8 >= 3.9x, top-k at 1% >= 30x, PowerSGD rank 2 >= 30x on cifar_cnn.
"""

from __future__ import annotations

from typing import Any

from paratrain.comm.codec_config import make_codec
from paratrain.comm.hooks import make_hook
from paratrain.comm.transport import ensure_process_group
from paratrain.config import TrainConfig
from paratrain.data.datasets import load_digits
from paratrain.launch.local import launch
from paratrain.models import build_model
from paratrain.session.teardown import destroy_groups
from paratrain.train import job

MODELS = ("mlp", "cifar_cnn", "lstm")
CODECS = ("none", "fp16", "bf16", "int8", "topk", "powersgd")
# (codec, model or None for every model, minimum ratio of bytes/step to uncompressed)
TARGETS = [
    ("fp16", None, 2.0),
    ("bf16", None, 2.0),
    ("int8", None, 3.9),
    ("topk", None, 30.0),
    ("powersgd", "cifar_cnn", 30.0),
]
COLUMNS = [
    ("model", "model", "s"),
    ("codec", "compression", "s"),
    ("bytes/step", "bytes_per_step", ".0f"),
    ("fewer bytes", "bytes_ratio", ".2f"),
    ("formula", "formula_ratio", ".2f"),
    ("step s", "step_seconds", ".4f"),
    ("step time vs none", "step_time_ratio", ".2f"),
    ("test acc", "test_accuracy", ".4f"),
    ("points vs none", "accuracy_points", "+.2f"),
]


def formula_bytes(model_name: str, codec_name: str) -> tuple[int, int]:
    """(bytes one rank sends per step, uncompressed bytes) for a model on digits, from
    the codecs' formulas (PowerSGD: once compression has started)."""
    model = build_model(model_name, load_digits().spec)
    full = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    hook = make_hook(make_codec(codec_name))
    return (full if hook is None else hook.step_bytes(model)), full


def run_all(jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """On every process of the launch: train each configuration in turn."""
    ensure_process_group("gloo", 300)
    rows = []
    for settings in jobs:
        config = TrainConfig(**settings)
        metrics = job.run(config)
        if "test_accuracy" not in metrics:  # only the chief gets the metrics document
            continue
        rows.append(
            {
                "model": config.model,
                "compression": metrics["compression"],
                "bytes_per_step": metrics["bytes_per_step"],
                "bytes_sent": metrics["bytes_sent"],
                "global_steps": metrics["global_steps"],
                "step_seconds": config.global_batch / metrics["examples_per_second"],
                "test_accuracy": metrics["test_accuracy"],
                "wall_seconds": metrics["wall_seconds"],
            }
        )
    destroy_groups()
    return rows


def measure(
    models: list[str], codecs: list[str], workers: int = 2, epochs: int = 15, **settings: Any
) -> list[dict[str, Any]]:
    """Train every (model, codec) pair in one launch of ``workers`` processes; the rows,
    with ratios to the uncompressed run (added to ``codecs`` if absent) and formulas."""
    if "none" not in codecs:
        codecs = ["none", *codecs]  # the reference every ratio is taken against
    jobs = [
        dict(
            **settings,
            model=model,
            compression=codec,
            strategy="allreduce",
            workers=workers,
            epochs=epochs,
            progress=False,
            log_every=0,
        )
        for model in models
        for codec in codecs
    ]
    rows = launch(run_all, jobs, num_processes=workers)[0]
    add_ratios(rows)
    for r in rows:  # steady state: PowerSGD's first steps are plain all-reduces
        sent, full = formula_bytes(r["model"], r["compression"])
        r["formula_ratio"] = full / sent
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


def table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]] = COLUMNS) -> str:
    head = "| " + " | ".join(title for title, _, _ in columns) + " |"
    rule = "| " + " | ".join("---" for _ in columns) + " |"
    body = [
        "| " + " | ".join("" if r.get(key) is None else format(r[key], spec) for _, key, spec in columns) + " |"
        for r in rows
    ]
    return "\n".join([head, rule, *body])
