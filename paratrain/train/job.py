"""One ``paratrain train`` run in this process: build everything from a TrainConfig, fit,
and return (and on the chief, write) the metrics document.

Every process of a run executes this same function (SPMD); the strategy gives each
its role from its rank.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from paratrain.config import TrainConfig
from paratrain.data.datasets import load_dataset
from paratrain.models import build_model
from paratrain.registry import OPTIMIZERS, SCHEDULES, STRATEGIES
from paratrain.train.callbacks import Callback, EarlyStopping, LearningRateScheduler
from paratrain.train.metrics import metrics_document, write_json_atomic
from paratrain.train.trainer import Trainer


def run(config: TrainConfig) -> dict[str, Any]:
    started = time.perf_counter()
    strategy = STRATEGIES.get(config.strategy).from_config(config)
    strategy.setup()
    try:
        torch.manual_seed(config.seed)
        splits = load_dataset(config)
        model = build_model(config.model, splits.spec)
        optimizer = OPTIMIZERS.get(config.optimizer)(model.parameters(), config)
        trainer = Trainer(model, "cross_entropy", optimizer, metrics=["accuracy"], strategy=strategy)
        steps_per_epoch = len(splits.train) // (config.batch_size * strategy.num_replicas)
        schedule = SCHEDULES.get(config.lr_schedule).from_config(config, steps_per_epoch)
        callbacks: list[Callback] = [LearningRateScheduler(schedule)]
        if config.early_stopping:
            callbacks.append(EarlyStopping("test_loss", patience=config.early_stopping))
        history = trainer.fit(
            splits.train,
            epochs=config.epochs,
            validation_data=splits.test,
            callbacks=callbacks,
            batch_size=config.batch_size,
            seed=config.seed,
            verbose=1 if config.progress else 0,
            log_every=config.log_every,
        )
        last = history.epochs[-1]
        stats = strategy.stats()
        document = metrics_document(
            strategy.describe(),
            stats,
            {
                # beyond the DESIGN's keys: the communication cost of one global step
                "bytes_per_step": stats["bytes_sent"] / trainer.global_step if trainer.global_step else 0.0,
                "model": config.model,
                "dataset": config.dataset,
                "epochs": len(history.epochs),
                "global_steps": trainer.global_step,
                "test_accuracy": last["test_accuracy"],
                "test_loss": last["test_loss"],
                "train_loss": last["train_loss"],
                "wall_seconds": time.perf_counter() - started,
                "examples_per_second": trainer.examples_seen / trainer.train_seconds if trainer.train_seconds else 0.0,
                "history": [
                    {k: entry[k] for k in ("epoch", "train_loss", "test_accuracy", "test_loss", "wall_seconds")}
                    for entry in history.epochs
                ],
                "config": config.to_dict(),
            },
        )
        if strategy.is_chief and config.metrics_out:
            write_json_atomic(config.metrics_out, document)
        return document
    finally:
        strategy.teardown()
