"""Who did not answer: when a collective times out, every rank still alive says so in the
run's store, and the ranks that stay silent are the ones to name."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch.distributed as dist

from paratrain.errors import WorkerLost


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


def timeout_culprits(error: RuntimeError, step: int, timeout: float, name: Callable[[int], str]) -> Exception | None:
    """A clearer error for ``error``, raised by a collective at ``step``: on a timeout, which
    ranks did not answer (named by ``name``). None to let ``error`` stand."""
    text = str(error)
    if not dist.is_initialized() or not ("imed out" in text or "timeout" in text.lower()):
        return None
    silent = silent_ranks(step, min(timeout, 5.0))
    if not silent:
        return None
    names = ", ".join(name(r) for r in silent)
    return WorkerLost(f"{names} did not answer within --timeout {timeout:g} s at step {step}")
