"""The parameter-server modes, their options and the checks of a run's options before any
process starts, and who is who in a parameter-server run.

Everything that differs between ``ps-sync``, ``ps-backup`` and ``ps-async`` is one row of
MODES: the update rule its shards run, whether the run survives a lost worker, how an
epoch's batches are handed out, and which options only that mode takes. Nothing else
compares mode names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from paratrain.errors import ConfigError
from paratrain.options import at_least, check_options, option
from paratrain.strategies.ps.policies import AsyncRule, StalePolicy, SyncRule
from paratrain.strategies.topology import Role, Topology

if TYPE_CHECKING:
    from paratrain.comm.transport import ClusterEnv
    from paratrain.config import TrainConfig


class PSMode(str, Enum):
    SYNC = "sync"
    BACKUP = "backup"
    ASYNC = "async"

    def __str__(self) -> str:
        return self.value

    @property
    def strategy_name(self) -> str:
        return f"ps-{self.value}"

    @classmethod
    def of(cls, name: str) -> PSMode:
        """``"ps-async"`` or ``"async"`` -> PSMode.ASYNC."""
        value = name.removeprefix("ps-")
        try:
            return cls(value)
        except ValueError:
            valid = ", ".join(m.value for m in cls)
            raise ConfigError(f"parameter-server mode must be one of {valid}, got {value!r}") from None


#: What a worker's parameters travel in from the shards (``--pull-compression``).
PULL_DTYPES = {"none": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _joining(default: Any, help: str) -> Any:
    """An option of the modes that admit workers joining while the run trains."""
    return option(default, f"ps-async, ps-backup: {help}", strategies=("ps-backup", "ps-async"))


@dataclass
class PSConfig:
    """Options of the parameter-server strategies (``ps-sync``, ``ps-backup``, ``ps-async``)."""

    strategies: ClassVar[tuple[str, ...]] = ("ps-sync", "ps-backup", "ps-async")

    ps_shards: int | None = option(
        None, "parameter-server shards (ps-* strategies; default 1): ranks 0..P-1 serve parameters"
    )
    backup_workers: int = option(
        0, "ps-backup: extra workers K; each update takes the first --workers gradients", strategies=("ps-backup",)
    )
    staleness_bound: int | None = option(
        None, "ps-async: a worker more than S steps ahead of the slowest live one waits", strategies=("ps-async",)
    )
    stale_policy: str = option(
        "none",
        "ps-async: none, scale-lr (step / staleness) or drop (staler than --max-staleness)",
        choices=StalePolicy.NAMES,
        strategies=("ps-async",),
    )
    max_staleness: int = option(
        4, "ps-async with --stale-policy drop: the largest staleness still applied", strategies=("ps-async",)
    )
    warmup_steps: int = option(
        0, "ps-async: the first W updates come from worker 0 alone, then the others join", strategies=("ps-async",)
    )
    pull_compression: str = option(
        "none", "parameter server: parameters sent to workers in none (fp32), fp16 or bf16", choices=tuple(PULL_DTYPES)
    )
    join: str | None = _joining(
        None,
        "join the running run whose rendezvous is HOST:PORT (it prints it) as one more worker; it starts from "
        "the shards' current parameters",
    )
    joiners: bool = _joining(
        True, "let workers join while the run trains (--join, with the run's join token); --no-joiners admits none"
    )
    join_token_file: str | None = _joining(
        None,
        "the file holding the run's join token (first line); default PARATRAIN_JOIN_TOKEN, else a local run makes "
        "one, prints it and saves it readable by you only; a joiner gives the run's",
    )
    tables: str = option(
        "none",
        "parameter server: embedding tables the shards hold by rows, workers pulling only the rows a batch "
        "touches: none, all (every nn.Embedding/EmbeddingBag not tied to another layer) or NAME[,NAME]",
    )
    table_sharding: str = option(
        "mod",
        "parameter server with --tables: row r on shard r mod P (mod) or in contiguous runs (range)",
        choices=("mod", "range"),
    )
    dense: str = option(
        "ps",
        "parameter server with --tables: the rest of the model on the shards (ps), or all-reduced among the "
        "workers, each stepping its own copy (allreduce: PERSIA's hybrid, tables by rows, dense layers in lockstep)",
        choices=("ps", "allreduce"),
        strategies=("ps-sync", "ps-async"),
    )
    table_optimizer: str = option(
        "auto",
        "parameter server with --tables: how a shard steps the rows a gradient touched: sgd, adagrad (row-wise) "
        "or lazy-adam; auto follows --optimizer (sgd, adagrad; adam and adamw: lazy-adam)",
        choices=("auto", "sgd", "adagrad", "lazy-adam"),
    )
    on_worker_lost: str = option(
        "stop",
        "ps-sync: stop (the run ends, or restarts with --max-restarts) or continue (later rounds take the "
        "workers left; the short rounds are counted)",
        choices=("stop", "continue"),
        strategies=("ps-sync",),
    )

    def __post_init__(self) -> None:
        check_options(self)
        at_least("ps_shards", self.ps_shards, 1)
        at_least("staleness_bound", self.staleness_bound, 0)
        for name in ("backup_workers", "max_staleness", "warmup_steps"):
            at_least(name, getattr(self, name), 0)

    @property
    def num_shards(self) -> int:
        return self.ps_shards or 1

    @property
    def holds_tables(self) -> bool:
        """Whether the shards hold embedding tables by rows (tables/)."""
        return self.tables != "none"


@dataclass(frozen=True)
class ModeFacts:
    """One parameter-server mode."""

    make_rule: Callable[[PSConfig, int], Any]
    """``(config, num_workers) -> rule``: what the shards do with each gradient and pull."""
    survives_lost_worker: bool
    """The run goes on without a lost worker (never the chief, which evaluates); ps-sync
    does with ``--on-worker-lost continue``."""
    whole_rounds: bool
    """Epochs hand out whole rounds of N batches: with plain SGD the run equals one process
    with the global batch. Otherwise workers take batches one at a time, as they come."""
    one_update_per_gradient: bool
    """Every gradient is its own update (async); else a round of N gradients is one."""
    admits_joiners: bool
    """Workers may join the running run (``--join``; joining.py): in ps-sync a round is
    every worker, so one more would change what a version is."""


def _sync_rule(config: PSConfig, num_workers: int) -> SyncRule:
    return SyncRule(required=num_workers - config.backup_workers)


def _async_rule(config: PSConfig, num_workers: int) -> AsyncRule:
    policy = StalePolicy(config.stale_policy, config.max_staleness)
    return AsyncRule(policy, config.staleness_bound, config.warmup_steps)


MODES: dict[PSMode, ModeFacts] = {
    PSMode.SYNC: ModeFacts(
        _sync_rule, survives_lost_worker=False, whole_rounds=True, one_update_per_gradient=False, admits_joiners=False
    ),
    PSMode.BACKUP: ModeFacts(
        _sync_rule, survives_lost_worker=True, whole_rounds=False, one_update_per_gradient=False, admits_joiners=True
    ),
    PSMode.ASYNC: ModeFacts(
        _async_rule, survives_lost_worker=True, whole_rounds=False, one_update_per_gradient=True, admits_joiners=True
    ),
}


def survives_lost_worker(mode: PSMode, config: PSConfig) -> bool:
    """Whether a run in ``mode`` goes on without a lost worker."""
    if config.dense == "allreduce":
        return False  # every worker takes part in each step's all-reduce
    return MODES[mode].survives_lost_worker or config.on_worker_lost == "continue"


def check_mode(mode: PSMode, config: PSConfig) -> None:
    """ConfigError for a backup mode without backups. (An option of another mode is refused
    by the run's configuration, before: options.refuse_untaken, from PSConfig's fields.)"""
    if mode is PSMode.BACKUP and config.backup_workers < 1:
        raise ConfigError("--strategy ps-backup needs --backup-workers K >= 1 (K = 0 is ps-sync)")


def check_run(config: TrainConfig) -> None:
    """ConfigError for a run option a parameter-server run cannot honour."""
    mode = PSMode.of(config.strategy)
    check_mode(mode, config.ps)
    if config.early_stopping:
        raise ConfigError(f"--early-stopping is not available with --strategy {config.strategy}")
    if config.ps.join and (config.checkpoint_dir or config.max_restarts):
        raise ConfigError(
            "--join adds a worker to a running run, whose shards keep its checkpoints: drop "
            "--checkpoint-dir and --max-restarts"
        )
    check_tables(config)
    fail = config.faults.fail_at
    if fail and fail[0] == 0 and survives_lost_worker(mode, config.ps):
        raise ConfigError("--fail names worker 0, the chief (it evaluates and writes the metrics); name another worker")


def check_tables(config: TrainConfig) -> None:
    """ConfigError for a table option without tables, or a run option tables cannot honour."""
    ps = config.ps
    if not ps.holds_tables:
        for name, default in (("table_sharding", "mod"), ("table_optimizer", "auto"), ("dense", "ps")):
            if getattr(ps, name) != default:
                raise ConfigError(f"--{name.replace('_', '-')} applies to tables on the shards: give --tables too")
        return
    if ps.dense == "allreduce":
        for given, flag in (
            (config.checkpoint_dir, "--checkpoint-dir"),
            (config.max_restarts, "--max-restarts"),
            (ps.join, "--join"),
            (config.codec.compression != "none", "--compression"),
        ):
            if given:
                raise ConfigError(
                    f"{flag} is not available with --dense allreduce (the dense layers live on the workers, the "
                    "shards hold the tables): drop it, or keep the dense layers on the shards (--dense ps)"
                )
    if config.clip_grad_norm:
        raise ConfigError(
            "--clip-grad-norm needs the whole gradient's norm; with --tables the rows' gradients go straight to "
            "the shards: drop --clip-grad-norm or --tables"
        )


@dataclass(frozen=True)
class PSTopology(Topology):
    """Ranks ``0..P-1`` are shards, the rest workers (backups included); worker 0 is the chief."""

    num_shards: int = 1
    num_backups: int = 0
    mode: PSMode = PSMode.SYNC
    survives_loss: bool = False
    """Workers other than the chief may be lost without ending the run."""

    @classmethod
    def of(cls, mode: PSMode, config: PSConfig, num_workers: int) -> PSTopology:
        """The topology of a run in ``mode`` with ``config``'s options and ``num_workers``
        workers (backups included)."""
        return cls(
            num_replicas=num_workers,
            num_shards=config.num_shards,
            num_backups=config.backup_workers,
            mode=mode,
            survives_loss=survives_lost_worker(mode, config),
        )

    @property
    def num_workers(self) -> int:
        """Processes that train: the replicas (backup workers included)."""
        return self.num_replicas

    @property
    def num_processes(self) -> int:
        return self.num_shards + self.num_workers

    @property
    def chief_rank(self) -> int:
        return self.num_shards

    @property
    def num_servers(self) -> int:
        return self.num_shards

    @property
    def expendable_ranks(self) -> frozenset[int]:
        if not self.survives_loss:
            return frozenset()
        return frozenset(range(self.num_shards + 1, self.num_processes))

    def role(self, rank: int) -> Role:
        return Role.PS if rank < self.num_shards else Role.WORKER

    def replica(self, rank: int) -> int:
        """A worker's index among the workers; a shard's index among the shards."""
        return rank if rank < self.num_shards else rank - self.num_shards

    def rank_name(self, rank: int) -> str:
        return f"ps shard {rank}" if rank < self.num_shards else f"worker {rank - self.num_shards}"

    def checkpoint_parts(self) -> list[str]:
        return [f"shard-{k}" for k in range(self.num_shards)]

    def checkpoint_part(self, rank: int) -> str | None:
        """Shards save their slice, optimizer, version and the data position; a worker's codec
        state goes beside them, outside the manifest (``worker-<i>.pt``)."""
        return f"shard-{rank}" if rank < self.num_shards else None

    def model_part(self, rank: int) -> str | None:
        return None

    def check_cluster(self, cluster: ClusterEnv, strategy: str) -> None:
        if cluster.source == "TF_CONFIG" and cluster.num_ps != self.num_shards:
            raise ConfigError(f"TF_CONFIG lists {cluster.num_ps} ps tasks but --ps-shards is {self.num_shards}")
        if cluster.world_size != self.num_processes:
            raise ConfigError(
                f"the cluster has {cluster.world_size} processes but --strategy {strategy} needs "
                f"{self.num_processes} ({self.num_shards} ps shards + {self.num_workers} workers)"
            )
