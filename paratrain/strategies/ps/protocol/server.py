"""One parameter-server shard: holds a slice of the parameters and its optimizer, and serves.

Three threads share the shard's state under one lock: the receiver takes headers from any worker in
arrival order (``recv(src=None)``) and handles each message at once (a round trip costs one wake-up); the
monitor watches the workers' heartbeats in the TCPStore (a lost worker ends a ps-sync run, naming it; other
modes go on); the main thread waits until every worker is done or lost, publishes the shard's statistics and
returns when the chief says the run is over. Gloo's any-source receives keep working when a peer dies,
which is what lets a shard outlive a worker.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from paratrain.comm.codec_config import make_codec
from paratrain.comm.packing import PackedGradient
from paratrain.errors import ConfigError, WorkerLost
from paratrain.strategies.ps.heartbeat import Watch
from paratrain.strategies.ps.joining import JoinAdmitter
from paratrain.strategies.ps.layout import ShardLayout
from paratrain.strategies.ps.policies import AsyncRule, Gradient, SyncRule
from paratrain.strategies.ps.protocol.batch_dealer import BatchDealer
from paratrain.strategies.ps.protocol.counters import ShardCounters
from paratrain.strategies.ps.protocol.links import WorldLink
from paratrain.strategies.ps.protocol.optimizer import shard_optimizer
from paratrain.strategies.ps.protocol.receiving import Receiving
from paratrain.strategies.ps.protocol.replies import Replies
from paratrain.strategies.ps.protocol.validator import MessageValidator
from paratrain.strategies.ps.protocol.wire import (
    DONE,
    HEADER_BYTES,
    PULL,
    PUSH,
    ROWS,
    SHUTDOWN,
    Header,
    Malformed,
    checks_lateness,
    message_buffer,
)
from paratrain.strategies.ps.reshard import optimizer_order, reshard
from paratrain.strategies.ps.statistics import max_rss_bytes


class ShardServer:
    def __init__(
        self,
        shard: int,
        num_shards: int,
        num_workers: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        rule: Any,
        store: Any,
        heartbeat_timeout: float,
        tolerate_loss: bool,
        wait_timeout: float,
        join_key: tuple[str, str] | None = None,
        codec_factory: Any = None,
        pull_dtype: torch.dtype = torch.float32,
        tags: int = 0,
        rule_name: str = "",
        on_version: Callable[[int], None] | None = None,
        tables: Any = None,
        dense: bool = True,
    ):
        self.tags = tags  # this run's offset of the message tags
        self.rule_name = rule_name or type(rule).__name__
        self.on_version = on_version or (lambda version: None)
        """Called with each version published, under the lock: the state is that version's."""
        self.shard = shard
        self.num_shards = num_shards
        self.num_workers = num_workers
        self.rule, self.store = rule, store
        self.tolerate_loss, self.wait_timeout = tolerate_loss, wait_timeout
        self.join_key = join_key  # (join token, run): workers that prove it may join (joining.py)
        self.layout = ShardLayout.of(model, num_shards, dense)  # dense=False: workers all-reduce it
        params = [p for p in model.parameters() if p.requires_grad] if self.layout.total else []
        group_of = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
        self.group_of = [group_of[id(p)] for p in params]  # each parameter's group in the user's optimizer
        flat = torch.cat([p.detach().reshape(-1).cpu() for p in params]) if params else torch.zeros(0)
        self.params = flat[self.layout.shard_range(shard)].clone()
        self.grad = torch.zeros_like(self.params)
        self.held = torch.zeros_like(self.params)
        # Gradients arrive compressed by the workers' codec (identity by default).
        fresh = codec_factory or (lambda: make_codec("none"))
        self.packer = PackedGradient(fresh(), fresh, self.layout.piece_shapes(shard))
        # Two message buffers: the next receive is posted before this message is handled.
        self.messages = [message_buffer(self.packer.nbytes) for _ in range(2)]
        self.validator = MessageValidator(self.packer.nbytes)  # what the shard lets in (validator.py)
        self.receiving = Receiving(self)  # its threads that read the links (receiving.py)
        self.incoming = torch.zeros_like(self.params)
        # Replies may carry the parameters in 16 bits (--pull-compression); cast once per version.
        self.pull_dtype = pull_dtype
        self.replies = Replies(self)  # what it sends back (replies.py)
        self.optimizer = self._shard_optimizer(optimizer)
        self.base_lrs = [group["lr"] for group in self.optimizer.param_groups]
        self.version = 0
        self._cpu_start = time.process_time()  # serve() starts it again
        self._held: list[Gradient] = []
        self._waiting: list[tuple[int, int, tuple[int, int] | None]] = []  # (worker, wanted, (epoch, batches))
        self.batch_dealer = BatchDealer(deals=shard == 0)  # shard 0 hands out each epoch's batches in turn
        self.workers = set(range(num_workers))  # the run's workers, and those that joined it since
        self.joined: list[int] = []
        self.links: dict[int, Any] = {}  # worker -> its link (links.py), made by serve() and admit()
        self._clocks = dict.fromkeys(range(num_workers), 0)
        self.watch = Watch(store, heartbeat_timeout, wait_timeout)  # which workers fell silent
        self.done: set[int] = set()
        self.lost: set[int] = set()
        self.counters = ShardCounters()
        # Under backup workers a round closes without the slowest: its version goes to the
        # store, where a worker looks before pushing a large gradient that would come late.
        backups = num_workers - rule.required if isinstance(rule, SyncRule) else 0
        self.announces = checks_lateness(backups, self.packer.nbytes)
        self.tables = tables  # this shard's rows of the run's tables (tables/shard.py), or None
        self.row_policy = rule.policy if isinstance(rule, AsyncRule) else None  # judges each row's staleness
        self.lock = threading.Lock()
        self.finished = threading.Event()
        self.fatal: str | None = None

    def _shard_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The user's optimizer class and hyper-parameters, over this shard's pieces."""
        pieces = optimizer_order(self.layout, self.shard, self.group_of)
        return shard_optimizer(optimizer, pieces, self.params, self.grad, self.group_of)

    # ----- state the rules and the validator read ----------------------------------------
    def active_workers(self) -> set[int]:
        """Workers that may still send gradients."""
        return self.workers - self.done - self.lost

    def request_of(self, worker: int) -> bool:
        return any(w == worker for w, _, _ in self._waiting)

    def holds_push_of(self, worker: int) -> bool:
        return any(g.worker == worker for g in self._held)

    def epochs_dealt(self) -> dict[int, int]:
        return self.batch_dealer.num_batches

    def deals(self) -> bool:
        return self.batch_dealer.deals

    def clocks(self) -> dict[int, int]:
        return self._clocks

    def section_bound(self, header: Header) -> int:
        """The longest table section a message with ``header`` may bring (0: none)."""
        if self.tables is None:
            return 0
        if header.kind == ROWS:
            return self.tables.request_bound()
        return self.tables.push_bound() if header.has_payload else 0

    # ----- serving ------------------------------------------------------------------------
    def serve(self) -> dict[str, Any]:
        """Serve until every worker is done or lost; returns this shard's statistics."""
        self._cpu_start = time.process_time()
        for worker in range(self.num_workers):
            self.watch.heard(worker)
        self._announce()
        self.links.update({w: WorldLink(w + self.num_shards) for w in range(self.num_workers)})
        receiver = threading.Thread(target=self.receiving.run, name="ps-receiver", daemon=True)
        monitor = threading.Thread(target=self._monitor_loop, name="ps-monitor", daemon=True)
        receiver.start()
        monitor.start()
        if self.join_key is not None:
            JoinAdmitter(self.store, self.shard, self.finished, self.admit, self.wait_timeout, self.join_key).start()
        self.finished.wait()
        # The monitor uses the store; it must be out of it before this process may exit.
        monitor.join()
        if self.fatal:
            raise WorkerLost(self.fatal)
        with self.lock:
            self.replies.flush()
            stats = self.statistics()
        self.store.set(f"stats/{self.shard}", json.dumps(stats))
        # Keep answering pulls (the chief's final one) until the chief says the run is over.
        receiver.join(timeout=self.wait_timeout)
        return stats

    def _handle(self, worker: int, message: torch.Tensor, header: Header, section: Any = None) -> bool:
        """One message from ``worker`` (``header``: its header, validated; ``section``: the
        table section that came with it); False for the chief's word that the run is over."""
        self.watch.heard(worker)
        with self.lock:
            if header.kind == ROWS:
                self.replies.rows(worker, section)
            elif header.kind == PUSH:
                finite = not header.nonfinite
                if header.has_payload:  # a non-finite or late push carries no payload
                    try:
                        self.packer.decompress_into(message[HEADER_BYTES:], self.incoming)
                    except (RuntimeError, ValueError, IndexError):
                        self.receiving.refuse(worker, "a payload that does not decode")
                        return True
                    finite = bool(torch.isfinite(self.incoming).all())  # else skipped, as --on-nan skip does
                rows = None
                if self.tables is not None and header.has_payload:
                    try:
                        rows = self.tables.read_push(section)
                    except Malformed as refusal:
                        self.receiving.refuse(worker, refusal.reason)
                        return True
                self.counters.late_pushes += header.late
                grad = Gradient(worker, header.version, header.samples, header.lr_scale, finite)
                self._on_push(grad, rows)
                if header.wants_reply:
                    self._waiting.append((worker, self.rule.wanted_after(grad), header.batch))
            elif header.kind == PULL:
                self._waiting.append((worker, header.wanted, header.batch))
            elif header.kind == DONE:
                self.done.add(worker)
            elif header.kind == SHUTDOWN:
                return False
            self._progress()
        return True

    def admit(self, worker: int, link: Any) -> dict[str, int]:
        """Serve ``worker``, which joined the running run over ``link``: it starts level with
        the slowest live worker (a staleness bound must not hold the others back for it).
        Returns where the run stands (``position``)."""
        with self.lock:
            live = [self._clocks[w] for w in self.active_workers()]
            self._clocks[worker] = min(live, default=0)
            self.watch.heard(worker)
            self.links[worker] = link
            self.workers.add(worker)
            self.joined.append(worker)
            position = self.position()
        threading.Thread(target=self.receiving.joined, args=(worker, link), name="ps-joined", daemon=True).start()
        return position

    def _on_push(self, grad: Gradient, rows: Any = None) -> None:
        self._clocks[grad.worker] += 1
        self.counters.samples += grad.samples
        lr_scale = grad.lr_scale  # before the rule scales it for the dense gradient's staleness
        verdict = self.rule.accept(grad, self)
        if rows is not None and grad.finite:
            if self.row_policy is not None:  # ps-async: each row by its own staleness
                self.tables.step_now(rows, lr_scale, self.row_policy)
            elif verdict == "hold":
                self.tables.hold(rows, grad.samples)
        if verdict == "drop":
            self.counters.dropped += 1
            self.counters.dropped_samples += grad.samples
        elif verdict == "apply" and not grad.finite:
            self.counters.skipped += 1  # ps-async: nothing applied, no version published
        elif verdict == "apply":
            self.counters.staleness[self.version - grad.version] += 1
            self.grad.copy_(self.incoming)
            self._apply(grad.lr_scale)
        else:  # hold for this version's average, weighted by samples
            if grad.finite:
                self.held.add_(self.incoming, alpha=grad.samples)
            self._held.append(grad)

    def _progress(self) -> None:
        """Publish a version if the held gradients make one; answer the pulls that may go."""
        if self._held and self.rule.ready({g.worker for g in self._held}, self):
            # fewer than a round's gradients: workers were lost (or an epoch's end under backups)
            self.counters.short_rounds += len(self._held) < self.rule.required
            if all(g.finite for g in self._held):
                total = sum(g.samples for g in self._held)
                self.grad.copy_(self.held).div_(total)
                self.counters.staleness[0] += len(self._held)
                if self.tables is not None:
                    self.tables.step_held(total, self._held[0].lr_scale)
                self._apply(self._held[0].lr_scale)
            else:  # the average holds a NaN or Inf: the version comes without an update
                self.counters.skipped += 1
                if self.tables is not None:
                    self.tables.drop_held()
                self._apply(self._held[0].lr_scale, skip=True)
            self.held.zero_()
            self._held.clear()
        still_waiting = []
        for worker, wanted, batch in self._waiting:
            # A worker that is done gets what there is: nothing more will come for it.
            if worker in self.done or self.rule.may_pull(worker, wanted, self):
                self.replies.params(worker, self.batch_dealer.deal(batch))
            else:
                still_waiting.append((worker, wanted, batch))
        self._waiting = still_waiting
        if not self.active_workers():
            self.finished.set()

    def _apply(self, lr_scale: float, skip: bool = False) -> None:
        """One optimizer step (none with ``skip``), then the next version."""
        if not skip:
            self.replies.flush()  # their bytes are read from self.params, about to change
            for group, base in zip(self.optimizer.param_groups, self.base_lrs):
                group["lr"] = base * lr_scale
            self.optimizer.step()
        self.version += 1
        self._announce()
        # Before this version's pulls are answered: a checkpoint taken now holds exactly the
        # batches of the gradients applied (in synchronous rounds).
        self.on_version(self.version)

    def _announce(self) -> None:
        """This shard's version to the store, where workers check a push for lateness."""
        if self.announces:
            self.store.set(f"version/{self.shard}", str(self.version))

    # ----- liveness -----------------------------------------------------------------------
    def _monitor_loop(self) -> None:
        while not self.finished.wait(self.watch.interval):
            for worker, why in self.watch.silent(sorted(self.active_workers())):
                with self.lock:
                    if worker in self.active_workers():
                        self._lose(worker, why)
                        self._progress()

    def _lose(self, worker: int, why: str) -> None:
        self.lost.add(worker)
        if not self.tolerate_loss:
            self.fatal = (
                f"worker {worker} (rank {worker + self.num_shards}) was lost ({why}) at version "
                f"{self.version}; {self.rule_name} needs every worker (--on-worker-lost continue goes on without it)"
            )
            self.finished.set()

    # ----- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "params": self.params.clone(),
            "optimizer": self.optimizer.state_dict(),
            "version": self.version,
            **self.batch_dealer.state_dict(),
            **self.counters.state_dict(),
            **({"tables": self.tables.state_dict()} if self.tables is not None else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["params"].shape != self.params.shape:
            raise ConfigError(
                f"checkpoint shard {self.shard} holds {state['params'].numel()} parameters, this shard {self.params.numel()}"
            )
        self.params.copy_(state["params"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
        self.batch_dealer.load_state_dict(state)
        self.counters.load_state_dict(state)
        if self.tables is not None:
            if "tables" not in state:
                raise ConfigError("the checkpoint was written without --tables: its tables were dense")
            self.tables.load_state_dict(state["tables"])

    def holds_as_saved(self, state: dict[str, Any]) -> bool:
        return self.tables is None or "tables" not in state or self.tables.holds_as_saved(state["tables"])

    def load_resharded(self, states: list[dict[str, Any]]) -> None:
        """This shard's state from the parts of a checkpoint saved by another number of
        shards (every part, in shard order)."""
        state = reshard(states, self.layout, self.shard, self.group_of)
        if self.tables is not None:
            state["tables"] = self.tables.resharded([part["tables"] for part in states])
        self.load_state_dict(state)

    def position(self) -> dict[str, int]:
        """Where a resumed run goes on: the version, and the first epoch with batches left."""
        epoch = self.batch_dealer.first_open_epoch()
        return {"version": self.version, "epoch": epoch}

    def statistics(self) -> dict[str, Any]:
        return {
            "shard": self.shard,
            "version": self.version,
            "bytes": self.layout.shard_bytes()[self.shard],
            **self.counters.statistics(),
            **self.validator.statistics(),
            "workers_lost": sorted(self.lost),
            "workers_joined": list(self.joined),
            "max_rss": max_rss_bytes(),
            # CPU-seconds of this process (every thread) while it served: what a push costs a shard
            "cpu_seconds": time.process_time() - self._cpu_start,
            **(self.tables.statistics() if self.tables is not None else {}),
        }
