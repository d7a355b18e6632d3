"""The Strategy protocol: what every training mode implements.

A strategy owns everything that differs between modes of training, and nothing else:

- the process: joining a process group, this process's role and rank (``setup``,
  ``role``, ``rank``, ``num_replicas``, ``is_chief``, ``teardown``);
- the model: wrapping it and its optimizer (``prepare``, ``unwrap``) and one training
  step (``train_step``), which is where modes really differ;
- the data: which slice of every global batch this replica reads (``distribute``);
- reductions for metrics (``all_reduce_sum``), accounting (``stats``), and state for
  checkpoints (``state_dict``).

The Trainer's loop calls only these, so a new mode is a new class in the STRATEGIES
table, never a branch in the loop.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from paratrain.comm.transport import destroy_process_group, ensure_process_group
from paratrain.data.sharding import ShardedBatches
from paratrain.errors import ConfigError, DivergedError, WorkerLost
from paratrain.timeline import span

if TYPE_CHECKING:
    from paratrain.comm.transport import ClusterEnv
    from paratrain.config import TrainConfig

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

_CURRENT: ContextVar[Strategy | None] = ContextVar("paratrain_strategy", default=None)


def get_strategy() -> Strategy:
    """The strategy of the innermost ``with strategy.scope():``, else a single-device one."""
    current = _CURRENT.get()
    if current is None:
        from paratrain.strategies.single import SingleDeviceStrategy

        current = SingleDeviceStrategy()
    return current


@dataclass
class StepOutput:
    """What one training step returns, detached from the graph."""

    loss: torch.Tensor
    """Mean loss over this replica's batch (a 0-d tensor on the device)."""
    logits: torch.Tensor
    """Model outputs for this replica's batch."""
    skipped: bool = False
    """The update was skipped: a NaN or Inf loss or gradient, with ``on_nan = "skip"``."""


def resolve_device(preference: str, local_rank: int = 0) -> torch.device:
    """``auto`` takes this process's GPU when there is one, else the CPU."""
    if preference == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        if preference == "cuda":
            raise ConfigError("--device cuda: no CUDA device is available; use --device cpu or auto")
        return torch.device("cpu")
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


