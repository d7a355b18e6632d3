"""IDX files (the MNIST format) and the Fashion-MNIST data set read from them.

An IDX file is a big-endian header, ``0 0 TYPE NDIM`` then NDIM 32-bit sizes, followed
by the array itself. The header's first four bytes read as one number are the
"magic number": 2051 (0x803) for a file of uint8 images of rank 3, 2049 (0x801) for
uint8 labels of rank 1. Files may be gzip-compressed (as published) or plain; the
reader looks at the bytes, not the name.
"""

from __future__ import annotations

import gzip
import zlib
from math import prod
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from paratrain.data.augment import Rescale
from paratrain.data.datasets import DataSpec, Splits, data_dir
from paratrain.data.download import Remote, ensure_files
from paratrain.data.sharding import TransformedTensors
from paratrain.errors import ConfigError

if TYPE_CHECKING:
    from paratrain.config import TrainConfig

IMAGES_MAGIC = 0x00000803
LABELS_MAGIC = 0x00000801

FASHION_MNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
# The publisher's location (github.com/zalandoresearch/fashion-mnist), then the copy
# Keras downloads from; the SHA-256 sums are those of the published files.
_SOURCES = (
    "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
    "https://storage.googleapis.com/tensorflow/tf-keras-datasets/",
)
FASHION_MNIST_FILES = {
    "train-images-idx3-ubyte": ("3aede38d61863908ad78613f6a32ed271626dd12800ba2636569512369268a84", 26421880),
    "train-labels-idx1-ubyte": ("a04f17134ac03560a47e3764e11b92fc97de4d1bfaf8ba1a3aa29af54cc90845", 29515),
    "t10k-images-idx3-ubyte": ("346e55b948d973a97e58d2351dde16a484bd415d4595297633bb08f03db6a073", 4422102),
    "t10k-labels-idx1-ubyte": ("67da17c76eaffca5446c3361aaab5c3cd6d1c2608764d35dfb1850b086bf8dd5", 5148),
}
FASHION_MNIST_REMOTES = tuple(
    Remote(f"{name}.gz", tuple(base + f"{name}.gz" for base in _SOURCES), sha256, size)
    for name, (sha256, size) in FASHION_MNIST_FILES.items()
)


def read_bytes(path: Path) -> bytes:
    """The file's bytes, gunzipped when they are gzip (whatever the file's name)."""
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise ConfigError(f"{path}: cannot read ({error.strerror})") from None
    if raw[:2] != b"\x1f\x8b":
        return raw
    try:
        return gzip.decompress(raw)
    except EOFError:
        raise ConfigError(f"{path}: the gzip stream is truncated (an interrupted download?)") from None
    except (OSError, zlib.error) as error:
        raise ConfigError(f"{path}: corrupt gzip data ({error})") from None


def read_idx(path: Path, magic: int, what: str) -> np.ndarray:
    """The uint8 array in IDX file ``path``, whose magic number must be ``magic``."""
    data = read_bytes(path)
    if len(data) < 4:
        raise ConfigError(f"{path}: {len(data)} bytes, too short for an IDX header ({what})")
    found = int.from_bytes(data[:4], "big")
    if found != magic:
        raise ConfigError(f"{path}: magic number {found}, expected {magic} (IDX {what})")
    rank = magic & 0xFF
    header = 4 + 4 * rank
    if len(data) < header:
        raise ConfigError(f"{path}: {len(data)} bytes, too short for the {header}-byte IDX header")
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(rank))
    needed = prod(shape)
    body = len(data) - header
    if body != needed:
        dims = "x".join(map(str, shape))
        problem = "truncated" if body < needed else f"{body - needed} bytes too long"
        raise ConfigError(
            f"{path}: {problem}: the header promises {dims} = {needed} bytes of {what}, the file has {body}"
        )
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(shape)


def find_file(directory: Path, name: str) -> Path | None:
    """``name`` or ``name.gz`` in ``directory`` (plain first: it needs no decompression)."""
    for candidate in (directory / name, directory / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    return None


def read_split(directory: Path, prefix: str, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(images (N, 1, H, W) uint8, labels (N,) int64)`` of ``prefix`` (``train``, ``t10k``)."""
    image_path = find_file(directory, f"{prefix}-images-idx3-ubyte")
    label_path = find_file(directory, f"{prefix}-labels-idx1-ubyte")
    assert image_path is not None and label_path is not None  # load_fashion_mnist checked
    images = read_idx(image_path, IMAGES_MAGIC, "images")
    labels = read_idx(label_path, LABELS_MAGIC, "labels")
    if len(images) != len(labels):
        raise ConfigError(f"{image_path} has {len(images)} images but {label_path} has {len(labels)} labels")
    if len(labels) == 0:
        raise ConfigError(f"{label_path}: no examples")
    if labels.max() >= num_classes:
        at = int(np.argmax(labels >= num_classes))
        raise ConfigError(f"{label_path}: label {labels[at]} at index {at}, expected 0..{num_classes - 1}")
    return torch.from_numpy(images.copy()).unsqueeze(1), torch.from_numpy(labels.astype(np.int64))


def load_fashion_mnist(config: TrainConfig | None = None) -> Splits:
    """Zalando's Fashion-MNIST: 60,000 + 10,000 grey 28x28 images of 10 kinds of clothing.

    Stored as uint8 (47 MB instead of 188 MB as float32); every batch is scaled to
    0..1 as it is read, as the Keras recipe does with ``x / 255.0``.
    """
    directory = data_dir(config, "fashion-mnist")
    ensure_files(
        directory,
        lambda: [r for r in FASHION_MNIST_REMOTES if find_file(directory, r.name.removesuffix(".gz")) is None],
        dataset="fashion-mnist",
        expected="these IDX files (gzip or plain)",
        allowed=config.download if config is not None else True,
    )
    train_x, train_y = read_split(directory, "train", len(FASHION_MNIST_CLASSES))
    test_x, test_y = read_split(directory, "t10k", len(FASHION_MNIST_CLASSES))
    if train_x.shape[1:] != test_x.shape[1:]:
        raise ConfigError(
            f"{directory}: training images are {tuple(train_x.shape[2:])}, test images {tuple(test_x.shape[2:])}"
        )
    scale = Rescale(255.0)
    return Splits(
        train=TransformedTensors(train_x, train_y, scale),
        test=TransformedTensors(test_x, test_y, scale),
        spec=DataSpec(input_shape=tuple(train_x.shape[1:]), num_classes=len(FASHION_MNIST_CLASSES)),
        classes=FASHION_MNIST_CLASSES,
    )
