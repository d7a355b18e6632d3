"""Who did not answer: when a collective times out, every rank still alive says so in the
run's store, and the ranks that stay silent are the ones to name."""

from __future__ import annotations

import time

import torch.distributed as dist


def silent_ranks(step: int, within: float) -> list[int]:
    """The ranks of the default group that did not say, within ``within`` seconds, that they
    are alive at ``step`` (this rank says so first)."""
    store = dist.distributed_c10d._get_default_store()
    me, world = dist.get_rank(), dist.get_world_size()
    store.set(f"paratrain/answer/{step}/{me}", "1")
    deadline = time.monotonic() + within
    silent = [r for r in range(world) if r != me]
    while silent and time.monotonic() < deadline:
        silent = [r for r in silent if not store.check([f"paratrain/answer/{step}/{r}"])]
        time.sleep(0.05)
    return silent