class Strategy:
    """Base of every training mode; the default methods are those of one plain replica."""

    name: ClassVar[str] = "base"
    takes_compression: ClassVar[bool] = False
    """Whether the mode sends gradients that a codec (``--compression``) can compress."""

    def __init__(self, device: str = "auto", timeout: float = 300.0):
        self.device_preference = device
        self.timeout = timeout
        self.device = torch.device("cpu")
        self._ready = False
        self._owns_group = False
        self._steps = 0
        self.on_nan = "stop"
        """``"stop"``: a NaN or Inf loss ends the run (DivergedError, exit 3); ``"skip"``: an
        update whose gradient holds one is skipped and counted (``skipped_updates``)."""
        self.skipped_updates = 0
        self.wait_seconds = 0.0
        """Seconds this process spent blocked on other processes (parameter-server pulls)."""

    # ----- configuration ---------------------------------------------------------------
    #: Options that only parameter-server strategies take, with their neutral values.
    PS_OPTIONS: ClassVar[dict[str, Any]] = {
        "ps_shards": None,
        "backup_workers": 0,
        "staleness_bound": None,
        "stale_policy": "none",
        "warmup_steps": 0,
        "pull_compression": "none",
    }

    #: Options that only the pipeline strategy takes, with their neutral (default) values.
    PIPELINE_OPTIONS: ClassVar[dict[str, Any]] = {
        "stages": 2,
        "microbatches": 4,
        "schedule": "1f1b",
        "balance": "params",
        "split_points": None,
    }

    @classmethod
    def check_config(cls, config: TrainConfig) -> None:
        """Raise ConfigError for settings this mode cannot run (called at validation)."""
        for name, neutral in cls.PS_OPTIONS.items():
            if getattr(config, name) != neutral:
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{flag} applies to the ps-* strategies, not to --strategy {config.strategy}")
        cls.check_pipeline_options(config)
        cls.check_faults(config)

    @classmethod
    def check_pipeline_options(cls, config: TrainConfig) -> None:
        for name, neutral in cls.PIPELINE_OPTIONS.items():
            if getattr(config, name) != neutral:
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{flag} applies to --strategy pipeline, not to --strategy {config.strategy}")

    @classmethod
    def check_faults(cls, config: TrainConfig) -> None:
        """--fail and --straggler must name a worker that exists (0..workers-1), and
        ``--fail ps:SHARD@VERSION`` a shard that exists."""
        for flag, parsed in (
            ("--fail", config.fail_at),
            ("--hang", config.hang_at),
            ("--straggler", config.straggler_factor),
        ):
            if parsed and parsed[0] >= config.num_worker_processes:
                raise ConfigError(
                    f"{flag} names worker {parsed[0]}, but the run has workers 0..{config.num_worker_processes - 1}"
                )
        if config.fail_shard_at:
            shards = cls.num_shards_for(config)
            if not shards:
                raise ConfigError(
                    f"--fail {config.fail} names a parameter-server shard; --strategy {config.strategy} has none "
                    "(the ps-* strategies do): name a worker, WORKER@STEP"
                )
            if config.fail_shard_at[0] >= shards:
                raise ConfigError(
                    f"--fail {config.fail} names shard {config.fail_shard_at[0]}, but the run has shards 0..{shards - 1}"
                )

    @classmethod
    def num_shards_for(cls, config: TrainConfig) -> int:
        """Parameter-server shards this mode runs (none outside the ps-* strategies)."""
        return 0

    @classmethod
    def check_model(cls, model: nn.Module, config: TrainConfig) -> None:
        """ConfigError if the mode cannot run this model as configured; called in the
        launching process before any worker starts."""

    @classmethod
    def chief_rank(cls, config: TrainConfig) -> int:
        """The global rank of the chief (worker 0)."""
        return 0

    @classmethod
    def rank_name(cls, rank: int, config: TrainConfig) -> str:
        """How failure messages name a rank."""
        return f"worker {rank}"

    @classmethod
    def expendable_ranks(cls, config: TrainConfig) -> frozenset[int]:
        """Ranks whose death the run survives (the rest must all finish)."""
        return frozenset()

    @classmethod
    def num_processes(cls, config: TrainConfig) -> int:
        """Processes a local launch starts for ``config``."""
        return config.workers

    @classmethod
    def num_replicas_for(cls, config: TrainConfig) -> int:
        """Replicas that each read their own slice of the global batch."""
        return config.workers

    @classmethod
    def check_cluster(cls, cluster: ClusterEnv, config: TrainConfig) -> None:
        """Raise ConfigError when a cluster started elsewhere (torchrun, TF_CONFIG) does not fit."""
        if cluster.num_ps:
            raise ConfigError(
                f"the cluster lists {cluster.num_ps} parameter-server tasks; strategy "
                f"{config.strategy} has none (use a ps-* strategy, or drop the ps job)"
            )
        needed = cls.num_processes(config)
        if cluster.world_size != needed:
            raise ConfigError(
                f"the cluster has {cluster.world_size} processes but --strategy {config.strategy} "
                f"with --workers {config.workers} needs {needed}"
            )

    @classmethod
    def from_config(cls, config: TrainConfig) -> Strategy:
        return cls(device=config.device, timeout=config.timeout)

    def describe(self) -> dict[str, Any]:
        """The metrics file's description of this mode."""
        return {
            "strategy": self.name,
            "workers": self.num_replicas,
            "ps_shards": 0,
            "backup_workers": 0,
            "compression": "none",
        }

    # ----- process -----------------------------------------------------------------------
    def setup(self) -> None:
        """Join the run (idempotent). Subclasses call ``super().setup()`` last."""
        self._ready = True

    @property
    def role(self) -> str:
        """``"worker"`` for processes that train; parameter-server shards say ``"ps"``."""
        return "worker"

    @property
    def rank(self) -> int:
        """This replica's index among the replicas, 0..num_replicas-1."""
        return 0

    @property
    def num_replicas(self) -> int:
        return 1

    @property
    def is_chief(self) -> bool:
        """The chief (replica 0) prints, evaluates for the log, and writes files."""
        return self.rank == 0

    @contextlib.contextmanager
    def scope(self) -> Iterator[Strategy]:
        """``with strategy.scope():`` models and tensors made inside land on its device,
        and a Trainer made inside uses this strategy."""
        self.setup()
        token = _CURRENT.set(self)
        try:
            with torch.device(self.device):
                yield self
        finally:
            _CURRENT.reset(token)

    def _join_group(self, backend: str) -> None:
        """Join the default process group (or form it); the strategy that formed it
        destroys it at teardown, one that joined an existing group leaves it be."""
        self._owns_group = self._owns_group or not dist.is_initialized()
        ensure_process_group(backend, self.timeout)

    def teardown(self) -> None:
        if self._owns_group:
            destroy_process_group()
            self._owns_group = False
        self._ready = False

    # ----- model -------------------------------------------------------------------------
    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Move the model to this replica's device and wrap it for this mode."""
        self.setup()
        return model.to(self.device), optimizer

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's own module inside whatever ``prepare`` wrapped it in."""
        return model

    def train_step(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        optimizer: torch.optim.Optimizer,
        inputs: torch.Tensor,
        targets: torch.Tensor,
    ) -> StepOutput:
        """Forward, backward and update on this replica's batch."""
        optimizer.zero_grad(set_to_none=True)
        with span("forward"):
            logits = model(inputs)
            loss = loss_fn(logits, targets)
        with span("backward"):  # under DDP: including the wait for the last bucket's all-reduce
            loss.backward()
        if self.on_nan == "skip" and not finite_gradients(optimizer):
            # Gradients are already averaged: every replica sees the same and skips alike.
            self.skipped_updates += 1
            if not finite_parameters(model):  # nothing left to skip back to
                raise DivergedError(loss.item(), self._steps + self.skipped_updates)
            return StepOutput(loss.detach(), logits.detach(), skipped=True)
        with span("optimizer"):
            optimizer.step()
        self._steps += 1
        return StepOutput(loss.detach(), logits.detach())

    def diagnose(self, error: RuntimeError, step: int) -> Exception | None:
        """A clearer error for ``error``, raised by a collective at ``step``: on a timeout,
        which ranks did not answer (each rank still alive says so in the store; the silent
        ones are named). None to let ``error`` stand."""
        text = str(error)
        if not dist.is_initialized() or not ("imed out" in text or "timeout" in text.lower()):
            return None
        store = dist.distributed_c10d._get_default_store()
        me, world = dist.get_rank(), dist.get_world_size()
        store.set(f"paratrain/answer/{step}/{me}", "1")
        deadline = time.monotonic() + min(self.timeout, 5.0)
        silent = [r for r in range(world) if r != me]
        while silent and time.monotonic() < deadline:
            silent = [r for r in silent if not store.check([f"paratrain/answer/{step}/{r}"])]
            time.sleep(0.05)
        if not silent:
            return None
        names = ", ".join(self.describe_rank(r) for r in silent)
        return WorkerLost(f"{names} did not answer within --timeout {self.timeout:g} s at step {step}")

    def describe_rank(self, global_rank: int) -> str:
        return f"worker {global_rank}"

    def forward(self, model: nn.Module, inputs: torch.Tensor) -> torch.Tensor | None:
        """Evaluation's forward pass on ``model`` (unwrapped): the logits, or None on a process
        that holds none (pipeline stages before the last, which pass activations on)."""
        return model(inputs)

    def step_counters(self) -> dict[str, float]:
        """This process's running totals, read after every step by the TensorBoard logger:
        ``bytes_sent`` (its own sends), ``wait_seconds``, and ``staleness`` of its last
        gradient as far as this process can see it (0 for synchronous modes)."""
        return {"bytes_sent": 0, "wait_seconds": self.wait_seconds, "staleness": 0}

    def examples_applied(self) -> int | None:
        """Examples in all the updates applied so far, where this process knows it without
        communicating (parameter-server workers: from the shard's version); None where only
        the loop's own count is known."""
        return None

    def set_learning_rate(self, optimizer: torch.optim.Optimizer, lr: float) -> None:
        for group in optimizer.param_groups:
            group["lr"] = lr

    def refresh(self, model: nn.Module) -> None:
        """Bring this replica's parameters up to date before evaluating (parameter servers pull)."""

    def finish(self, model: nn.Module) -> None:
        """End of training on this process (parameter-server workers report done)."""

    def serve(self) -> Any:
        """On a process whose role is not ``worker``: serve until training ends."""
        raise NotImplementedError(f"{self.name} has no serving role")

    @property
    def evaluates(self) -> bool:
        """Whether this process takes part in evaluation (all replicas, unless a mode says not)."""
        return True

    # ----- data --------------------------------------------------------------------------
    def distribute(
        self, dataset: object, batch_size: int, *, shuffle: bool = True, drop_last: bool = True, seed: int = 0
    ) -> ShardedBatches:
        """This replica's batches of ``dataset`` (``batch_size`` is per replica)."""
        self.setup()
        return ShardedBatches(
            dataset,
            batch_size,
            num_replicas=self.num_replicas,
            rank=self.rank,
            shuffle=shuffle,
            drop_last=drop_last,
            seed=seed,
            device=self.device,
        )

    # ----- reductions, accounting, state ---------------------------------------------------
    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over replicas, in place; returns it."""
        return tensor

    def stats(self) -> dict[str, Any]:
        """Communication and staleness counters, summed over ranks (call on every rank)."""
        return {
            "bytes_sent": 0,
            "dropped_gradients": 0,
            "staleness": staleness_summary({0: self._steps * self.num_replicas}),
        }

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "steps": self._steps, "skipped_updates": self.skipped_updates}

    # ----- checkpoints (train/checkpoint.py) ------------------------------------------------
    def _process_rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    def checkpoint_parts(self) -> list[str]:
        """The parts of a complete checkpoint of this run: one per process by default."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        return [f"rank-{r}" for r in range(world)]

    def checkpoint_part(self) -> str | None:
        """The part this process writes at each checkpoint step (its position, random
        generators, strategy state); None where it writes none at steps."""
        return f"rank-{self._process_rank()}"

    def model_part(self) -> str | None:
        """The part holding this process's model and optimizer: replicas are identical, so
        rank 0's by default; None where the model lives elsewhere (parameter servers)."""
        return "rank-0"

    def attach_checkpoint(self, checkpoint: Any, state: dict[str, Any] | None) -> None:
        """On a serving process: save through ``checkpoint`` while serving, starting from
        ``state`` (its part of the checkpoint resumed from, or None)."""
        raise NotImplementedError(f"{self.name} has no serving role")

    def on_checkpoint(self, checkpoint: Any) -> None:
        """On every process of a run with checkpoints, before training: a mode that keeps
        state of its own outside the checkpoint steps may save it through ``checkpoint``."""

    def resume_trainer(self, trainer: Any, folder: Any) -> None:
        """On a process whose checkpoint state lives elsewhere: put ``trainer`` where the
        run resumes (from the checkpoint folder ``folder``)."""
        raise NotImplementedError(f"{self.name} keeps its state in its own checkpoint part")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("name") != self.name:
            raise ConfigError(f"checkpoint was written by strategy {state.get('name')!r}, this run uses {self.name!r}")
        self._steps = int(state["steps"])
        self.skipped_updates = int(state.get("skipped_updates", 0))


def finite_parameters(model: nn.Module) -> bool:
    return bool(torch.isfinite(torch.stack(torch._foreach_norm([p.detach() for p in model.parameters()])).sum()))


def finite_gradients(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every gradient the optimizer would apply is finite (one host sync)."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not grads:
        return True
    return bool(torch.isfinite(torch.stack(torch._foreach_norm(grads)).sum()))


def staleness_summary(histogram: dict[int, int]) -> dict[str, Any]:
    """``{"mean", "max", "histogram"}`` from counts of gradients by staleness."""
    total = sum(histogram.values())
    used = {s: c for s, c in sorted(histogram.items()) if c}
    return {
        "mean": (sum(s * c for s, c in used.items()) / total) if total else 0.0,
        "max": max(used, default=0),
        "histogram": {str(s): c for s, c in used.items()},
    }
