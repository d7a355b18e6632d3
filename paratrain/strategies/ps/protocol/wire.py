"""What travels between a worker and a parameter-server shard, packed and read in this one place for both sides.

A message to a shard is one byte tensor: a ``Header`` (``HEADER_SIZE`` float32 fields), for a push the shard's
slice of the gradient coded by the run's codec (always the codec's full payload size), then a trailer
(``TRAILER_BYTES``). Table rows (tables/) travel as a *section*, a second message on ``TAG_SECTION`` whose
length the header states. One message a step, a push that also asks for the next parameters, because Gloo
moves a message only once the receiver has posted its buffer, so fewer messages is most of the latency.
Every message starts with ``MAGIC`` (protocol and version: another program or version is refused) and a
random nonce that the trailer repeats, so a message cut short is detected (receivers ``blank`` the mark
first); ``Header.read`` refuses any field out of range (``Malformed``). A reply is ``REPLY_HEADER_SIZE``
float64 fields (version, and the worker's next batch when asked), then the parameters in the pull dtype.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch

# Message kinds, in the first field of every message to a shard.
PULL = 1
PUSH = 2
DONE = 3
SHUTDOWN = 4
ROWS = 5
TAG_MESSAGE = 11
TAG_REPLY_HEADER = 13
TAG_REPLY = 14
TAG_SECTION = 15
TAG_ROWS = 12
RUN_TAG_STRIDE = 16  # each run in a process group adds a multiple of this to its tags
KINDS = (PULL, PUSH, DONE, SHUTDOWN, ROWS)
MAGIC = 20_803.0  # the protocol's mark and version (2.08.03): first field of every message
HEADER_SIZE = 18
HEADER_BYTES = HEADER_SIZE * 4  # float32 fields at the front of a byte message
TRAILER_BYTES = 8  # the nonce again, as two float32 fields, right after the payload
FRONT_BYTES = 12  # the mark and the nonce: a receiver blanks them before each receive
MAX_SAMPLES = 1 << 24
"""The most examples one gradient may stand for (float32 holds every count up to it)."""
MAX_LR_SCALE = 1e4
"""The largest learning-rate factor a push may carry: the linear-scaling rule's for a global
batch of 2.5 million at a reference of 256, beyond any schedule paratrain runs."""
REPLY_HEADER_SIZE = 2
# The batch field of a reply: an index into the epoch's batches, or one of these.
NO_MORE_BATCHES, NOT_ASSIGNED = -1, -2
_SPLIT = 1 << 20  # versions travel as two float32 fields, each exact below 2**24
LATE_CHECK_BYTES = 1 << 20
"""Pushes of at least this many bytes (per shard) are checked for lateness before they go:
a store lookup (well under a millisecond) against the gradient's time on the link (8 ms
at 1 Gbit/s) and the shard's to take it in."""


_NONCES = random.Random()  # seeded by the system, apart from the user's random stream


