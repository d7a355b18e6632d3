"""How parameters are split across parameter-server shards (the wire protocol: protocol/wire.py).

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
        if 0 < self.total < num_shards:  # none at all: the shards hold tables only (--dense allreduce)
            raise ConfigError(f"--ps-shards {num_shards} is more than the model's {self.total} parameters")
        self.bounds = [self.total * s // num_shards for s in range(num_shards + 1)]
        self.pieces: list[list[Piece]] = [self._pieces(s) for s in range(num_shards)]

    @classmethod
    def of(cls, model: nn.Module, num_shards: int, dense: bool = True) -> ShardLayout:
        """``model``'s trainable parameters over ``num_shards``; none with ``dense=False``
        (the workers all-reduce them: tables/ and dense.py)."""
        params = [p for p in model.parameters() if p.requires_grad] if dense else []
        if not params:
            return cls([], num_shards)
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
