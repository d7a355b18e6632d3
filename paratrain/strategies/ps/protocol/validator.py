"""What a parameter-server shard lets in: every message is validated before anything is allocated for it or
applied, and one that is refused changes nothing but a count.

``Header.read`` (wire.py) refuses what no sender of this protocol writes; ``MessageValidator.check`` then
refuses what no worker of this run may send now (an unknown sender, a shutdown not from the chief, an
oversized section, a version not published or not in flight, a request before its reply, a second push to a
synchronous round, a batch outside the run's epochs); a payload that does not decode is refused as the shard
decodes it. Refusals are counted by reason (``rejected_messages``) and said once per reason; then a joiner is
dropped, a worker the run started with ends the run as a broken rank, and a stranger is only counted.
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any, Protocol

import torch

from paratrain.strategies.ps.protocol.wire import PULL, PUSH, ROWS, SHUTDOWN, Header, Malformed


class Served(Protocol):
    """What the validator reads of the shard it guards (server.py)."""

    shard: int
    num_shards: int
    num_workers: int
    version: int
    workers: set[int]
    joined: list[int]

    def request_of(self, worker: int) -> bool: ...
    def holds_push_of(self, worker: int) -> bool: ...
    def epochs_dealt(self) -> dict[int, int]: ...
    def deals(self) -> bool: ...
    def section_bound(self, header: Header) -> int: ...


class MessageValidator:
    def __init__(self, payload_bytes: int):
        self.payload_bytes = payload_bytes
        """The bytes of a push's payload (the codec's, for this shard's slice)."""
        self.refused: Counter[str] = Counter()

    def check(self, server: Served, worker: int, message: torch.Tensor) -> Header:
        """``message``'s header, if the shard may act on it; Malformed naming why not."""
        if worker not in server.workers:
            raise Malformed("a sender that is no worker of the run")
        header = Header.read(message, self.payload_bytes)
        if header.extra > server.section_bound(header) or header.extra % 4:
            raise Malformed("a table section longer than any the shard takes")
        if header.kind == ROWS and not header.extra:
            raise Malformed("a row request with no rows")
        if header.has_payload and not header.extra and server.section_bound(header):
            raise Malformed("a push without its table section")  # a table shard's push brings one
        if header.kind == SHUTDOWN and worker != 0:
            raise Malformed("a shutdown from a worker other than the chief")
        if header.kind == PUSH and header.version > server.version:
            raise Malformed("a push on a version the shard has not published")
        # A pull waits for shard 0's version, which runs ahead of this shard's by at most one
        # push in flight from each worker.
        if header.kind == PULL and header.wanted > server.version + len(server.workers):
            raise Malformed("a pull for a version beyond any in flight")
        if header.wants_reply and server.request_of(worker):
            raise Malformed("a second request before the reply to the first")
        if header.kind == PUSH and server.holds_push_of(worker):
            raise Malformed("a second push to the same round")
        if header.batch is not None and server.deals():  # shard 0 hands out the batches
            epoch, batches = header.batch
            dealt = server.epochs_dealt()
            if epoch > max(dealt, default=-1) + 1 or dealt.get(epoch, batches) != batches:
                raise Malformed("a batch request outside the run's epochs")
        return header

    def refuse(self, server: Served, worker: int, reason: str) -> str | None:
        """Count and say (once per reason) that ``worker``'s message was refused; returns
        what ends the run (a worker the run started with is broken), or None."""
        self.refused[reason] += 1
        own = 0 <= worker < server.num_workers and worker not in server.joined  # a rank of the run
        if own:
            sender = f"worker {worker} (rank {worker + server.num_shards})"
        else:
            sender = f"worker {worker} (joined)" if worker in server.joined else f"sender {worker}"
        if self.refused[reason] == 1:
            print(
                f"paratrain: ps shard {server.shard} refused a message from {sender}: {reason} "
                "(counted in rejected_messages; said once per reason)",
                file=sys.stderr,
                flush=True,
            )
        if own:
            return f"ps shard {server.shard}: {sender} sent a message the shard refuses ({reason}); the rank is broken"
        return None

    def statistics(self) -> dict[str, Any]:
        return {"rejected_messages": dict(sorted(self.refused.items()))}
