"""Run configuration: one dataclass, loaded from TOML and the command line, validated once.

Every field is one command-line flag (``batch_size`` <-> ``--batch-size``) and one key of
a ``--config`` TOML file; the flag overrides the file. Each field's help text sits in
its metadata, right under it, and is what ``paratrain train --help`` prints.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paratrain.errors import ConfigError
from paratrain.registry import CODECS, DATASETS, MODELS, OPTIMIZERS, SCHEDULES, STRATEGIES

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


def _opt(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class TrainConfig:
    """Everything one ``paratrain train`` run needs; the metrics file embeds it."""

    model: str = _opt("mlp", "model to train", choices=MODELS)
    dataset: str = _opt(
        "digits",
        "data set (digits ships with scikit-learn; fashion-mnist and cifar10 are downloaded to "
        "--data-dir when absent; text reads --data-dir)",
        choices=DATASETS,
    )
    data_dir: str | None = _opt(
        None, "folder of the data set's files (default ~/.cache/paratrain/<dataset>, or $PARATRAIN_DATA/<dataset>)"
    )
    download: bool = _opt(True, "download a missing data set from its publisher (SHA-256 checked)")
    max_len: int = _opt(200, "text: tokens per document, cut or padded at the front")
    vocab_size: int = _opt(20000, "text: vocabulary size (the most frequent training words, plus padding and unknown)")
    strategy: str = _opt("single", "how training is distributed", choices=STRATEGIES)
    workers: int = _opt(1, "number of data-parallel replicas (processes)")
    device: str = _opt("auto", "auto (CUDA when available), cpu or cuda", choices=("auto", "cpu", "cuda"))
    ps_shards: int | None = _opt(
        None, "parameter-server shards (ps-* strategies; default 1): ranks 0..P-1 serve parameters"
    )
    backup_workers: int = _opt(0, "ps-backup: extra workers K; each update takes the first --workers gradients")
    staleness_bound: int | None = _opt(None, "ps-async: a worker more than S steps ahead of the slowest live one waits")
    stale_policy: str = _opt(
        "none",
        "ps-async: none, scale-lr (step / staleness) or drop (staler than --max-staleness)",
        choices=("none", "scale-lr", "drop"),
    )
    max_staleness: int = _opt(4, "ps-async with --stale-policy drop: the largest staleness still applied")
    warmup_steps: int = _opt(0, "ps-async: the first W updates come from worker 0 alone, then the others join")
    pull_compression: str = _opt(
        "none",
        "parameter server: parameters sent to workers in none (fp32), fp16 or bf16",
        choices=("none", "fp16", "bf16"),
    )
    heartbeat_timeout: float = _opt(
        10.0, "parameter server: seconds without a heartbeat before a worker counts as dead"
    )
    stages: int = _opt(2, "pipeline: stages the model is split into, one process each")
    microbatches: int = _opt(4, "pipeline: micro-batches per batch (--batch-size must be a multiple)")
    schedule: str = _opt("1f1b", "pipeline: micro-batch schedule", choices=("gpipe", "1f1b"))
    balance: str = _opt(
        "params",
        "pipeline: balance stages by parameter count or by measured time per layer",
        choices=("params", "time"),
    )
    split_points: str | None = _opt(None, "pipeline: layer indices where stages start, e.g. 3,7 (instead of --balance)")
    fail: str | None = _opt(
        None,
        "fault injection: WORKER@STEP makes that worker's process die at that step; ps:SHARD@VERSION makes a parameter-server shard die once it has published that version",
    )
    hang: str | None = _opt(
        None, "fault injection: WORKER@STEP makes that worker stop answering at that step (for --timeout drills)"
    )
    straggler: str | None = _opt(None, "fault injection: WORKER:FACTOR makes that worker's steps FACTOR times slower")
    epochs: int = _opt(15, "passes over the training data")
    batch_size: int = _opt(32, "examples per replica per step; the global batch is batch_size x workers")
    lr: float = _opt(0.05, "learning rate (the base rate when a schedule scales it)")
    optimizer: str = _opt("sgd", "optimizer", choices=OPTIMIZERS)
    momentum: float = _opt(0.9, "SGD momentum (0 for plain SGD)")
    weight_decay: float = _opt(0.0, "L2 weight decay")
    lr_schedule: str = _opt("constant", "learning-rate schedule", choices=SCHEDULES)
    lr_decay_rate: float = _opt(0.1, "exponential schedule: factor applied every --lr-decay-steps")
    lr_decay_steps: int = _opt(1000, "exponential schedule: steps between decays")
    staircase: bool = _opt(True, "exponential schedule: decay in whole steps (the CIFAR-10 recipe)")
    warmup_epochs: float = _opt(0.0, "linear-scaling schedule: epochs of gradual warm-up (Goyal et al. use 5)")
    reference_batch: int = _opt(256, "linear-scaling schedule: global batch at which --lr applies unscaled")
    compression: str = _opt(
        "none", "gradient codec on the wire (allreduce: as a DDP communication hook)", choices=CODECS
    )
    compression_ratio: float = _opt(
        0.01, "topk: fraction R of each gradient's entries sent, 0 < R <= 1 (the rest is carried by error feedback)"
    )
    powersgd_rank: int = _opt(2, "powersgd: rank r of the low-rank approximation (Vogels et al. 2019 use 1-4)")
    stochastic_rounding: bool = _opt(False, "int8: round stochastically (unbiased) instead of to nearest")
    early_stopping: int = _opt(0, "stop after this many epochs without test-loss improvement (0: off)")
    seed: int = _opt(0, "random seed for model initialisation and data order")
    log_every: int = _opt(50, "print the step log every this many steps (0: only per epoch)")
    progress: bool = _opt(True, "show a progress bar on the chief when writing to a terminal")
    checkpoint_dir: str | None = _opt(
        None, "save checkpoints to this folder (ckpt-STEP/ with a manifest; see docs/reliability.md)"
    )
    checkpoint_every: int = _opt(500, "with --checkpoint-dir: save every this many steps (and at the end)")
    keep: int = _opt(3, "with --checkpoint-dir: complete checkpoints kept (older ones are removed)")
    resume: bool = _opt(
        False, "go on from the newest complete checkpoint in --checkpoint-dir (from the start if there is none)"
    )
    max_restarts: int = _opt(
        0, "restart the whole run from its last checkpoint when a process dies, up to this many times"
    )
    on_nan: str = _opt(
        "stop",
        "a NaN or Inf loss or gradient: stop (exit 3) or skip that update and count it",
        choices=("stop", "skip"),
    )
    timeout: float = _opt(300.0, "seconds any collective or rendezvous may wait before the run fails")
    metrics_out: str | None = _opt(None, "write the run's metrics as one JSON object to this file")
    logdir: str | None = _opt(
        None, "write TensorBoard scalars to this folder (run-level by the chief, per-rank timing in rank-N/)"
    )
    timeline: str | None = _opt(None, "write a Chrome/Perfetto trace of every rank's step phases to this JSON file")

    def __post_init__(self) -> None:
        self._check_types()
        for name in ("model", "dataset", "strategy", "optimizer", "lr_schedule", "compression"):
            registry = _field(name).metadata["choices"]
            setattr(self, name, registry.canonical(getattr(self, name)))
        _choice("device", self.device, ("auto", "cpu", "cuda"))
        _choice("stale_policy", self.stale_policy, ("none", "scale-lr", "drop"))
        _choice("pull_compression", self.pull_compression, ("none", "fp16", "bf16"))
        _choice("schedule", self.schedule, ("gpipe", "1f1b"))
        _choice("balance", self.balance, ("params", "time"))
        _choice("on_nan", self.on_nan, ("stop", "skip"))
        for name in (
            "workers",
            "epochs",
            "batch_size",
            "lr_decay_steps",
            "reference_batch",
            "max_len",
            "powersgd_rank",
            "stages",
            "microbatches",
            "checkpoint_every",
            "keep",
        ):
            _at_least(name, getattr(self, name), 1)
        _at_least("vocab_size", self.vocab_size, 3)  # padding, unknown, and one word
        for name in (
            "early_stopping",
            "log_every",
            "seed",
            "backup_workers",
            "max_staleness",
            "warmup_steps",
            "max_restarts",
        ):
            _at_least(name, getattr(self, name), 0)
        for name in ("ps_shards", "staleness_bound"):
            if getattr(self, name) is not None:
                _at_least(name, getattr(self, name), 1 if name == "ps_shards" else 0)
        for name in ("lr", "timeout", "lr_decay_rate", "heartbeat_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{_flag(name)} must be > 0, got {getattr(self, name)}")
        for name in ("momentum", "weight_decay", "warmup_epochs"):
            _at_least(name, getattr(self, name), 0)
        if not 0 < self.compression_ratio <= 1:
            raise ConfigError(f"--compression-ratio must be in (0, 1], got {self.compression_ratio}")
        if self.stochastic_rounding and self.compression != "int8":
            raise ConfigError(
                f"--stochastic-rounding applies to --compression int8, this run uses --compression {self.compression}"
            )
        for name in ("metrics_out", "timeline"):
            if getattr(self, name) is not None:
                _check_writable(name, getattr(self, name))
        if self.checkpoint_dir is not None and Path(self.checkpoint_dir).expanduser().is_file():
            raise ConfigError(f"--checkpoint-dir {self.checkpoint_dir} is a file; give a folder")
        if (self.resume or self.max_restarts) and self.checkpoint_dir is None:
            flag = "--resume" if self.resume else "--max-restarts"
            raise ConfigError(f"{flag} needs --checkpoint-dir (the folder to go on from)")
        if self.logdir is not None and Path(self.logdir).expanduser().is_file():
            raise ConfigError(f"--logdir {self.logdir} is a file; give a folder")
        shard_fault = self.fail is not None and self.fail.startswith("ps:")
        fail_form = "WORKER@STEP (e.g. 1@40) or ps:SHARD@VERSION (e.g. ps:0@100)"
        parsed = _parse_fault("fail", self.fail, "@", int, fail_form, prefix="ps:" if shard_fault else "")
        if parsed is not None and parsed[1] < 1:
            raise ConfigError(f"--fail {self.fail}: the step or version must be >= 1")
        self.fail_at, self.fail_shard_at = (None, parsed) if shard_fault else (parsed, None)
        self.hang_at = _parse_fault("hang", self.hang, "@", int, "WORKER@STEP, e.g. 1@40")
        self.straggler_factor = _parse_fault("straggler", self.straggler, ":", float, "WORKER:FACTOR, e.g. 2:3.0")
        if self.straggler_factor and self.straggler_factor[1] < 1:
            raise ConfigError(f"--straggler factor must be >= 1, got {self.straggler_factor[1]}")
        strategy = STRATEGIES.get(self.strategy)
        strategy.check_config(self)
        if self.compression != "none" and not strategy.takes_compression:
            takers = [n for n in STRATEGIES.names(with_aliases=False) if STRATEGIES.get(n).takes_compression]
            raise ConfigError(
                f"--compression {self.compression}: --strategy {self.strategy} sends no gradients to compress; "
                f"strategies that take it: {', '.join(takers)}"
            )

    def _check_types(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            expected = field_type(f)
            if value is None and "None" in str(f.type):
                continue
            if expected is float and isinstance(value, int) and not isinstance(value, bool):
                setattr(self, f.name, float(value))
                continue
            if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
                raise ConfigError(f"{_flag(f.name)} must be {expected.__name__}, got {value!r}")

    @property
    def global_batch(self) -> int:
        """Examples per step over all replicas (a pipeline replica is several processes)."""
        return self.batch_size * STRATEGIES.get(self.strategy).num_replicas_for(self)

    @property
    def num_worker_processes(self) -> int:
        """Processes that train: the workers plus ps-backup's backup workers."""
        return self.workers + self.backup_workers

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)


