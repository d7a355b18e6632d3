"""Codecs on their own: round-trip error bounds, exact byte counts, error feedback, state."""

import copy
import io
import math

import pytest
import torch

from paratrain.comm.codec_config import CodecOptions, make_codec
from paratrain.comm.codecs import (
    BF16Codec,
    FP16Codec,
    IdentityCodec,
    Int8Codec,
    PowerSGDCodec,
    TopKCodec,
    payload_bytes,
)
from paratrain.comm.error_feedback import ErrorFeedback
from paratrain.errors import ConfigError
from paratrain.registry import CODECS

# empty, scalar, one value, odd sizes, 1-D across a chunk boundary, 2-D, 4-D (a conv weight)
SHAPES = [(), (0,), (1,), (7,), (257,), (0, 3), (3, 5), (10, 256), (2, 3, 5, 7), (64, 1, 5, 5)]
CODEC_NAMES = ["none", "fp16", "bf16", "int8", "topk", "powersgd"]


def _random(shape, seed=0, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator) * scale


def _round_trip(codec, x, key="w"):
    payload, ctx = codec.compress(x, key)
    return payload, codec.decompress(payload, ctx)


def test_the_table_lists_every_codec_of_the_issue():
    assert CODECS.names() == sorted(CODEC_NAMES)
    with pytest.raises(ConfigError, match="unknown codec 'zip'; valid: bf16, fp16, int8, none, powersgd, topk"):
        make_codec("zip")


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_shape_dtype_and_exact_wire_bytes(name, shape):
    codec = make_codec(name)
    x = _random(shape)
    payload, y = _round_trip(codec, x)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert payload_bytes(payload) == codec.wire_bytes(shape)
    assert all(isinstance(t, torch.Tensor) for t in payload)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_none_is_exact(shape):
    x = _random(shape)
    assert torch.equal(_round_trip(IdentityCodec(), x)[1], x)


@pytest.mark.parametrize(
    "codec, unit", [(FP16Codec(), 2.0**-11), (BF16Codec(), 2.0**-8), (FP16Codec(divide_by=3), 2.0**-11)]
)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_half_precision_relative_error(codec, unit, shape):
    x = _random(shape, scale=100.0)
    payload, y = _round_trip(codec, x)
    assert payload[0].dtype == codec.wire_dtype
    # relative error of one rounding (plus fp16's subnormal spacing near zero), and the
    # division by divide_by is undone exactly up to one more rounding
    bound = unit * x.abs() * (1 + 1e-6) + 2.0**-24 * codec.divide_by + 1e-6 * x.abs() * (codec.divide_by != 1)
    assert bool(((y - x).abs() <= bound).all())


def test_fp16_divide_by_keeps_a_sum_of_workers_in_range():
    big = torch.full((4,), 40000.0)  # two workers' sum (80000) overflows fp16 (max 65504)
    plain, halved = FP16Codec(), FP16Codec(divide_by=2)
    assert torch.isinf(plain.compress(big)[0][0] + plain.compress(big)[0][0]).all()
    total = halved.compress(big)[0][0] + halved.compress(big)[0][0]
    assert torch.equal(halved.decompress((total,), halved.compress(big)[1]), torch.full((4,), 80000.0))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_int8_round_to_nearest_errs_by_half_a_step(shape):
    codec = Int8Codec()
    x = _random(shape, scale=3.0)
    (codes, scale), y = _round_trip(codec, x)
    assert codes.dtype == torch.int8 and scale.dtype == torch.float32
    assert len(scale) == math.ceil(x.numel() / 256)
    step = torch.repeat_interleave(scale, 256)[: x.numel()].view(x.shape)
    assert bool(((y - x).abs() <= step / 2 * (1 + 1e-5) + 1e-7).all())


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_int8_stochastic_rounding_errs_by_less_than_a_step(shape):
    codec = Int8Codec(stochastic_rounding=True)
    x = _random(shape, scale=3.0)
    (_, scale), y = _round_trip(codec, x)
    step = torch.repeat_interleave(scale, 256)[: x.numel()].view(x.shape)
    assert bool(((y - x).abs() <= step * (1 + 1e-5) + 1e-7).all())


