"""One ``paratrain train`` run in this process: build everything from a TrainConfig, fit,
and return (and on the chief, write) the metrics document.

Every process of a run executes this same function (SPMD); the strategy gives each
its role from its rank.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from typing import Any

import torch

from paratrain import timeline
from paratrain.config import TrainConfig
from paratrain.data.datasets import load_dataset
from paratrain.data.sharding import as_source, is_map_style
from paratrain.launch.threads import leave_cores
from paratrain.models import build_model
from paratrain.registry import OPTIMIZERS, SCHEDULES, STRATEGIES, is_reference, load_reference
from paratrain.session.warm_spare import take_replica_if_warm_spare
from paratrain.train.callbacks import Callback, EarlyStopping, LearningRateScheduler, TokenLog, perplexity
from paratrain.train.checkpoint import Checkpoint
from paratrain.train.cpu_tuning import CpuTuning
from paratrain.train.faults import fault_callbacks, lost_ranks, restart_count
from paratrain.train.metrics import metrics_document, write_json_atomic
from paratrain.train.observe import ExamplesApplied, TensorBoardLogger, TimelineSpans
from paratrain.train.preemption import StopOnSignal, stops_on_signal
from paratrain.train.trainer import Trainer
from paratrain.usercode import first_example


def run(config: TrainConfig) -> dict[str, Any]:
    # Before any computation, so that the compute threads started later inherit it.
    torch.set_flush_denormal(config.flush_denormal)
    # A warm spare (session/warm_spare.py) loads what the run imports, then becomes a replica's
    # replacement here.
    take_replica_if_warm_spare(lambda: _warm_up(config))
    started = time.perf_counter()
    strategy = STRATEGIES.get(config.strategy).from_config(config)
    strategy.on_nan = config.on_nan
    strategy.setup()
    # The process's place in the whole run, for the timeline's tracks (before the model is
    # wrapped: DDP's comm hook for the timeline is registered in prepare). Not the process
    # group's rank: a fault-tolerant replica's group is its own (or none), so every replica
    # would write the same track.
    global_rank, num_processes = strategy.process_rank, strategy.topology.num_processes
    if config.timeline:
        if strategy.is_chief:  # stale parts of an earlier run
            shutil.rmtree(timeline.parts_dir(config.timeline), ignore_errors=True)
        timeline.start(global_rank, f"{strategy.role} {strategy.rank}")
    merge_timeline = False
    try:
        result = _run(config, strategy, started)
        merge_timeline = config.timeline is not None and strategy.is_chief
        return result
    finally:
        recorder = timeline.stop()
        if recorder is not None:
            recorder.write_part(config.timeline)
        strategy.teardown()
        if merge_timeline:
            # After teardown: parameter-server shards finish (and write) once the chief lets them go.
            timeline.merge(config.timeline, num_processes, min(config.timeout, 60.0), lambda: lost_ranks(num_processes))


def _warm_up(config: TrainConfig) -> None:
    """What a run imports and reads before its first step, done once ahead of need: the
    data (its libraries, files into the page cache), the model's modules, its optimizer's
    (the first optimizer made imports torch._dynamo: ~1 s of CPU)."""
    splits = load_dataset(config)
    model = build_model(
        config.model, splits.spec, first_example(splits.train), config.model_options, config.ps.holds_tables
    )
    OPTIMIZERS.get(config.optimizer)(model.parameters(), config)


def _steps_per_epoch(train: Any, step_batch: int, replicas: int) -> int:
    """Global steps in an epoch: of examples, or of a stream's batches (``data/sharding.py``)."""
    source = as_source(train)[0]
    if is_map_style(source):
        return len(source) // (step_batch * replicas)
    try:
        return len(source) // replicas  # type: ignore[arg-type]
    except TypeError:
        return 0


def user_score(name: str, what: str) -> Any:
    """A loss or metric by name: a built-in's name as it is (the Trainer resolves it), or the
    function a ``package.module:fn`` reference names."""
    return load_reference(name, what) if is_reference(name) else name


def _run(config: TrainConfig, strategy: Any, started: float) -> dict[str, Any]:
    try:
        return _train(config, strategy, started)
    finally:
        leave_cores()  # a run in a process that goes on (a test's): its cores are free again


