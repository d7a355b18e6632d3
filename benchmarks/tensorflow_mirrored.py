"""paratrain against TensorFlow's MirroredStrategy on the seeds' three models, same batches.

TensorFlow is never a dependency of paratrain: this benchmark runs TensorFlow's half
(tensorflow_side.py) in a virtual environment of its own, made once:

    python3 -m venv /tmp/tf-venv && /tmp/tf-venv/bin/pip install tensorflow-cpu==2.21.0
    .venv/bin/python benchmarks/tensorflow_mirrored.py --tf-python /tmp/tf-venv/bin/python [--rounds 3]

The models, as the tutorials build them and as paratrain's own (``paratrain/models``):

- ``mlp``: Fashion-MNIST's (28x28 inputs, Dense 256 ReLU, Dense 10), 128 per replica;
- ``cifar_cnn``: the CIFAR-10 tutorial's (24x24x3 inputs; conv 5x5x64, max-pool 3/2, local
  response normalization; conv 5x5x64, LRN, max-pool; Dense 384, 192, 10), 128 per replica;
- ``lstm``: the text classifier (200 token ids of a 20,000-word vocabulary, embedding 64,
  LSTM 128, Dense 2), 64 per replica;
- ``plain_cnn``: an ordinary conv net as a user writes it, the CIFAR-10 tutorial's without
  its local response normalization (conv 5x5x64, ReLU, max-pool 3/2, twice; Dense 384, 192,
  10), 128 per replica: on paratrain's side a plain ``nn.Sequential``, not a model of
  paratrain's.

Both sides train on the same synthetic examples (one seeded draw, written to a ``.npz``
file both read), SGD lr 0.01 momentum 0.9, cross-entropy, 2 replicas (global batch twice
the per-replica batch), ``--steps`` steps per epoch and ``--epochs`` epochs; a run's
throughput is the median examples/s of its epochs after the first (start-up, graph tracing
and the first epoch's warm-up excluded). Each side runs in configurations a user would
pick, and its best is taken:

- TensorFlow: ``MirroredStrategy`` over 2 logical CPU devices in one process (the seeds'
  towers on one host), and the default strategy (one replica of the global batch);
- paratrain: ``allreduce --workers 2`` (one process per replica, each with the threads
  ``--threads-per-worker`` gives it by default) and ``single`` (one process, every core,
  the global batch), both with the Trainer's defaults (for the conv nets on the CPU:
  channels-last, and a ReLU followed by a max-pooling pooled first) and the threads
  ``paratrain train`` gives each process.

Defaults against defaults (paratrain's ``allreduce`` against ``MirroredStrategy``, no flags
on either side) is the comparison a user makes; the best of each side is given beside it.

With ``--bf16``, each of those also runs in mixed precision, bfloat16 compute with float32
weights: Keras's ``mixed_bfloat16`` policy (the output layer kept in float32, as Keras
advises) and paratrain's ``--precision bf16`` (autocast). The table then gives the best of
each side in float32 and the best of all.

Rounds alternate the two sides (the order flips every round), so drift of a shared
machine hits both; the median over ``--rounds`` is reported, with paratrain's best over
TensorFlow's best (target: >= 1.1). Each run also counts the minor page faults a step of
its measuring process (TensorFlow's one process, paratrain's chief) in the same epochs: an
allocator that gives freed memory back pays for it again, page by page, on the next step,
at a price that differs between machines and between days of one virtual machine.

Writes benchmarks/results/tensorflow_mirrored.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from recorded_table import cpu_name
from tensorflow_side import LR, MODELS, MOMENTUM, REPLICAS, minor_faults, steady

ROOT = Path(__file__).resolve().parents[1]
SIDE = Path(__file__).with_name("tensorflow_side.py")


def write_data(path: Path, name: str, steps: int) -> None:
    """One seeded draw of ``steps`` global batches of ``name``'s inputs (NHWC for images,
    as TensorFlow wants them; paratrain's side permutes its view to NCHW)."""
    import numpy as np

    spec = MODELS[name]
    n = steps * spec["batch"] * REPLICAS
    rng = np.random.default_rng(0)
    if spec["kind"] == "tokens":
        x = rng.integers(2, spec["vocab"], size=(n, *spec["shape"]), dtype=np.int64)
    else:
        x = rng.standard_normal((n, *spec["shape"]), dtype=np.float32)
    y = rng.integers(0, spec["classes"], size=n, dtype=np.int64)
    np.savez(path, x=x, y=y)


