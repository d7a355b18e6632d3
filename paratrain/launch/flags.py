"""The flags of ``paratrain train`` and the run configuration they make: one parser for the
command line, ``strategy_from_flags`` and the tests, so that a flag means the same
everywhere."""

from __future__ import annotations

import argparse
from typing import Any

from paratrain.config import config_fields, field_type, make_config
from paratrain.config_files import config_from_run, load_toml
from paratrain.errors import ConfigError
from paratrain.launch.parser import OneLineParser


def add_train_arguments(train: argparse.ArgumentParser) -> None:
    """``--config``, ``--config-from`` and a flag for every TrainConfig option."""
    train.add_argument("--config", metavar="FILE.toml", help="read options from a TOML file (flags override it)")
    train.add_argument(
        "--config-from",
        metavar="RUN.json",
        help="repeat a run: read options from the config embedded in its metrics file (flags override them; "
        "its output paths --metrics-out, --logdir, --timeline, --checkpoint-dir are not reused)",
    )
    for f in config_fields():
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata["help"]
        choices = f.metadata.get("choices")
        if choices is not None:
            names = choices.names() if hasattr(choices, "names") else choices
            help_text += f" ({'|'.join(names)}; default {f.default})"
        elif f.default is not None:
            help_text += f" (default {f.default})"
        kind = field_type(f)
        if kind is bool:
            train.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            train.add_argument(flag, type=kind, default=None, metavar=f.name.upper(), help=help_text)


def parse_train_config(argv: list[str], cluster: Any = None) -> Any:
    """The TrainConfig that ``paratrain train ARGV`` would run (in ``cluster``, or outside any)."""
    parser = OneLineParser(prog="paratrain train")
    add_train_arguments(parser)
    return train_config(parser.parse_args(argv), cluster)


def train_config(args: argparse.Namespace, cluster: Any, base: dict[str, Any] | None = None) -> Any:
    """The run's TrainConfig from ``--config``/``--config-from`` (or ``base``: the options of
    the run a worker joins) and the flags given on top; under a cluster started elsewhere,
    ``--workers`` defaults to its worker count."""
    if args.config and args.config_from:
        raise ConfigError("give --config or --config-from, not both")
    if base and (args.config or args.config_from):
        raise ConfigError("--join takes the options of the run it joins: give no --config or --config-from")
    file_values = load_toml(args.config) if args.config else dict(base or {})
    if args.config_from:
        file_values = config_from_run(args.config_from)
    overrides = {f.name: getattr(args, f.name) for f in config_fields() if getattr(args, f.name) is not None}
    # What the user gave: the flags and a --config file's keys; the options of an earlier
    # run (--config-from, or the run a worker joins) are all written, and count where they
    # differ from their defaults.
    given = set(overrides) | (set(file_values) if args.config else set())
    if cluster is not None and "workers" not in overrides and "workers" not in file_values:
        if cluster.num_ps:  # TF_CONFIG names the ps jobs
            overrides["workers"] = cluster.world_size - cluster.num_ps
        else:  # torchrun: as many workers as the processes left beside the mode's own (shards)
            probe = make_config(file_values, {**overrides, "workers": cluster.world_size}, given)
            others = probe.topology.num_processes - cluster.world_size  # shards, backups
            overrides["workers"] = max(1, cluster.world_size - others)
    return make_config(file_values, overrides, given)
