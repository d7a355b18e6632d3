"""Codec payloads packed into one byte buffer, and parsed back, for point-to-point messages.

A payload's layout (the shapes and dtypes of its tensors) depends only on the input's
shape and the codec's settings, so sender and receiver each derive it from a zero
tensor of that shape with a fresh codec (one that carries no state), and the bytes need
no framing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from paratrain.comm.codecs import Codec, Context, Payload


@dataclass(frozen=True)
class PayloadLayout:
    tensors: tuple[tuple[torch.Size, torch.dtype, int], ...]
    """(shape, dtype, bytes) of each tensor of the payload."""
    ctx: Context

    @property
    def nbytes(self) -> int:
        return sum(size for _, _, size in self.tensors)


def payload_layout(fresh_codec: Codec, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> PayloadLayout:
    payload, ctx = fresh_codec.compress(torch.zeros(tuple(shape), dtype=dtype, device="cpu"), "layout")
    return PayloadLayout(tuple((t.shape, t.dtype, t.numel() * t.element_size()) for t in payload), ctx)


def pack(payload: Payload, out: torch.Tensor) -> int:
    """Write ``payload``'s bytes into the uint8 tensor ``out``; returns the bytes written."""
    offset = 0
    for tensor in payload:
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        out[offset : offset + data.numel()].copy_(data)
        offset += data.numel()
    return offset


def unpack(data: torch.Tensor, layout: PayloadLayout) -> Payload:
    """The payload tensors stored in the uint8 tensor ``data`` (views where aligned)."""
    tensors, offset = [], 0
    for shape, dtype, size in layout.tensors:
        chunk = data[offset : offset + size]
        if offset % torch.empty((), dtype=dtype).element_size():
            chunk = chunk.clone()  # a view as a wider type must be aligned
        tensors.append(chunk.view(dtype).view(shape))
        offset += size
    return tuple(tensors)


class PackedGradient:
    """A shard's slice of the gradient, as pieces, compressed into one byte buffer.

    ``pieces`` are (key, shape) pairs in buffer order; their elements are consecutive in
    the flat gradient. Whole tensors keep their shape (so PowerSGD sees matrices); a
    tensor cut between shards is sent as a 1-D piece."""

    def __init__(self, codec: Codec, fresh: Callable[[], Codec], pieces: Sequence[tuple[str, tuple[int, ...]]]):
        self.codec = codec
        self.pieces = list(pieces)
        self.layouts = [payload_layout(fresh(), shape) for _, shape in self.pieces]
        self.nbytes = sum(layout.nbytes for layout in self.layouts)

    def compress_into(self, flat: torch.Tensor, out: torch.Tensor) -> None:
        offset = element = 0
        for (key, shape), _layout in zip(self.pieces, self.layouts):
            numel = int(torch.Size(shape).numel())
            payload, _ = self.codec.compress(flat[element : element + numel].view(shape), key)
            offset += pack(payload, out[offset:])
            element += numel

    def decompress_into(self, data: torch.Tensor, flat: torch.Tensor) -> None:
        offset = element = 0
        for (_, shape), layout in zip(self.pieces, self.layouts):
            numel = int(torch.Size(shape).numel())
            gradient = self.codec.decompress(unpack(data[offset : offset + layout.nbytes], layout), layout.ctx)
            flat[element : element + numel].copy_(gradient.reshape(-1))
            offset += layout.nbytes
            element += numel
