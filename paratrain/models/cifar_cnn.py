"""The network of TensorFlow's CIFAR-10 tutorial (cifar10.inference).

conv 5x5x64, ReLU, max-pool 3x3/2, LRN, conv 5x5x64, ReLU, LRN, max-pool 3x3/2,
dense 384, dense 192, linear (the first ReLU computed after its pooling: the same values).
The tutorial's LRN uses depth radius 4, bias 1, alpha 0.001/9, beta 0.75; TensorFlow's
alpha is per element while PyTorch's LocalResponseNorm divides alpha by the window size
(2*4+1 = 9), hence alpha = 0.001.
Any image size works: the dense layer's input size is taken from the data.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from paratrain.data.spec import DataSpec
from paratrain.errors import ConfigError


class LocalResponseNorm(nn.Module):
    """``torch.nn.LocalResponseNorm`` (the same arguments, the same values to float rounding),
    several times faster forward and backward on the CPU: each channel's window sum of
    squares is one matrix product with a band of ones (PyTorch's averages with a 3-d
    pooling), and the backward pass is written out (one more band product, the band
    mirrored) instead of recorded op by op. PyTorch's LRNs took half of this net's step; a
    cumulative sum along the channels (a sequential scan) is slower than the band product."""

    def __init__(self, size: int, alpha: float = 1e-4, beta: float = 0.75, k: float = 1.0):
        super().__init__()
        self.size = size
        self.alpha = alpha
        self.beta = beta
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _LocalResponseNorm.apply(x, self.size, self.alpha, self.beta, self.k)

    def extra_repr(self) -> str:
        return f"{self.size}, alpha={self.alpha}, beta={self.beta}, k={self.k}"


def _band(channels: int, before: int, after: int, like: torch.Tensor) -> torch.Tensor:
    """The (channels, channels) matrix B with B[j, c] = 1 where channel j is in c's window
    c - before .. c + after: ``x @ B`` (channels last) sums each channel's window."""
    j = torch.arange(channels, device=like.device)
    return ((j[:, None] >= j[None, :] - before) & (j[:, None] <= j[None, :] + after)).to(like.dtype)


def _channel_sum(x: torch.Tensor, band: torch.Tensor) -> torch.Tensor:
    """Each channel's window sum of ``x`` (batch, channels, ...), in ``x``'s memory order: a
    product over the last dimension for channels-last tensors, over the channels otherwise.
    In ``x``'s own dtype, under autocast too (a bfloat16 product would round the sums)."""
    with torch.autocast(x.device.type, enabled=False):
        last = x.movedim(1, -1)
        if last.is_contiguous():
            return (last @ band).movedim(-1, 1)
        return (band.t() @ x.contiguous().flatten(2)).view(x.shape)


def _negative_power(d: torch.Tensor, beta: float) -> torch.Tensor:
    """d ** -beta; for the usual beta = 0.75 as 1 / sqrt(d * sqrt(d)), 3 cheap ops against a pow."""
    return d.sqrt().mul_(d).rsqrt_() if beta == 0.75 else d.pow(-beta)


class _LocalResponseNorm(torch.autograd.Function):
    """y_c = x_c * d_c ** -beta, d_c = k + alpha / size * (sum of x ** 2 over c's window).

    dL/dx_j = g_j * d_j ** -beta - 2 * alpha * beta / size * x_j * (sum over the channels c
    whose window holds j of g_c * y_c / d_c): the same windowed sum, its window mirrored."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, size: int, alpha: float, beta: float, k: float) -> torch.Tensor:  # noqa: ANN001
        band = _band(x.shape[1], size // 2, (size - 1) // 2, x)
        d = _channel_sum(x * x, band).mul_(alpha / size).add_(k)
        scale = _negative_power(d, beta)
        ctx.save_for_backward(x, d, scale, band)
        ctx.factor = 2 * alpha * beta / size
        return x * scale

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # noqa: ANN001
        x, d, scale, band = ctx.saved_tensors
        through = grad * scale
        mirrored = _channel_sum(through * x / d, band.t())
        return through.sub_(mirrored.mul_(x).mul_(ctx.factor)), None, None, None, None


def build_cifar_cnn(spec: DataSpec) -> nn.Module:
    if spec.input_kind != "image" or len(spec.input_shape) != 3:
        raise ConfigError(f"model cifar_cnn needs images (channels, height, width), the data gives {spec.input_shape}")
    channels, height, width = spec.input_shape
    # 'SAME' pooling with stride 2 halves each side, rounding up, twice.
    pooled = math.ceil(math.ceil(height / 2) / 2) * math.ceil(math.ceil(width / 2) / 2)
    return nn.Sequential(
        nn.Conv2d(channels, 64, kernel_size=5, padding=2),
        # Max-pooling before the ReLU: the same function and gradient as after it (a ReLU
        # keeps the order of values), with the ReLU on a quarter of the elements.
        nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
        nn.ReLU(),
        LocalResponseNorm(size=9, alpha=0.001, beta=0.75, k=1.0),
        nn.Conv2d(64, 64, kernel_size=5, padding=2),
        nn.ReLU(),
        LocalResponseNorm(size=9, alpha=0.001, beta=0.75, k=1.0),
        nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
        nn.Flatten(),
        nn.Linear(64 * pooled, 384),
        nn.ReLU(),
        nn.Linear(384, 192),
        nn.ReLU(),
        nn.Linear(192, spec.num_classes),
    )