def test_int8_stochastic_rounding_is_unbiased_and_round_to_nearest_is_not():
    x = torch.linspace(-1, 1, 300)  # many values sit between two levels
    stochastic, nearest = Int8Codec(stochastic_rounding=True, seed=1), Int8Codec()
    draws = 4000
    mean = sum(_round_trip(stochastic, x)[1] for _ in range(draws)) / draws
    step = 1 / 127
    # each draw errs by < step, so the mean of n draws by ~ step / (2 sqrt(n)); allow 5 sigma
    assert (mean - x).abs().max() < 5 * step / (2 * math.sqrt(draws))
    assert (_round_trip(nearest, x)[1] - x).abs().max() > 0.3 * step
    assert stochastic.unbiased and not nearest.unbiased


def test_int8_zero_chunk_decodes_to_zero():
    x = torch.zeros(300)
    x[280] = 5.0  # second chunk nonzero, first all zeros
    assert torch.equal(_round_trip(Int8Codec(), x)[1], x)


@pytest.mark.parametrize("ratio", [0.01, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_topk_keeps_exactly_the_largest_entries(ratio, shape):
    codec = TopKCodec(ratio)
    x = _random(shape)
    (values, indices), y = _round_trip(codec, x)
    n = x.numel()
    k = codec.k(n)
    assert k == (min(n, max(1, math.ceil(round(ratio * n, 9)))) if n else 0)
    assert indices.dtype == torch.int32 and len(values) == len(indices) == k
    flat_x, flat_y = x.reshape(-1), y.reshape(-1)
    kept = torch.zeros(n, dtype=torch.bool)
    kept[indices.long()] = True
    assert torch.equal(flat_y[kept], flat_x[kept]) and not flat_y[~kept].any()
    if 0 < k < n:
        assert flat_x[kept].abs().min() >= flat_x[~kept].abs().max()
    # the contraction property that error feedback relies on
    assert (x - y).pow(2).sum() <= (1 - k / max(n, 1)) * x.pow(2).sum() + 1e-6


def test_topk_ratio_rounding():
    assert TopKCodec(0.01).k(300) == 3  # not 4: 0.01 * 300 is 3.0000000000000004 in floats
    assert TopKCodec(0.01).k(10) == 1  # at least one value per tensor
    assert TopKCodec(0.01).k(0) == 0


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_powersgd_never_errs_by_more_than_the_tensor(shape):
    codec = PowerSGDCodec(rank=2)
    x = _random(shape)
    payload, y = _round_trip(codec, x)
    if codec.matrix(shape) is None:
        assert len(payload) == 1 and torch.equal(y, x)
    else:
        n, m, r = codec.matrix(shape)
        assert [t.shape for t in payload] == [(n, r), (m, r)]
        assert (x - y).norm() <= x.norm() * (1 + 1e-5)


def test_powersgd_reconstructs_a_low_rank_matrix_and_warm_starts():
    g = torch.Generator().manual_seed(3)
    low_rank = torch.randn(40, 2, generator=g) @ torch.randn(2, 30, generator=g)
    codec = PowerSGDCodec(rank=2)
    y = _round_trip(codec, low_rank)[1]
    assert (low_rank - y).norm() < 1e-4 * low_rank.norm()
    # warm start: the second call starts from the first call's Q instead of a random one
    q_before = codec.q["w"].clone()
    (p, q), _ = codec.compress(low_rank, "w")
    assert torch.allclose(p, torch.linalg.qr(low_rank @ q_before).Q)


def test_powersgd_zero_gradient_does_not_poison_the_warm_start():
    codec = PowerSGDCodec(rank=2)
    _, y = _round_trip(codec, torch.zeros(20, 10))
    assert torch.equal(y, torch.zeros(20, 10)) and "w" not in codec.q
    x = _random((20, 10))
    assert (x - _round_trip(codec, x)[1]).norm() < x.norm()


@pytest.mark.parametrize("inner", [TopKCodec(0.1), Int8Codec(), PowerSGDCodec(rank=1)], ids=repr)
def test_error_feedback_carries_the_exact_residual(inner):
    codec = ErrorFeedback(copy.deepcopy(inner))
    reference = copy.deepcopy(inner)  # the bare codec, fed the corrected gradients by hand
    gradients = [_random((12, 9), seed=s) for s in range(5)]
    sent = torch.zeros(12, 9)
    residual = torch.zeros(12, 9)
    for g in gradients:
        payload, ctx = codec.compress(g, "layer")
        decoded = codec.decompress(payload, ctx)
        corrected = g + residual
        # the codec compressed the corrected gradient, not the raw one...
        expected, _ = reference.compress(corrected, "layer")
        assert all(torch.equal(a, b) for a, b in zip(payload, expected))
        # ...and kept exactly what it did not send
        assert torch.equal(codec.residuals["layer"], corrected - decoded)
        residual = codec.residuals["layer"]
        sent += decoded
    # nothing is lost: what was sent plus what is still owed is every gradient
    torch.testing.assert_close(sent + residual, sum(gradients), rtol=0, atol=1e-5)
    assert residual.abs().sum() > 0 and codec.name == inner.name


@pytest.mark.parametrize("inner", [TopKCodec(0.1), Int8Codec()], ids=repr)
def test_a_gradient_that_is_not_finite_leaves_the_residual_as_it_was(inner):
    """An fp16 overflow (or a NaN under --on-nan skip) makes a skipped step: the residual
    before it stays, and the steps after it decode finite values (it held NaN for good)."""
    codec = ErrorFeedback(copy.deepcopy(inner))
    codec.compress(_random((12, 9), seed=0), "layer")
    before = codec.residuals["layer"].clone()
    overflow = _random((12, 9), seed=1)
    overflow[3, 4] = math.inf
    codec.compress(overflow, "layer")
    assert torch.equal(codec.residuals["layer"], before)
    for seed in range(2, 5):
        payload, ctx = codec.compress(_random((12, 9), seed=seed), "layer")
        assert torch.isfinite(codec.decompress(payload, ctx)).all(), seed


def test_error_feedback_keeps_one_residual_per_key():
    codec = ErrorFeedback(TopKCodec(0.5))
    codec.compress(torch.ones(4), "a")
    codec.compress(torch.ones(6), "b")
    assert set(codec.residuals) == {"a", "b"}
    with pytest.raises(ValueError, match="error feedback for 'a'"):
        codec.compress(torch.ones(5), "a")


def _reload(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_codec_state_survives_a_checkpoint(name):
    options = CodecOptions(compression_ratio=0.05, stochastic_rounding=name == "int8")
    original = make_codec(name, options)
    for step in range(3):
        for key, shape in (("conv.weight", (16, 3, 3, 3)), ("fc.weight", (10, 40)), ("fc.bias", (10,))):
            original.compress(_random(shape, seed=step), key)
    restored = make_codec(name, options)
    restored.load_state_dict(_reload(original.state_dict()))
    for key, shape in (("conv.weight", (16, 3, 3, 3)), ("fc.weight", (10, 40)), ("fc.bias", (10,))):
        x = _random(shape, seed=9)
        a, b = original.compress(x, key)[0], restored.compress(x, key)[0]
        assert all(torch.equal(u, v) for u, v in zip(a, b)), (name, key)
    if name in ("topk", "powersgd"):
        assert set(restored.residuals) == {"conv.weight", "fc.weight", "fc.bias"}
    if name == "powersgd":
        assert set(restored.inner.q) == {"conv.weight", "fc.weight"}
