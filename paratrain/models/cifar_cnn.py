"""The network of TensorFlow's CIFAR-10 tutorial (cifar10.inference).

conv 5x5x64, ReLU, max-pool 3x3/2, LRN, conv 5x5x64, ReLU, LRN, max-pool 3x3/2,
dense 384, dense 192, linear. The tutorial's LRN uses depth radius 4, bias 1,
alpha 0.001/9, beta 0.75; TensorFlow's alpha is per element while PyTorch's
LocalResponseNorm divides alpha by the window size (2*4+1 = 9), hence alpha = 0.001.
Any image size works: the dense layer's input size is taken from the data.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.data.datasets import DataSpec
from paratrain.errors import ConfigError


class LocalResponseNorm(nn.Module):
    """``torch.nn.LocalResponseNorm`` (the same arguments, the same values to float rounding),
    about 2x faster forward and backward on the CPU: the window's sum of squares is a
    difference of a cumulative sum along the channels (PyTorch's averages with a 3-d
    pooling), and the backward pass is written out (one more windowed sum) instead of
    recorded op by op (its LRNs took half of this net's step in PyTorch's, a third in the
    cumulative sum's under autograd)."""

    def __init__(self, size: int, alpha: float = 1e-4, beta: float = 0.75, k: float = 1.0):
        super().__init__()
        self.size, self.alpha, self.beta, self.k = size, alpha, beta, k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _LocalResponseNorm.apply(x, self.size, self.alpha, self.beta, self.k)

    def extra_repr(self) -> str:
        return f"{self.size}, alpha={self.alpha}, beta={self.beta}, k={self.k}"


def _window_sum(x: torch.Tensor, before: int, after: int) -> torch.Tensor:
    """For each channel c, the sum of channels c - before .. c + after (zeros past the edges)."""
    size = before + after + 1
    # A zero channel first, so that cumsum[c + size] - cumsum[c] is the window of c.
    sums = F.pad(x, (0, 0, 0, 0, before + 1, after)).cumsum(1)
    return sums[:, size:] - sums[:, :-size]


def _negative_power(d: torch.Tensor, beta: float) -> torch.Tensor:
    """d ** -beta; for the usual beta = 0.75 as 1 / sqrt(d * sqrt(d)), 3 cheap ops against a pow."""
    return torch.rsqrt(d * d.sqrt()) if beta == 0.75 else d.pow(-beta)


class _LocalResponseNorm(torch.autograd.Function):
    """y_c = x_c * d_c ** -beta, d_c = k + alpha / size * (sum of x ** 2 over c's window).

    dL/dx_j = g_j * d_j ** -beta - 2 * alpha * beta / size * x_j * (sum over the channels c
    whose window holds j of g_c * y_c / d_c): the same windowed sum, its window mirrored."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, size: int, alpha: float, beta: float, k: float) -> torch.Tensor:  # noqa: ANN001
        before, after = size // 2, (size - 1) // 2
        d = _window_sum(x * x, before, after).mul_(alpha / size).add_(k)
        scale = _negative_power(d, beta)
        ctx.save_for_backward(x, d, scale)
        ctx.lrn = (before, after, 2 * alpha * beta / size)
        return x * scale

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # noqa: ANN001
        x, d, scale = ctx.saved_tensors
        before, after, factor = ctx.lrn
        through = _window_sum(grad * x * scale / d, after, before)
        return grad * scale - factor * x * through, None, None, None, None


def build_cifar_cnn(spec: DataSpec) -> nn.Module:
    if spec.input_kind != "image" or len(spec.input_shape) != 3:
        raise ConfigError(f"model cifar_cnn needs images (channels, height, width), the data gives {spec.input_shape}")
    channels, height, width = spec.input_shape
    # 'SAME' pooling with stride 2 halves each side, rounding up, twice.
    pooled = math.ceil(math.ceil(height / 2) / 2) * math.ceil(math.ceil(width / 2) / 2)
    return nn.Sequential(
        nn.Conv2d(channels, 64, kernel_size=5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
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
