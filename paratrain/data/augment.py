"""Per-batch transforms: stored examples (uint8 pixels) -> model inputs, in torch.

Each is a ``BatchTransform``: ``transform(inputs, generator) -> inputs`` on a whole
batch, on whatever device the batch is on. Random ones draw their parameters (one
small vector per batch) from ``generator`` on the CPU, so that a run is reproducible
whatever the device; ShardedBatches seeds the generator from (seed, epoch, rank).

``CifarDistortions`` and ``CifarCentralCrop`` are the training and evaluation inputs
of TensorFlow's CIFAR-10 recipe (cifar10_input.distorted_inputs and .inputs).
"""

from __future__ import annotations

import math

import torch


class Rescale:
    """``inputs / scale`` as float32: the Keras recipes' ``x / 255.0``."""

    def __init__(self, scale: float = 255.0):
        self.scale = scale

    def __call__(self, inputs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        return inputs.to(torch.float32) / self.scale

    def __repr__(self) -> str:
        return f"Rescale({self.scale})"


def per_image_standardization(images: torch.Tensor) -> torch.Tensor:
    """``(x - mean) / max(stddev, 1/sqrt(num_elements))`` per image, as
    ``tf.image.per_image_standardization``; the floor keeps uniform images finite."""
    flat = images.flatten(1)
    mean = flat.mean(dim=1, keepdim=True)
    std = flat.std(dim=1, unbiased=False, keepdim=True)
    adjusted = std.clamp_min(1.0 / math.sqrt(flat.shape[1]))
    return ((flat - mean) / adjusted).view_as(images)


def crop(
    images: torch.Tensor, top: torch.Tensor, left: torch.Tensor, size: tuple[int, int], flip: torch.Tensor | None = None
) -> torch.Tensor:
    """A ``size`` window of each image at its own ``(top, left)``, mirrored where ``flip``.

    One gather for the whole batch: the flip reverses each image's column index.
    """
    n, channels = images.shape[:2]
    height, width = size
    device = images.device
    rows = top.to(device)[:, None] + torch.arange(height, device=device)  # (N, h)
    columns = torch.arange(width, device=device).expand(n, width)
    if flip is not None:
        columns = torch.where(flip.to(device)[:, None], columns.flip(1), columns)
    columns = left.to(device)[:, None] + columns  # (N, w)
    batch = torch.arange(n, device=device)[:, None, None, None]
    channel = torch.arange(channels, device=device)[None, :, None, None]
    return images[batch, channel, rows[:, None, :, None], columns[:, None, None, :]]


class CifarDistortions:
    """The training inputs of the CIFAR-10 recipe, per image: a random 24x24 crop, a
    random horizontal flip, brightness + U(-63, 63), contrast x U(0.2, 1.8) about each
    channel's mean, then per-image standardization (pixels stay in 0..255 until then,
    as in cifar10_input.distorted_inputs).

    As the recipe's own comment says (tensorflow#1458), standardization undoes the
    brightness shift, and the contrast factor except for the change in the channels'
    relative means; both are kept so that the inputs are the recipe's.
    """

    def __init__(
        self, size: tuple[int, int] = (24, 24), max_brightness: float = 63.0, contrast: tuple[float, float] = (0.2, 1.8)
    ):
        self.size = size
        self.max_brightness = max_brightness
        self.contrast = contrast

    def __call__(self, images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        n, _, height, width = images.shape
        h, w = self.size
        top = torch.randint(0, height - h + 1, (n,), generator=generator)
        left = torch.randint(0, width - w + 1, (n,), generator=generator)
        flip = torch.rand(n, generator=generator) < 0.5
        delta = (torch.rand(n, generator=generator) * 2 - 1) * self.max_brightness
        low, high = self.contrast
        factor = low + torch.rand(n, generator=generator) * (high - low)
        x = crop(images, top, left, self.size, flip).to(torch.float32)
        x = x + delta.to(x.device).view(n, 1, 1, 1)
        channel_mean = x.mean(dim=(2, 3), keepdim=True)
        x = (x - channel_mean) * factor.to(x.device).view(n, 1, 1, 1) + channel_mean
        return per_image_standardization(x)

    def __repr__(self) -> str:
        return f"CifarDistortions(size={self.size})"


class CifarCentralCrop:
    """The evaluation inputs of the CIFAR-10 recipe: the central 24x24 crop
    (``resize_image_with_crop_or_pad``), then per-image standardization."""

    def __init__(self, size: tuple[int, int] = (24, 24)):
        self.size = size

    def __call__(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        h, w = self.size
        top, left = (images.shape[2] - h) // 2, (images.shape[3] - w) // 2
        x = images[:, :, top : top + h, left : left + w].to(torch.float32)
        return per_image_standardization(x)

    def __repr__(self) -> str:
        return f"CifarCentralCrop(size={self.size})"
