"""The shard side of a parameter-server run: one ShardHost per shard process.

It is the process's server role (strategies/roles.py): it builds the ShardServer
(protocol/server.py) with every collaborator it needs passed to the constructor (update
rule, store, codec, message tags, the version listener), restores it from a checkpoint
part (or from the parts of another number of shards), tells the workers which checkpoint
they go on from, and serves. The worker side is worker.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from paratrain.strategies.ps.modes import MODES, PULL_DTYPES, PSConfig, PSMode, survives_lost_worker
from paratrain.strategies.ps.protocol.server import ShardServer
from paratrain.strategies.ps.tables.setup import shard_tables


class ShardHost:
    """Shard ``shard`` of ``num_shards``, serving ``num_workers`` workers in mode ``mode``."""

    def __init__(
        self,
        shard: int,
        num_shards: int,
        num_workers: int,
        mode: PSMode,
        config: PSConfig,
        store: Any,
        *,
        heartbeat_timeout: float,
        timeout: float,
        codec_factory: Callable[[], Any],
        tags: int,
        join_key: tuple[str, str] | None = None,
    ):
        self.shard = shard
        self.num_shards = num_shards
        self.num_workers = num_workers
        self.mode = mode
        self.config = config
        self.store = store
        self.heartbeat_timeout, self.timeout = heartbeat_timeout, timeout
        self.codec_factory, self.tags = codec_factory, tags
        self.join_key = join_key
        """(join token, run) where workers may join the running run (joining.py); None: it admits none."""
        self.server: ShardServer | None = None
        self.on_version: Callable[[int], None] = _ignore
        """Called with each version this shard publishes (the Trainer points it at its callbacks)."""

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Build this shard's server over its slice of ``model`` and ``optimizer``."""
        facts = MODES[self.mode]
        pull_dtype = PULL_DTYPES[self.config.pull_compression]
        tables = shard_tables(model, optimizer, self.config, self.shard, pull_dtype)  # out of the model first
        self.server = ShardServer(
            self.shard,
            self.num_shards,
            self.num_workers,
            model,
            optimizer,
            facts.make_rule(self.config, self.num_workers),
            self.store,
            rule_name=self.mode.strategy_name,
            heartbeat_timeout=self.heartbeat_timeout,
            tolerate_loss=survives_lost_worker(self.mode, self.config),
            join_key=self.join_key,
            wait_timeout=self.timeout,
            codec_factory=self.codec_factory,
            tags=self.tags,
            pull_dtype=pull_dtype,
            tables=tables,
            dense=self.config.dense == "ps",
            # read at each version, so that on_version may be set after this
            on_version=lambda version: self.on_version(version),
        )

    def serve(self) -> dict[str, Any]:
        """Serve until training ends (the classic ``server.join()``); this shard's statistics."""
        if self.server is None:
            raise RuntimeError("serve() needs prepare(model, optimizer) first")
        return self.server.serve()

    # ----- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The shard's slice of the parameters, its optimizer, version and the data position."""
        return self.server.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.server.load_state_dict(state)

    def holds_as_saved(self, state: dict[str, Any]) -> bool:
        """Whether this shard's part ``state`` of a checkpoint holds this shard's rows of every
        table (its run sharded them as this one does)."""
        return self.server.holds_as_saved(state)

    def load_resharded_state(self, states: list[dict[str, Any]]) -> None:
        """From every part of a checkpoint saved by another number of shards (reshard.py)."""
        self.server.load_resharded(states)

    def announce_resume(self, folder: str | None) -> None:
        """On shard 0: tell the workers which checkpoint the shards took (None: none, they
        start afresh), so that every process goes on from the same one."""
        if self.shard == 0:
            position = self.server.position() if folder is not None else {"version": 0, "epoch": 0}
            self.store.set("resume", json.dumps({**position, "folder": folder}))


def _ignore(version: int) -> None:
    pass
