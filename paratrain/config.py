"""Run configuration: the options of one ``paratrain train`` run, loaded from TOML and the
command line, validated once.

TrainConfig holds the run-level options and composes the sections each component owns:
``codec`` (comm/codec_config.py), each strategy folder's (named by its spec, which the
strategy table reads: ``allreduce``, ``ps``, ``pipeline``, ``averaging``, ``fsdp``, ``ft``),
``faults`` (train/fault_config.py), ``gpt`` (models/gpt_config.py), ``dlrm`` (models/dlrm_config.py) and ``lstm`` (models/lstm_config.py): leaf modules that
import no strategy runtime, so that the configuration sits below the strategies. Every option is one
command-line flag (``batch_size`` <-> ``--batch-size``) and one key of a ``--config`` TOML
file, whichever section it lives in: flags and keys are flat, as they always were. A
section's options are refused with one line when the chosen strategy does not take them.
Each field's help text sits in its metadata, right under it, and is what
``paratrain train --help`` prints.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paratrain.comm.codec_config import CodecConfig
from paratrain.errors import ConfigError
from paratrain.models.dlrm_config import DLRMConfig
from paratrain.models.gpt_config import GPTConfig
from paratrain.models.lstm_config import LSTMConfig
from paratrain.options import (
    at_least,
    check_options,
    field_type,
    flag,
    non_default,
    option,
    option_fields,
    refuse_untaken,
)
from paratrain.registry import DATASETS, MODELS, OPTIMIZERS, SCHEDULES, STRATEGIES, is_reference
from paratrain.strategies.activation import checkpoint_every
from paratrain.strategies.recipe import PRECISIONS
from paratrain.strategies.topology import Topology
from paratrain.train.fault_config import FaultConfig
from paratrain.train.scores import LOSSES, metric

DEFAULT_TIMEOUT_S = 60.0
"""How long any wait of a run (a collective, a rendezvous, a store key, a shard's reply)
may last before the run fails naming who did not answer (``--timeout``). The longest
legitimate wait in a run is one process doing alone what the others wait for: the chief
evaluating, a checkpoint being written, the first step of ``--compile``, a slow host
starting. On the built-in models and data sets these take under 5 s on 2 CPU cores;
60 s leaves a wide margin and yet ends a run with a dead peer within a minute. Raise it
for models of many GB or a compiled first step that takes longer."""

#: The sections of a TrainConfig: attribute -> the config class of the component that owns
#: it; each strategy folder's section comes from its spec (registry.STRATEGIES).
SECTIONS: dict[str, type] = {
    "codec": CodecConfig,
    **STRATEGIES.sections(),
    "faults": FaultConfig,
    "gpt": GPTConfig,
    "dlrm": DLRMConfig,
    "lstm": LSTMConfig,
}


@dataclass(init=False, eq=False)
class TrainConfig:
    """Everything one ``paratrain train`` run needs; the metrics file embeds it (flat).

    ``TrainConfig(strategy="ps-async", ps_shards=2)`` takes every option by its flat name, as
    the command line does, and puts each in its section (``config.ps.ps_shards``): the
    run-level options are the fields below, the sections are SECTIONS' (attributes set by
    ``__init__``)."""

    model: str = option(
        "mlp", "model to train, or your own: package.module:factory (docs/user_code.md)", choices=MODELS
    )
    dataset: str = option(
        "digits",
        "data set (digits ships with scikit-learn; fashion-mnist and cifar10 are downloaded to "
        "--data-dir when absent; text reads --data-dir), or your own: package.module:factory",
        choices=DATASETS,
    )
    data_dir: str | None = option(
        None, "folder of the data set's files (default ~/.cache/paratrain/<dataset>, or $PARATRAIN_DATA/<dataset>)"
    )
    download: bool = option(True, "download a missing data set from its publisher (SHA-256 checked)")
    max_len: int = option(200, "text: tokens per document, cut or padded at the front")
    vocab_size: int = option(
        20000, "text: vocabulary size (the most frequent training words, plus padding and unknown)"
    )
    seq_len: int = option(64, "text-lm: tokens per example (the language model's context)")
    strategy: str = option("single", "how training is distributed", choices=STRATEGIES)
    fault_tolerant: bool = option(
        False,
        "keep training through a lost replica, in quorums of the live ones: allreduce, pipeline and fsdp (each "
        "step), local-sgd and diloco (each synchronization); the same as --strategy allreduce-ft, pipeline-ft, "
        "fsdp-ft, local-sgd-ft, diloco-ft",
    )
    workers: int = option(1, "number of data-parallel replicas (processes)")
    device: str = option("auto", "auto (CUDA when available), cpu or cuda", choices=("auto", "cpu", "cuda"))
    heartbeat_timeout: float = option(
        10.0, "seconds without a heartbeat before a worker counts as dead (parameter servers)"
    )
    epochs: int = option(15, "passes over the training data")
    batch_size: int = option(32, "examples per replica per step; the global batch is batch_size x workers")
    lr: float = option(0.05, "learning rate (the base rate when a schedule scales it)")
    optimizer: str = option("sgd", "optimizer", choices=OPTIMIZERS)
    momentum: float = option(0.9, "SGD momentum (0 for plain SGD)")
    weight_decay: float = option(0.0, "L2 weight decay")
    loss: str = option(
        "cross_entropy", f"loss: {', '.join(LOSSES)}, or your own (outputs, targets) -> loss as package.module:fn"
    )
    metrics: str = option(
        "accuracy",
        "evaluation metrics, comma-separated: accuracy, top<k>_accuracy (top5_accuracy), mae, mse, "
        "or package.module:fn",
    )
    precision: str = option(
        "fp32", "fp32; bf16 (autocast, CPU and GPU); fp16 (autocast and a gradient scaler)", choices=tuple(PRECISIONS)
    )
    accumulate: int = option(
        1, "batches per optimizer step (gradient accumulation; one all-reduce per step): global batch x N"
    )
    clip_grad_norm: float | None = option(
        None, "clip the gradient to this global norm (parameter servers: each worker its own, before the push)"
    )
    channels_last: bool | None = option(
        None,
        "conv nets: parameters and 4-d inputs in channels-last (NHWC) memory order "
        "(default: on for a model with 2-d convolutions on the CPU, where it is faster)",
    )
    threads_per_worker: int | None = option(
        None,
        "CPU threads each process computes with (default: its usable cores / the paratrain processes on this "
        "machine, every run's, followed as runs start and end)",
    )
    activation_checkpointing: str = option(
        "none",
        "none; blocks (every transformer block, or every layer of an nn.Sequential, recomputes its activations "
        "in the backward pass instead of keeping them); every-K (every K-th block)",
    )
    pool_before_relu: bool = option(
        True,
        "a ReLU followed by a max-pooling in an nn.Sequential pools first (the same values and gradients, a "
        "quarter of the ReLU's work)",
    )
    onednn_layers: bool | None = option(
        None,
        "on the CPU: linear layers multiply through oneDNN (default: on x86 processors not made by Intel, where "
        "MKL runs a slower path; --onednn-layers: on any) and 2-d convolutions sum their bias gradient apart from oneDNN's weight "
        "gradient (faster; --no-onednn-layers keeps PyTorch's kernels as they are)",
    )
    compile: bool = option(False, "torch.compile the model (a slower first step while it compiles)")
    keep_host_memory: bool = option(
        True,
        "keep memory freed by CPU tensors in the process for the next step's (glibc malloc gives nothing back and "
        "maps no block apart; faster CPU steps, resident memory stays at its peak)",
    )
    flush_denormal: bool = option(
        True,
        "CPU arithmetic flushes denormal numbers (below 1.2e-38) to zero, as TensorFlow's does (a gradient "
        "fading through a long recurrence otherwise takes the processor's slow path)",
    )
    lr_schedule: str = option("constant", "learning-rate schedule", choices=SCHEDULES)
    lr_decay_rate: float = option(0.1, "exponential schedule: factor applied every --lr-decay-steps")
    lr_decay_steps: int = option(1000, "exponential schedule: steps between decays")
    staircase: bool = option(True, "exponential schedule: decay in whole steps (the CIFAR-10 recipe)")
    warmup_epochs: float = option(0.0, "linear-scaling schedule: epochs of gradual warm-up (Goyal et al. use 5)")
    reference_batch: int = option(256, "linear-scaling schedule: global batch at which --lr applies unscaled")
    early_stopping: int = option(0, "stop after this many epochs without test-loss improvement (0: off)")
    seed: int = option(0, "random seed for model initialisation and data order")
    log_every: int = option(50, "print the step log every this many steps (0: only per epoch)")
    progress: bool = option(True, "show a progress bar on the chief when writing to a terminal")
    checkpoint_dir: str | None = option(
        None, "save checkpoints to this folder (ckpt-STEP/ with a manifest; see docs/checkpoints.md)"
    )
    checkpoint_every: int = option(500, "with --checkpoint-dir: save every this many steps (and at the end)")
    checkpoint_async: bool = option(
        False,
        "with --checkpoint-dir: each save copies the state in memory and writes it from a thread while training "
        "goes on (the next save and the end wait for it); not with a parameter server",
    )
    keep: int = option(3, "with --checkpoint-dir: complete checkpoints kept (older ones are removed)")
    resume: bool = option(
        False, "go on from the newest complete checkpoint in --checkpoint-dir (from the start if there is none)"
    )
    max_restarts: int = option(
        0, "restart the whole run from its last checkpoint when a process dies, up to this many times"
    )
    on_nan: str = option(
        "stop",
        "a NaN or Inf loss or gradient: stop (exit 3) or skip that update and count it",
        choices=("stop", "skip"),
    )
    timeout: float = option(
        DEFAULT_TIMEOUT_S, "seconds any collective, rendezvous or shard reply may wait before the run fails"
    )
    metrics_out: str | None = option(None, "write the run's metrics as one JSON object to this file")
    logdir: str | None = option(
        None, "write TensorBoard scalars to this folder (run-level by the chief, per-rank timing in rank-N/)"
    )
    timeline: str | None = option(None, "write a Chrome/Perfetto trace of every rank's step phases to this JSON file")

    def __init__(self, _given: Any = None, **options: Any):
        # The options given (flags, a config file's keys, keyword arguments), beside those
        # that differ from their defaults: an option a strategy does not take is refused
        # when given, even at its default value. ``_given``: the names, where ``options``
        # holds more than was given (the options of an earlier run, --config-from).
        self._given = frozenset(options if _given is None else _given)
        for name, section in SECTIONS.items():
            given = options.pop(name, None)
            own = {f.name: options.pop(f.name) for f in option_fields(section) if f.name in options}
            if given is None:
                value = section(**own)
            else:
                value = dataclasses.replace(given, **own) if own else given
            setattr(self, name, value)
        for f in option_fields(TrainConfig):
            setattr(self, f.name, options.pop(f.name, f.default))
        if options:
            raise TypeError(f"TrainConfig got an unexpected keyword argument {next(iter(options))!r}")
        self.__post_init__()

    def __post_init__(self) -> None:
        check_options(self)
        if self.fault_tolerant:
            self.strategy = fault_tolerant_strategy(self.strategy)
        for name in (
            "workers",
            "epochs",
            "batch_size",
            "lr_decay_steps",
            "reference_batch",
            "max_len",
            "checkpoint_every",
            "keep",
            "accumulate",
            "threads_per_worker",
            "seq_len",
        ):
            at_least(name, getattr(self, name), 1)
        at_least("vocab_size", self.vocab_size, 3)  # padding, unknown, and one word
        for name in (
            "early_stopping",
            "log_every",
            "seed",
            "max_restarts",
            "momentum",
            "weight_decay",
            "warmup_epochs",
        ):
            at_least(name, getattr(self, name), 0)
        for name in ("lr", "timeout", "lr_decay_rate", "heartbeat_timeout", "clip_grad_norm"):
            if getattr(self, name) is None:
                continue
            if not 0 < getattr(self, name) < math.inf:
                raise ConfigError(f"{flag(name)} must be > 0, got {getattr(self, name)}")  # inf too
        for name in ("metrics_out", "timeline"):
            if getattr(self, name) is not None:
                _check_writable(name, getattr(self, name))
        if self.checkpoint_dir is not None and Path(self.checkpoint_dir).expanduser().is_file():
            raise ConfigError(f"--checkpoint-dir {self.checkpoint_dir} is a file; give a folder")
        # allreduce-ft's replacements take the live state from a peer, not from a checkpoint.
        restarts_need_checkpoint = self.max_restarts and not self.topology.replaces_lost
        if (self.resume or restarts_need_checkpoint) and self.checkpoint_dir is None:
            raise ConfigError(
                f"{'--resume' if self.resume else '--max-restarts'} needs --checkpoint-dir (the folder to go on from)"
            )
        if self.checkpoint_async and self.checkpoint_dir is None:
            raise ConfigError("--checkpoint-async needs --checkpoint-dir (the folder to save to)")
        if self.logdir is not None and Path(self.logdir).expanduser().is_file():
            raise ConfigError(f"--logdir {self.logdir} is a file; give a folder")
        self._check_scores()
        checkpoint_every(self.activation_checkpointing)
        self._check_model_options()
        strategy = STRATEGIES.get(self.strategy)
        self._check_sections(strategy)
        strategy.check_step(self.strategy, self.precision, self.compile, bool(self.channels_last))
        strategy.check_config(self)
        if self.checkpoint_async and not strategy.checkpoints_in_background:
            able = [n for n in STRATEGIES.names(with_aliases=False) if STRATEGIES.get(n).checkpoints_in_background]
            raise ConfigError(
                f"--checkpoint-async: --strategy {self.strategy} writes its checkpoints on its own schedule (a "
                f"parameter server's shards commit from a thread always); strategies that take it: {', '.join(able)}"
            )
        self.faults.check(strategy.topology_for(self), self.strategy)

    def _check_scores(self) -> None:
        """The loss and each metric: a built-in name or a package.module:fn reference (imported
        when the run starts)."""
        if self.loss not in LOSSES and not is_reference(self.loss):
            raise ConfigError(f"--loss {self.loss!r}: valid: {', '.join(LOSSES)}, or package.module:fn")
        for name in self.metric_names:
            if not is_reference(name):
                metric(name)

    def _check_model_options(self) -> None:
        """A model's own options (a section with ``models``) are refused with any other model,
        and --seq-len with data other than text-lm."""
        for section_name, section in SECTIONS.items():
            models = getattr(section, "models", None)
            changed = self.changed(section_name) if models else []
            if changed and self.model not in models:
                raise ConfigError(
                    f"{flag(changed[0])} applies to --model {' and '.join(models)}, not to --model {self.model}"
                )
        if self.model_options is not None:
            self.model_options.check()
        given = "seq_len" in self._given or self.seq_len != TrainConfig.seq_len
        if given and self.dataset.partition(":")[0] != "text-lm":
            raise ConfigError(f"--seq-len applies to --dataset text-lm, not to --dataset {self.dataset}")

    @property
    def model_options(self) -> Any:
        """The section of options of this run's model (``gpt`` for --model gpt), or None."""
        for section_name, section in SECTIONS.items():
            if self.model in getattr(section, "models", ()):
                return getattr(self, section_name)
        return None

    @property
    def metric_names(self) -> list[str]:
        return [m.strip() for m in self.metrics.split(",") if m.strip()]

    def changed(self, section: str) -> list[str]:
        """The options of ``section`` (a SECTIONS name) that were given or differ from
        their defaults, in the section's order."""
        differ = set(non_default(getattr(self, section)))
        return [f.name for f in option_fields(SECTIONS[section]) if f.name in self._given or f.name in differ]

    def _check_sections(self, strategy: Any) -> None:
        """An option of a strategy's section is refused by every strategy that does not take
        it (the section's ``strategies``, or the field's own), when given or changed from its
        default; a codec only by strategies that send gradients."""
        name = STRATEGIES.canonical(self.strategy)
        for section_name, section in SECTIONS.items():
            if hasattr(section, "strategies"):
                refuse_untaken(name, getattr(self, section_name), self.changed(section_name))
        self.codec.check()
        if self.codec.compression != "none" and not strategy.takes_compression:
            takers = [n for n in STRATEGIES.names(with_aliases=False) if STRATEGIES.get(n).takes_compression]
            raise ConfigError(
                f"--compression {self.codec.compression}: --strategy {self.strategy} sends no gradients to compress; "
                f"strategies that take it: {', '.join(takers)}"
            )

    @property
    def topology(self) -> Topology:
        """Who is who in this run (processes, roles, the chief), from the configuration alone."""
        return STRATEGIES.get(self.strategy).topology_for(self)

    @property
    def global_batch(self) -> int:
        """Examples per step over all replicas (a pipeline replica is several processes)."""
        return self.batch_size * self.accumulate * self.topology.num_replicas

    @property
    def num_worker_processes(self) -> int:
        """Processes that train: the workers plus ps-backup's backup workers."""
        return self.workers + self.ps.backup_workers

    def to_dict(self) -> dict[str, Any]:
        """Every option by its flat name (what ``--config`` files and metrics files hold)."""
        values = {f.name: getattr(self, f.name) for f in option_fields(TrainConfig)}
        for name in SECTIONS:
            section = getattr(self, name)
            values.update({f.name: getattr(section, f.name) for f in option_fields(section)})
        return values

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TrainConfig) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return f"TrainConfig({', '.join(f'{k}={v!r}' for k, v in self.to_dict().items())})"

    def replace(self, **changes: Any) -> TrainConfig:
        return TrainConfig(_given=self._given | set(changes), **{**self.to_dict(), **changes})


