"""The multi-layer perceptron of the Fashion-MNIST tutorial: Flatten, Dense 256 ReLU, Dense."""

from __future__ import annotations

import math

from torch import nn

from paratrain.data.spec import DataSpec
from paratrain.errors import ConfigError


def build_mlp(spec: DataSpec, hidden: int = 256) -> nn.Module:
    if spec.input_kind != "image":
        raise ConfigError(f"model mlp needs image-like float inputs, the data gives {spec.input_kind}")
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(math.prod(spec.input_shape), hidden),
        nn.ReLU(),
        nn.Linear(hidden, spec.num_classes),
    )
