"""What travels between a worker and a parameter-server shard, packed and read in this
one place for both sides.

A message to a shard is one byte tensor: a ``Header`` (``HEADER_SIZE`` float32 fields),
then the shard's slice of the gradient, compressed by the run's codec. One message a step
(a push that also asks for the next parameters) means one wake-up of the shard a step;
Gloo moves a message only once the receiver has posted its buffer, so fewer messages is
most of the latency. The rare control messages (pull, done, shutdown) carry an unused
payload. A message may be shorter than the shard's posted buffer (Gloo fills what
arrives): a late push, or one whose gradient is not finite, is its header alone.

A reply is two messages: ``REPLY_HEADER_SIZE`` float64 fields (the shard's version and,
from shard 0 when asked, the worker's next batch of the epoch), then the shard's
parameters in the pull dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Message kinds, in the first field of every message to a shard.
PULL, PUSH, DONE, SHUTDOWN = 1, 2, 3, 4
TAG_MESSAGE, TAG_REPLY_HEADER, TAG_REPLY = 11, 13, 14
RUN_TAG_STRIDE = 16  # each run in a process group adds a multiple of this to its tags
HEADER_SIZE = 13
HEADER_BYTES = HEADER_SIZE * 4  # float32 fields at the front of a byte message
REPLY_HEADER_SIZE = 2
# The batch field of a reply: an index into the epoch's batches, or one of these.
NO_MORE_BATCHES, NOT_ASSIGNED = -1, -2
_SPLIT = 1 << 20  # versions travel as two float32 fields, each exact below 2**24
LATE_CHECK_BYTES = 1 << 20
"""Pushes of at least this many bytes (per shard) are checked for lateness before they go:
a store lookup (well under a millisecond) against the gradient's time on the link (8 ms
at 1 Gbit/s) and the shard's to take it in."""


def encode_version(version: int) -> tuple[float, float]:
    return float(version // _SPLIT), float(version % _SPLIT)


def decode_version(hi: float, lo: float) -> int:
    return int(hi) * _SPLIT + int(lo)


def checks_lateness(backup_workers: int, push_bytes: int) -> bool:
    """Whether a run's pushes of ``push_bytes`` to a shard are checked for lateness: the one
    rule by which a shard keeps its version in the store and a worker looks it up there."""
    return backup_workers > 0 and push_bytes >= LATE_CHECK_BYTES


@dataclass
class Header:
    """The fields of a message to a shard, in their order on the wire.

    ``version``: the shard's version of the worker's parameters (a push: the version its
    gradient was computed on). ``wanted``: a pull answers once the shard has at least this
    version. ``batch``: (epoch, batches in it) when the worker asks shard 0 for its next
    batch with the reply. ``nonfinite``: the gradient held a NaN or Inf (--on-nan skip);
    its payload is not sent. ``late``: under backup workers, the round the push was
    computed for closed before it went (the shard's version, kept in the store, had moved
    on): the header alone goes, and the shard counts the gradient dropped as it would have
    on its arrival."""

    kind: int
    version: int = 0
    samples: int = 0
    lr_scale: float = 1.0
    wants_reply: bool = False
    wanted: int = 0
    batch: tuple[int, int] | None = None
    nonfinite: bool = False
    late: bool = False

    def fields(self) -> list[float]:
        epoch, num_batches = self.batch or (0, 0)
        return [
            float(self.kind),
            *encode_version(self.version),
            float(self.samples),
            float(self.lr_scale),
            float(self.wants_reply),
            *encode_version(self.wanted),
            float(self.batch is not None),
            float(epoch),
            float(num_batches),
            float(self.nonfinite),
            float(self.late),
        ]

    def write(self, message: torch.Tensor) -> None:
        """Into the first ``HEADER_BYTES`` of the byte tensor ``message``."""
        message[:HEADER_BYTES].view(torch.float32).copy_(torch.tensor(self.fields(), dtype=torch.float32, device="cpu"))

    @classmethod
    def read(cls, message: torch.Tensor) -> Header:
        """From the first ``HEADER_BYTES`` of the byte tensor ``message``."""
        f = message[:HEADER_BYTES].view(torch.float32).tolist()
        return cls(
            kind=int(f[0]),
            version=decode_version(f[1], f[2]),
            samples=int(f[3]),
            lr_scale=f[4],
            wants_reply=bool(f[5]),
            wanted=decode_version(f[6], f[7]),
            batch=(int(f[9]), int(f[10])) if f[8] else None,
            nonfinite=bool(f[11]),
            late=bool(f[12]),
        )


def reply_header(version: int, batch: int = NOT_ASSIGNED) -> torch.Tensor:
    """The first message of a reply: the shard's version and the worker's next batch."""
    return torch.tensor([float(version), float(batch)], dtype=torch.float64, device="cpu")


def empty_reply_header() -> torch.Tensor:
    return torch.zeros(REPLY_HEADER_SIZE, dtype=torch.float64, device="cpu")


def read_reply_header(reply: torch.Tensor) -> tuple[int, int]:
    """(version, batch) of a reply's first message."""
    version, batch = reply.tolist()
    return int(version), int(batch)
