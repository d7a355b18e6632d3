"""Where a run's options come from besides its flags: a ``--config`` TOML file, and the
metrics file of an earlier run (``--config-from``, which repeats that run). Each is read into
flat option values, checked against the options that exist (config.py), with one line
naming what is wrong."""

from __future__ import annotations

import json
from typing import Any

from paratrain.config import config_fields
from paratrain.errors import ConfigError

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib


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
    if "train" in raw:
        others = [key for key in raw if key != "train"]
        if others:  # they were dropped without a word
            raise ConfigError(
                f"--config {path}: keys beside its [train] table ({', '.join(others)}); give them in [train] "
                "or all at the top"
            )
        if not isinstance(raw["train"], dict):
            raise ConfigError(f"--config {path}: train must be a table of keys ([train]), got {raw['train']!r}")
        raw = raw["train"]
    known = {f.name for f in config_fields()}
    values: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in known:
            valid = ", ".join(sorted(k.replace("_", "-") for k in known))
            raise ConfigError(f"--config {path}: unknown key {key!r}; valid keys: {valid}")
        if name in values:
            raise ConfigError(f"--config {path}: {name.replace('_', '-')} is given twice (with dashes and underscores)")
        values[name] = value
    return values


#: Where a run writes; a repeated run (--config-from) does not overwrite the first one's files.
OUTPUT_FIELDS = ("metrics_out", "logdir", "timeline", "checkpoint_dir", "resume")


def config_from_run(path: str) -> dict[str, Any]:
    """The options of the run that wrote metrics file ``path`` (its embedded ``config``),
    without its output paths."""
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
    config = dict(document["config"])
    if "loss_parallel" not in config and config.get("tensor_parallel") == 2:
        # Written before --tensor-parallel's default became each strategy's own (tensor 2,
        # pipeline 1: unsplit stages) with --loss-parallel: the 2 is that former default.
        del config["tensor_parallel"]
    return {k: v for k, v in config.items() if k not in OUTPUT_FIELDS}