# ----- paratrain's side ---------------------------------------------------------------------------
def _fit(name: str, data: str, epochs: int, precision: str, onednn_layers: bool | None) -> list[float] | None:
    """In each process of a paratrain run: the model trained on the shared draw; the chief's
    examples/s per epoch."""
    import numpy as np
    import torch

    import paratrain
    from paratrain.data.datasets import DataSpec
    from paratrain.launch.threads import set_threads
    from paratrain.models import build_model

    strategy = paratrain.current_strategy()
    set_threads(None)  # what paratrain train does: usable cores / processes here
    spec = MODELS[name]
    arrays = np.load(data)
    x, y = torch.from_numpy(arrays["x"]), torch.from_numpy(arrays["y"])
    if spec["kind"] == "image" and len(spec["shape"]) == 3:
        x = x.permute(0, 3, 1, 2)  # NHWC -> NCHW view, as the model takes it
    if spec["kind"] == "image" and len(spec["shape"]) == 2:
        x = x.unsqueeze(1)  # one channel
    data_spec = DataSpec(tuple(x.shape[1:]), spec["classes"], input_kind=spec["kind"], vocab_size=spec.get("vocab", 0))
    torch.manual_seed(0)
    model = plain_cnn() if name == "plain_cnn" else build_model(name, data_spec)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    trainer = paratrain.Trainer(  # its own layout rule
        model, "cross_entropy", optimizer, precision=precision, cpu=paratrain.CpuTuning(onednn_layers=onednn_layers)
    )
    batch = spec["batch"] * REPLICAS // strategy.num_replicas
    faults = page_faults(paratrain.Callback)
    history = trainer.fit((x, y), epochs=epochs, batch_size=batch, verbose=0, log_every=0, callbacks=[faults])
    return ([e["examples_per_second"] for e in history.epochs], faults.per_step) if strategy.is_chief else None


def page_faults(base: type) -> Any:
    """A paratrain callback (``base``: paratrain.Callback, imported where paratrain runs) that
    counts this process's minor page faults a step of each epoch."""

    class PageFaults(base):
        def __init__(self) -> None:
            self.per_step: list[float] = []

        def on_epoch_begin(self, epoch: int, logs: dict) -> None:
            self.faults, self.steps = minor_faults(), 0

        def on_batch_end(self, step: int, logs: dict) -> None:
            self.steps += 1

        def on_epoch_end(self, epoch: int, logs: dict) -> None:
            self.per_step.append((minor_faults() - self.faults) / max(1, self.steps))

    return PageFaults()


