"""Fashion-MNIST on mirrored replicas: the Keras multi-GPU recipe, on paratrain.

The TensorFlow original (tf.distribute.MirroredStrategy):

    strategy = tf.distribute.MirroredStrategy()
    batch_per_gpu = 64
    batch = batch_per_gpu * strategy.num_replicas_in_sync
    with strategy.scope():
        model = Sequential([Flatten(input_shape=(28, 28)), Dense(256, activation="relu"), Dense(10)])
        model.compile(loss=SparseCategoricalCrossentropy(from_logits=True), optimizer=Adam(),
                      metrics=["accuracy"])
    model.fit(train_dataset, epochs=10)
    model.evaluate(eval_dataset)

Here every replica is a process (one per GPU, or several on the CPU) that reads its
own 64 examples of each global batch; an all-reduce averages the gradients, so every
replica applies the same Adam update.

    python examples/fashion_mnist_mirrored.py                    # all local GPUs (or 1 CPU process)
    python examples/fashion_mnist_mirrored.py --workers 4        # 4 processes on this machine
    torchrun --nproc-per-node 4 examples/fashion_mnist_mirrored.py

The data (four IDX files, 30 MB) is downloaded to ~/.cache/paratrain/fashion-mnist on
first use; --data-dir reads it from elsewhere.
"""

from __future__ import annotations

import argparse
import sys

import torch

import paratrain
from paratrain.comm.transport import cluster_from_env
from paratrain.data.datasets import load_dataset
from paratrain.launch.cli import report_errors
from paratrain.models import build_model


def train(args: argparse.Namespace) -> dict[str, float]:
    """One replica's part of the run (every process runs this)."""
    strategy = paratrain.MirroredStrategy(device=args.device)
    data = load_dataset("fashion-mnist", data_dir=args.data_dir, download=args.download)
    with strategy.scope():
        torch.manual_seed(args.seed)
        model = build_model("mlp", data.spec)  # Flatten, Dense 256 ReLU, Dense 10 (logits)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)  # Keras' Adam() defaults
        trainer = paratrain.Trainer(model, "cross_entropy", optimizer, metrics=["accuracy"])
    if strategy.is_chief:
        print(
            f"{strategy.num_replicas} replica(s) x {args.batch_per_replica} = global batch "
            f"{args.batch_per_replica * strategy.num_replicas}"
        )
    trainer.fit(data.train, epochs=args.epochs, batch_size=args.batch_per_replica, seed=args.seed, verbose=1)
    results = trainer.evaluate(data.test)
    if strategy.is_chief:
        print(f"test loss {results['loss']:.4f}, test accuracy {results['accuracy']:.4f}")
    strategy.teardown()
    return results


def run(args: argparse.Namespace) -> None:
    if cluster_from_env() is None and args.workers > 1:
        paratrain.launch(train, args, num_processes=args.workers)  # N processes on this machine
    else:
        train(args)  # one process, or one rank of a torchrun cluster


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", help="folder of the IDX files (default ~/.cache/paratrain/fashion-mnist)")
    parser.add_argument(
        "--download",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="download the files when absent (default yes)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=max(torch.cuda.device_count(), 1),
        help="replicas (default: one per local GPU, else 1)",
    )
    parser.add_argument("--batch-per-replica", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(report_errors(run, parse(), prog="fashion_mnist_mirrored"))
