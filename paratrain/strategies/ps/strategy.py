"""``ps-sync``, ``ps-backup``, ``ps-async``: parameter-server training.

Ranks ``0..P-1`` are shards (``--ps-shards P``), the rest workers, worker 0 the chief. Each step a worker pulls
the parameters from every shard, computes gradients on its slice of the global batch and pushes each shard
its slice; the shard's update rule (policies.py) decides what happens to it. Transport is c10d
point-to-point over Gloo (PS state lives in host memory, as in the classic design), the control plane a
TCPStore. Every process makes the same ParameterServerStrategy, which joins the run (membership.py) and
composes its role (ShardHost, host.py; PSWorker, worker.py); per-mode facts come from modes.MODES.
"""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim import Optimizer

from paratrain.checkpoints.files import RunCheckpoints
from paratrain.comm.codec_config import CodecConfig, make_codec
from paratrain.comm.codecs import Codec
from paratrain.data.batch import num_examples
from paratrain.data.sharding import ShardedBatches
from paratrain.errors import ReplicaLeft
from paratrain.periodic import Periodic
from paratrain.session.leaving import LeaveOnSigterm
from paratrain.strategies.accounting import staleness_summary
from paratrain.strategies.base import DEFAULT_TIMEOUT_S, Strategy
from paratrain.strategies.device import resolve_device
from paratrain.strategies.ps.batches import run_batches
from paratrain.strategies.ps.checkpoint import ShardState, WorkerState
from paratrain.strategies.ps.dense import DenseAllReduce
from paratrain.strategies.ps.heartbeat import heartbeat
from paratrain.strategies.ps.host import ShardHost
from paratrain.strategies.ps.join_access import JoinAccess, output_folder, say_joined
from paratrain.strategies.ps.joining import describe_run, run_options
from paratrain.strategies.ps.layout import ShardLayout
from paratrain.strategies.ps.membership import Membership, join_own_run, join_running_run
from paratrain.strategies.ps.modes import (
    MODES,
    PULL_DTYPES,
    PSConfig,
    PSMode,
    PSTopology,
    check_run,
    survives_lost_worker,
)
from paratrain.strategies.ps.tables.setup import check_model_tables, worker_tables
from paratrain.strategies.ps.worker import PSWorker
from paratrain.strategies.recipe import StepRecipe
from paratrain.strategies.spec import process_options
from paratrain.strategies.step import LossFn, StepOutput
from paratrain.strategies.topology import Role
from paratrain.timeline import COMM, span

if TYPE_CHECKING:
    from pathlib import Path

    from paratrain.config import TrainConfig
    from paratrain.strategies.roles import FitLoop


