"""Name -> implementation tables: strategies, codecs, models, data sets, optimizers, schedules.

Every mode of paratrain is one object looked up here by the name the user gives;
nothing branches on mode names elsewhere. Entries are ``"module:attribute"`` strings
imported on first use, so that this table can list everything without importing it
(and so that ``registry`` depends on nothing).
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from typing import Any

from paratrain.errors import ConfigError


class Registry:
    """A table of named implementations of one kind (``"strategy"``, ``"model"``...)."""

    def __init__(
        self,
        kind: str,
        entries: dict[str, str],
        aliases: dict[str, str] | None = None,
        user_code: bool = False,
        with_argument: tuple[str, ...] = (),
    ):
        self.kind = kind
        self._entries = dict(entries)
        self._aliases = dict(aliases or {})
        self.user_code = user_code
        """Whether a ``package.module:attribute`` reference to the user's own code is a valid name."""
        self.with_argument = with_argument
        """Entries that may be named ``name:ARGUMENT`` (``text-lm:corpus.txt``); the
        implementation is then called with ``argument=ARGUMENT``."""

    def names(self, with_aliases: bool = True) -> list[str]:
        names = list(self._entries)
        if with_aliases:
            names += list(self._aliases)
        return sorted(names)

    def canonical(self, name: str) -> str:
        """The table's own name for ``name`` (resolves aliases); ConfigError if unknown."""
        name = self._aliases.get(name, name)
        if self.user_code and is_reference(name):
            return name
        base, sep, argument = name.partition(":")
        if sep and base in self.with_argument and argument:
            return name
        if name not in self._entries:
            valid = ", ".join(self.names())
            more = ", or package.module:factory for your own" if self.user_code else ""
            raise ConfigError(f"unknown {self.kind} {name!r}; valid: {valid}{more}")
        return name

    def __contains__(self, name: str) -> bool:
        return self._aliases.get(name, name) in self._entries

    def get(self, name: str) -> Any:
        name = self.canonical(name)
        base, _, argument = name.partition(":")
        if base in self.with_argument:
            return functools.partial(self._load(base), argument=argument or None)
        if name not in self._entries:
            return load_reference(name, f"--{self.kind}")
        return self._load(name)

    def _load(self, name: str) -> Any:
        module_name, _, attribute = self._entries[name].partition(":")
        return getattr(importlib.import_module(module_name), attribute)

    def register(self, name: str, target: str) -> None:
        """Add an implementation (``"package.module:attribute"``), e.g. from a plugin."""
        self._entries[name] = target


def is_reference(name: str) -> bool:
    """Whether ``name`` reads ``package.module:attribute``."""
    module, sep, attribute = name.partition(":")
    return bool(sep and module and attribute) and all(part.isidentifier() for part in (*module.split("."), attribute))


def load_reference(reference: str, what: str) -> Any:
    """The object ``package.module:attribute`` names, importable from the working directory
    too (as ``python -m`` would find it); ConfigError naming what failed."""
    module_name, _, attribute = reference.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(f"{what} {reference}: cannot import {module_name} ({error})") from None
    except Exception as error:  # the user's module failed while importing
        raise ConfigError(
            f"{what} {reference}: importing {module_name} raised {type(error).__name__}: {error}"
        ) from None
    if not hasattr(module, attribute):
        raise ConfigError(f"{what} {reference}: module {module_name} has no attribute {attribute!r}")
    return getattr(module, attribute)


class StrategyTable(Registry):
    """The strategies, read from each strategy folder's ``spec.py`` (its names, their classes
    and its configuration section: strategies/spec.py) on first use."""

    def __init__(self, specs: list[str]):
        super().__init__("strategy", {})
        self._spec_references = list(specs)
        self._specs: list[Any] | None = None

    def specs(self) -> list[Any]:
        """Every folder's ``StrategySpec``, in the table's order."""
        if self._specs is None:
            self._specs = [load_reference(reference, "strategy spec") for reference in self._spec_references]
            for spec in self._specs:
                self._entries.update(spec.references())
                self._aliases.update(spec.aliases)
        return self._specs

    def sections(self) -> dict[str, type]:
        """The run configuration's strategy sections: attribute -> its dataclass."""
        return {spec.section: spec.options for spec in self.specs() if spec.section}

    def names(self, with_aliases: bool = True) -> list[str]:
        self.specs()
        return super().names(with_aliases)

    def canonical(self, name: str) -> str:
        self.specs()
        return super().canonical(name)

    def __contains__(self, name: str) -> bool:
        self.specs()
        return super().__contains__(name)


#: One line per strategy folder: its spec (``SPEC`` in the folder's spec.py).
STRATEGIES = StrategyTable(
    [
        "paratrain.strategies.single.spec:SPEC",
        "paratrain.strategies.allreduce.spec:SPEC",
        "paratrain.strategies.ps.spec:SPEC",
        "paratrain.strategies.pipeline.spec:SPEC",
        "paratrain.strategies.averaging.spec:SPEC",
        "paratrain.strategies.fsdp.spec:SPEC",
        "paratrain.strategies.tensor.spec:SPEC",
        "paratrain.strategies.fault_tolerant.spec:SPEC",
    ]
)

# Gradient codecs (paratrain/comm/codecs.py): builders ``(CodecOptions) -> Codec``.
CODECS = Registry(
    "codec",
    {
        "none": "paratrain.comm.codec_config:make_none",
        "fp16": "paratrain.comm.codec_config:make_fp16",
        "bf16": "paratrain.comm.codec_config:make_bf16",
        "int8": "paratrain.comm.codec_config:make_int8",
        "topk": "paratrain.comm.codec_config:make_topk",
        "powersgd": "paratrain.comm.codec_config:make_powersgd",
    },
)

MODELS = Registry(
    "model",
    {
        "mlp": "paratrain.models.mlp:build_mlp",
        "cifar_cnn": "paratrain.models.cifar_cnn:build_cifar_cnn",
        "lstm": "paratrain.models.lstm_classifier:build_lstm",
        "gpt": "paratrain.models.gpt:build_gpt",
        "dlrm": "paratrain.models.dlrm:build_dlrm",
    },
    user_code=True,
)

DATASETS = Registry(
    "dataset",
    {
        "digits": "paratrain.data.datasets:load_digits",
        "fashion-mnist": "paratrain.data.idx:load_fashion_mnist",
        "cifar10": "paratrain.data.cifar:load_cifar10",
        "text": "paratrain.data.text:load_text",
        "text-lm": "paratrain.data.text_lm:load_text_lm",
        "clicks": "paratrain.data.clicks:load_clicks",
    },
    aliases={"fashion_mnist": "fashion-mnist", "cifar-10": "cifar10"},
    user_code=True,
    with_argument=("text-lm", "clicks"),
)

OPTIMIZERS = Registry(
    "optimizer",
    {
        "sgd": "paratrain.train.optimizers:make_sgd",
        "adam": "paratrain.train.optimizers:make_adam",
        "adamw": "paratrain.train.optimizers:make_adamw",
        "adagrad": "paratrain.train.optimizers:make_adagrad",
    },
)

SCHEDULES = Registry(
    "learning-rate schedule",
    {
        "constant": "paratrain.train.schedules:Constant",
        "exponential": "paratrain.train.schedules:ExponentialDecay",
        "linear-scaling": "paratrain.train.schedules:LinearScalingWarmup",
    },
)
