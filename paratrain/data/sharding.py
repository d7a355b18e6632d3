"""Per-replica batches: each replica reads its own disjoint slice of every global batch.

Training order for epoch ``e`` is one permutation drawn from ``seed + e``. Global batch
``s`` is ``perm[s*B*R : (s+1)*B*R]`` for ``R`` replicas of batch ``B``, and replica ``r``
reads the ``r``-th block of ``B`` examples in it. So the union of the replicas' batches
at step ``s`` is exactly the batch a single process with batch ``B*R`` reads at step
``s``: this is what makes synchronous data parallelism equal to the single-device run
(tests/distributed/test_allreduce_equivalence.py).

In-memory tensor data sets are indexed directly (no per-example collation); any other
map-style Dataset goes through a DataLoader with the same index lists.

A data set may store its examples compactly (uint8 pixels) and carry a per-batch
``batch_transform`` that turns a batch of stored inputs into model inputs: scaling,
or the random distortions of the CIFAR-10 recipe (``paratrain/data/augment.py``). The
transform draws its randomness from a generator seeded by (seed, epoch, rank, batch), so a
run is reproducible. When a batch needs such work, or comes through a DataLoader, a
background thread prepares the next batches while the step runs (``prefetch``), and
``wait_seconds`` counts the time the consumer spent waiting for a batch anyway.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from paratrain.errors import ConfigError

BatchTransform = Callable[[torch.Tensor, torch.Generator], torch.Tensor]
"""``transform(stored_inputs, generator) -> model_inputs`` for one batch; random
transforms draw from ``generator`` (on the CPU) and nothing else."""


class TransformedTensors(TensorDataset):
    """In-memory ``(inputs, targets)`` whose batches pass through ``batch_transform``.

    Indexing gives the stored examples; ShardedBatches (and so ``Trainer.fit``,
    ``evaluate`` and ``predict``) applies the transform to every batch it reads.
    """

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor, batch_transform: BatchTransform):
        super().__init__(inputs, targets)
        self.batch_transform = batch_transform


def as_tensor_dataset(data: object) -> Dataset:
    """Accept a Dataset, or an ``(inputs, targets)`` pair of tensors or NumPy arrays."""
    if isinstance(data, Dataset):
        return data
    if isinstance(data, (tuple, list)) and len(data) == 2:
        inputs, targets = (torch.as_tensor(np.asarray(a)) if not torch.is_tensor(a) else a for a in data)
        if len(inputs) != len(targets):
            raise ConfigError(f"inputs have {len(inputs)} examples but targets have {len(targets)}")
        return TensorDataset(inputs, targets)
    raise ConfigError(f"data must be a torch Dataset or an (inputs, targets) pair, got {type(data).__name__}")


class ShardedBatches:
    """Iterable of ``(inputs, targets)`` batches for one replica, on its device."""

    def __init__(
        self,
        dataset: object,
        batch_size: int,
        *,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
        seed: int = 0,
        device: torch.device | str = "cpu",
        num_workers: int = 0,
        transform: BatchTransform | None = None,
        prefetch: int = 2,
    ):
        self.dataset = as_tensor_dataset(dataset)
        self.transform = transform if transform is not None else getattr(self.dataset, "batch_transform", None)
        self.prefetch = prefetch
        self.wait_seconds = 0.0
        """Seconds spent waiting for batches of this object, over all its iterations."""
        self.batch_size = batch_size
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.seed = seed
        self.device = torch.device(device)
        self.num_workers = num_workers
        self.epoch = 0
        self.start = 0
        self.num_examples = len(self.dataset)
        if drop_last and len(self) == 0:
            raise ConfigError(
                f"the global batch ({batch_size} x {num_replicas} replicas = "
                f"{batch_size * num_replicas}) is larger than the data set "
                f"({self.num_examples} examples); lower --batch-size or --workers"
            )

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Iterate epoch ``epoch``'s batches from batch ``start`` on (a resumed run skips
        those it trained on before its checkpoint)."""
        self.epoch = epoch
        self.start = start

    def __len__(self) -> int:
        return len(self.batch_indices())

    def batch_indices(self) -> list[torch.Tensor]:
        """This replica's index lists for the current epoch, one per step."""
        n, b, r = self.num_examples, self.batch_size, self.num_replicas
        if self.drop_last:
            order = self._order()
            steps = n // (b * r)
            return [order[s * b * r + self.rank * b : s * b * r + (self.rank + 1) * b] for s in range(steps)]
        # Evaluation: contiguous, nearly equal blocks per replica, every example once.
        block = torch.tensor_split(self._order(), r)[self.rank]
        return list(torch.split(block, b)) if len(block) else []

    def numbered_batches(self) -> Iterator[tuple[int, torch.Tensor]]:
        """``(batch number, indices)`` of this epoch's batches from ``start`` on."""
        return itertools.islice(enumerate(self.batch_indices()), self.start, None)

    def _order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_examples)
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_examples, generator=generator)

    def transform_generator(self, batch: int) -> torch.Generator:
        """The generator of one batch's random transforms, seeded by (seed, epoch, rank,
        batch): a run that resumes mid-epoch draws exactly what it would have drawn."""
        state = np.random.SeedSequence([self.seed, self.epoch, self.rank, batch]).generate_state(2)
        return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        indices = self.numbered_batches()
        tensors = isinstance(self.dataset, TensorDataset)
        batches = self._tensor_batches(indices) if tensors else self._loader_batches(indices)
        # Plain in-memory tensors are one index_select away from a batch: a thread would
        # only add a hand-off, which cost digits a fifth to a third of its throughput
        # (benchmarks/input_pipeline.py, docs/data.md).
        if self.prefetch > 0 and (self.transform is not None or not tensors):
            batches = prefetched(batches, self.prefetch)
        return self._timed(batches)

    def _timed(self, batches: Iterator[Any]) -> Iterator[Any]:
        while True:
            start = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                return
            finally:
                self.wait_seconds += time.perf_counter() - start
            yield batch

    def _tensor_batches(
        self, indices: Iterable[tuple[int, torch.Tensor]]
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        inputs, targets = self.dataset.tensors[:2]
        if inputs.device != self.device:
            # Move the whole (in-memory) data set once instead of every batch; stored
            # compactly (uint8) it is a quarter of its float size.
            inputs, targets = inputs.to(self.device), targets.to(self.device)
            self.dataset = TensorDataset(inputs, targets)
        for number, idx in indices:
            idx = idx.to(self.device)
            batch = inputs.index_select(0, idx)
            if self.transform is not None:
                batch = self.transform(batch, self.transform_generator(number))
            yield batch, targets.index_select(0, idx)

    def _loader_batches(
        self, indices: Iterable[tuple[int, torch.Tensor]]
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        numbered = list(indices)
        loader = DataLoader(
            self.dataset,
            batch_sampler=[idx.tolist() for _, idx in numbered],
            num_workers=self.num_workers,
            pin_memory=self.device.type == "cuda",
        )
        for (number, _), (inputs, targets) in zip(numbered, loader):
            if self.transform is not None:
                inputs = self.transform(inputs, self.transform_generator(number))
            yield inputs.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True)


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


_END = object()


def prefetched(items: Iterator[Any], depth: int = 2) -> Iterator[Any]:
    """``items``, produced by a background thread up to ``depth`` ahead of the consumer.

    PyTorch kernels release the GIL, so indexing and transforming the next batch runs
    while the training step computes. An error in the producer is raised in the
    consumer; a consumer that stops early stops the producer.
    """
    ready: queue.Queue[Any] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put(item):
                    return
            put(_END)
        except BaseException as error:  # handed to the consumer, which re-raises it
            put(_Failed(error))
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()

    thread = threading.Thread(target=produce, name="paratrain-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item = ready.get()
            if item is _END:
                return
            if isinstance(item, _Failed):
                raise item.error
            yield item
    finally:
        stop.set()
        thread.join()