class Malformed(Exception):
    """A message a shard refuses; ``reason`` says why in a few words (the metrics' key)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


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
    """The fields of a message to a shard, in their order on the wire (after ``MAGIC``).

        ``version``: the shard's version of the worker's parameters (a push: the version its
        gradient was computed on). ``wanted``: a pull answers once the shard has at least this
        version. ``batch``: (epoch, batches in it) when the worker asks shard 0 for its next
        batch with the reply. ``nonfinite``: the gradient held a NaN or Inf (--on-nan skip);
        its payload is not sent. ``late``: under backup workers, the round the push was
        computed for closed before it went (the shard's version, kept in the store, had moved
        on): the header alone goes, and the shard counts the gradient dropped as it would have
        on its arrival. ``extra``: the bytes of the section that follows on ``TAG_SECTION`` (a
    row request's ids, a push's gradient rows; 0: none). ``nonce``: drawn for each message,
    repeated by its trailer."""

    kind: int
    version: int = 0
    samples: int = 0
    lr_scale: float = 1.0
    wants_reply: bool = False
    wanted: int = 0
    batch: tuple[int, int] | None = None
    nonfinite: bool = False
    late: bool = False
    extra: int = 0
    nonce: int = field(default=0, compare=False)

    @property
    def has_payload(self) -> bool:
        """Whether the message carries a gradient (a push in time, with finite values)."""
        return self.kind == PUSH and not self.late and not self.nonfinite

    def fields(self) -> list[float]:
        epoch, num_batches = self.batch or (0, 0)
        return [
            MAGIC,
            *_halves(self.nonce),
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
            *encode_version(self.extra),
        ]

    def write(self, message: torch.Tensor, payload_bytes: int = 0) -> torch.Tensor:
        """Into the byte tensor ``message``: the header first, its trailer after
        ``payload_bytes`` (the payload already in place); a fresh nonce ties them. Returns
        the message's bytes to send."""
        # both halves nonzero: a buffer's zeros never read as this trailer, however cut
        self.nonce = _NONCES.randrange(1, 1 << 16) << 16 | _NONCES.randrange(1, 1 << 16)
        message[:HEADER_BYTES].view(torch.float32).copy_(torch.tensor(self.fields(), dtype=torch.float32, device="cpu"))
        end = HEADER_BYTES + payload_bytes
        trailer = torch.tensor(_halves(self.nonce), dtype=torch.float32, device="cpu")
        message[end : end + TRAILER_BYTES].copy_(trailer.view(torch.uint8))  # any offset: byte-wise
        return message[: end + TRAILER_BYTES]

    @classmethod
    def read(cls, message: torch.Tensor, payload_bytes: int) -> Header:
        """From the byte tensor ``message`` (a receive buffer: at least the header, the full
        payload and the trailer long), whose pushes carry ``payload_bytes``. Malformed for
        a message of another program or version, a field out of its range, or a message
        cut short."""
        if message.numel() < HEADER_BYTES + payload_bytes + TRAILER_BYTES:
            raise Malformed("a message cut short")  # a buffer that cannot hold a whole one
        f = message[:HEADER_BYTES].view(torch.float32).tolist()
        if f[0] != MAGIC:
            raise Malformed("not this protocol or version")
        if not all(math.isfinite(x) for x in f):
            raise Malformed("a header field is not finite")
        ints = [f[i] for i in (1, 2, 3, 4, 5, 6, 9, 10, 12, 13, 16, 17)]
        flags = [f[i] for i in (8, 11, 14, 15)]
        if any(x != int(x) or x < 0 for x in ints) or any(x not in (0.0, 1.0) for x in flags):
            raise Malformed("a header field is out of its range")
        header = cls(
            kind=int(f[3]),
            version=decode_version(f[4], f[5]),
            samples=int(f[6]),
            lr_scale=f[7],
            wants_reply=bool(f[8]),
            wanted=decode_version(f[9], f[10]),
            batch=(int(f[12]), int(f[13])) if f[11] else None,
            nonfinite=bool(f[14]),
            late=bool(f[15]),
            extra=decode_version(f[16], f[17]),
            nonce=int(f[1]) * 65536 + int(f[2]),
        )
        if header.kind not in KINDS:
            raise Malformed("an unknown kind of message")
        if header.kind == PUSH and not (0 < header.samples <= MAX_SAMPLES and 0 <= header.lr_scale <= MAX_LR_SCALE):
            raise Malformed("a push's examples or learning-rate factor out of range")
        end = HEADER_BYTES + (payload_bytes if header.has_payload else 0)
        trailer = message[end : end + TRAILER_BYTES].clone().view(torch.float32).tolist()  # an unaligned offset
        if 0.0 in _halves(header.nonce) or trailer != _halves(header.nonce):  # a writer's halves are never 0
            raise Malformed("a message cut short")
        return header


def _halves(nonce: int) -> list[float]:
    """A 32-bit nonce as two float32 fields (each exact below 2**24)."""
    return [float(nonce >> 16), float(nonce & 0xFFFF)]


def blank(message: torch.Tensor) -> torch.Tensor:
    """``message`` (a receive buffer) with its mark and nonce zeroed, before a receive is
    posted into it: a message cut within them reads as no message of this protocol, and one
    cut after them leaves an earlier message's trailer, which holds another nonce."""
    message[:FRONT_BYTES].zero_()
    return message


def message_buffer(payload_bytes: int) -> torch.Tensor:
    """A buffer for the largest message to a shard whose pushes carry ``payload_bytes``."""
    return torch.zeros(HEADER_BYTES + payload_bytes + TRAILER_BYTES, dtype=torch.uint8, device="cpu")


def reply_header(version: int, batch: int = NOT_ASSIGNED) -> torch.Tensor:
    """The first message of a reply: the shard's version and the worker's next batch."""
    return torch.tensor([float(version), float(batch)], dtype=torch.float64, device="cpu")


def empty_reply_header() -> torch.Tensor:
    return torch.zeros(REPLY_HEADER_SIZE, dtype=torch.float64, device="cpu")


def read_reply_header(reply: torch.Tensor) -> tuple[int, int]:
    """(version, batch) of a reply's first message."""
    version, batch = reply.tolist()
    return int(version), int(batch)