class ParameterServerStrategy(Strategy):
    """Parameter-server training; ``mode`` is ``"sync"``, ``"backup"`` or ``"async"`` (or a PSMode)."""

    PULL_DTYPES = PULL_DTYPES
    takes_compression = True
    scales_loss = False  # the optimizer runs on the shards
    # The shards hold the whole state and hand out batches by their index in the epoch's
    # order: any number of workers goes on from a checkpoint, on any number of shards
    # (reshard.py).
    reshards = True
    checkpoints_in_background = False  # shards save at versions and commit in the background always

    def __init__(
        self,
        mode: str | PSMode = "sync",
        num_shards: int = 1,
        backup_workers: int = 0,
        staleness_bound: int | None = None,
        stale_policy: str = "none",
        max_staleness: int = 4,
        warmup_steps: int = 0,
        heartbeat_timeout: float = 10.0,
        device: str = "auto",
        timeout: float = DEFAULT_TIMEOUT_S,
        compression: str = "none",
        codec_options: CodecConfig | None = None,
        pull_compression: str = "none",
        on_worker_lost: str = "stop",
        workers: int | None = None,
        join: str | None = None,
        joiners: bool = True,
        join_token_file: str | None = None,
        tables: str = "none",
        table_sharding: str = "mod",
        table_optimizer: str = "auto",
        dense: str = "ps",
    ):
        # `workers` counts the workers of a round; backup workers come on top of them.
        super().__init__(device=device, timeout=timeout, workers=workers)
        self.mode = PSMode.of(mode.value if isinstance(mode, PSMode) else mode)
        self.config = PSConfig(
            ps_shards=num_shards,
            backup_workers=backup_workers,
            staleness_bound=staleness_bound,
            stale_policy=stale_policy,
            max_staleness=max_staleness,
            warmup_steps=warmup_steps,
            pull_compression=pull_compression,
            on_worker_lost=on_worker_lost,
            join=join,
            joiners=joiners,
            join_token_file=join_token_file,
            tables=tables,
            table_sharding=table_sharding,
            table_optimizer=table_optimizer,
            dense=dense,
        )
        self.join = join  # HOST:PORT of a running run this worker joins (joining.py); None: its own run's
        self.run_options: dict[str, Any] | None = None  # the run's flags, published to the workers that join it
        self.token_folder: Path | None = None  # where the chief saves the join token (join_access.py)
        self.join_access: JoinAccess | None = None  # how workers join this run: its token, open or not
        self.name = self.mode.strategy_name
        self.facts = MODES[self.mode]
        self.num_shards, self.backup_workers = num_shards, backup_workers
        self.pull_compression = pull_compression
        self.heartbeat_timeout = heartbeat_timeout
        # Workers compress each push with `compression`; shards decode with a fresh codec.
        self.compression, self.codec_options = compression, codec_options
        self.codec = make_codec(compression, codec_options)
        self.host: ShardHost | None = None
        """The shard this process serves as (None on a worker)."""
        self._heartbeat: Periodic | None = None
        self.worker: PSWorker | None = None
        """This process's side of the wire where it is a worker (None on a shard)."""
        self.membership: Membership | None = None
        """This process's place in the run (membership.py), once it joined."""
        self._per_update = 1  # gradients per version: 1 (ps-async), else a round's
        self._sigterm = LeaveOnSigterm()  # asked: say done after this step and leave
        self.dense: DenseAllReduce | None = None  # --dense allreduce: the workers' own dense step

    # ----- configuration ---------------------------------------------------------------
    @classmethod
    def topology_for(cls, config: TrainConfig) -> PSTopology:
        return PSTopology.of(PSMode.of(config.strategy), config.ps, config.num_worker_processes)

    @classmethod
    def check_config(cls, config: TrainConfig) -> None:
        check_run(config)

    @classmethod
    def check_model(cls, model: nn.Module, config: TrainConfig) -> None:
        check_model_tables(model, config)

    @classmethod
    def from_config(cls, config: TrainConfig) -> ParameterServerStrategy:
        ps = config.ps  # the section's fields are the constructor's keywords (ps_shards: num_shards)
        section = {field.name: getattr(ps, field.name) for field in fields(ps) if field.name != "ps_shards"}
        strategy = cls(
            mode=PSMode.of(config.strategy),
            num_shards=ps.num_shards,
            heartbeat_timeout=config.heartbeat_timeout,
            compression=config.codec.compression,
            codec_options=config.codec,
            **process_options(config),
            **section,
        )
        strategy.run_options = run_options(config.to_dict())
        strategy.token_folder = output_folder(config.metrics_out, config.checkpoint_dir, config.logdir)
        return strategy

    def planned_topology(self) -> PSTopology:
        return self._topology((self.workers or 1) + self.backup_workers)

    def _topology(self, num_workers: int) -> PSTopology:
        return PSTopology.of(self.mode, self.config, num_workers)

    def describe(self) -> dict[str, Any]:
        workers = self.num_replicas - self.backup_workers
        shards = self.num_shards
        backups = self.backup_workers
        return {
            "strategy": self.name,
            "workers": workers,
            "ps_shards": shards,
            "backup_workers": backups,
            "compression": self.codec.name,
            "pull_compression": self.pull_compression,
        }

    # ----- process -----------------------------------------------------------------------
    def setup(self) -> None:
        if self._ready:
            return
        self.join_access = JoinAccess.of(self.facts.admits_joiners, self.config)
        if self.join:
            self.membership = join_running_run(
                self.join, self._joining_facts(), self.num_shards, self.timeout, self.join_access.token
            )
            self.workers = None  # this process's place is the one the run gave it, not --workers
        else:
            # Parameter-server traffic is host memory over Gloo, on GPUs too.
            self.membership = join_own_run(self.name, self.num_shards, self.timeout, lambda: self._join_group("gloo"))
        member = self.membership
        self.process_rank = member.process_rank
        self.topology = self._topology(member.num_workers)
        if self.role is Role.WORKER:
            self.device = resolve_device(self.device_preference, member.local_rank)
        if self.config.dense == "allreduce":  # every rank makes the workers' group (dense.py)
            self.dense = DenseAllReduce(self.num_shards, self.num_replicas)
        own = 1 if self.facts.one_update_per_gradient else self.num_replicas - self.backup_workers
        self._per_update = member.joined["run"]["per_update"] if member.joined is not None else own
        if self.role is Role.PS:
            self.host = ShardHost(
                self.rank,
                self.num_shards,
                self.num_replicas,
                self.mode,
                self.config,
                self.membership.store,
                heartbeat_timeout=self.heartbeat_timeout,
                timeout=self.timeout,
                codec_factory=self._fresh_codec,
                tags=self.membership.tags,
                join_key=self.join_access.key(self.membership.prefix),
            )
        else:
            self.worker = PSWorker(
                self.rank,
                self.num_shards,
                self.num_replicas,
                self.backup_workers,
                self.facts,
                self.membership.links,
                self.membership.store,
                self.membership.tags,
                self.timeout,
                on_version=lambda version: self.on_version(version),  # the Trainer sets it later
            )
            self.worker.per_update, self.worker.dense = self._per_update, self.dense
            self._heartbeat = heartbeat(self.membership.store, self.rank, self.heartbeat_timeout).start()
        super().setup()

    @property
    def evaluates(self) -> bool:
        return self.is_chief

    @property
    def server(self) -> ShardHost | None:
        """The shard this process serves as (roles.py); None on a worker."""
        return self.host

    @property
    def remote(self) -> PSWorker | None:
        """A worker's parameters, optimizer and position are the shards' (roles.py)."""
        return self.worker

    def state_writer(self, files: RunCheckpoints, loop: FitLoop) -> ShardState | WorkerState:
        """A shard writes its slice at versions, a worker its codec's state beside them (checkpoint.py)."""
        if self.host is not None:
            return ShardState(files, self, self.host)
        return WorkerState(files, self, self.worker, loop, self._codec_has_state())

    # ----- model -------------------------------------------------------------------------
    def prepare(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, recipe: StepRecipe | None = None
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        self.setup()
        self.use_recipe(recipe)
        if self.host is not None:
            self.host.prepare(model, optimizer)
            if self.rank == 0 and self.facts.admits_joiners:
                describe_run(
                    self.membership,
                    **self._joining_facts(),
                    workers=self.num_replicas,
                    parameters=self.host.server.layout.total,
                    per_update=self._per_update,
                    options=self.run_options,
                    joiners=self.join_access.open,
                )
            return model, optimizer
        pull_dtype = self.PULL_DTYPES[self.pull_compression]
        self.worker.tables = worker_tables(model, self.config, pull_dtype)  # out of the model first
        model = self.recipe.prepare_model(model.to(self.device))
        layout = ShardLayout.of(model, self.num_shards, dense=self.dense is None)
        if self.dense is not None:
            self.dense.prepare(model)
        self.membership.check_parameters(layout.total, self.join)
        self.worker.prepare(model, optimizer, layout, self.device, pull_dtype, self.codec, self._fresh_codec)
        return model, optimizer

    def _joining_facts(self) -> dict[str, Any]:
        """What a joining worker must share with the run (joining.py checks them)."""
        facts = {"strategy": self.name, "shards": self.num_shards, "compression": self.codec.name}
        return {**facts, "pull_compression": self.pull_compression, "tables": self.config.tables}

    def begin_fit(self, trainer: Any) -> None:
        """A worker that joined goes on from where the run stands (the epoch whose batches
        shard 0 hands out now). A worker the run may lose (not the chief) leaves cleanly
        on SIGTERM: it finishes its step, says done, and exits 0."""
        if self.role is not Role.WORKER:
            return
        if self.membership.joined is not None:
            trainer.epoch, trainer.global_step = self.membership.joined_position(self.facts.one_update_per_gradient)
            say_joined(self.rank, self.join, self.membership.joined["position"])
        elif self.is_chief and self.facts.admits_joiners:
            self.join_access.announce(self.membership.address, self.token_folder)
        if not self.is_chief and survives_lost_worker(self.mode, self.config):
            self._sigterm.install()

    # ----- state: a shard's slice, or a worker's codec ----------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """On a shard: its slice of the parameters, optimizer, version and data position (the
        parts of a checkpoint). On a worker whose codec keeps state (error feedback, PowerSGD,
        stochastic rounding): that state, as of its last push, and the version it last saw
        (a file beside the checkpoint); empty for a stateless codec."""
        if self.host is not None:
            return self.host.state_dict()
        if not self._codec_has_state():
            return {}
        return {"codec": self.codec.state_dict(), "version": self.worker.version_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.host is not None:
            self.host.load_state_dict(state)
        else:
            self.codec.load_state_dict(state["codec"])

    def _codec_has_state(self) -> bool:
        return type(self.codec).state_dict is not Codec.state_dict

    def _fresh_codec(self) -> Any:  # the shards decode each push with one
        return make_codec(self.compression, self.codec_options)

    def train_step(
        self, model: nn.Module, loss_fn: LossFn, optimizer: Optimizer, inputs: Any, targets: Any
    ) -> StepOutput:
        """Compute on the parameters the last push asked for, then push the gradient and ask
        for the next parameters in the same message. The optimizer runs on the shards."""
        worker = self.worker
        with span("pull", COMM):  # the reply to the last push: parameters (and staleness)
            worker.await_reply()
        worker.begin_step(optimizer)
        loss, outputs = self.recipe.forward_backward(model, loss_fn, inputs, targets, self.device)
        self.steps_taken += 1
        if self.recipe.clip_grad_norm:  # this worker's own gradient, before the push
            self.clip_gradients(model)
        # A worker sees its own gradient only: it flags it, and the shards skip it (in ps-sync
        # and ps-backup: the whole round it is part of).
        dense_finite = worker.reduce_dense(model)  # every worker, every step (--dense allreduce)
        finite = not self.skip_nonfinite(model, loss, lambda: dense_finite and worker.gradient_is_finite())
        samples = num_examples(targets)
        leaving = self._sigterm.asked  # asked to leave (SIGTERM): this batch is the last one it asks for
        with span("push", COMM):
            worker.push(samples, finite, last=leaving)
        worker.step_dense(optimizer, finite)
        self._steps += 1
        if leaving:
            self.finish(model)  # done: the shards stop counting on this worker
            raise ReplicaLeft(
                f"worker {self.rank} left the run after step {self.steps_taken} (SIGTERM); the others go on"
            )
        return StepOutput(loss, outputs, skipped=not finite)

    def step_counters(self) -> dict[str, float]:
        return self.worker.step_counters()

    def set_learning_rate(self, optimizer: torch.optim.Optimizer, lr: float) -> None:
        if self.worker is not None:
            self.worker.set_learning_rate(lr, optimizer)  # the shards' optimizers scale theirs

    # ----- end of training -------------------------------------------------------------------
    def finish(self, model: nn.Module) -> None:
        """Workers: say done (worker.py); the chief takes the final parameters and statistics."""
        if self.worker is not None:
            self.worker.finish(self.is_chief, keeps_state=self._codec_has_state())

    def distribute(
        self, dataset: object, batch_size: int, *, shuffle: bool = True, drop_last: bool = True, seed: int = 0
    ) -> ShardedBatches:
        if self.config.dense == "allreduce" and drop_last:  # lockstep: each worker its share, as allreduce
            return super().distribute(dataset, batch_size, shuffle=shuffle, drop_last=drop_last, seed=seed)
        self.setup()
        return run_batches(self, dataset, batch_size, shuffle, drop_last, seed, self.facts.whole_rounds)

    def stats(self) -> dict[str, Any]:
        """On the chief after finish(): totals over every shard and worker."""
        empty = {"bytes_sent": 0, "dropped_gradients": 0, "staleness": staleness_summary({})}
        return self.worker.stats() if self.worker is not None else empty

    def teardown(self) -> None:
        if self._ready and self.is_chief and self.worker is not None and self.worker.finished:
            self.worker.shut_down_shards()
        if self._heartbeat is not None:
            self._heartbeat.stop()  # out of the store before it goes
            self._heartbeat = None
        if self.join_access is not None:
            self.join_access.close()  # the run is over: the file of its join token goes
        self._sigterm.uninstall()
        super().teardown()
