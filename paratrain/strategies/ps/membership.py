"""How a process becomes part of a parameter-server run, and what it holds of it then: its
rank, the run's store and message tags, and a link to each shard.

Two ways in: one of the processes the run started with (a rank of its process group, under
``paratrain train``, torchrun or TF_CONFIG), or a worker added to a running run with
``--join HOST:PORT`` (joining.py), which meets each shard over a link of its own.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from paratrain.comm.transport import cluster_from_env
from paratrain.errors import ConfigError
from paratrain.strategies.ps.joining import join_run
from paratrain.strategies.ps.protocol.links import WorldLink
from paratrain.strategies.ps.protocol.wire import RUN_TAG_STRIDE


@dataclass
class Membership:
    process_rank: int
    num_workers: int
    """The workers this process knows of: all of its own run's; a joiner's count ends with it."""
    local_rank: int
    store: Any
    """The run's store (its keys prefixed with the run's)."""
    tags: int
    """This run's offset of the message tags."""
    links: list[Any]
    """One per shard (protocol/links.py)."""
    address: str = ""
    """HOST:PORT of the run's rendezvous, where workers join it (a run's own process)."""
    root_store: Any = None
    prefix: str = ""
    joined: dict[str, Any] | None = None
    """Where the run stood when this worker joined it (None: one of the run's own)."""

    def check_parameters(self, total: int, address: str) -> None:
        """A joiner's model must be the run's: ConfigError if its parameters are not."""
        if self.joined is not None and self.joined["run"]["parameters"] != total:
            raise ConfigError(
                f"--join {address}: this model has {total} parameters, the run's "
                f"{self.joined['run']['parameters']}: give the run's --model and data"
            )

    def joined_position(self, one_update_per_gradient: bool) -> tuple[int, int]:
        """A joiner's ``(epoch, global step)``: where the run stands (its version counts one
        update per gradient of every worker in ps-async, one per round otherwise)."""
        position = self.joined["position"]
        per_worker = self.joined["run"]["workers"] if one_update_per_gradient else 1
        return position["epoch"], position["version"] // per_worker


_runs = 0
"""Parameter-server runs this process has been part of."""


def join_own_run(name: str, num_shards: int, timeout: float, join_group: Callable[[], None]) -> Membership:
    """One of the processes the run started with; ``join_group`` joins its process group."""
    global _runs
    cluster = cluster_from_env()
    if cluster is None or cluster.world_size < num_shards + 1:
        raise ConfigError(
            f"{name} needs {num_shards} ps shard(s) and at least one worker: run "
            "`paratrain train --strategy ps-... --workers N`, or under torchrun / TF_CONFIG"
        )
    join_group()
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    # Every process makes its strategies in the same order, so a run's number names it in
    # the store even when several runs share one process group, and gives it message tags
    # of its own: a process that moved on to the next run must not reach the previous
    # run's shard, still serving until its chief says it is over.
    _runs += 1
    root_store = dist.TCPStore(
        cluster.master_addr, cluster.master_port, is_master=False, timeout=timedelta(seconds=timeout)
    )
    prefix = f"paratrain/{restart}/ps{_runs}/"
    return Membership(
        process_rank=cluster.rank,
        num_workers=cluster.world_size - num_shards,
        local_rank=cluster.local_rank,
        store=dist.PrefixStore(prefix, root_store),
        tags=RUN_TAG_STRIDE * _runs,
        links=[WorldLink(shard) for shard in range(num_shards)],
        address=f"{cluster.master_addr}:{cluster.master_port}",
        root_store=root_store,
        prefix=prefix,
    )


def join_running_run(
    address: str, facts: dict[str, Any], num_shards: int, timeout: float, token: str | None
) -> Membership:
    """A worker added to the running run at ``address`` (proving its join ``token``): no
    rank of its process group."""
    joined = join_run(address, facts, timeout, token)
    worker, run = joined["worker"], joined["run"]
    return Membership(
        process_rank=num_shards + worker,
        num_workers=worker + 1,
        local_rank=0,
        store=joined["store"],
        tags=run["tags"],
        links=joined["links"],
        joined=joined,
    )