def plain_cnn():
    """The plain conv net as a user writes it in PyTorch (24x24x3 inputs: 12x12, then 6x6)."""
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(3, 64, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(3, 2, padding=1),
        nn.Conv2d(64, 64, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(3, 2, padding=1),
        nn.Flatten(),
        nn.Linear(64 * 6 * 6, 384),
        nn.ReLU(),
        nn.Linear(384, 192),
        nn.ReLU(),
        nn.Linear(192, 10),
    )


def paratrain_run(name: str, data: str, strategy_name: str, epochs: int, onednn_layers: bool | None = None) -> dict:
    import paratrain

    strategy_name, _, precision = strategy_name.partition("+")
    workers = REPLICAS if strategy_name == "allreduce" else 1
    strategy = paratrain.make_strategy(strategy_name, device="cpu", workers=workers)
    run = paratrain.launch(_fit, name, data, epochs, precision or "fp32", onednn_layers, strategy=strategy)
    return steady(*next(r for r in run if r is not None))


# ----- the comparison -----------------------------------------------------------------------------
SIDES = {
    "tensorflow": ("mirrored", "default"),
    "paratrain": ("allreduce", "single"),
}


def run_tf(python: str, name: str, data: str, strategy: str, epochs: int) -> dict:
    command = [python, str(SIDE), name, data, strategy, str(epochs)]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | {"TF_CPP_MIN_LOG_LEVEL": "2"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    if result.returncode:
        raise RuntimeError(f"TensorFlow run failed: {result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def configurations(side: str, bf16: bool) -> list[str]:
    """``strategy`` or ``strategy+bf16`` for each configuration ``side`` runs in."""
    return [*SIDES[side], *(f"{s}+bf16" for s in SIDES[side] if bf16)]


def markdown(document: dict) -> str:
    bf16 = document.get("bf16", False)
    runs = [f"{side}/{c}" for side in SIDES for c in configurations(side, bf16)]
    lines = [
        f"paratrain against TensorFlow {document['tensorflow']} on this machine ({document['cpus']} CPU cores"
        + (f", {document['processor']}" if "processor" in document else "")
        + "): "
        f"{REPLICAS} replicas, the same synthetic batches, SGD momentum 0.9, {document['steps']} steps per epoch, "
        f"{document['epochs']} epochs (the first excluded); median examples/s of {document['rounds']} alternating "
        "rounds. Defaults: paratrain's `allreduce` over TensorFlow's `MirroredStrategy`, no flags on either "
        "side; best: the faster configuration of each side"
        + (" in float32, and of all (+bf16: mixed precision, bfloat16 compute)." if bf16 else ".")
        + (
            " paratrain with `--no-onednn-layers` (PyTorch's own CPU kernels), not its default."
            if document.get("onednn_layers") is False
            else ""
        ),
        "",
        "| model | batch per replica | "
        + " | ".join(runs)
        + " | allreduce / mirrored (defaults) | paratrain best / TF best (fp32) "
        + ("| paratrain best / TF best (all) |" if bf16 else "|"),
        "| --- | ---: | " + " | ".join("---:" for _ in runs) + " | ---: | ---: |" + (" ---: |" if bf16 else ""),
    ]
    for name, row in document["models"].items():
        m = row["median"]
        cells = " | ".join(f"{m[run]:.0f}" for run in runs)
        lines.append(
            f"| {name} | {MODELS[name]['batch']} | {cells} | {row['ratio_defaults']:.2f}x | {row['ratio']:.2f}x |"
            + (f" {row['ratio_all']:.2f}x |" if bf16 else "")
        )
    faulted = [(name, row["faults_per_step"]) for name, row in document["models"].items() if "faults_per_step" in row]
    if faulted:
        lines += [
            "",
            "Minor page faults a step in the steady epochs (median; the measuring process: TensorFlow's one, "
            "paratrain's chief): a page the kernel maps and zero-fills on first touch, each time an allocator "
            "has given freed memory back; what one costs differs from machine to machine and day to day.",
            "",
            "| model | " + " | ".join(runs) + " |",
            "| --- | " + " | ".join("---:" for _ in runs) + " |",
            *(f"| {name} | " + " | ".join(f"{f[run]:,.0f}" for run in runs) + " |" for name, f in faulted),
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tf-python", required=True, help="the python of an environment with tensorflow-cpu")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30, help="global steps per epoch")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--bf16", action="store_true", help="also run each configuration in mixed bfloat16")
    parser.add_argument(
        "--no-onednn-layers",
        dest="onednn_layers",
        action="store_const",
        const=False,
        default=None,
        help="paratrain's side with PyTorch's own CPU kernels (CpuTuning(onednn_layers=False)), not its default",
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/tensorflow_mirrored.json"))
    args = parser.parse_args(argv)
    version = subprocess.run(
        [args.tf_python, "-c", "import tensorflow as tf; print(tf.__version__)"], capture_output=True, text=True
    ).stdout.strip()
    import torch

    document = {
        "command": " ".join(["python", "benchmarks/tensorflow_mirrored.py", *argv]),
        "tensorflow": version,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "processor": cpu_name(),
        "rounds": args.rounds,
        "steps": args.steps,
        "epochs": args.epochs,
        "bf16": args.bf16,
        "onednn_layers": args.onednn_layers,
        "models": {},
    }
    with tempfile.TemporaryDirectory() as folder:
        for name in args.models.split(","):
            data = str(Path(folder) / f"{name}.npz")
            write_data(Path(data), name, args.steps)
            samples: dict[str, list[float]] = {}
            faults: dict[str, list[float]] = {}
            for index in range(args.rounds):
                order = list(SIDES) if index % 2 == 0 else list(reversed(SIDES))
                for side in order:
                    for strategy in configurations(side, args.bf16):
                        if side == "tensorflow":
                            result = run_tf(args.tf_python, name, data, strategy, args.epochs)
                        else:
                            result = paratrain_run(name, data, strategy, args.epochs, args.onednn_layers)
                        samples.setdefault(f"{side}/{strategy}", []).append(result["examples_per_second"])
                        faults.setdefault(f"{side}/{strategy}", []).append(result["faults_per_step"])
                        print(json.dumps({"model": name, "round": index, "run": f"{side}/{strategy}", **result}))
            median = {key: statistics.median(values) for key, values in samples.items()}
            best = {side: max(median[f"{side}/{s}"] for s in SIDES[side]) for side in SIDES}
            best_all = {side: max(median[f"{side}/{s}"] for s in configurations(side, args.bf16)) for side in SIDES}
            document["models"][name] = {
                "samples": samples,
                "median": median,
                "faults_per_step": {key: statistics.median(values) for key, values in faults.items()},
                "best": best,
                "ratio": best["paratrain"] / best["tensorflow"],
                # each side as a user of its distribution API runs it: 2 replicas, no flags
                "ratio_defaults": median["paratrain/allreduce"] / median["tensorflow/mirrored"],
                "best_all": best_all,
                "ratio_all": best_all["paratrain"] / best_all["tensorflow"],
            }
    out = Path(args.out)
    out.write_text(json.dumps(document, indent=2) + "\n")
    table = markdown(document)
    out.with_suffix(".md").write_text(table)
    print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
