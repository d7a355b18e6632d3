"""An LSTM text classifier trained on 2 replicas with Adam (IMDB reviews, or any folder
of .txt files per class).

The data is a folder in the IMDB layout: DATA_DIR/train/<class>/*.txt and
DATA_DIR/test/<class>/*.txt. For the Large Movie Review Dataset (aclImdb_v1.tar.gz
from ai.stanford.edu/~amaas/data/sentiment/), remove the unlabelled train/unsup folder
first, as the Keras text tutorial does:

    tar xzf aclImdb_v1.tar.gz && rm -r aclImdb/train/unsup
    python examples/text_lstm.py --data-dir aclImdb

Words are lower-cased, HTML tags dropped; the vocabulary holds the 20,000 most
frequent training words; each review is cut or padded (at the front) to 200 tokens.
The model embeds the tokens, runs an LSTM and classifies its last output.
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
    data = load_dataset("text", data_dir=args.data_dir, max_len=args.max_len, vocab_size=args.vocab_size)
    with strategy.scope():
        torch.manual_seed(args.seed)
        model = build_model("lstm", data.spec)
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
        trainer = paratrain.Trainer(model, "cross_entropy", optimizer, metrics=["accuracy"])
    if strategy.is_chief:
        print(
            f"{len(data.train)} training and {len(data.test)} test documents, classes {list(data.classes)}, "
            f"vocabulary {len(data.vocabulary)} words, {strategy.num_replicas} replica(s)"
        )
    trainer.fit(
        data.train, epochs=args.epochs, validation_data=data.test, batch_size=args.batch_size, seed=args.seed, verbose=1
    )
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
    parser.add_argument("--data-dir", required=True, help="folder with train/ and test/, one sub-folder per class")
    parser.add_argument("--workers", type=int, default=2, help="replicas (processes)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="documents per replica per step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-len", type=int, default=200)
    parser.add_argument("--vocab-size", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(report_errors(run, parse(), prog="text_lstm"))
