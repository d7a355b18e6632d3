"""Codec payloads packed into parameter-server messages and parsed back."""

import pytest
import torch

from paratrain.comm.codec_config import CodecOptions, make_codec
from paratrain.comm.packing import PackedGradient
from paratrain.strategies.ps.layout import ShardLayout

SHAPES = [torch.Size([64, 33]), torch.Size([64]), torch.Size([10, 64]), torch.Size([10])]


@pytest.mark.parametrize("name, tolerance", [("none", 0.0), ("fp16", 1e-3), ("bf16", 1e-2), ("int8", 2e-2)])
@pytest.mark.parametrize("shards", [1, 3])
def test_round_trip_through_bytes(name, tolerance, shards):
    layout = ShardLayout(SHAPES, shards)
    flat = torch.randn(layout.total)
    for shard in range(shards):
        fresh = lambda: make_codec(name)  # noqa: E731
        sender = PackedGradient(make_codec(name), fresh, layout.piece_shapes(shard))
        receiver = PackedGradient(fresh(), fresh, layout.piece_shapes(shard))
        assert sender.nbytes == receiver.nbytes
        part = flat[layout.shard_range(shard)]
        buffer = torch.zeros(sender.nbytes, dtype=torch.uint8)
        sender.compress_into(part, buffer)
        out = torch.zeros_like(part)
        receiver.decompress_into(buffer, out)
        assert (out - part).abs().max() <= tolerance * part.abs().max()


def test_cut_tensors_travel_as_1d_pieces_and_whole_ones_keep_their_shape():
    layout = ShardLayout(SHAPES, 2)
    shapes = [shape for _, shape in layout.piece_shapes(0)] + [shape for _, shape in layout.piece_shapes(1)]
    assert (64, 33) in shapes or any(len(s) == 1 for s in shapes)
    assert (10, 64) in shapes  # whole on the second shard: PowerSGD sees a matrix


def test_topk_bytes_and_error_feedback_carry_the_rest():
    options = CodecOptions(compression_ratio=0.05)
    layout = ShardLayout(SHAPES, 1)
    fresh = lambda: make_codec("topk", options)  # noqa: E731
    sender = PackedGradient(make_codec("topk", options), fresh, layout.piece_shapes(0))
    receiver = PackedGradient(fresh(), fresh, layout.piece_shapes(0))
    assert sender.nbytes < 0.15 * 4 * layout.total
    gradient = torch.randn(layout.total)
    sent = torch.zeros(layout.total)
    for _ in range(3):
        buffer = torch.zeros(sender.nbytes, dtype=torch.uint8)
        sender.compress_into(gradient, buffer)
        out = torch.zeros(layout.total)
        receiver.decompress_into(buffer, out)
        sent += out
    residual = torch.cat([sender.codec.residuals[key].reshape(-1) for key, _ in layout.piece_shapes(0)])
    # What was sent plus what is still held equals everything computed, exactly.
    assert torch.allclose(sent + residual, 3 * gradient, atol=1e-5)
