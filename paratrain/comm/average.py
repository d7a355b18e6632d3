"""The mean of a list of tensors over every process of a group, through a codec: what
``local-sgd`` and ``diloco`` send when they synchronize (parameter deltas, not gradients).

One collective per call, whatever the number of tensors. Summable codecs (``none``,
``fp16``, ``bf16``) add their payloads in an all-reduce; the others (``int8``, ``topk``,
``powersgd``) all-gather every process's packed payload and decode each in rank order,
as ``comm/hooks.py``'s AllGatherHook does for DDP buckets.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
import torch.distributed as dist

from paratrain.comm.codecs import Codec, Context, Payload

Layout = list[tuple[torch.Size, torch.dtype, int]]


def pack(payload: Payload) -> tuple[torch.Tensor, Layout]:
    """A payload's tensors as one byte string, and what ``unpack`` needs to read it back."""
    layout = [(t.shape, t.dtype, t.numel() * t.element_size()) for t in payload]
    return torch.cat([t.reshape(-1).view(torch.uint8) for t in payload]), layout


def unpack(data: torch.Tensor, offset: int, layout: Layout) -> tuple[Payload, int]:
    """The payload ``layout`` describes at ``offset`` in ``data``, and the offset after it."""
    payload = []
    for shape, dtype, size in layout:
        chunk = data[offset : offset + size]
        if offset % chunk.new_empty((), dtype=dtype).element_size():
            chunk = chunk.clone()  # a view as a wider type must be aligned
        payload.append(chunk.view(dtype).view(shape))
        offset += size
    return tuple(payload), offset


def average(
    tensors: Sequence[torch.Tensor], codec: Codec, keys: Sequence[Hashable], group: dist.ProcessGroup | None = None
) -> tuple[list[torch.Tensor], int]:
    """The mean of each of ``tensors`` over the group's processes, as ``codec`` carries it
    (``keys`` name each tensor's stream, for codecs with state), and the bytes this process
    handed to the collective."""
    world = dist.get_world_size(group)
    if codec.summable:
        # Divided first: the sum of `world` payloads stays in fp16's range.
        coded = [codec.compress(t / world, key) for t, key in zip(tensors, keys)]
        flat = torch.cat([payload[0] for payload, _ in coded])
        dist.all_reduce(flat, group=group)
        out, offset = [], 0
        for (payload, ctx), tensor in zip(coded, tensors):
            size = payload[0].numel()
            out.append(codec.decompress((flat[offset : offset + size],), ctx).to(tensor.dtype))
            offset += size
        return out, flat.numel() * flat.element_size()
    layouts: list[tuple[Layout, Context]] = []
    pieces = []
    for tensor, key in zip(tensors, keys):
        payload, ctx = codec.compress(tensor, key)
        data, layout = pack(payload)
        layouts.append((layout, ctx))
        pieces.append(data)
    packed = torch.cat(pieces)
    gathered = [torch.empty_like(packed) for _ in range(world)]
    dist.all_gather(gathered, packed, group=group)
    out = [torch.zeros_like(t) for t in tensors]
    for data in gathered:
        offset = 0
        for (layout, ctx), total in zip(layouts, out):
            payload, offset = unpack(data, offset, layout)
            total.add_(codec.decompress(payload, ctx))
    return [total.div_(world) for total in out], packed.numel()
