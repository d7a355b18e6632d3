"""Data sets, each a loader function in the DATASETS table returning train/test splits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.utils.data import Dataset, TensorDataset

from paratrain.registry import DATASETS

if TYPE_CHECKING:
    from paratrain.config import TrainConfig


@dataclass(frozen=True)
class DataSpec:
    """What a model builder needs to know about the data it will see."""

    input_shape: tuple[int, ...]
    """Shape of one example: (channels, height, width) for images, (length,) for tokens."""
    num_classes: int
    input_kind: str = "image"
    """"image" (float tensors) or "tokens" (integer ids, see vocab_size)."""
    vocab_size: int = 0


@dataclass
class Splits:
    train: Dataset
    test: Dataset
    spec: DataSpec


def load_dataset(config: "TrainConfig") -> Splits:
    """The train/test splits named by ``config.dataset``."""
    return DATASETS.get(config.dataset)(config)


def load_digits(config: "TrainConfig | None" = None) -> Splits:
    """scikit-learn's bundled 8x8 handwritten digits (1,797 images, 10 classes).

    Split 80/20, stratified, with a fixed seed (independent of the run's seed, so the
    test set is the same in every run). Pixels are scaled from 0..16 to 0..1.
    """
    from sklearn.datasets import load_digits as sklearn_digits
    from sklearn.model_selection import train_test_split

    bunch = sklearn_digits()
    images = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(bunch.target, dtype=torch.long)
    train_idx, test_idx = train_test_split(
        list(range(len(labels))), test_size=0.2, random_state=0, stratify=bunch.target
    )
    train_idx, test_idx = torch.tensor(train_idx), torch.tensor(test_idx)
    return Splits(
        train=TensorDataset(images[train_idx], labels[train_idx]),
        test=TensorDataset(images[test_idx], labels[test_idx]),
        spec=DataSpec(input_shape=(1, 8, 8), num_classes=10),
    )
