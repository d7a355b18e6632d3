"""How a component declares its options: a dataclass field made with ``option()``, its help
text and valid choices right under it. The command line (``--batch-size``) and TOML keys
(``batch-size`` or ``batch_size``) are derived from these fields; ``check_options`` checks
their types and choices, so a choice is written once, in the field.

Depends on nothing but errors.py: configuration dataclasses at every layer use it.
"""

from __future__ import annotations

import dataclasses
import math
from enum import Enum
from typing import Any

from paratrain.errors import ConfigError


def option(default: Any, help: str, choices: Any = None, strategies: tuple[str, ...] | None = None) -> Any:
    """A configuration field: its default, its help text (what ``--help`` prints) and, if it
    has them, its valid values (a tuple, an Enum class, or a registry table). In a
    strategy's section, ``strategies`` names the strategies that take this option where
    they are fewer than the section's own (``strategies``, a class attribute)."""
    metadata = {"help": help, "choices": choices}
    if strategies is not None:
        metadata["strategies"] = strategies
    return dataclasses.field(default=default, metadata=metadata)


def _field(section: Any, name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(section) if f.name == name)


def takers(section: Any, name: str) -> tuple[str, ...]:
    """The strategies (registry names) that take option ``name`` of ``section``: the field's
    own list, else its section's; every other strategy refuses the option."""
    return _field(section, name).metadata.get("strategies", section.strategies)


def refuse_untaken(strategy: str, section: Any, names: list[str]) -> None:
    """ConfigError naming the first of ``names`` (options of ``section``, given or changed)
    that ``strategy`` does not take, and the strategies that do. Given the section's values
    (an instance), a switch on by default that is off is named as it was given
    (``--no-shared-memory``)."""
    for name in names:
        who = takers(section, name)
        if strategy not in who:
            off = _field(section, name).default is True and getattr(section, name) is False
            raise ConfigError(f"{flag(name, off)} applies to {_strategies(who)}, not to --strategy {strategy}")


def _strategies(names: tuple[str, ...]) -> str:
    """("local-sgd", "diloco") -> "--strategy local-sgd and diloco"."""
    if len(names) > 2 and all(n.startswith("ps-") for n in names):
        return "the ps-* strategies"
    return "--strategy " + (" and ".join(names) if len(names) < 3 else ", ".join(names[:-1]) + " and " + names[-1])


def flag(name: str, off: bool = False) -> str:
    """``batch_size`` -> ``--batch-size``; a switch turned ``off``: ``--no-shared-memory``."""
    return ("--no-" if off else "--") + name.replace("_", "-")


def choice_names(choices: Any) -> list[str]:
    if isinstance(choices, type) and issubclass(choices, Enum):
        return [member.value for member in choices]
    if hasattr(choices, "names"):  # a registry table
        return choices.names()
    return list(choices)


def field_type(f: dataclasses.Field) -> type:
    """The plain type of an option field (``int | None`` -> int)."""
    text = str(f.type)
    for kind in (bool, int, float, str):
        if text.startswith(kind.__name__):
            return kind
    raise TypeError(f"unsupported option type {f.type} for {f.name}")


def option_fields(config: Any) -> list[dataclasses.Field]:
    """The option fields of a configuration dataclass (or its class), in order."""
    return [f for f in dataclasses.fields(config) if "help" in f.metadata]


def check_options(config: Any) -> None:
    """Types (ints widened to floats where a float is expected) and choices of every option
    field of ``config``; a registry's aliases are replaced by the table's own name."""
    for f in option_fields(config):
        value = getattr(config, f.name)
        if value is None and "None" in str(f.type):
            continue
        expected = field_type(f)
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
            setattr(config, f.name, value)
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise ConfigError(f"{flag(f.name)} must be {expected.__name__}, got {value!r}")
        choices = f.metadata.get("choices")
        if choices is None:
            continue
        if hasattr(choices, "canonical"):  # a registry table: its error names the valid ones
            setattr(config, f.name, choices.canonical(value))
        elif value not in choice_names(choices):
            raise ConfigError(f"{flag(f.name)} must be one of {', '.join(choice_names(choices))}; got {value!r}")


def at_least(name: str, value: float | None, low: float) -> None:
    """ConfigError unless ``value`` (None: not given) is a finite number >= ``low``."""
    if value is not None and not (math.isfinite(value) and value >= low):
        raise ConfigError(f"{flag(name)} must be >= {low}, got {value}")  # nan and inf too


def non_default(config: Any) -> list[str]:
    """The option fields of ``config`` that differ from a fresh instance's defaults."""
    fresh = type(config)()
    return [f.name for f in option_fields(config) if getattr(config, f.name) != getattr(fresh, f.name)]
