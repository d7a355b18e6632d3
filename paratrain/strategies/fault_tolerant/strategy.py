"""``allreduce-ft``: synchronous data parallelism that keeps training through a lost replica.

Each replica is its own process and its own replica group of torchft (``torchft.Manager``):
before every step the replicas alive form a quorum through a Lighthouse, and the step's
gradient is summed over that quorum only. A replica killed at any moment is dropped (at
once when it dies inside the all-reduce, after ``--replica-heartbeat-timeout`` otherwise)
and the survivors go on at the next step; none of them restarts. A replacement (local
``--max-restarts``, or a new ``torchrun`` node) rejoins at its first quorum by fetching
the model, the optimizer and the loop's position from a live peer over HTTP
(``comm/live_state.py``): no checkpoint is read.

The global batch does not change when replicas are lost: every replica reads the whole
global batch of the step (``batch_size x workers`` examples, the same as ``allreduce``)
and, once the quorum is known, computes the gradient of its own part of it, the
``p``-th of ``P`` near-equal slices for participant ``p`` of ``P``. Each part's gradient is
weighted by its share of the global batch before the sum, so every committed step is
exactly one step of the global batch's mean loss whoever took part: with ``P`` replicas
left, each computes ``N/P`` times its usual share. A step that did not commit (a peer
died during it) is done again with the same batch, so no example is lost or seen twice,
and the learning-rate schedule follows committed steps.

Why torchft and not c10d alone: the per-step quorum (who is alive, agreed by all), the
heal (who is behind, who sends it the state) and the reconfiguration of the gradient
group after each membership change are what torchft's Lighthouse and Manager do and
are tested for; paratrain adds what they leave to the user (global-batch semantics,
a reduction that never raises out of ``backward()``, safe loading of a peer's state,
the launcher that replaces only the dead). See docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
import zlib
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from torch.distributed import ReduceOp, TCPStore
from torch.utils._pytree import tree_leaves

from paratrain.comm.flat import flat_gradients, write_gradients
from paratrain.comm.transport import load_compiler
from paratrain.data.batch import map_tensors, num_examples
from paratrain.data.sharding import ShardedBatches
from paratrain.errors import ConfigError, ReplicaLeft, WorkerLost
from paratrain.session.incarnation import restart_count
from paratrain.session.leaving import LeaveOnSigterm
from paratrain.strategies.accounting import staleness_summary
from paratrain.strategies.base import DEFAULT_TIMEOUT_S, FitLoop, LossFn, StepOutput, Strategy, resolve_device
from paratrain.strategies.topology import Topology
from paratrain.timeline import span

if TYPE_CHECKING:
    from paratrain.comm.transport import ClusterEnv
    from paratrain.config import TrainConfig

INSTALL_HINT = "pip install 'paratrain[ft]' (torchft: Linux x86_64, Python 3.10-3.13)"


@dataclass(frozen=True)
class ReplicaGroups(Topology):
    """``num_replicas`` replicas, one process each, each its own group: none is needed by
    the others, and a lost one is replaced alone (``launch/replacing.py``)."""

    replaces_lost = True

    @property
    def expendable_ranks(self) -> frozenset[int]:
        return frozenset(range(self.num_replicas))

    def check_cluster(self, cluster: ClusterEnv, strategy: str) -> None:
        """Under torchrun, each replica is its own job of one process (``--nproc-per-node 1``)."""
        if cluster.world_size != 1:
            raise ConfigError(
                f"--strategy {strategy} runs one torchrun job per replica (--nnodes 1 --nproc-per-node 1, "
                f"REPLICA_GROUP_ID set, --lighthouse given), got a job of {cluster.world_size} processes"
            )


def torchft_modules() -> Any:
    """``torchft``, imported quietly (its Rust side logs every quorum at INFO); ConfigError
    when it is not installed."""
    os.environ.setdefault("RUST_LOG", "warn")
    os.environ.setdefault("TOKIO_WORKER_THREADS", "1")
    try:
        import torchft
    except ImportError:
        raise ConfigError(
            f"per-step fault tolerance (allreduce-ft, pipeline-ft) needs torchft: {INSTALL_HINT}"
        ) from None
    # One warning per reconfiguration on builds without NCCL's flight recorder.
    logging.getLogger("torchft.manager").setLevel(logging.ERROR)
    return torchft


def replica_slot() -> int:
    """This process's replica: ``REPLICA_GROUP_ID`` (torchft's name, set by the launcher or by
    the user for each torchrun job)."""
    text = os.environ.get("REPLICA_GROUP_ID", "0")
    if not text.isdigit():
        raise ConfigError(f"REPLICA_GROUP_ID must be a replica index 0, 1, ..., got {text!r}")
    return int(text)


class FaultTolerantAllReduceStrategy(Strategy):
    name = "allreduce-ft"
    # fp16's scaler skips steps on its own; replicas must agree on every commit.
    scales_loss = False
    takes_compression = True
    leaves_on_sigterm: ClassVar[bool] = True
    """SIGTERM makes the replica leave after its step (one process: it can leave alone)."""
    #: Codecs whose payloads add up: the Manager's one all-reduce sums them (in 16 bits).
    WIRE_DTYPES: ClassVar[dict[str, torch.dtype | None]] = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}

    def __init__(
        self,
        device: str = "auto",
        timeout: float = DEFAULT_TIMEOUT_S,
        workers: int | None = None,
        lighthouse: str | None = None,
        min_replicas: int = 1,
        heartbeat_timeout: float = 1.0,
        compression: str = "none",
    ):
        super().__init__(device=device, timeout=timeout, workers=workers)
        self.check_compression(compression)
        self.compression = compression
        self._wire_dtype = self.WIRE_DTYPES[compression]
        self.lighthouse = lighthouse
        self.min_replicas = min_replicas
        self.heartbeat_timeout = heartbeat_timeout
        """Seconds of silence before a local launch's Lighthouse drops a replica."""
        self.manager: Any = None
        self.incarnation = 0
        self.trainer: FitLoop | None = None
        self._sigterm = LeaveOnSigterm()  # asked: leave after the step
        self._quorum_ready = False  # begin_fit formed the quorum of the first step already
        self._joined_state: dict[str, Any] | None = None
        self._last_loss = 0.0
        self._grad_bytes = 0
        self._participants: Counter[int] = Counter()  # P -> steps committed with P replicas
        self._spans: list[list[int]] = []  # [first step, last step, P], run-length
        self.uncommitted_steps = 0
        self.behind_heals = 0
        self.quorums = 0
        self.recoveries: list[dict[str, Any]] = []

    @classmethod
    def topology_of(cls, num_replicas: int) -> Topology:
        return ReplicaGroups(num_replicas=num_replicas)

    @classmethod
    def check_compression(cls, compression: str) -> None:
        if compression not in cls.WIRE_DTYPES:
            raise ConfigError(
                f"--strategy {cls.name} sums each step's gradient in one all-reduce: --compression must be "
                f"one of {', '.join(cls.WIRE_DTYPES)} (payloads that add up), got {compression!r}"
            )

    @classmethod
    def check_config(cls, config: TrainConfig) -> None:
        cls.check_compression(config.codec.compression)
        if config.checkpoint_dir is not None:
            raise ConfigError(
                "--strategy allreduce-ft recovers from live peers, not checkpoints: drop --checkpoint-dir "
                "(or use --strategy allreduce, which restarts the run from its checkpoints)"
            )
        if config.ft.min_replicas > config.workers:
            raise ConfigError(
                f"--min-replicas {config.ft.min_replicas} is more than --workers {config.workers}: no step could commit"
            )

    @classmethod
    def from_config(cls, config: TrainConfig) -> FaultTolerantAllReduceStrategy:
        return cls(
            device=config.device,
            timeout=config.timeout,
            workers=config.workers,
            lighthouse=config.ft.lighthouse,
            min_replicas=config.ft.min_replicas,
            heartbeat_timeout=config.ft.replica_heartbeat_timeout,
            compression=config.codec.compression,
        )

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "compression": self.compression,
            "fault_tolerance": "per-step",
            "min_replicas": self.min_replicas,
        }

    # ----- process -----------------------------------------------------------------------
    def setup(self) -> None:
        """One replica: no process group to join (the Manager forms one per quorum)."""
        if not self._ready:
            torchft_modules()
            self.device = resolve_device(self.device_preference)
            self.incarnation = restart_count()
            replicas = self.workers or int(os.environ.get("NUM_REPLICA_GROUPS", "1"))
            self.topology = self.topology_of(replicas)
            # A replica beyond --workers joins a running job: the global batch stays
            # batch_size x workers, split over more replicas.
            self.process_rank = replica_slot()
        super().setup()

    @property
    def is_chief(self) -> bool:
        """The first replica of the current quorum (the lowest alive), else replica 0."""
        if self.manager is None or self.manager.participating_rank() is None:
            return self.process_rank == 0
        return self.manager.participating_rank() == 0

    @property
    def stands_in_for_chief(self) -> bool:
        return True  # every replica trained the same committed steps

    def teardown(self) -> None:
        self._stop_manager()
        super().teardown()

    def _stop_manager(self) -> None:
        """Leave the quorums: the heartbeats stop, and the Lighthouse drops this replica."""
        if self.manager is not None:
            with contextlib.suppress(Exception):
                self.manager.shutdown(wait=False)
            self.manager = None

    def prepare(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, recipe: Any = None
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        model, optimizer = super().prepare(model, optimizer, recipe)
        size = None if self._wire_dtype is None else torch.empty(0, dtype=self._wire_dtype).element_size()
        self._grad_bytes = sum(p.numel() * (size or p.element_size()) for p in model.parameters() if p.requires_grad)
        return model, optimizer

    def begin_fit(self, trainer: FitLoop) -> None:
        """Join the run: the Manager starts (last, so that the Lighthouse never waits on a
        replica still building its model), then the first quorum; a replacement takes the
        live state from a peer there and the loop goes on from the peer's position."""
        self.trainer = trainer
        if self.leaves_on_sigterm:
            self._sigterm.install()
        if self.manager is None:
            self.manager = self._start_manager()
            _wait_for_all_first_replicas(self.incarnation, self.topology.num_processes, self.timeout)
        self._quorum()
        self._quorum_ready = True
        if self._joined_state is not None:
            state, self._joined_state = self._joined_state, None
            trainer.load_state_dict(state)
            heal = self.recoveries[-1]
            print(
                f"paratrain: worker {self.process_rank} joined the run at step {heal['to_step']} with a live "
                f"peer's state ({heal['seconds']:.2f} s from its first quorum)",
                file=sys.stderr,
                flush=True,
            )
        elif self.manager.errored() is not None:
            raise WorkerLost(
                f"worker {self.process_rank} could not take the live state from a peer: "
                f"{str(self.manager.errored().original_exception).splitlines()[0]}"
            )
        elif self.incarnation > 0 and self.manager.num_participants() < 2 and self.num_replicas > 1:
            # Alone at step 0, a replacement would train the run again from the start.
            raise WorkerLost(
                f"worker {self.process_rank}'s replacement found no live replica to take the state from "
                "(the others are gone or done)"
            )

    def _leave(self, step: int) -> None:
        self._stop_manager()
        raise ReplicaLeft(f"worker {self.process_rank} left the run after step {step} (SIGTERM); the others go on")

    def _start_manager(self) -> Any:
        torchft = torchft_modules()

        from paratrain.comm.live_state import LiveStateTransport  # deferred: imports torchft (optional extra)

        host = os.environ.get("PARATRAIN_REPLICA_HOST", "127.0.0.1")
        wait = timedelta(seconds=self.timeout)
        store_host, store_port, group_rank, group_size = self._replica_group(host)
        lighthouse = self.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
        if not lighthouse:
            raise ConfigError(f"--strategy {self.name} under torchrun needs --lighthouse http://HOST:PORT")
        load_compiler()
        return torchft.Manager(
            pg=torchft.ProcessGroupGloo(timeout=wait),
            load_state_dict=self._load_live_state,
            state_dict=self._live_state,
            min_replica_size=self.min_replicas,
            use_async_quorum=False,  # the quorum (and a heal) completes before the step's forward
            timeout=wait,
            quorum_timeout=wait,
            connect_timeout=wait,
            rank=group_rank,
            world_size=group_size,
            store_addr=store_host,
            store_port=store_port,
            lighthouse_addr=lighthouse,
            replica_id=f"replica_{self.rank}",
            hostname=host,
            checkpoint_transport=LiveStateTransport(wait, host),
            init_sync=False,  # every replica builds the same initial model from --seed
            max_retries=max(3, self.num_replicas * 2),  # then a replica that cannot commit leaves
        )

    def _replica_group(self, host: str) -> tuple[str, int, int, int]:
        """Where this replica's processes meet (a store's host and port) and this process's
        rank among them, of how many: one process, and a store of its own (the gradient
        group of a quorum meets in its first member's)."""
        self._store = TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=self.timeout))
        return host, self._store.port, 0, 1

    def _quorum(self) -> None:
        """The quorum of the next step: who takes part, and a heal if this replica is behind."""
        started = time.perf_counter()
        step = self.manager.current_step()
        with span("quorum"):
            try:
                self.manager.start_quorum()
            except TimeoutError:
                raise WorkerLost(
                    f"worker {self.process_rank}: no quorum of --min-replicas {self.min_replicas} formed "
                    f"within --timeout {self.timeout:g} s (the Lighthouse or the other replicas are gone)"
                ) from None
        self.quorums += 1
        if self.manager.current_step() > step:  # healed: took a peer's state
            self.recoveries.append(
                {
                    "worker": self.process_rank,
                    "incarnation": self.incarnation,
                    "from_step": step,
                    "to_step": self.manager.current_step(),
                    "seconds": time.perf_counter() - started,
                }
            )

    # ----- live state (what a joining replica takes from a peer) ---------------------------
    def _live_state(self) -> dict[str, Any]:
        """Served to a joiner during a quorum, while this replica's loop waits in it: the
        step being started is the joiner's first, so the loop's position is one batch back."""
        trainer = self.trainer
        assert trainer is not None, "a replica serves state only once it trains"
        position = trainer.state_dict()
        position["batch"] = max(trainer.batch - 1, 0)
        return {
            "model": trainer.module.state_dict(),
            "optimizer": trainer.optimizer.state_dict(),
            "trainer": position,
            "strategy": {**self.state_dict(), "last_loss": self._last_loss, "record": self._record()},
        }

    def _record(self) -> dict[str, Any]:
        """The run's record so far: every committed step's participants and the heals. A
        replica that joins takes it over, so that whichever replica reports the run reports
        all of it."""
        return {
            "participants": [[p, c] for p, c in self._participants.items()],
            "spans": [list(span) for span in self._spans],
            "recoveries": [dict(heal) for heal in self.recoveries],
        }

    def _load_live_state(self, state: dict[str, Any]) -> None:
        trainer = self.trainer
        assert trainer is not None
        trainer.module.load_state_dict(state["model"])
        trainer.optimizer.load_state_dict(state["optimizer"])
        own = state["strategy"]
        self._last_loss = float(own["last_loss"])
        self.skipped_updates = int(own["skipped_updates"])
        record = own["record"]
        self._participants = Counter({int(p): int(c) for p, c in record["participants"]})
        self._spans = [[int(v) for v in span] for span in record["spans"]]
        self.recoveries = [dict(heal) for heal in record["recoveries"]]
        self._joined_state = state["trainer"]

    # ----- data and step -----------------------------------------------------------------
    def distribute(
        self, dataset: object, batch_size: int, *, shuffle: bool = True, drop_last: bool = True, seed: int = 0
    ) -> ShardedBatches:
        """Every replica reads whole global batches (``batch_size`` per replica times the
        run's replicas): its part is chosen once the step's quorum is known."""
        self.setup()
        return ShardedBatches(
            dataset,
            batch_size * self.num_replicas,
            num_replicas=1,
            rank=0,
            shuffle=shuffle,
            drop_last=drop_last,
            seed=seed,
            device=self.device,
        )

    def train_step(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        optimizer: torch.optim.Optimizer,
        inputs: Any,
        targets: Any,
    ) -> StepOutput:
        """One committed step of the global batch ``(inputs, targets)``: done again until the
        quorum commits it, or taken from a peer that committed it while this replica could not."""
        step = self.manager.current_step() + 1
        if self._sigterm.asked:  # asked between steps
            self._leave(step - 1)
        while True:
            if not self._quorum_ready:
                self._quorum()
            self._quorum_ready = False
            done = self.manager.current_step()
            if done >= step:
                if done > step:  # cannot happen with a synchronous quorum; never train on a wrong position
                    raise WorkerLost(f"worker {self.process_rank} fell {done - step + 1} steps behind its peers")
                self.behind_heals += 1
                self._joined_state = None  # the loop's position is this replica's own
                self._steps += 1  # the peer's record, taken with its state, holds the step
                # The quorum that healed this replica is its peers' next step: they are in that
                # step's all-reduce already, so this replica's next step must take part in it,
                # not form another quorum (they would wait out the timeout for it).
                self._quorum_ready = True
                return StepOutput(torch.tensor(self._last_loss, device=self.device), None)
            loss, outputs = self._gradient(model, loss_fn, optimizer, inputs, targets, step)
            self.steps_taken += 1
            if self.recipe.clip_grad_norm:
                self.clip_gradients(model)
            skip = self.skip_nonfinite(self.unwrap(model), loss, lambda: self.gradients_finite(optimizer))
            if self.manager.should_commit():
                if not skip:
                    with span("optimizer"):
                        optimizer.step()
                self._last_loss = float(loss)
                self._steps += 1
                self._count_step(step, self.manager.num_participants())
                if self._sigterm.asked:
                    self._leave(step)
                return StepOutput(loss, outputs, skipped=skip)
            self.uncommitted_steps += 1

    def _gradient(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        optimizer: torch.optim.Optimizer,
        inputs: Any,
        targets: Any,
        step: int,
    ) -> tuple[torch.Tensor, Any]:
        """This participant's part of the global batch: its gradient, weighted by the part's
        share, summed over the quorum in one flat all-reduce (with the loss) that never
        raises: a peer lost during it makes the step uncommitted instead."""
        optimizer.zero_grad(set_to_none=True)
        total = num_examples(targets)
        piece = part_of(total, self.manager.participating_rank(), self.manager.num_participants())
        x, y = map_tensors(inputs, lambda t: t[piece]), map_tensors(targets, lambda t: t[piece])
        loss, outputs = self.recipe.forward_backward(model, loss_fn, x, y, self.device)
        params = [p for p in self.unwrap(model).parameters() if p.requires_grad]
        return self._sum_over_quorum(params, loss, (piece.stop - piece.start) / total, step, targets), outputs

    def _sum_over_quorum(
        self, params: list[nn.Parameter], loss: torch.Tensor, share: float, step: int, targets: Any
    ) -> torch.Tensor:
        """This participant's gradients of ``params`` and its ``loss``, weighted by its
        ``share`` of the global batch, summed over the quorum in place (one flat all-reduce
        that never raises: a peer lost during it leaves the step uncommitted); the summed loss."""
        grads = flat_gradients(params)
        # Every participant must hold the same step's same global batch: their marks then sum
        # to P times each one's (exact in float32, as the loss must be: never in 16 bits).
        mark = _batch_mark(step, targets)
        tail = torch.stack([loss.detach().to(torch.float32) * share, torch.tensor(float(mark), device=grads.device)])
        with span("allreduce"):
            if self._wire_dtype is None:  # one all-reduce: gradient, loss and mark
                flat = torch.cat([grads.mul_(share), tail.to(grads.dtype)])
                self.manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
                grads, tail = flat[:-2], flat[-2:]
            else:  # the gradient in 16 bits (scaled first: a share is never below 1/P)
                wire = grads.mul_(share).to(self._wire_dtype)
                works = [self.manager.allreduce(t, reduce_op=ReduceOp.SUM) for t in (wire, tail)]
                for work in works:
                    work.wait()
                grads = wire.to(grads.dtype)
        if self.manager.errored() is None and int(tail[1]) != mark * self.manager.num_participants():
            raise WorkerLost(
                f"worker {self.process_rank}: the replicas disagree on the global batch of step "
                f"{step} (a position was not carried over)"
            )
        write_gradients(params, grads)
        return tail[0].detach().clone()

    def _count_step(self, step: int, participants: int) -> None:
        self._participants[participants] += 1
        if self._spans and self._spans[-1][2] == participants and self._spans[-1][1] == step - 1:
            self._spans[-1][1] = step
        else:
            self._spans.append([step, step, participants])

    # ----- accounting ----------------------------------------------------------------------
    def step_counters(self) -> dict[str, float]:
        return {"bytes_sent": self._grad_bytes * self._steps, "wait_seconds": self.wait_seconds, "staleness": 0}

    def stats(self) -> dict[str, Any]:
        """This replica's view of the run: every committed step's participants (the same on
        every replica that took part), the steps that had to be done again, and the heals."""
        steps = sum(self._participants.values())
        return {
            "bytes_sent": self._grad_bytes * sum(p * c for p, c in self._participants.items()),
            "dropped_gradients": 0,
            "staleness": staleness_summary({0: steps}),
            "participants": {
                "min": min(self._participants, default=0),
                "max": max(self._participants, default=0),
                "histogram": {str(p): c for p, c in sorted(self._participants.items())},
                "per_step": [list(span) for span in self._spans],
            },
            "uncommitted_steps": self.uncommitted_steps,
            "quorums": self.quorums,
            "recoveries": list(self.recoveries),
        }

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "participants": {str(p): c for p, c in self._participants.items()}}