def config_fields() -> list[dataclasses.Field]:
    """Every option field, the sections' included (the CLI builds its flags from them)."""
    fields = option_fields(TrainConfig)
    for section in SECTIONS.values():
        fields += option_fields(section)
    return fields


#: The strategies --fault-tolerant makes per-step fault tolerant, and what they become.
FAULT_TOLERANT = {
    "allreduce": "allreduce-ft",
    "pipeline": "pipeline-ft",
    "fsdp": "fsdp-ft",
    "local-sgd": "local-sgd-ft",
    "diloco": "diloco-ft",
}


def fault_tolerant_strategy(strategy: str) -> str:
    """``--strategy S --fault-tolerant``: the strategy that is S kept through lost replicas."""
    if strategy in FAULT_TOLERANT.values():
        return strategy
    if strategy not in FAULT_TOLERANT:
        raise ConfigError(
            f"--fault-tolerant keeps {', '.join(FAULT_TOLERANT)} training through a lost replica; --strategy "
            f"{strategy} has no fault tolerance of its own yet (it restarts from its checkpoints: --checkpoint-dir "
            "with --max-restarts)"
        )
    return FAULT_TOLERANT[strategy]


def _check_writable(name: str, path: str) -> None:
    parent = Path(path).expanduser().resolve().parent
    if not parent.is_dir():
        raise ConfigError(f"{flag(name)} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise ConfigError(f"{flag(name)} {path}: directory {parent} is not writable")
    if Path(path).is_dir():
        raise ConfigError(f"{flag(name)} {path} is a directory; give a file name")


def make_config(file_values: dict[str, Any], overrides: dict[str, Any], given: Any = None) -> TrainConfig:
    """A validated TrainConfig from a config file's values and the flags given on top;
    ``given``: the names the user gave (default: all of them)."""
    try:
        return TrainConfig(_given=given, **{**file_values, **overrides})
    except TypeError as error:  # a key TrainConfig does not take
        raise ConfigError(str(error)) from None


__all__ = ["SECTIONS", "TrainConfig", "config_fields", "field_type", "make_config"]
