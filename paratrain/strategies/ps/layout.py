"""How parameters are split across parameter-server shards, and the wire protocol.

All parameters are laid end to end in one flat vector (model order) and cut into P
contiguous ranges of nearly equal bytes, so shards are balanced by bytes whatever the
layer sizes; a large tensor may be cut between two shards. A shard holds, for each
tensor that overlaps its range, one *piece*: a Parameter sharing storage with the
shard's flat buffer, which is what the shard's optimizer updates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from paratrain.errors import ConfigError

# Message kinds, in the first field of every message to a shard.
PULL, PUSH, DONE, SHUTDOWN = 1, 2, 3, 4
# Every message to a shard is one byte tensor: a HEADER_SIZE-field float32 header, then the shard's
# slice of the gradient. One message per step (a push that also asks for the next
# parameters) means one wake-up of the shard per step; Gloo only moves a message once
# the receiver has posted its buffer, so fewer messages is most of the latency. The
# rare control messages (pull, done, shutdown) carry an unused payload. A message may also
# be shorter than the shard's posted buffer (Gloo fills what arrives): a late push is its
# header alone.
TAG_MESSAGE, TAG_REPLY_HEADER, TAG_REPLY = 11, 13, 14
RUN_TAG_STRIDE = 16  # each run in a process group adds a multiple of this to its tags
HEADER_SIZE = 13
(
    KIND,
    VERSION_HI,
    VERSION_LO,
    SAMPLES,
    LR_SCALE,
    WANTS_REPLY,
    WANTED_HI,
    WANTED_LO,
    WANTS_BATCH,
    EPOCH,
    NUM_BATCHES,
    NONFINITE,
    LATE,
) = range(HEADER_SIZE)
# NONFINITE: the push's gradient held a NaN or Inf (--on-nan skip); its payload is not sent.
# LATE: under backup workers, the round the push was computed for had closed before it was
# sent (the shard's version, which it keeps in the store, had moved on): the header alone
# goes, and the shard counts the gradient dropped, as it would have on its arrival.
LATE_CHECK_BYTES = 1 << 20
"""Pushes of at least this many bytes (per shard) are checked for lateness before they go:
a store lookup (well under a millisecond) against the gradient's time on the link (8 ms
at 1 Gbit/s) and the shard's to take it in."""


def checks_lateness(backup_workers: int, push_bytes: int) -> bool:
    """Whether a run's pushes of ``push_bytes`` to a shard are checked for lateness: the one
    rule by which a shard keeps its version in the store and a worker looks it up there."""
    return backup_workers > 0 and push_bytes >= LATE_CHECK_BYTES


# A reply: the shard's version, then (from shard 0, when asked) the next batch of the
# epoch for this worker: its index, or NO_MORE_BATCHES; the other shards say NOT_ASSIGNED.
HEADER_BYTES = HEADER_SIZE * 4  # the header travels as float32 at the front of a byte message
REPLY_HEADER_SIZE = 2
NO_MORE_BATCHES, NOT_ASSIGNED = -1, -2
_SPLIT = 1 << 20  # versions travel as two float32 fields, each exact below 2**24


def encode_version(version: int) -> tuple[float, float]:
    return float(version // _SPLIT), float(version % _SPLIT)


def decode_version(hi: float, lo: float) -> int:
    return int(hi) * _SPLIT + int(lo)


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` of parameter ``index`` (flattened), at ``offset`` in its shard."""

    index: int
    start: int
    stop: int
    offset: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


class ShardLayout:
    """Which shard holds which elements of which parameter."""

    def __init__(self, shapes: list[torch.Size], num_shards: int, element_size: int = 4):
        self.shapes = shapes
        self.numels = [int(torch.Size(s).numel()) for s in shapes]
        self.total = sum(self.numels)
        self.num_shards = num_shards
        self.element_size = element_size
        if self.total < num_shards:
            raise ConfigError(f"--ps-shards {num_shards} is more than the model's {self.total} parameters")
        self.bounds = [self.total * s // num_shards for s in range(num_shards + 1)]
        self.pieces: list[list[Piece]] = [self._pieces(s) for s in range(num_shards)]

    @classmethod
    def of(cls, model: nn.Module, num_shards: int) -> ShardLayout:
        params = [p for p in model.parameters() if p.requires_grad]
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ConfigError(
                f"the parameter server needs one parameter dtype, the model has {sorted(map(str, dtypes))}"
            )
        return cls([p.shape for p in params], num_shards, params[0].element_size())

    def _pieces(self, shard: int) -> list[Piece]:
        lo, hi = self.bounds[shard], self.bounds[shard + 1]
        pieces, begin = [], 0
        for index, numel in enumerate(self.numels):
            end = begin + numel
            a, b = max(lo, begin), min(hi, end)
            if a < b:
                pieces.append(Piece(index, a - begin, b - begin, a - lo))
            begin = end
        return pieces

    def shard_range(self, shard: int) -> slice:
        """The shard's elements within the flat vector of all parameters."""
        return slice(self.bounds[shard], self.bounds[shard + 1])

    def shard_numel(self, shard: int) -> int:
        return self.bounds[shard + 1] - self.bounds[shard]

    def piece_shapes(self, shard: int) -> list[tuple[str, tuple[int, ...]]]:
        """(key, shape) of each piece of a shard, for codecs: a whole tensor keeps its
        shape (PowerSGD compresses matrices), a piece of a cut tensor is 1-D."""
        shapes = []
        for piece in self.pieces[shard]:
            whole = piece.start == 0 and piece.stop == self.numels[piece.index]
            shape = tuple(self.shapes[piece.index]) if whole else (piece.numel,)
            shapes.append((f"{piece.index}.{piece.start}", shape))
        return shapes

    def shard_bytes(self) -> list[int]:
        return [self.shard_numel(s) * self.element_size for s in range(self.num_shards)]
