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
from paratrain.train.faults import fault_callbacks
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
        callbacks += fault_callbacks(config)
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
        if strategy.role != "worker":
            return {"role": strategy.role, "rank": strategy.rank}
        # The final model, after every process's updates (asynchronous ones too).
        final = trainer.evaluate(splits.test)
        stats = strategy.stats()  # on every worker: it may reduce across them
        # Every replica reads its own shard; report the mean of the waits of those reduced.
        wait = torch.tensor([trainer.loader_wait_seconds, 1.0], dtype=torch.float64, device=strategy.device)
        total, count = strategy.all_reduce_sum(wait).tolist()
        loader_wait = total / count
        if not strategy.is_chief:
            return {"role": "worker", "rank": strategy.rank}
        examples = stats.pop("examples_processed", trainer.examples_seen)
        global_steps = stats.pop("global_steps", trainer.global_step)
        document = metrics_document(
            strategy.describe(),
            stats,
            {
                # beyond the DESIGN's keys: the communication cost of one global step
                "bytes_per_step": stats["bytes_sent"] / global_steps if global_steps else 0.0,
                "model": config.model,
                "dataset": config.dataset,
                "epochs": len(history.epochs),
                "global_steps": global_steps,
                "test_accuracy": final["accuracy"],
                "test_loss": final["loss"],
                "train_loss": history.epochs[-1]["train_loss"],
                "wall_seconds": time.perf_counter() - started,
                "examples_per_second": examples / trainer.train_seconds if trainer.train_seconds else 0.0,
                "loader_wait_seconds": loader_wait,
                "history": [
                    {k: entry[k] for k in ("epoch", "train_loss", "test_accuracy", "test_loss", "wall_seconds")}
                    for entry in history.epochs
                ],
                "config": config.to_dict(),
            },
        )
        if config.metrics_out:
            write_json_atomic(config.metrics_out, document)
        return document
    finally:
        strategy.teardown()
