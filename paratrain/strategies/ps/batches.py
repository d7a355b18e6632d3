"""Dynamic sharding of a parameter-server run's training data: shard 0 hands out each
epoch's batches, one at a time, to whichever worker asks first."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch

from paratrain.data.sharding import ShardedBatches
from paratrain.errors import ConfigError


class BatchHandout(Protocol):
    """What the batches ask of the parameter-server worker that reads them."""

    @property
    def device(self) -> torch.device: ...

    @property
    def num_replicas(self) -> int: ...

    def assigned_batches(self, epoch: int, num_batches: int) -> Iterator[int]:
        """The numbers of the batches of ``epoch`` that shard 0 hands this worker."""
        ...


class AssignedBatches(ShardedBatches):
    """One epoch's batches of the whole data set (one permutation, the same on every
    worker), handed out one at a time by shard 0 in the order workers ask: dynamic
    sharding. A straggler takes fewer batches instead of holding the others back, which
    is what asynchronous and backup-worker training need to gain from it."""

    def __init__(
        self,
        strategy: BatchHandout,
        dataset: object,
        batch_size: int,
        *,
        group: int,
        shuffle: bool,
        seed: int,
    ):
        self.strategy = strategy
        self.group = group
        super().__init__(
            dataset, batch_size, shuffle=shuffle, drop_last=True, seed=seed, device=strategy.device, prefetch=0
        )
        self.rank = 0  # batch k of an epoch is distorted alike whichever worker takes it

    @property
    def num_batches(self) -> int:
        if self.streaming:  # a stream of ready batches: its length counts batches
            if self.num_examples is None:
                raise ConfigError(
                    f"the training data ({type(self.dataset).__name__}) has no len(): shard 0 hands out "
                    "each epoch's batches by number and must know how many there are; give it __len__"
                )
            return self.num_examples // self.group * self.group
        return self.num_examples // self.batch_size // self.group * self.group

    def __len__(self) -> int:
        """This worker's expected share of an epoch (the progress bar's total)."""
        return -(-self.num_batches // max(self.strategy.num_replicas, 1))

    def numbered_batches(self) -> Iterator[tuple[int, torch.Tensor]]:
        """The batches shard 0 hands this worker, numbered in the epoch (their transforms'
        seeds); shard 0 knows where a resumed epoch goes on."""
        order = None if self.streaming else self._order()
        for k in self.strategy.worker.assigned_batches(self.epoch, self.num_batches):
            yield k, None if order is None else order[k * self.batch_size : (k + 1) * self.batch_size]


def run_batches(
    worker: BatchHandout,
    dataset: object,
    batch_size: int,
    shuffle: bool,
    drop_last: bool,
    seed: int,
    whole_rounds: bool,
) -> ShardedBatches:
    """A parameter-server run's batches: training batches handed out by shard 0 (``drop_last``),
    evaluation's read by the chief alone, all of it (workers never wait for each other there)."""
    if drop_last:
        # Synchronous rounds take N batches: whole rounds per epoch keep ps-sync equal to
        # one process with the global batch. Backup and async workers take what they can.
        group = worker.num_replicas if whole_rounds else 1
        return AssignedBatches(worker, dataset, batch_size, group=group, shuffle=shuffle, seed=seed)
    return ShardedBatches(dataset, batch_size, shuffle=False, drop_last=False, device=worker.device)
