"""Helpers to test distributed code on the CPU: N Gloo processes on loopback.

    def check(k):                       # module level, so spawned processes can import it
        strategy = paratrain.AllReduceStrategy(device="cpu")
        ...
        return result

    results = run_distributed(check, 5, world_size=2)   # [rank 0's result, rank 1's result]

The processes start through the same launcher as ``paratrain train --workers N``; a failure in any raises
WorkerFailed instead of hanging the test. ``run_processes``/``alive`` find a run's processes (to kill one from
outside); ``write_fashion_mnist``, ``write_cifar10`` and ``write_text_folders`` write small data sets in the
real formats, so tests and examples need no download.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from paratrain.launch.local import launch
from paratrain.proc_stat import started, stat_fields

if TYPE_CHECKING:
    import numpy as np


def run_distributed(fn: Callable[..., Any], *args: Any, world_size: int = 2) -> list[Any]:
    """``fn(*args)`` on ``world_size`` processes; their results by rank."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return launch(fn, *args, num_processes=world_size)


def descendants(root: int) -> list[int]:
    """Every process under ``root`` (from /proc), oldest first."""
    children: dict[int, list[int]] = {}
    started: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = stat_fields(int(entry.name))
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(entry.name))
            started[int(entry.name)] = int(fields[19])
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return sorted(found, key=lambda pid: (started[pid], pid))


def run_processes(root: int) -> list[int]:
    """The processes of the run under launcher ``root``, oldest first: its descendants less
    multiprocessing's helpers (its resource tracker and fork server, the launcher's own
    children; the run's processes are forked from the latter and share its command line)."""
    try:
        launcher = Path(f"/proc/{root}/cmdline").read_bytes()
    except OSError:
        return []
    return [pid for pid in descendants(root) if not _is_helper(pid, root, launcher)]


def _is_helper(pid: int, root: int, launcher: bytes) -> bool:
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
        parent = int(stat_fields(pid)[1])
    except OSError:
        return True
    # A child still showing the launcher's own command line is a helper between its fork
    # and its exec (the fork server starting): it is no process of the run, and a moment
    # later it no longer looks like one.
    return parent == root and (b"resource_tracker" in command or b"forkserver" in command or command == launcher)


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (dead, its exit not yet collected)."""
    return started(pid) is not None


def flat_parameters(module: torch.nn.Module) -> torch.Tensor:
    """All parameters of ``module`` as one detached CPU vector (to compare runs); a sharded
    parameter (fsdp's DTensor) is gathered whole, so every process must call it."""
    return torch.cat([_whole(p.detach()).cpu().reshape(-1) for p in module.parameters()])


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` in the 2-norm."""
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ----- small data sets in the real file formats ------------------------------------------
# Each class gets its own pattern plus noise, so that a few epochs learn something.


def write_idx(path: str | os.PathLike, array: np.ndarray, compress: bool = True) -> Path:
    """``array`` (uint8) as an IDX file: magic ``0x08 << 8 | ndim``, big-endian sizes, data."""
    import gzip

    import numpy as np

    array = np.ascontiguousarray(array, dtype=np.uint8)
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(n).to_bytes(4, "big") for n in array.shape)
    data = header + array.tobytes()
    path = Path(path)
    path.write_bytes(gzip.compress(data) if compress else data)
    return path


def _class_images(num: int, shape: tuple[int, ...], num_classes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    import numpy as np

    rng = np.random.default_rng(seed)
    templates = np.random.default_rng(1234).integers(0, 256, size=(num_classes, *shape))
    labels = np.arange(num) % num_classes
    rng.shuffle(labels)
    noise = rng.integers(-40, 41, size=(num, *shape))
    images = np.clip(templates[labels] + noise, 0, 255).astype(np.uint8)
    return images, labels.astype(np.uint8)


def write_fashion_mnist(
    directory: str | os.PathLike, num_train: int = 200, num_test: int = 100, compress: bool = True, seed: int = 0
) -> Path:
    """The four Fashion-MNIST IDX files (28x28, 10 classes) with ``num_train``/``num_test`` images."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    suffix = ".gz" if compress else ""
    for prefix, num, offset in (("train", num_train, 0), ("t10k", num_test, 1)):
        images, labels = _class_images(num, (28, 28), 10, seed + offset)
        write_idx(directory / f"{prefix}-images-idx3-ubyte{suffix}", images, compress)
        write_idx(directory / f"{prefix}-labels-idx1-ubyte{suffix}", labels, compress)
    return directory


def write_cifar10(directory: str | os.PathLike, per_batch: int = 40, num_test: int = 40, seed: int = 0) -> Path:
    """``directory/cifar-10-batches-bin`` with five training files of ``per_batch`` records
    and a test file of ``num_test``, in the binary version's 3073-byte records."""
    import numpy as np

    folder = Path(directory) / "cifar-10-batches-bin"
    folder.mkdir(parents=True, exist_ok=True)
    names = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]
    for i, name in enumerate(names):
        images, labels = _class_images(num_test if name == "test_batch.bin" else per_batch, (3, 32, 32), 10, seed + i)
        records = np.concatenate([labels[:, None], images.reshape(len(images), -1)], axis=1)
        (folder / name).write_bytes(records.astype(np.uint8).tobytes())
    return folder


POSITIVE_WORDS = ("good", "great", "excellent", "wonderful", "fun", "loved")
NEGATIVE_WORDS = ("bad", "awful", "boring", "terrible", "poor", "hated")
FILLER_WORDS = ("the", "movie", "film", "was", "a", "and", "plot", "actors", "it's", "i", "story", "scene")


def write_text_folders(
    directory: str | os.PathLike,
    docs_per_class: int = 30,
    num_test: int = 10,
    classes: tuple[str, ...] = ("neg", "pos"),
    seed: int = 0,
) -> Path:
    """``directory/{train,test}/<class>/N.txt`` in the IMDB layout, with HTML line breaks."""
    import random

    rng = random.Random(seed)
    cue = {name: (NEGATIVE_WORDS, POSITIVE_WORDS)[i % 2] for i, name in enumerate(classes)}
    root = Path(directory)
    for split, count in (("train", docs_per_class), ("test", num_test)):
        for name in classes:
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for n in range(count):
                words = [rng.choice(FILLER_WORDS) for _ in range(rng.randint(5, 30))]
                for _ in range(3):
                    words.insert(rng.randrange(len(words) + 1), rng.choice(cue[name]))
                text = " ".join(words).capitalize() + ".<br /><br />" + rng.choice(FILLER_WORDS).upper() + "!"
                (folder / f"{n}_{rng.randint(1, 10)}.txt").write_text(text, encoding="utf-8")
    return root
