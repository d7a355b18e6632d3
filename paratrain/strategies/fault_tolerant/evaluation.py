"""Evaluation of a fault-tolerant run, split over the quorum.

The replicas that committed the last step hold the same model, so each evaluates its ``p``-th of ``P`` blocks
of the data and the sums are added over that quorum, as a step's gradient is. When a member is gone by then
(the sum fails or misses its examples), or the quorum was formed but not yet used (a replica that just
healed), or there is no quorum, the process scores every example itself: the same answer, only later.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from paratrain.data.sharding import ShardedBatches
from paratrain.strategies.evaluation import SumsOf

if TYPE_CHECKING:
    from paratrain.strategies.fault_tolerant.session import FaultTolerantSession


def evaluation_sums(
    session: FaultTolerantSession, data: object, batch_size: int, sums_of: SumsOf, within: tuple[int, int] = (1, 0)
) -> torch.Tensor:
    """``sums_of`` this process's part of ``data``, summed over its replica (the strategy's
    ``all_reduce_sum``) and over the last step's quorum; ``within``: the parts a replica's
    processes take of its part, and this process's (fsdp-ft's shards each take one; a
    pipeline's stages all take the whole)."""
    replica, (parts, part) = session.replica, within
    quorum = _settled_quorum(session)
    probe = torch.zeros(1, dtype=torch.float64, device=replica.device)
    if _all_agree(quorum is not None, probe):  # the processes of a replica take one path
        size, rank = quorum  # type: ignore[misc]
        batches = _batches(replica, data, batch_size, size * parts, rank * parts + part)
        sums = replica.all_reduce_sum(sums_of(batches))
        step = session.manager.current_step()
        with session.watchdog.phase("evaluation", step):
            session.membership.sum([sums], step)  # never raises: an error goes to the Manager
        whole = batches.num_examples is None or float(sums[0]) == batches.num_examples
        if _all_agree(session.manager.errored() is None and whole, sums):
            return sums
    return replica.all_reduce_sum(sums_of(_batches(replica, data, batch_size, parts, part)))


def _settled_quorum(session: FaultTolerantSession) -> tuple[int, int] | None:
    """``(participants, this replica's rank)`` of the quorum of the step this replica committed
    last, or None where there is none to sum over."""
    manager = session.manager
    if manager is None or session.quorum_ready or manager.errored() is not None:
        return None
    rank, size = manager.participating_rank(), manager.num_participants()
    if rank is None or size < 2:
        return None
    return size, rank


def _batches(replica: Any, data: object, batch_size: int, parts: int, part: int) -> ShardedBatches:
    return ShardedBatches(
        data, batch_size, num_replicas=parts, rank=part, shuffle=False, drop_last=False, device=replica.device
    )


def _all_agree(ok: bool, like: torch.Tensor) -> bool:
    """Whether ``ok`` holds on every process of this replica (its default group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return ok
    failed = like.new_tensor([0.0 if ok else 1.0])
    dist.all_reduce(failed)
    return float(failed) == 0.0
