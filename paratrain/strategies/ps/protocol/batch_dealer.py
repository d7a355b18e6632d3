"""Dynamic sharding of the data: shard 0 hands out each epoch's batches in turn to whoever
asks first, so a fast worker takes more of an epoch than a slow one (and a resumed run goes
on from the first batch no worker took)."""

from __future__ import annotations

from typing import Any

from paratrain.strategies.ps.protocol.wire import NO_MORE_BATCHES, NOT_ASSIGNED


class BatchDealer:
    def __init__(self, deals: bool):
        self.deals = deals  # shard 0 alone keeps count
        self.next_batch: dict[int, int] = {}  # epoch -> the next batch to hand out
        self.num_batches: dict[int, int] = {}  # epoch -> its batches

    def deal(self, batch: tuple[int, int] | None) -> int:
        """The next batch of the epoch ``batch = (epoch, batches in it)`` names, for the worker
        asking; NO_MORE_BATCHES once the epoch is handed out, NOT_ASSIGNED where no batch was
        asked for (or on a shard that does not deal)."""
        if batch is None or not self.deals:
            return NOT_ASSIGNED
        epoch, num_batches = batch
        self.num_batches[epoch] = num_batches
        index = self.next_batch.get(epoch, 0)
        if index >= num_batches:
            return NO_MORE_BATCHES
        self.next_batch[epoch] = index + 1
        return index

    def first_open_epoch(self) -> int:
        """The first epoch with batches left (where a resumed run goes on)."""
        epoch = max(self.next_batch, default=0)
        if epoch in self.num_batches and self.next_batch[epoch] >= self.num_batches[epoch]:
            epoch += 1
        return epoch

    def state_dict(self) -> dict[str, Any]:
        return {"next_batch": dict(self.next_batch), "num_batches": dict(self.num_batches)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The position of a saved run. An epoch it left open holds as many batches as the
        resumed run's workers say: ps-sync's epochs are whole rounds of its workers, so a run
        resumed on another number of them counts another number of batches in an epoch (it
        goes on from the first batch no worker took)."""
        self.next_batch = {int(k): int(v) for k, v in state["next_batch"].items()}
        self.num_batches = {int(k): int(v) for k, v in state["num_batches"].items()}
        self.num_batches.pop(self.first_open_epoch(), None)
