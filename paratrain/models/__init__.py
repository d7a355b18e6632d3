"""Models, built from a DataSpec by the builders in the MODELS table.

A model here knows nothing of how it is parallelised: strategies wrap it.
"""

from __future__ import annotations

import torch
from torch import nn

from paratrain.data.datasets import DataSpec
from paratrain.errors import ConfigError
from paratrain.registry import MODELS


def build_model(name: str, spec: DataSpec) -> nn.Module:
    """Build model ``name`` for data described by ``spec``; ConfigError if they do not fit."""
    model = MODELS.get(name)(spec)
    check_fits(model, spec, name)
    return model


def check_fits(model: nn.Module, spec: DataSpec, name: str = "model") -> None:
    """Run two dummy examples through ``model`` to prove it accepts the data's shape."""
    dtype = torch.long if spec.input_kind == "tokens" else torch.float32
    example = torch.zeros((2, *spec.input_shape), dtype=dtype)
    try:
        with torch.no_grad():
            out = model(example)
    except (RuntimeError, ValueError, IndexError) as error:
        raise ConfigError(
            f"model {name} does not fit the data (examples of shape {spec.input_shape}): {str(error).splitlines()[0]}"
        ) from None
    if out.shape != (2, spec.num_classes):
        raise ConfigError(
            f"model {name} gives outputs of shape {tuple(out.shape[1:])}, the data has {spec.num_classes} classes"
        )


__all__ = ["build_model", "check_fits"]
