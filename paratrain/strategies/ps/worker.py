"""A parameter-server worker's side of the wire: its model as flat buffers (buffers.py),
its client to the shards (protocol/client.py), and what it asks of them: the parameters
(a pull, or the reply to a push), the next batch of an epoch shard 0 hands out, where a
resumed run goes on, and at the end, done and the run's statistics. It is the worker's
``remote`` role (strategies/roles.py): its parameters, optimizer and position are the
shards'. The step itself, with the run's policies (NaN, clipping, leaving), is the
strategy's (strategy.py)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from paratrain.comm.packing import PackedGradient
from paratrain.errors import WorkerLost
from paratrain.strategies.accounting import staleness_summary
from paratrain.strategies.ps.buffers import FlatParameters
from paratrain.strategies.ps.layout import ShardLayout
from paratrain.strategies.ps.modes import ModeFacts
from paratrain.strategies.ps.protocol.client import ShardClient
from paratrain.strategies.ps.protocol.wire import DONE, PULL, PUSH, SHUTDOWN, Header
from paratrain.strategies.ps.statistics import max_rss_bytes, run_statistics
from paratrain.timeline import COMM, span


class PSWorker:
    """Worker ``rank`` of ``num_replicas`` (backups included) of a run of ``num_shards``
    shards reached over ``links``; ``store`` is the run's, ``on_version`` is told each
    version received."""

    def __init__(
        self,
        rank: int,
        num_shards: int,
        num_replicas: int,
        backup_workers: int,
        facts: ModeFacts,
        links: list[Any],
        store: Any,
        tags: int,
        timeout: float,
        on_version: Callable[[int], None],
    ):
        self.rank = rank
        self.num_shards = num_shards
        self.num_replicas = num_replicas
        self.backup_workers, self.facts = backup_workers, facts
        self.links = links
        self.store = store
        self.tags = tags
        self.timeout = timeout
        self.on_version = on_version
        self.per_update = 1
        """Gradients per version: 1 (ps-async), else a round's."""
        self.client: ShardClient | None = None
        self.buffers: FlatParameters | None = None
        self.tables: Any = None
        """The model's tables held by the shards (tables/remote.py: TableRows), or None."""
        self.dense: Any = None
        """--dense allreduce: the dense layers all-reduced among the workers (dense.py), or None."""
        self.version_seen = 0
        """The newest parameter version this worker received (its codec state's version)."""
        self.last_staleness = 0
        self.samples_per_push = 0
        self.finished = False
        self._base_lr = 1.0
        self._lr_scale = 1.0
        self._pushed_on: int | None = None
        self._epoch_asking: tuple[int, int] | None = None
        self._server_stats: list[dict[str, Any]] = []

    def prepare(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        layout: ShardLayout,
        device: torch.device,
        pull_dtype: torch.dtype,
        codec: Any,
        codec_factory: Callable[[], Any],
    ) -> None:
        """Make ``model``'s parameters views of the flat buffers, connect to the shards that
        hold ``layout``'s slices, and pull."""
        params = [p for p in model.parameters() if p.requires_grad] if layout.total else []  # else all-reduced
        self.buffers = FlatParameters(params, device, pull_dtype)
        packers = [PackedGradient(codec, codec_factory, layout.piece_shapes(s)) for s in range(self.num_shards)]
        self.client = ShardClient(
            self.rank,
            self.links,
            layout,
            packers,
            self.buffers.pulled,
            tags=self.tags,
            store=self.store,
            backup_workers=self.backup_workers,
            timeout=self.timeout,
        )
        if self.tables is not None:
            self.tables.client = self.client
        self._base_lr = optimizer.param_groups[0]["lr"]
        self.pull(wanted=0)

    def set_learning_rate(self, lr: float, optimizer: torch.optim.Optimizer) -> None:
        # Shards scale each parameter group's rate by this factor (sent with every push).
        self._lr_scale = lr / self._base_lr
        if self.dense is not None:  # the dense layers step here
            self.dense.set_learning_rate(optimizer, lr)

    # ----- the wire ------------------------------------------------------------------------
    def header(
        self, kind: int, *, samples: int = 0, wants_reply: bool = False, wanted: int = 0, finite: bool = True
    ) -> Header:
        """A message to the shards; one that asks for a reply during an epoch of assigned
        batches also asks for a batch."""
        batch = self._epoch_asking if wants_reply else None
        return Header(
            kind,
            samples=samples,
            lr_scale=self._lr_scale,
            wants_reply=wants_reply,
            wanted=wanted,
            batch=batch,
            nonfinite=not finite,
        )

    def await_reply(self) -> None:
        """Take the reply to the last message, if one is due: the parameters into the model."""
        if not self.client.await_reply():
            return
        versions = self.client.versions
        self.version_seen = versions[0]
        self.on_version(self.version_seen)
        if self._pushed_on is not None:
            # The reply to a push comes once the shard applied it, at version v'; a gradient
            # computed on v was then v' - 1 - v versions old (0 in synchronous rounds).
            self.last_staleness = max(versions[0] - 1 - self._pushed_on, 0)
            self._pushed_on = None
        self.buffers.take_pulled()

    def pull(self, wanted: int | None) -> None:
        """The parameters of version ``wanted`` or later; None: of the version each shard
        last sent, or later."""
        self.await_reply()
        self.client.post_reply()
        self.client.send(self.header(PULL, wanted=wanted or 0, wants_reply=True), wanted_seen=wanted is None)
        self.await_reply()

    def push(self, samples: int, finite: bool, last: bool) -> None:
        """Send this step's gradient and ask for the next parameters (and, in an epoch of
        assigned batches, the next batch, unless this is the ``last`` this worker asks for)."""
        if last:
            self._epoch_asking = None
        client = self.client
        client.post_reply()
        header = self.header(PUSH, samples=samples, wants_reply=True, finite=finite)
        sections = self.tables.sections() if self.tables is not None and finite else None
        client.send(header, self.buffers.gradients_to_send(), sections)
        self._pushed_on = client.versions[0]
        self.samples_per_push = samples

    def begin_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Zero the gradient; this step's table rows come with its forward pass."""
        self.buffers.grads.zero_()
        if self.tables is not None:
            self.tables.clear()
        if self.dense is not None:
            self.dense.begin_step(optimizer)

    def reduce_dense(self, model: nn.Module) -> bool:
        """--dense allreduce: average the dense gradient over the workers; whether it is finite."""
        return self.dense.reduce(model) if self.dense is not None else True

    def step_dense(self, optimizer: torch.optim.Optimizer, finite: bool) -> None:
        """--dense allreduce: the dense layers' step, the same on every worker."""
        if self.dense is not None and finite:
            optimizer.step()

    def gradient_is_finite(self) -> bool:
        """Whether this step's gradient (its table rows' too) holds no NaN or Inf."""
        finite = bool(torch.isfinite(self.buffers.grads).all())
        return finite and (self.tables is None or self.tables.finite())

    def assigned_batches(self, epoch: int, num_batches: int) -> Iterator[int]:
        """Indices of the batches of ``epoch`` that shard 0 hands this worker, one per step:
        each comes with the parameters of the reply to the previous push."""
        self._epoch_asking = (epoch, num_batches)
        try:
            with span("pull", COMM):  # the epoch's first batch
                self.pull(wanted=None)
            while self.client.assigned >= 0:
                yield self.client.assigned
                # The reply to this step's push: parameters and the next batch. The loop waits
                # for it here, in its batch, on the comm track as the train step's own pull.
                with span("pull", COMM):
                    self.await_reply()
        finally:
            self._epoch_asking = None

    # ----- the remote role (strategies/roles.py) --------------------------------------------
    def resume_position(self) -> dict[str, Any]:
        """A worker goes on from the checkpoint shard 0 took, at the epoch and step it
        restored (its parameters come with its first pull); the shards' state is the run's,
        so the epochs' logs start anew. ``folder`` is None when the shards started afresh."""
        try:
            self.store.wait(["resume"], timedelta(seconds=self.timeout))
        except RuntimeError as error:  # the store's timeout (DistStoreError)
            raise WorkerLost(
                f"worker {self.rank}: ps shard 0 did not say which checkpoint the shards resumed from within "
                f"--timeout {self.timeout:g} s ({str(error).splitlines()[0]})"
            ) from None
        position = json.loads(self.store.get("resume"))
        per_worker = self.num_replicas if self.facts.one_update_per_gradient else 1
        return {
            "global_step": position["version"] // per_worker,
            "epoch": position["epoch"],
            "version": position["version"],
            "folder": position["folder"],
        }

    def examples_applied(self) -> int:
        # Shard 0's version counts updates: one gradient each in async mode, a round of
        # workers - backup_workers gradients in sync and backup mode (full batches: drop_last).
        return self.client.versions[0] * self.per_update * self.samples_per_push

    def refresh(self, model: nn.Module) -> None:
        """Bring this worker up to the shards' current parameters (before evaluating)."""
        self.pull(wanted=0)

    # ----- the end ---------------------------------------------------------------------------
    def finish(self, is_chief: bool, keeps_state: bool) -> None:
        """Say done. The chief then waits for every shard to finish and takes the final
        parameters, so the final evaluation sees every update (async ones too); a worker
        whose codec ``keeps_state`` learns the final version its state is that of."""
        if self.finished:
            return
        client = self.client
        mine = {"bytes_sent": client.bytes_sent + client.message_bytes(), "max_rss": max_rss_bytes()}
        self.store.set(f"worker/{self.rank}", json.dumps(mine))
        # Done first: a shard answers a done worker's last pull at once, whatever the rule.
        client.send(self.header(DONE))
        self.await_reply()
        client.drain()  # the shard must have all of it before this process may go
        self.finished = True
        if keeps_state:
            # The shards save the final version at the end; this worker's codec is done
            # changing: its state is that of the final version.
            self.store.wait(["stats/0"], timedelta(seconds=self.timeout))
            self.version_seen = json.loads(self.store.get("stats/0"))["version"]
        if is_chief:
            keys = [f"stats/{s}" for s in range(self.num_shards)]
            self.store.wait(keys, timedelta(seconds=self.timeout))
            self._server_stats = [json.loads(self.store.get(k)) for k in keys]
            self.pull(wanted=0)

    def step_counters(self) -> dict[str, float]:
        """This worker's traffic, waiting and staleness so far (the step log's columns)."""
        return {
            "bytes_sent": self.client.bytes_sent,
            "wait_seconds": self.client.wait_seconds,
            "staleness": self.last_staleness,
        }

    def stats(self) -> dict[str, Any]:
        """On the chief after ``finish``: totals over every shard and worker (before it, or on
        another worker: this worker's traffic)."""
        if not self._server_stats:
            sent = self.client.bytes_sent if self.client else 0
            return {"bytes_sent": sent, "dropped_gradients": 0, "staleness": staleness_summary({})}
        first = self._server_stats[0]
        others = [
            json.loads(self.store.get(f"worker/{w}"))
            for w in [*range(1, self.num_replicas), *first["workers_joined"]]
            if w not in first["workers_lost"]
        ]
        # The chief's own count is live (its final pull and the coming shutdown included).
        chief = self.client.bytes_sent + self.client.message_bytes()
        stats = run_statistics(
            self._server_stats, sum(w["bytes_sent"] for w in others), chief, self.buffers.pull_ratio()
        )
        stats["max_rss_bytes"] = {
            "workers": [max_rss_bytes(), *(w.get("max_rss", 0) for w in others)],
            "shards": [s.get("max_rss", 0) for s in self._server_stats],
        }
        if self.dense is not None:  # every worker sent as much in the dense layers' all-reduces
            stats["bytes_sent"] += self.dense.bytes_sent * self.num_replicas
            stats["dense_allreduce_bytes"] = self.dense.bytes_sent * self.num_replicas
        return stats

    def shut_down_shards(self) -> None:
        """The chief, once the run is over: the shards may stop serving."""
        self.client.send(self.header(SHUTDOWN))
        self.client.drain()
