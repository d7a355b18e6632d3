"""CIFAR-10, read from its binary version (``cifar-10-batches-bin``).

Each file is a run of 3073-byte records: one label byte (0..9), then a 32x32 image as
1024 red, 1024 green and 1024 blue bytes, row by row: already the (channels, height,
width) layout PyTorch uses. Five training files of 10,000 records and one test file.
The pickled "python version" of the data set is never read: unpickling a downloaded
file runs whatever code it contains.

The training split distorts every batch as the TensorFlow recipe does (random 24x24
crop, flip, brightness, contrast, standardization); the test split takes the central
crop (``data/augment.py``).
"""

from __future__ import annotations

import tarfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from paratrain.data.augment import CifarCentralCrop, CifarDistortions
from paratrain.data.datasets import DataSpec, Splits, data_dir
from paratrain.data.download import Remote, ensure_files
from paratrain.data.sharding import TransformedTensors
from paratrain.errors import ConfigError

if TYPE_CHECKING:
    from paratrain.config import TrainConfig

CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
IMAGE_SHAPE = (3, 32, 32)
RECORD_BYTES = 1 + 3 * 32 * 32
CROP = (24, 24)
FOLDER = "cifar-10-batches-bin"
TRAIN_FILES = tuple(f"data_batch_{i}.bin" for i in range(1, 6))
TEST_FILES = ("test_batch.bin",)
# www.cs.toronto.edu/~kriz/cifar.html, "CIFAR-10 binary version (suitable for C programs)".
ARCHIVE = Remote(
    "cifar-10-binary.tar.gz",
    ("https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz",),
    "c4a38c50a1bc5f3a1c5537f2155ab9d68f9f25eb1ed8d9ddda3db29a59bca1dd",
    170052171,
)


def read_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """``(images (N, 3, 32, 32) uint8, labels (N,) uint8)`` of one binary batch file."""
    try:
        raw = np.fromfile(path, dtype=np.uint8)
    except OSError as error:
        raise ConfigError(f"{path}: cannot read ({error.strerror})") from None
    if raw.size == 0:
        raise ConfigError(f"{path}: empty, expected {RECORD_BYTES}-byte CIFAR-10 records")
    if raw.size % RECORD_BYTES:
        raise ConfigError(
            f"{path}: {raw.size} bytes is not a multiple of {RECORD_BYTES}-byte records "
            "(truncated, or not the CIFAR-10 binary version)"
        )
    records = raw.reshape(-1, RECORD_BYTES)
    labels = records[:, 0]
    if labels.max() >= len(CIFAR10_CLASSES):
        at = int(np.argmax(labels >= len(CIFAR10_CLASSES)))
        raise ConfigError(
            f"{path}: record {at} has label {labels[at]}, expected 0..9 "
            "(CIFAR-100 files have 3074-byte records with two labels)"
        )
    return records[:, 1:].reshape(-1, *IMAGE_SHAPE), labels


def read_files(directory: Path, names: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [read_batch(directory / name) for name in names]
    images = torch.from_numpy(np.concatenate([p[0] for p in parts]))
    labels = torch.from_numpy(np.concatenate([p[1] for p in parts]).astype(np.int64))
    return images, labels


def batches_dir(root: Path) -> Path:
    """The folder holding the .bin files: ``root/cifar-10-batches-bin`` as the archive
    unpacks, or ``root`` itself."""
    nested = root / FOLDER
    return nested if nested.is_dir() else root


def extract(archive: Path, root: Path) -> None:
    """Unpack the .bin files of the archive into ``root/cifar-10-batches-bin``.

    Only the expected regular files are written, each by name: no path from the
    archive is trusted."""
    wanted = set(TRAIN_FILES + TEST_FILES + ("batches.meta.txt",))
    target = root / FOLDER
    target.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(archive, "r:gz") as tar:
            for member in tar:
                name = Path(member.name).name
                if member.isfile() and name in wanted and Path(member.name).parent.name == FOLDER:
                    source = tar.extractfile(member)
                    assert source is not None
                    tmp = target / (name + ".tmp")
                    tmp.write_bytes(source.read())
                    tmp.replace(target / name)
    except (tarfile.TarError, EOFError, OSError) as error:
        raise ConfigError(f"{archive}: cannot unpack ({error}); delete it and run again") from None


def _partial(root: Path, names: tuple[str, ...]) -> str:
    missing = [n for n in names if not (batches_dir(root) / n).is_file()]
    return f"; {', '.join(missing)} missing from {batches_dir(root)}" if len(missing) < len(names) else ""


def load_cifar10(config: TrainConfig | None = None) -> Splits:
    """CIFAR-10: 50,000 + 10,000 colour 32x32 images of 10 classes; the model sees 24x24."""
    root = data_dir(config, "cifar10")
    names = TRAIN_FILES + TEST_FILES
    archive = root / ARCHIVE.name

    def unpack() -> None:
        extract(archive, root)
        missing = [n for n in names if not (batches_dir(root) / n).is_file()]
        if missing:
            raise ConfigError(f"{archive}: has no {', '.join(missing)}; delete it and run again")
        archive.unlink()  # 170 MB that the .bin files now hold

    ensure_files(
        root,
        lambda: [] if all((batches_dir(root) / n).is_file() for n in names) else [ARCHIVE],
        dataset="cifar10",
        expected=f"{FOLDER}/ with {', '.join(names)} (the binary version, not the python one){_partial(root, names)}",
        allowed=config.download if config is not None else True,
        unpack=unpack,
    )
    directory = batches_dir(root)
    train_x, train_y = read_files(directory, TRAIN_FILES)
    test_x, test_y = read_files(directory, TEST_FILES)
    return Splits(
        train=TransformedTensors(train_x, train_y, CifarDistortions(CROP)),
        test=TransformedTensors(test_x, test_y, CifarCentralCrop(CROP)),
        spec=DataSpec(input_shape=(IMAGE_SHAPE[0], *CROP), num_classes=len(CIFAR10_CLASSES)),
        classes=CIFAR10_CLASSES,
    )
