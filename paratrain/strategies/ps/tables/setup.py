"""A parameter-server run's tables, set up in each process: on a shard, its rows of every
table and their optimizer (shard.py); on a worker, the tables of its model replaced by
RemoteTables that fetch rows (remote.py). Both take the tables out of the model first, so
the dense parameters the shards split by bytes (layout.py) are the rest of the model."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paratrain.errors import ConfigError
from paratrain.parallel.tables import find_tables, spec_of
from paratrain.strategies.ps.tables.layout import TableLayout
from paratrain.strategies.ps.tables.optimizers import table_kind
from paratrain.strategies.ps.tables.remote import TableRows, swap_tables
from paratrain.strategies.ps.tables.shard import TableShard, check_memory


def _layout(model: nn.Module, selection: str, num_shards: int, sharding: str) -> tuple[list[Any], TableLayout]:
    tables = find_tables(model, selection)
    return tables, TableLayout([spec_of(name, module) for name, module in tables], num_shards, sharding)


def shard_tables(
    model: nn.Module, optimizer: torch.optim.Optimizer, config: Any, shard: int, pull_dtype: torch.dtype
) -> TableShard | None:
    """This shard's rows of the tables ``config.tables`` names (None: no tables), taken out
    of ``model``; stepped by the lazy form of ``optimizer``, each with its group's settings."""
    if not config.holds_tables:
        return None
    tables, layout = _layout(model, config.tables, config.num_shards, config.table_sharding)
    kind = table_kind(type(optimizer).__name__, config.table_optimizer)
    groups = []
    for name, module in tables:
        group = next((g for g in optimizer.param_groups if any(p is module.weight for p in g["params"])), None)
        if group is None:
            raise ConfigError(f"--tables {name}: the optimizer does not train its weight")
        groups.append(group)
    modules = [module for _, module in tables]
    rows = TableShard(layout, shard, modules, groups, kind, isinstance(optimizer, torch.optim.AdamW), pull_dtype)
    swap_tables(model, tables, None, layout.specs)
    return rows


def worker_tables(model: nn.Module, config: Any, pull_dtype: torch.dtype) -> TableRows | None:
    """The fetcher of rows for ``model``'s tables, which it replaces (None: no tables); its
    client is set once the worker is connected."""
    if not config.holds_tables:
        return None
    tables, layout = _layout(model, config.tables, config.num_shards, config.table_sharding)
    rows = TableRows(layout, None, pull_dtype)
    swap_tables(model, tables, rows, layout.specs)
    return rows


def check_model_tables(model: nn.Module, run: Any) -> None:
    """Before any process starts: the tables ``--tables`` names exist and can be tables, and
    every shard's rows with their optimizer state fit its host's memory (``run``: the
    TrainConfig)."""
    config = run.ps
    if not config.holds_tables:
        return
    _, layout = _layout(model, config.tables, config.num_shards, config.table_sharding)
    kind = table_kind(run.optimizer, config.table_optimizer)
    momentum = run.momentum if run.optimizer == "sgd" else 0.0
    for shard in range(config.num_shards):
        check_memory(shard, layout.shard_bytes(shard), kind, momentum)
