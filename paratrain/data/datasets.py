"""Data sets, each a loader function in the DATASETS table returning train/test splits.

| name            | reader                 | files                                                   |
| --------------- | ---------------------- | ------------------------------------------------------- |
| ``digits``      | this module            | none: ships with scikit-learn                           |
| ``fashion-mnist`` | ``data/idx.py``      | the four IDX files (gzip or plain), downloaded if absent |
| ``cifar10``     | ``data/cifar.py``      | ``cifar-10-batches-bin``: 3073-byte records, downloaded if absent |
| ``text``        | ``data/text.py``       | ``train/`` and ``test/``, one folder of .txt files per class |

Files live in ``--data-dir``, by default ``~/.cache/paratrain/<name>`` (the root can be
moved with ``PARATRAIN_DATA``). A file that is missing, truncated or not in its format
is a ConfigError naming the file and what was expected.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import TensorDataset

from paratrain.config import TrainConfig
from paratrain.data.spec import DataSpec, Splits
from paratrain.registry import DATASETS, is_reference
from paratrain.usercode import user_splits


def _digits_table() -> np.ndarray:
    """The digits as scikit-learn ships them (64 pixels and a label per row).

    Read straight from the package's data file: importing sklearn.datasets costs more
    start-up time than the whole default training run, in every process of a run.
    """
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("sklearn")
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz" if spec and spec.origin else None
    if path is not None and path.is_file():
        return np.loadtxt(path, delimiter=",", dtype=np.float32)
    from sklearn.datasets import load_digits as sklearn_digits  # another layout: the public loader

    bunch = sklearn_digits()
    return np.column_stack([bunch.data, bunch.target]).astype(np.float32)


def load_dataset(config: TrainConfig | str, **options: Any) -> Splits:
    """The train/test splits named by ``config.dataset``, or by name with TrainConfig
    options: ``load_dataset("cifar10", data_dir="data/cifar10")``."""
    if isinstance(config, str):
        config = TrainConfig(dataset=config, **options)
    loader = DATASETS.get(config.dataset)
    if is_reference(config.dataset):
        return user_splits(loader, config, f"--dataset {config.dataset}")
    return loader(config)


def data_dir(config: TrainConfig | None, name: str) -> Path:
    """Where data set ``name`` lives: ``--data-dir``, else ``$PARATRAIN_DATA/<name>``,
    else ``~/.cache/paratrain/<name>``."""
    if config is not None and config.data_dir:
        return Path(config.data_dir).expanduser()
    return Path(os.environ.get("PARATRAIN_DATA") or "~/.cache/paratrain").expanduser() / name


def load_digits(config: TrainConfig | None = None) -> Splits:
    """scikit-learn's bundled 8x8 handwritten digits (1,797 images, 10 classes).

    Split 80/20, stratified (every fifth example of each class, in a fixed random order,
    is a test example), with a fixed seed independent of the run's seed, so the test set
    is the same in every run. Pixels are scaled from 0..16 to 0..1.
    """
    table = _digits_table()
    images = torch.tensor(table[:, :64], dtype=torch.float32, device="cpu").reshape(-1, 1, 8, 8) / 16.0
    labels = torch.tensor(table[:, 64], dtype=torch.long, device="cpu")
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0), device="cpu")
    order = order[torch.argsort(labels[order], stable=True)]  # grouped by class, shuffled within
    rank_in_class = torch.arange(len(order), device="cpu") - torch.searchsorted(labels[order], labels[order])
    is_test = rank_in_class % 5 == 0
    train_idx, test_idx = order[~is_test], order[is_test]
    return Splits(
        train=TensorDataset(images[train_idx], labels[train_idx]),
        test=TensorDataset(images[test_idx], labels[test_idx]),
        spec=DataSpec(input_shape=(1, 8, 8), num_classes=10),
        classes=tuple(str(d) for d in range(10)),
    )
