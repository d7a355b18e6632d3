"""The user's own model and data, named on the command line or in TOML as
``package.module:factory`` (``--model``, ``--dataset``).

- A model factory is called with the data's DataSpec when it takes an argument, else
  with none, and must return a ``torch.nn.Module``.
- A data factory is called with the run's TrainConfig when it takes an argument, else
  with none, and returns the train and test data: a ``Splits``, a ``(train, test)`` pair
  or a ``{"train": ..., "test": ...}`` dict, each a map-style Dataset, an
  ``(inputs, targets)`` pair of tensors, a DataLoader or a re-iterable of batches.

Whatever goes wrong (an import, a call, a result of the wrong kind) is one ConfigError
naming the reference: exit code 2 on the command line.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from paratrain.data.sharding import as_source, is_map_style
from paratrain.data.spec import DataSpec, Splits
from paratrain.errors import ConfigError, ParatrainError


def call_factory(factory: Callable[..., Any], argument: Any, what: str) -> Any:
    """``factory(argument)`` if it takes a positional argument, else ``factory()``."""
    if not callable(factory):
        raise ConfigError(f"{what} is a {type(factory).__name__}, not a callable factory")
    try:
        parameters = inspect.signature(factory).parameters.values()
        takes = any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in parameters)
    except (TypeError, ValueError):  # a builtin without a signature: try it bare
        takes = False
    try:
        return factory(argument) if takes else factory()
    except ParatrainError:
        raise
    except Exception as error:
        raise ConfigError(f"{what} raised {type(error).__name__}: {error}") from None


def user_model(factory: Callable[..., Any], spec: DataSpec, what: str) -> nn.Module:
    model = call_factory(factory, spec, what)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{what} returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def user_splits(factory: Callable[..., Any], config: Any, what: str) -> Splits:
    result = call_factory(factory, config, what)
    if isinstance(result, Splits):
        return result
    if isinstance(result, Mapping) and {"train", "test"} <= set(result):
        train, test = result["train"], result["test"]
    elif isinstance(result, (tuple, list)) and len(result) == 2:
        train, test = result
    else:
        raise ConfigError(
            f"{what} returned a {type(result).__name__}; a data factory returns (train, test), "
            '{"train": ..., "test": ...} or a paratrain Splits'
        )

    train = as_source(train)[0] if isinstance(train, (tuple, list)) else train
    test = as_source(test)[0] if isinstance(test, (tuple, list)) else test
    return Splits(train=train, test=test, spec=infer_spec(train, what))


def first_example(data: Any) -> tuple[Any, Any] | None:
    """The first ``(inputs, targets)`` example of a map-style data set (None for a stream)."""
    source = as_source(data)[0]
    if not is_map_style(source) or len(source) == 0:
        return None
    item = source[0]
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        return None
    return item[0], item[1]


def infer_spec(train: Any, what: str) -> DataSpec:
    """A DataSpec from the first example (input shape and kind) and, for integer targets
    of a tensor data set, the number of classes (the largest label + 1)."""
    example = first_example(train)
    if example is None or not torch.is_tensor(example[0]):
        return DataSpec(input_shape=(), num_classes=0, input_kind="other")
    inputs, targets = example
    kind = "tokens" if not inputs.is_floating_point() else "image"
    classes = 0
    labels = getattr(train, "tensors", (None, None))[1]
    if labels is not None and not labels.is_floating_point() and labels.numel():
        classes = int(labels.max()) + 1
    elif torch.is_tensor(targets) and not targets.is_floating_point():
        raise ConfigError(
            f"{what}: cannot count the classes of a {type(train).__name__}; use your own --model, "
            "or return a paratrain Splits with its DataSpec"
        )
    stored = getattr(train, "tensors", (inputs,))[0]
    vocab = int(stored.max()) + 1 if kind == "tokens" and stored.numel() else 0
    return DataSpec(input_shape=tuple(inputs.shape), num_classes=classes, input_kind=kind, vocab_size=vocab)
