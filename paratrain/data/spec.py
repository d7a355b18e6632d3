"""What a model is told about its data (``DataSpec``) and a data set's train and test
splits (``Splits``): the types data loaders, user factories and model builders share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch.utils.data import Dataset


@dataclass(frozen=True)
class DataSpec:
    """What a model builder needs to know about the data it will see."""

    input_shape: tuple[int, ...]
    """Shape of one example: (channels, height, width) for images, (length,) for tokens."""
    num_classes: int
    input_kind: str = "image"
    """"image" (float tensors), "tokens" (integer ids, see vocab_size) or "clicks" (a dict of
    dense features, ``input_shape``, and one row id per table, ``tables``)."""
    vocab_size: int = 0
    tables: tuple[int, ...] = ()
    """Click data: the rows of each categorical feature's table."""
    per_position: bool = False
    """Whether the target is a token at every input position (a language model's next
    token: outputs ``(batch, positions, vocab_size)``) rather than one label per example."""


@dataclass
class Splits:
    train: Dataset
    test: Dataset
    spec: DataSpec
    classes: tuple[str, ...] = ()
    """Class names, by label."""
    vocabulary: Any = field(default=None, repr=False)
    """Token data: the ``Vocabulary`` the ids come from (``data/text.py``)."""
