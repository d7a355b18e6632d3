"""The same model and data from Python, under a parameter server: one shard, two workers.

    python examples/user_project/train.py                     # ps-sync, 1 shard + 2 workers
    python examples/user_project/train.py --mode async --workers 3

``paratrain.launch`` starts the processes the strategy needs (shards, workers) and runs
``train`` in each, inside the strategy's scope. On a shard, ``fit`` serves until the
workers are done and returns an empty history; on the chief (worker 0) ``evaluate``
gives the final model's scores; other workers get None for them.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

import paratrain

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tabular  # noqa: E402  (the user's own module, beside this script)


def train(epochs: int) -> dict:
    torch.manual_seed(0)
    train_data, test_data = tabular.data()
    model = tabular.model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    trainer = paratrain.Trainer(model, "mse", optimizer, metrics=["mae", tabular.within_10_percent])
    history = trainer.fit(train_data, epochs=epochs, batch_size=32, validation_data=test_data, verbose=0)
    scores = trainer.evaluate(test_data)
    strategy = paratrain.current_strategy()
    return {"role": strategy.role.value, "chief": strategy.is_chief, "history": history["test_mae"], **scores}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="sync", choices=["sync", "async", "backup"])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()
    backups = 1 if args.mode == "backup" else 0
    strategy = paratrain.ParameterServerStrategy(
        mode=args.mode, workers=args.workers, backup_workers=backups, device="cpu"
    )
    results = paratrain.launch(train, args.epochs, strategy=strategy)
    chief = next(r for r in results if r and r["chief"])
    print(f"ps-{args.mode}: test mae {chief['mae']:.4f}, within 10% {chief['within_10_percent']:.3f}")
    print("test mae per epoch:", ", ".join(f"{v:.3f}" for v in chief["history"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