def _train(config: TrainConfig, strategy: Any, started: float) -> dict[str, Any]:
    torch.manual_seed(config.seed)
    splits = load_dataset(config)
    model = build_model(
        config.model, splits.spec, first_example(splits.train), config.model_options, config.ps.holds_tables
    )  # tables the shards hold stay on the meta device: each shard makes its own rows
    optimizer = OPTIMIZERS.get(config.optimizer)(model.parameters(), config)
    trainer = Trainer(
        model,
        user_score(config.loss, "--loss"),
        optimizer,
        metrics=[user_score(name, "--metrics") for name in config.metric_names],
        strategy=strategy,
        precision=config.precision,
        accumulate=config.accumulate,
        clip_grad_norm=config.clip_grad_norm,
        channels_last=config.channels_last,  # None: the Trainer's rule (recipe.prefers_channels_last)
        activation_checkpointing=config.activation_checkpointing,
        compile=config.compile,
        cpu=CpuTuning(
            pool_before_relu=config.pool_before_relu,
            onednn_layers=config.onednn_layers,
            keep_host_memory=config.keep_host_memory,
            flush_denormal=config.flush_denormal,
            threads=config.threads_per_worker,
        ),
    )
    threads = trainer.cores.threads  # at the start; a share of the machine's cores may move
    steps_per_epoch = _steps_per_epoch(splits.train, config.batch_size * config.accumulate, strategy.num_replicas)
    schedule = SCHEDULES.get(config.lr_schedule).from_config(config, steps_per_epoch)
    callbacks: list[Callback] = [LearningRateScheduler(schedule)]
    if config.early_stopping:
        callbacks.append(EarlyStopping("test_loss", patience=config.early_stopping))
    checkpoint = None
    if config.checkpoint_dir:
        # Restarted by --max-restarts (or torchrun's): go on from the last checkpoint.
        resume = config.resume or restart_count() > 0
        checkpoint = Checkpoint(
            config.checkpoint_dir,
            config.checkpoint_every,
            config.keep,
            resume,
            config.model,
            asynchronous=config.checkpoint_async,
        )
        callbacks.append(checkpoint)
    stopper = StopOnSignal(checkpoint) if checkpoint is not None and stops_on_signal(strategy) else None
    if stopper is not None:  # SIGUSR1 or SIGTERM: a checkpoint at an agreed step, then exit (preemption.py)
        callbacks.append(stopper)
    callbacks += fault_callbacks(config)
    tokens_per_example = splits.spec.input_shape[0] if splits.spec.per_position else 0
    if tokens_per_example:
        callbacks.append(TokenLog(tokens_per_example))
    seen = ExamplesApplied()
    callbacks.append(seen)
    tensorboard = TensorBoardLogger(config.logdir) if config.logdir else None
    if tensorboard:
        callbacks.append(tensorboard)
    if config.timeline:
        callbacks.append(TimelineSpans())
    with timeline.span("serve") if strategy.server is not None else contextlib.nullcontext():
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
    if strategy.server is not None:
        return {"role": strategy.role.value, "rank": strategy.rank}
    # The final model, after every process's updates (asynchronous ones too).
    final = trainer.evaluate(splits.test)
    stats = strategy.stats()  # on every worker: it may reduce across them
    # Every replica reads its own shard; report the mean of the waits of those reduced.
    wait = torch.tensor([trainer.loader_wait_seconds, 1.0], dtype=torch.float64, device=strategy.device)
    total, count = strategy.all_reduce_sum(wait).tolist()
    loader_wait = total / count
    summary = {
        "role": "worker",
        "rank": strategy.rank,
        "steps": strategy.steps_taken,
        "examples": trainer.examples_seen,
        **({"stopped": stopper.stopped} if stopper is not None and stopper.stopped else {}),
    }
    if not strategy.is_chief and not strategy.stands_in_for_chief:
        return summary
    examples = stats.pop("examples_processed", trainer.examples_seen)
    examples_per_second = examples / trainer.train_seconds if trainer.train_seconds else 0.0
    global_steps = stats.pop("global_steps", trainer.global_step)
    # every replica skips alike; a parameter server's shards count the updates they skipped
    skipped = stats.pop("skipped_updates", strategy.skipped_updates)
    document = metrics_document(
        strategy.describe(),
        stats,
        {
            # beyond the contract's keys (docs/architecture.md): the communication cost of one global step
            "bytes_per_step": stats["bytes_sent"] / global_steps if global_steps else 0.0,
            "model": config.model,
            "dataset": config.dataset,
            "epochs": len(history.epochs),
            "global_steps": global_steps,
            "test_accuracy": final.get("accuracy"),
            "test_loss": final["loss"],
            **{f"test_{name}": value for name, value in final.items() if name not in ("loss", "accuracy")},
            "train_loss": history.epochs[-1]["train_loss"],
            "wall_seconds": time.perf_counter() - started,
            "examples_per_second": examples_per_second,
            "loader_wait_seconds": loader_wait,
            **(
                {
                    "tokens_per_second": examples_per_second * tokens_per_example,
                    "test_perplexity": perplexity(final["loss"]),
                }
                if tokens_per_example
                else {}
            ),
            "history": [
                {
                    **{
                        k: entry.get(k)
                        for k in (
                            "epoch",
                            "train_loss",
                            "test_accuracy",
                            "test_loss",
                            "wall_seconds",
                            "train_seconds",
                            "cpu_seconds",
                        )
                    },
                    **{k: v for k, v in entry.items() if k.startswith("test_") and k not in ("test_accuracy",)},
                    "examples_seen": applied if applied is not None else entry["examples_seen"],
                }
                # a resumed run saw only its own epochs' counts: the earlier ones are the loop's
                for entry, applied in zip(
                    history.epochs, [None] * (len(history.epochs) - len(seen.per_epoch)) + seen.per_epoch
                )
            ],
            "config": config.to_dict(),
            "resumed_from_step": checkpoint.restored_step if checkpoint else None,
            "restarts": restart_count(),
            "skipped_updates": skipped,
            "threads_per_worker": threads,
            "channels_last": trainer.recipe.channels_last,
            "stopped": summary.get("stopped"),  # {"signal", "step"}: stopped early, to go on with --resume
        },
    )
    if not strategy.is_chief:
        # The chief may yet be lost after the last step (a fault-tolerant run goes on without
        # it): the launcher then reports the run from this replica's view of it.
        return {**summary, "document": document}
    if config.metrics_out:
        write_json_atomic(config.metrics_out, document)
    if tensorboard:
        tensorboard.write_summary(document)
    return document
