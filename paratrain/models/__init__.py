"""Models, built from a DataSpec by the builders in the MODELS table.

A model here knows nothing of how it is parallelised: strategies wrap it.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from paratrain.data.batch import call_model, map_tensors
from paratrain.data.spec import DataSpec
from paratrain.errors import ConfigError
from paratrain.registry import MODELS, is_reference
from paratrain.usercode import user_model


def build_model(
    name: str, spec: DataSpec, example: Any = None, options: Any = None, lazy_tables: bool = False
) -> nn.Module:
    """Build model ``name`` (a built-in, or ``package.module:factory``) for data described
    by ``spec``; ConfigError if they do not fit. ``example``: one ``(inputs, targets)``
    example of the data, which a user's model is tried on. ``options``: the run's section
    of options for this model (``TrainConfig.model_options``: ``--gpt-*`` for gpt), if any.
    ``lazy_tables``: a built-in model's embedding tables stay on the meta device, for a run
    whose parameter server holds them row by row (``parallel/tables.py``)."""
    builder = MODELS.get(name)
    if is_reference(name):
        model = user_model(builder, spec, f"--model {name}")
        if example is not None:
            check_runs(model, example, name)
        return model
    if lazy_tables and "lazy_tables" in inspect.signature(builder).parameters:
        given = () if options is None else (options,)
        return builder(spec, *given, lazy_tables=True)  # its tables exist nowhere whole: nothing to try it on
    model = builder(spec) if options is None else builder(spec, options)
    check_fits(model, spec, name)
    return model


def check_runs(model: nn.Module, example: tuple[Any, Any], name: str) -> None:
    """Run one real example (as a batch of one) through ``model``."""
    inputs = map_tensors(example[0], lambda t: t.unsqueeze(0))
    try:
        with torch.no_grad():
            call_model(model, inputs)
    except Exception as error:
        raise ConfigError(
            f"--model {name} fails on an example of the data: {type(error).__name__}: {str(error).splitlines()[0]}"
        ) from None


def check_fits(model: nn.Module, spec: DataSpec, name: str = "model") -> None:
    """Run two dummy examples through ``model`` to prove it accepts the data's shape."""
    if spec.input_kind == "other" or spec.num_classes == 0:
        raise ConfigError(
            f"model {name} needs examples of one tensor and integer class labels; this data has "
            "others: use your own --model package.module:factory"
        )
    dtype = torch.long if spec.input_kind == "tokens" else torch.float32
    example = torch.zeros((2, *spec.input_shape), dtype=dtype)
    if spec.input_kind == "clicks":
        example = {"dense": example, "ids": torch.zeros((2, len(spec.tables)), dtype=torch.long)}
    try:
        with torch.no_grad():
            out = call_model(model, example)
    except (RuntimeError, ValueError, IndexError) as error:
        raise ConfigError(
            f"model {name} does not fit the data (examples of shape {spec.input_shape}): {str(error).splitlines()[0]}"
        ) from None
    expected = (2, *spec.input_shape, spec.num_classes) if spec.per_position else (2, spec.num_classes)
    if out.shape != expected:
        raise ConfigError(
            f"model {name} gives outputs of shape {tuple(out.shape[1:])}, the data needs {expected[1:]} "
            f"({spec.num_classes} classes{' at every position' if spec.per_position else ''})"
        )


__all__ = ["build_model", "check_fits", "check_runs"]