def part_of(total: int, part: int, parts: int) -> slice:
    """Participant ``part``'s examples of a global batch of ``total`` among ``parts``:
    consecutive, sizes within one of each other, every example in exactly one part."""
    return slice(part * total // parts, (part + 1) * total // parts)


def _batch_mark(step: int, targets: Any) -> int:
    """A 16-bit fingerprint of ``step`` and its batch's targets."""
    mark = zlib.crc32(step.to_bytes(8, "little"))
    for leaf in tree_leaves(targets):
        if torch.is_tensor(leaf):
            mark = zlib.crc32(leaf.detach().cpu().contiguous().numpy().tobytes(), mark)
    return mark % 65536


def _wait_for_all_first_replicas(incarnation: int, replicas: int, timeout: float) -> None:
    """A local launch's first replicas wait for each other's Managers before their first
    quorum, so that it holds them all (not whichever replica imported torch first, the
    others then taking its state); a replacement joins whatever quorum there is."""
    address = os.environ.get("PARATRAIN_FT_STORE")
    if not address:
        return
    host, _, port = address.rpartition(":")
    store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout))
    # A replacement counts for the replica it replaces, lost before it got here.
    if store.add("ready", 1) >= replicas:
        store.set("all-ready", "1")
    if incarnation > 0:
        return
    try:
        store.wait(["all-ready"], timedelta(seconds=timeout))
    except RuntimeError:  # the store's timeout (DistStoreError)
        raise WorkerLost(f"the {replicas} replicas did not all start within --timeout {timeout:g} s") from None
