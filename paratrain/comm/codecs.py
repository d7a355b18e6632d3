"""Gradient codecs: what a worker puts on the wire instead of its fp32 gradient.

A codec is a transformation with explicit state, in the shape of PyTorch's DDP communication hooks::

    payload, ctx = codec.compress(gradient, key)   # payload: a tuple of tensors, sent
    gradient_hat = codec.decompress(payload, ctx)  # ctx: shape and dtype, never sent

``key`` names the gradient stream so stateful codecs (error feedback, PowerSGD's ``Q``) keep one state per
stream. The payload's shapes depend only on the input's shape and the settings, so a receiver parses a
peer's bytes with its own ``ctx``, and ``payload_bytes(payload) == codec.wire_bytes(shape)``. Codecs know
nothing of strategies (``comm/hooks.py`` makes a DDP hook of one). ``registry.py``'s CODECS names the builders
below; docs/compression.md compares their sizes.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

Payload = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class Context:
    """What ``decompress`` needs besides the payload; derived from the input alone."""

    shape: torch.Size
    dtype: torch.dtype


def payload_bytes(payload: Payload) -> int:
    """Bytes a payload occupies on the wire: every tensor in it, metadata included."""
    return sum(t.numel() * t.element_size() for t in payload)


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _stream_generator(seed: int, key: Hashable, count: int, device: torch.device) -> torch.Generator:
    """A generator for draw ``count`` of stream ``key``: the same numbers whatever order
    the keys come in (DDP's buckets change order after the first step) and after a
    resume, with only a counter per key as state."""
    mixed = (seed * 1_000_003 + zlib.crc32(repr(key).encode())) * 1_000_033 + count
    return torch.Generator(device=device).manual_seed(mixed % 2**63)


class Codec:
    """Base of every codec. Subclasses list their settings and their state as fields."""

    name: ClassVar[str] = "codec"
    summable: ClassVar[bool] = False
    """Whether the payloads of several workers may be added before decoding (so that
    an all-reduce of payloads decodes to the sum of the gradients). If not, each
    worker's payload is decoded on its own: all-gather, decode, average."""
    unbiased: ClassVar[bool] = False
    """Whether E[decompress(compress(x))] == x. Biased codecs want error feedback."""

    def compress(self, tensor: torch.Tensor, key: Hashable = 0) -> tuple[Payload, Context]:
        raise NotImplementedError

    def decompress(self, payload: Payload, ctx: Context) -> torch.Tensor:
        raise NotImplementedError

    def wire_bytes(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> int:
        """Exact payload bytes ``compress`` makes for a tensor of ``shape`` (the formula)."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """The codec's state as tensors and plain values (``torch.load(weights_only=True)``)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class IdentityCodec(Codec):
    """``none``: the gradient itself (DDP's own all-reduce, no hook)."""

    name = "none"
    summable = True
    unbiased = True

    def compress(self, tensor: torch.Tensor, key: Hashable = 0) -> tuple[Payload, Context]:
        return (tensor.detach().reshape(-1),), Context(tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload, ctx: Context) -> torch.Tensor:
        return payload[0].view(ctx.shape)

    def wire_bytes(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> int:
        return _numel(shape) * _itemsize(dtype)


@dataclass(eq=False)
class _CastCodec(Codec):
    """Cast to a 2-byte float. ``divide_by`` (the number of workers whose payloads are
    summed) is applied before the cast so that the sum of N payloads cannot overflow
    fp16's range (max 65504); ``decompress`` multiplies it back. PyTorch's
    ``fp16_compress_hook`` divides by the world size the same way."""

    divide_by: int = 1
    wire_dtype: ClassVar[torch.dtype] = torch.float16
    summable = True

    def compress(self, tensor: torch.Tensor, key: Hashable = 0) -> tuple[Payload, Context]:
        flat = tensor.detach().reshape(-1)
        if self.divide_by != 1:
            flat = flat / self.divide_by
        return (flat.to(self.wire_dtype),), Context(tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload, ctx: Context) -> torch.Tensor:
        out = payload[0].to(ctx.dtype)
        if self.divide_by != 1:
            out = out * self.divide_by
        return out.view(ctx.shape)

    def wire_bytes(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> int:
        return _numel(shape) * _itemsize(self.wire_dtype)


class FP16Codec(_CastCodec):
    """``fp16``: relative error <= 2**-11 in fp16's normal range (6.1e-5 .. 65504)."""

    name = "fp16"
    wire_dtype = torch.float16


class BF16Codec(_CastCodec):
    """``bf16``: fp32's exponent range, so no overflow; relative error <= 2**-8."""

    name = "bf16"
    wire_dtype = torch.bfloat16


@dataclass(eq=False)
class Int8Codec(Codec):
    """``int8``: per-chunk scaled quantization to the 255 levels -127..127.

    Each chunk of ``chunk_size`` values sends one fp32 scale, max|x| / 127, and one
    int8 code per value. Round to nearest errs by at most scale/2 per value but is
    biased; stochastic rounding (floor(x/scale + u), u ~ U[0, 1)) errs by less than
    one scale and is unbiased, as in QSGD (Alistarh et al. 2017). Chunks of 256 keep
    the scales' overhead at 4/256 byte per value (bitsandbytes' block-wise
    quantization makes the same trade, Dettmers et al. 2022).
    """

    chunk_size: int = 256
    stochastic_rounding: bool = False
    seed: int = 0
    # state: how many tensors of each key were rounded stochastically (seeds the noise)
    counts: dict[Hashable, int] = field(default_factory=dict, repr=False)

    name = "int8"

    def __post_init__(self) -> None:
        if self.chunk_size < 1:
            raise ValueError(f"int8 chunk_size must be >= 1, got {self.chunk_size}")

    @property
    def unbiased(self) -> bool:  # type: ignore[override]
        return self.stochastic_rounding

    def _chunks(self, flat: torch.Tensor) -> torch.Tensor:
        n, c = flat.numel(), self.chunk_size
        padded = flat.new_zeros(math.ceil(n / c) * c)
        padded[:n] = flat
        return padded.view(-1, c)

    def compress(self, tensor: torch.Tensor, key: Hashable = 0) -> tuple[Payload, Context]:
        flat = tensor.detach().reshape(-1).float()
        chunks = self._chunks(flat)
        scale = chunks.abs().amax(dim=1) / 127.0
        scaled = chunks / torch.where(scale > 0, scale, torch.ones_like(scale))[:, None]
        if self.stochastic_rounding:
            count = self.counts.get(key, 0)
            self.counts[key] = count + 1
            generator = _stream_generator(self.seed, key, count, scaled.device)
            noise = torch.rand(scaled.shape, generator=generator, device=scaled.device)
            codes = torch.floor(scaled + noise)
        else:
            codes = torch.round(scaled)
        codes = codes.clamp_(-127, 127).to(torch.int8).view(-1)[: flat.numel()]
        return (codes, scale), Context(tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload, ctx: Context) -> torch.Tensor:
        codes, scale = payload
        values = self._chunks(codes.float()) * scale[:, None]
        return values.view(-1)[: codes.numel()].to(ctx.dtype).view(ctx.shape)

    def wire_bytes(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> int:
        n = _numel(shape)
        return n + 4 * math.ceil(n / self.chunk_size)

    def state_dict(self) -> dict[str, Any]:
        return {"counts": dict(self.counts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counts = dict(state.get("counts", {}))


@dataclass(eq=False)
class TopKCodec(Codec):
    """``topk``: the k = ceil(R n) entries of largest magnitude, as values and int32
    indices (int64 past 2**31 entries). Keeping the largest entries is a contraction,
    |x - topk(x)|^2 <= (1 - k/n) |x|^2, which is what makes it converge with error
    feedback (Stich et al. 2018); without it the dropped mass is lost for good.
    """

    ratio: float = 0.01

    name = "topk"

    def __post_init__(self) -> None:
        if not 0 < self.ratio <= 1:
            raise ValueError(f"top-k ratio must be in (0, 1], got {self.ratio}")

    def k(self, n: int) -> int:
        # round() first: 0.01 * 300 is 3.0000000000000004 in floating point.
        return min(n, max(1, math.ceil(round(self.ratio * n, 9)))) if n else 0

    @staticmethod
    def _index_dtype(n: int) -> torch.dtype:
        return torch.int32 if n < 2**31 else torch.int64

    def compress(self, tensor: torch.Tensor, key: Hashable = 0) -> tuple[Payload, Context]:
        flat = tensor.detach().reshape(-1)
        indices = torch.topk(flat.abs(), self.k(flat.numel()), sorted=False).indices
        payload = (flat[indices], indices.to(self._index_dtype(flat.numel())))
        return payload, Context(tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload, ctx: Context) -> torch.Tensor:
        values, indices = payload
        out = values.new_zeros(_numel(ctx.shape))
        out[indices.long()] = values
        return out.to(ctx.dtype).view(ctx.shape)

    def wire_bytes(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> int:
        n = _numel(shape)
        return self.k(n) * (_itemsize(dtype) + _itemsize(self._index_dtype(n)))


@dataclass(eq=False)
class PowerSGDCodec(Codec):
    """``powersgd``: one step of power iteration per call (Vogels et al. 2019, Alg. 1).

    A tensor is viewed as the n x m matrix M = t.view(shape[0], -1); P = M Q, P is
    orthogonalised, Q = M^T P, and M ~ P Q^T (the projection of M on span(P), so the
    error is never larger than M). Q is kept per ``key`` and reused next step ("warm
    start"), which turns the single iteration into a running subspace iteration.
    Tensors where r(n + m) * min_compression_rate >= nm (biases, vectors) are sent
    uncompressed: the same rule as PyTorch's ``powerSGD_hook``, which ``allreduce``
    uses (its two-round all-reduce of P and Q needs every worker's M at once; this
    codec is the single-worker form for push-style exchanges).
    """

    rank: int = 2
    min_compression_rate: float = 2.0
    seed: int = 0
    # state: the warm-start Q of each key (a key's first Q is drawn from seed and key)
    q: dict[Hashable, torch.Tensor] = field(default_factory=dict, repr=False)

    name = "powersgd"

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"PowerSGD rank must be >= 1, got {self.rank}")

    def matrix(self, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
        """(n, m, r) of the low-rank form of a tensor of ``shape``, or None to send it raw."""
        if len(shape) < 2 or _numel(shape) == 0:
            return None
        n = shape[0]
        m = _numel(shape) // n
        r = min(n, m, self.rank)
        return (n, m, r) if r * (n + m) * self.min_compression_rate < n * m else None

    def compress(self, tensor: torch.Tensor, key: Hashable = 0) -> tuple[Payload, Context]:
        ctx = Context(tensor.shape, tensor.dtype)
        form = self.matrix(tuple(tensor.shape))
        if form is None:
            return (tensor.detach().reshape(-1),), ctx
        n, m, r = form
        matrix = tensor.detach().reshape(n, m)
        q = self.q.get(key)
        if q is None or q.shape != (m, r):
            generator = _stream_generator(self.seed, key, 0, torch.device("cpu"))
            q = torch.randn(m, r, generator=generator, dtype=matrix.dtype, device="cpu")
        q = q.to(matrix.device)
        p = torch.linalg.qr(matrix @ q).Q
        q = matrix.T @ p
        # A zero gradient gives Q = 0, from which no warm start can recover: draw afresh.
        if bool(torch.isfinite(q).all()) and bool(q.any()):
            self.q[key] = q
        else:
            self.q.pop(key, None)
        return (p, q), ctx

    def decompress(self, payload: Payload, ctx: Context) -> torch.Tensor:
        if len(payload) == 1:
            return payload[0].view(ctx.shape)
        p, q = payload
        return (p @ q.T).to(ctx.dtype).view(ctx.shape)

    def wire_bytes(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> int:
        form = self.matrix(tuple(shape))
        if form is None:
            return _numel(shape) * _itemsize(dtype)
        n, m, r = form
        return (n + m) * r * _itemsize(dtype)

    def state_dict(self) -> dict[str, Any]:
        return {"q": dict(self.q)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.q = dict(state.get("q", {}))
