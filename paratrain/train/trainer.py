"""The Trainer: a Keras-like ``fit``/``evaluate``/``predict`` over any strategy.

``fit`` is one loop that reads top to bottom; everything that differs between modes
of training happens inside ``strategy.train_step`` and ``strategy.distribute``.
Users who want their own loop keep it: ``strategy.prepare``, ``strategy.distribute``
and ``strategy.train_step`` are the same pieces this loop uses.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from paratrain.console import console
from paratrain.data.batch import num_examples
from paratrain.data.sharding import ShardedBatches, as_source, is_map_style
from paratrain.errors import ConfigError, ReplicaLeft
from paratrain.strategies.base import Strategy
from paratrain.strategies.cpu_layers import describe as describe_onednn_layers
from paratrain.strategies.recipe import StepRecipe, prefers_channels_last, slow_precision
from paratrain.strategies.single.strategy import get_strategy
from paratrain.timeline import span
from paratrain.train.callbacks import Callback, CallbackList, EpochLog, ProgressBar, StepLog
from paratrain.train.cpu_tuning import CpuTuning, FollowCoreShare
from paratrain.train.faults import progress_beacon
from paratrain.train.history import History
from paratrain.train.metrics import EpochSums, StepWindow
from paratrain.train.rng import rng_state, set_rng_state
from paratrain.train.scores import Score, resolve_loss, resolve_metrics, summed_scores
from paratrain.train.step_device import StepDevice


class Trainer:
    def __init__(
        self,
        model: nn.Module,
        loss: str | Score | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        metrics: Sequence[str | Score] | Mapping[str, Score] | None = None,
        strategy: Strategy | None = None,
        *,
        precision: str = "fp32",
        accumulate: int = 1,
        clip_grad_norm: float | None = None,
        channels_last: bool | None = None,
        activation_checkpointing: str = "none",
        compile: bool = False,
        cpu: CpuTuning | None = None,
    ):
        """Prepare ``model`` and ``optimizer`` for ``strategy`` (None: the current one).

        ``loss``: a name (``scores.LOSSES``), a callable ``(outputs, targets)``, or None:
        cross-entropy, or the model's own loss where a batch is a dict alone. ``metrics``:
        names (``accuracy``, ``top5_accuracy``, ``mae``, ``mse``), callables or a dict of them;
        None: ``accuracy``, or none where the model's own loss scores dict examples. The step
        options are ``StepRecipe``'s (``strategies/recipe.py``; ``channels_last`` None: on for
        a conv net on the CPU where the strategy takes it); ``compile``: ``torch.compile`` the
        prepared model; ``cpu``: how this process uses the CPU (``CpuTuning``; None: defaults)."""
        cpu = cpu or CpuTuning()
        self.cores = cpu.apply_to_process()
        self._metrics_by_default = metrics is None
        self.metric_fns = resolve_metrics(("accuracy",) if metrics is None else metrics)
        loss = resolve_loss(loss)
        if optimizer is None:
            raise ConfigError("Trainer needs an optimizer, e.g. torch.optim.SGD(model.parameters(), lr=0.05)")
        self.strategy = strategy or get_strategy()
        self.strategy.check_step(self.strategy.name, precision, compile)
        if channels_last is None or cpu.onednn_layers is not False:
            self.strategy.setup()  # its device decides
        if channels_last is None:
            channels_last = prefers_channels_last(model, self.strategy.device) and self.strategy.takes_channels_last
        onednn = cpu.onednn_layers_for(self.strategy.device.type, precision)
        self.recipe = StepRecipe(
            precision, accumulate, clip_grad_norm, channels_last, activation_checkpointing, cpu.pool_before_relu, onednn
        )
        self.loss_fn = loss
        self.metrics = tuple(self.metric_fns)
        try:  # DDP's first broadcast: a peer gone already is named like one lost mid-run
            self.model, self.optimizer = self.strategy.prepare(model, optimizer, self.recipe)
        except RuntimeError as error:
            raise (self.strategy.diagnose(error, 0) or error) from None
        if onednn is not False and (line := describe_onednn_layers(self.model, onednn)):
            self._note(line)
        if slow := slow_precision(precision, self.strategy.device):  # prepared: on its device
            self._note(slow)
        if compile:
            self.model = torch.compile(self.model)
        # The default device over each step (step_device.py); a compiled step keeps it as it
        # is (dropping it after the first step would compile the step again).
        self._step_device = contextlib.nullcontext if compile else StepDevice(self._note)
        self.learning_rate = optimizer.param_groups[0]["lr"]
        self.global_step = 0
        self.epoch = 0
        self.stop_training = False
        self.train_seconds = 0.0
        self.examples_seen = 0
        self.loader_wait_seconds = 0.0
        """Seconds the training loop waited for input batches (this replica)."""
        self.batch = 0
        """Batches of the current epoch done (where a resumed run goes on)."""
        self.history = History()
        self._window = StepWindow()
        self._epoch_sums = EpochSums()
        self._resumed = False
        self._epoch_start = 0.0
        self._epoch_elapsed = 0.0  # seconds of the current epoch before the checkpoint resumed from

    @property
    def module(self) -> nn.Module:
        """The user's model, unwrapped from whatever the strategy (and torch.compile) wrapped it in."""
        return self.strategy.unwrap(self.model)

    def log_keys(self, validation: bool) -> tuple[str, ...]:
        """The keys of every epoch's log that depend on the metrics."""
        tested = ("test_loss", *(f"test_{m}" for m in self.metrics)) if validation else ()
        return ("train_loss", *tested)

    def _settle_metrics(self, data: object) -> None:
        """The default metrics (``metrics=None``) for ``data``: none where its examples are
        dicts that the model's own loss scores (a Hugging Face model's output), whose
        ``accuracy`` failed after a whole epoch of training."""
        if not self._metrics_by_default or not getattr(self.loss_fn, "uses_model_loss", False):
            return
        source = as_source(data)[0]
        if is_map_style(source) and len(source) and isinstance(source[0], Mapping):
            self.metric_fns, self.metrics = {}, ()
        self._metrics_by_default = False

    def set_learning_rate(self, lr: float) -> None:
        self.strategy.set_learning_rate(self.optimizer, lr)
        self.learning_rate = lr

    def fit(
        self,
        train_data: object,
        epochs: int = 1,
        validation_data: object | None = None,
        callbacks: Sequence[Callback] = (),
        batch_size: int | None = None,
        seed: int = 0,
        verbose: int = 1,
        log_every: int = 0,
    ) -> History:
        """Train for ``epochs`` passes over ``train_data``; ``batch_size`` is per replica (default: a DataLoader's own,
        else 32), and each optimizer step takes ``accumulate`` such batches.

        ``train_data``: a map-style Dataset, an ``(inputs, targets)`` pair of tensors or arrays, a DataLoader, or a
        re-iterable of ready batches (``data/sharding.py``). ``verbose``: 0 silent, 1 progress and a line per epoch
        (chief only). ``log_every``: reduce the loss across replicas and print every this many steps (0: once per
        epoch); divergence is detected there.
        """
        strategy = self.strategy
        self._settle_metrics(train_data)
        keys = self.log_keys(validation_data is not None)
        server = strategy.server
        if server is not None:
            # A server (a parameter-server shard) serves until training ends, like `server.join()`.
            hooks = CallbackList(progress_beacon(strategy.process_rank) + list(callbacks), self)
            hooks.on_serve_begin({})
            server.on_version = hooks.on_version
            server.serve()
            hooks.on_serve_end({})
            return History(keys=keys, role=strategy.role.value)
        batch_size = batch_size or getattr(train_data, "batch_size", None) or 32
        step_batch = batch_size * self.recipe.accumulate
        batches = self._batches = strategy.distribute(train_data, step_batch, shuffle=True, drop_last=True, seed=seed)
        global_batch = step_batch * strategy.num_replicas
        defaults: list[Callback] = [ProgressBar(), EpochLog()] if verbose else []
        if verbose and log_every:
            defaults.append(StepLog())
        # The launcher's record of this process's steps comes first: a callback that kills the
        # process at a step (a fault drill) finds it recorded.
        beacon = progress_beacon(strategy.process_rank)
        hooks = CallbackList(beacon + [FollowCoreShare(self.cores)] + list(callbacks) + defaults, self)
        strategy.on_version = hooks.on_version
        self.stop_training = False
        start, cpu_start = time.perf_counter(), time.process_time()
        # A callback may restore a checkpoint here: the loop goes on from the position it set.
        hooks.on_train_begin({"epochs": epochs, "steps_per_epoch": len(batches), "global_batch": global_batch})
        # A replica joining a running job (allreduce-ft) takes the live position here.
        strategy.begin_fit(self)
        if not self._resumed:
            self.history = History(keys=keys)
            self._window = StepWindow()
            self._epoch_sums = EpochSums()
            self.batch = 0
            self._window.first_step = self.global_step + 1
        self._resumed = False
        self.history.keys = keys
        while self.epoch < epochs:
            epoch = self.epoch
            history = self.history
            window = self._window
            batches.set_epoch(epoch, start=self.batch)
            hooks.on_epoch_begin(epoch, {})
            self.module.train()
            # A resumed epoch counts the time it ran before its checkpoint too.
            epoch_start = self._epoch_start = time.perf_counter() - self._epoch_elapsed
            self._epoch_elapsed = 0.0
            waited, moved = batches.wait_seconds, False
            for batch_index, (inputs, targets) in enumerate(batches, start=self.batch + 1):
                self.batch = batch_index
                hooks.on_batch_begin(self.global_step, {})
                try:
                    with self._step_device():
                        out = strategy.train_step(self.model, self.loss_fn, self.optimizer, inputs, targets)
                except RuntimeError as error:
                    raise (strategy.diagnose(error, self.global_step + 1) or error) from None
                except ReplicaLeft:
                    hooks.on_train_left({})  # a save under way ends before the process does
                    raise
                if out.position is not None:  # the run is further on (a fault-tolerant replica
                    self.load_state_dict(out.position)  # healed from a peer): go on from there
                    self._resumed, moved = False, True
                    break
                if out.skipped:
                    self._report_skip(self.global_step + 1, out.loss)
                else:
                    window.add(out.loss, num_examples(targets))
                self.global_step += 1
                logs: dict[str, Any] = {"batch": self.batch, "global_batch": global_batch, "local_loss": out.loss}
                if log_every and self.global_step % log_every == 0 and len(window):
                    logs["loss"] = self._reduce_window()
                hooks.on_batch_end(self.global_step, logs)
                if self.stop_training:  # a callback ends training mid-epoch (e.g. at a step count)
                    hooks.on_stop(self.global_step, logs)  # a checkpoint of this position, mid-epoch
                    break
            if moved:
                continue
            if len(window):
                self._reduce_window()
            epoch_loss, epoch_examples = self._epoch_sums.mean(), self._epoch_sums.examples
            self._epoch_sums, self.batch = EpochSums(), 0
            seconds = time.perf_counter() - epoch_start
            self.train_seconds += seconds
            self.examples_seen += int(epoch_examples)
            self.loader_wait_seconds += batches.wait_seconds - waited
            logs = {
                "epoch": epoch + 1,
                "epochs": epochs,
                "train_loss": epoch_loss,
                "examples_per_second": epoch_examples / seconds if seconds > 0 else 0.0,
                "train_seconds": seconds,  # the epoch's steps; its evaluation and its start come after
                "learning_rate": self.learning_rate,
                "loader_wait_seconds": batches.wait_seconds - waited,
                "examples_seen": self.examples_seen,
            }
            if validation_data is not None:
                logs.update({f"test_{k}": v for k, v in self.evaluate(validation_data).items()})
            logs["wall_seconds"] = time.perf_counter() - start
            logs["cpu_seconds"] = time.process_time() - cpu_start  # this process's, every thread
            history.epochs.append({k: v for k, v in logs.items() if k != "epochs"})
            hooks.on_epoch_end(epoch, logs)
            self.epoch = epoch + 1
            if self.stop_training:
                break
        strategy.finish(self.model)
        hooks.on_train_end({"history": self.history})
        return self.history

    def _note(self, line: str) -> None:
        if self.strategy.is_chief:
            console.print(f"paratrain: {line}")

    def _report_skip(self, step: int, loss: torch.Tensor) -> None:
        if self.strategy.is_chief:
            console.print(
                f"step {step}: loss = {loss.item()}, a NaN or Inf gradient: update skipped "
                f"({self.strategy.skipped_updates} so far)"
            )

    def check_finite(self) -> None:
        """Reduce the losses not yet reduced: DivergedError if one is NaN or Inf (before a
        checkpoint is written, so that a diverged model is never saved)."""
        if len(self._window):
            self._reduce_window()

    def _reduce_window(self) -> float:
        """Reduce the steps' losses since the last reduction across replicas (raising
        DivergedError at a NaN or Inf); adds them to the epoch's sums, returns their mean."""
        try:
            reduced = self._window.reduce(self.strategy)
        except RuntimeError as error:
            raise (self.strategy.diagnose(error, self.global_step) or error) from None
        self._epoch_sums.add(reduced)
        return reduced["loss"]

    # ----- state for checkpoints ------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where the loop stands (epoch, batch, step), what it has logged, the losses it has
        not reduced yet, and this process's random-number generators: with the model,
        optimizer and strategy state, all a checkpoint needs to go on exactly."""
        return {
            "global_step": self.global_step,
            "epoch": self.epoch,
            "batch": self.batch,
            "examples_seen": self.examples_seen,
            "train_seconds": self.train_seconds,
            "epoch_seconds": time.perf_counter() - self._epoch_start if self.batch else 0.0,
            "loader_wait_seconds": self.loader_wait_seconds,
            "learning_rate": self.learning_rate,
            "history": self.history.saved(),
            **self._epoch_sums.state_dict(),
            "window": self._window.state_dict(),
            "rng": rng_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from ``state`` at the next ``fit`` (with the model and optimizer restored)."""
        self.global_step = int(state["global_step"])
        self.epoch = int(state["epoch"])
        self.batch = int(state["batch"])
        self.examples_seen = int(state["examples_seen"])
        self.train_seconds = float(state["train_seconds"])
        self._epoch_elapsed = float(state["epoch_seconds"])
        self.loader_wait_seconds = float(state["loader_wait_seconds"])
        self.set_learning_rate(float(state["learning_rate"]))
        self.history = History.restored(state["history"])
        self._epoch_sums = EpochSums.from_state(state)
        self._window = StepWindow()
        self._window.load_state_dict(state["window"], self.strategy.device)
        set_rng_state(state["rng"])
        self._resumed = True

    def carry_position(self, saved_replicas: int, replicas: int) -> None:
        """After resuming a checkpoint written by ``saved_replicas`` replicas on ``replicas``:
        the current epoch goes on after the examples already read (global batches cover
        consecutive stretches of the epoch's order, so the same examples, rounded down to a
        whole batch of this run)."""
        self.batch = self.batch * saved_replicas // replicas

    def example_batch(self) -> tuple[Any, Any]:
        """The first batch of this replica's training data, for a strategy that must see one
        before the first step (pipeline-ft cuts a traced model at it)."""
        batches = iter(self._batches)
        try:
            return next(batches)
        finally:
            batches.close()

    @torch.no_grad()
    def evaluate(self, data: object, batch_size: int = 256) -> dict[str, float | None]:
        """``loss`` and each metric on ``data``, each replica on its own part, reduced across
        replicas: the means over every example.

        The same keys everywhere; None values on a process that does not evaluate
        (parameter-server shards, and workers other than the chief)."""
        self._settle_metrics(data)
        if not self.strategy.evaluates:
            return dict.fromkeys(("loss", *self.metrics))
        with span("evaluate"):
            try:  # its collectives: a peer lost mid-evaluation is named as one lost mid-step
                return self._evaluate(data, batch_size)
            except RuntimeError as error:
                raise (self.strategy.diagnose(error, self.global_step) or error) from None

    def _evaluate(self, data: object, batch_size: int) -> dict[str, float | None]:
        if self.strategy.remote is not None:
            self.strategy.remote.refresh(self.model)
        model = self.module
        was_training = model.training
        model.eval()
        sums_of = functools.partial(summed_scores, self.strategy, model, self.loss_fn, list(self.metric_fns.values()))
        with self.strategy.evaluating(model):
            count, *totals = self.strategy.evaluation_sums(data, batch_size, sums_of).tolist()
        model.train(was_training)
        return dict(zip(("loss", *self.metrics), (t / max(count, 1) for t in totals)))

    @torch.no_grad()
    def predict(self, data: object, batch_size: int = 256) -> torch.Tensor:
        """Model outputs for every example of ``data``, in order, computed on this process
        (with ``pipeline``: called on every stage, the outputs on the last, empty elsewhere)."""
        model = self.module
        was_training = model.training
        model.eval()
        batches = ShardedBatches(data, batch_size, shuffle=False, drop_last=False, device=self.strategy.device)
        # Through the strategy: pipeline stages all take part, the last one holds the outputs.
        outputs = [self.strategy.forward(model, inputs) for inputs, _ in batches]  # type: ignore[misc]
        outputs = [out for out in outputs if out is not None]
        model.train(was_training)
        return torch.cat(outputs) if outputs else torch.empty(0)
