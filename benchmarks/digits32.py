"""scikit-learn's digits at CIFAR-10's shape (3x32x32), for benchmarks that need the
tutorial CNN's real compute per example on data that can be learned here (no data set
can be downloaded on the benchmark machine). Each 8x8 image is scaled up bilinearly and
repeated over three channels; the split is the built-in digits split.

    paratrain train --model cifar_cnn --dataset benchmarks.digits32:load
"""

from __future__ import annotations

import torch.nn.functional as F
from torch.utils.data import TensorDataset

from paratrain.data.datasets import load_digits


def _upscaled(part: TensorDataset) -> TensorDataset:
    images, labels = part.tensors
    large = F.interpolate(images, size=(32, 32), mode="bilinear", align_corners=False)
    return TensorDataset(large.expand(-1, 3, -1, -1).contiguous(), labels)


def load() -> tuple[TensorDataset, TensorDataset]:
    splits = load_digits()
    return _upscaled(splits.train), _upscaled(splits.test)