def _parse_fault(
    name: str, text: str | None, sep: str, kind: type, form: str, prefix: str = ""
) -> tuple[int, Any] | None:
    """``"1@40"`` -> (1, 40) for --fail, ``"2:3.0"`` -> (2, 3.0) for --straggler; ``prefix``
    (``"ps:"``) is dropped first."""
    if text is None:
        return None
    worker, found, value = text.removeprefix(prefix).partition(sep)
    try:
        if not found:
            raise ValueError
        parsed = (int(worker), kind(value))
    except ValueError:
        raise ConfigError(f"{_flag(name)} must be {form}, got {text!r}") from None
    if parsed[0] < 0:
        raise ConfigError(f"{_flag(name)}: {'shard' if prefix else 'worker'} index must be >= 0, got {parsed[0]}")
    return parsed


def _field(name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(TrainConfig) if f.name == name)


def field_type(f: dataclasses.Field) -> type:
    text = str(f.type)
    for t in (bool, int, float, str):
        if text.startswith(t.__name__):
            return t
    raise TypeError(f"unsupported config type {f.type} for {f.name}")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _choice(name: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ConfigError(f"{_flag(name)} must be one of {', '.join(valid)}; got {value!r}")


def _at_least(name: str, value: float, low: float) -> None:
    if value < low:
        raise ConfigError(f"{_flag(name)} must be >= {low}, got {value}")


def _check_writable(name: str, path: str) -> None:
    parent = Path(path).expanduser().resolve().parent
    if not parent.is_dir():
        raise ConfigError(f"{_flag(name)} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise ConfigError(f"{_flag(name)} {path}: directory {parent} is not writable")
    if Path(path).is_dir():
        raise ConfigError(f"{_flag(name)} {path} is a directory; give a file name")


def config_fields() -> list[dataclasses.Field]:
    """The fields of TrainConfig, in order (the CLI builds its flags from them)."""
    return list(dataclasses.fields(TrainConfig))


def load_toml(path: str) -> dict[str, Any]:
    """Read a ``--config`` file: a flat TOML table of TrainConfig keys (dashes allowed)."""
    try:
        with open(path, "rb") as handle:
            raw = tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"--config {path}: not valid TOML ({error})") from None
    except OSError as error:
        raise ConfigError(f"--config {path}: cannot read ({error.strerror})") from None
    raw = raw.get("train", raw)
    known = {f.name for f in config_fields()}
    values = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in known:
            valid = ", ".join(sorted(k.replace("_", "-") for k in known))
            raise ConfigError(f"--config {path}: unknown key {key!r}; valid keys: {valid}")
        values[name] = value
    return values


#: Where a run writes; a repeated run (--config-from) does not overwrite the first one's files.
OUTPUT_FIELDS = ("metrics_out", "logdir", "timeline", "checkpoint_dir", "resume")


def config_from_run(path: str) -> dict[str, Any]:
    """The options of the run that wrote metrics file ``path`` (its embedded ``config``),
    without its output paths."""
    import json

    try:
        with open(path) as handle:
            document = json.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"--config-from {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"--config-from {path}: cannot read ({getattr(error, 'strerror', None) or error})") from None
    except json.JSONDecodeError:
        raise ConfigError(
            f"--config-from {path}: not JSON; give a metrics file (paratrain train --metrics-out)"
        ) from None
    if not isinstance(document, dict) or not isinstance(document.get("config"), dict):
        raise ConfigError(f'--config-from {path}: no embedded "config"; give a metrics file of paratrain train')
    known = {f.name for f in config_fields()}
    unknown = sorted(set(document["config"]) - known)
    if unknown:
        raise ConfigError(
            f"--config-from {path}: unknown option {unknown[0]!r} (written by another paratrain version?)"
        )
    return {k: v for k, v in document["config"].items() if k not in OUTPUT_FIELDS}


def make_config(file_values: dict[str, Any], overrides: dict[str, Any]) -> TrainConfig:
    """A validated TrainConfig from a config file's values and the flags given on top."""
    try:
        return TrainConfig(**{**file_values, **overrides})
    except TypeError as error:  # a key TrainConfig does not take
        raise ConfigError(str(error)) from None
