"""Per-replica batches: each replica reads its own disjoint slice of every global batch.

Epoch ``e``'s order is one permutation drawn from ``seed + e``; global batch ``s`` is
``perm[s*B*R : (s+1)*B*R]`` for ``R`` replicas of batch ``B``, and replica ``r`` reads its ``r``-th block of
``B``. The replicas' union at step ``s`` is what one process with batch ``B*R`` reads, which makes synchronous
data parallelism equal to the single-device run (tests/distributed/test_allreduce_equivalence.py).
In-memory tensors are indexed directly; other map-style Datasets go through a DataLoader with the same
indices. Data that cannot be indexed is a stream: replica ``r`` takes batches ``r, r+R, ...``, each the same
count in training (``len()`` needed), the last round split in evaluation (``data/streams.py``). A
``batch_transform`` is seeded by (seed, epoch, rank, batch), so runs are reproducible; a background thread
prefetches batches that need work and ``wait_seconds`` counts the wait left. docs/data.md has more.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from paratrain.data.batch import as_pair, to_device
from paratrain.data.streams import batches_at, evaluation_batches, evaluation_count
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


def _is_array(value: object) -> bool:
    return torch.is_tensor(value) or isinstance(value, np.ndarray)


def is_map_style(data: object) -> bool:
    """Whether ``data`` can be indexed by example (``len`` and ``[i]``), like a map-style
    Dataset: a torch Dataset with a length, or any other object with both (a Hugging Face
    ``datasets.Dataset``). A list or tuple is a stream of ready batches; a tensor or array
    is not data on its own."""
    if isinstance(data, (torch.utils.data.IterableDataset, list, tuple, str, bytes, Mapping)) or _is_array(data):
        return False
    if isinstance(data, Dataset):
        return hasattr(data, "__len__")
    return hasattr(type(data), "__getitem__") and hasattr(type(data), "__len__")


def _torch_format(data: object) -> object:
    """A Hugging Face ``datasets.Dataset`` with no output format gives Python lists: its
    columns as tensors instead (``with_format("torch")``), which the default collate stacks."""
    with_format, form = getattr(data, "with_format", None), getattr(data, "format", None)
    if callable(with_format) and isinstance(form, Mapping) and form.get("type") is None:
        return with_format("torch")
    return data


def as_source(data: object) -> tuple[object, Callable[[list[Any]], Any] | None, int]:
    """What to read from: a map-style Dataset (an ``(inputs, targets)`` pair of tensors or
    NumPy arrays becomes a TensorDataset), or an iterable of batches; with the
    ``collate_fn`` and ``num_workers`` of a DataLoader given as the data."""
    if isinstance(data, DataLoader):
        if is_map_style(data.dataset):
            return data.dataset, data.collate_fn, data.num_workers
        return data, None, 0  # a loader over a stream: its batches, as it makes them
    if is_map_style(data):
        return _torch_format(data), None, 0
    if isinstance(data, (tuple, list)) and len(data) == 2 and all(_is_array(a) for a in data):
        inputs, targets = (torch.as_tensor(np.asarray(a)) if not torch.is_tensor(a) else a for a in data)
        if len(inputs) != len(targets):
            raise ConfigError(f"inputs have {len(inputs)} examples but targets have {len(targets)}")
        return TensorDataset(inputs, targets), None, 0
    if isinstance(data, Iterable) and not isinstance(data, (str, bytes, Iterator)):
        return data, None, 0
    raise ConfigError(
        f"data must be a map-style Dataset, an (inputs, targets) pair of tensors, a DataLoader, "
        f"or a re-iterable of (inputs, targets) batches (a list, an IterableDataset), got {type(data).__name__}"
    )


def as_tensor_dataset(data: object) -> object:
    """The map-style Dataset (or the stream of batches) ``data`` reads from."""
    return as_source(data)[0]


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
        self.dataset, self.collate_fn, loader_workers = as_source(dataset)
        self.streaming = not is_map_style(self.dataset)
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
        self.num_workers = num_workers or loader_workers
        self.epoch = 0
        self.start = 0
        self._indices_on = torch.device("cpu")
        self.num_examples = self._stream_length() if self.streaming else len(self.dataset)
        if drop_last and len(self) == 0 and self.streaming:
            if self.num_examples is not None:  # without len(), one replica reads it to its end
                raise ConfigError(
                    f"the training data ({type(self.dataset).__name__}) has {self.num_examples} batches, "
                    f"fewer than the {num_replicas} replicas that each need one per step"
                )
        elif drop_last and len(self) == 0:
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

    def _stream_length(self) -> int | None:
        """Batches in the stream, or None where it has no ``len()``."""
        try:
            return len(self.dataset)  # type: ignore[arg-type]
        except TypeError:
            if self.drop_last and self.num_replicas > 1:
                raise ConfigError(
                    f"the training data ({type(self.dataset).__name__}) has no len(): with {self.num_replicas} "
                    "replicas each must take the same number of steps; give it __len__ (batches per epoch) "
                    "or pass a map-style Dataset"
                ) from None
            return None

    def __len__(self) -> int:
        n = self.num_examples
        b = self.batch_size
        r = self.num_replicas
        if self.streaming:  # batches of the stream; 0 where it has no len()
            return 0 if n is None else (n // r if self.drop_last else evaluation_count(n, r))
        if self.drop_last:
            return n // (b * r)
        return self._evaluation_batches()

    def stream_numbers(self) -> range:
        """The stream's batches this replica takes this epoch, by their place in the stream."""
        total = self.num_examples if self.num_examples is not None else 1 << 62
        r = self.num_replicas
        end = total // r * r if self.drop_last else total
        return range(self.rank, end, r)

    def batch_indices(self) -> list[torch.Tensor]:
        """This replica's index lists for the current epoch, one per step."""
        n = self.num_examples
        b = self.batch_size
        r = self.num_replicas
        if self.drop_last:
            order = self._order()
            steps = n // (b * r)
            return [order[s * b * r + self.rank * b : s * b * r + (self.rank + 1) * b] for s in range(steps)]
        # Evaluation: contiguous, nearly equal blocks per replica, every example once, each
        # block in as many batches as the largest needs (fsdp's shards all-gather in every
        # forward: each must take as many as the others; a replica whose block is empty, with
        # fewer examples than replicas, takes empty batches, which evaluation counts nothing of).
        block = torch.tensor_split(self._order(), r)[self.rank]
        return list(torch.tensor_split(block, self._evaluation_batches()))

    def _evaluation_batches(self) -> int:
        """Batches of each replica's block in evaluation: the largest block's, in ``batch_size``."""
        largest = -(-self.num_examples // self.num_replicas)
        return -(-largest // self.batch_size)

    def numbered_batches(self) -> Iterator[tuple[int, torch.Tensor]]:
        """``(batch number, indices)`` of this epoch's batches from ``start`` on (for a
        stream: ``(place in the stream, None)``)."""
        if self.streaming:
            return ((k, None) for k in itertools.islice(self.stream_numbers(), self.start, None))
        return itertools.islice(enumerate(self.batch_indices()), self.start, None)

    def _order(self) -> torch.Tensor:
        """This epoch's order of the examples, where the data set's tensors are (on a GPU: one
        copy of the whole order per epoch, not one of each step's indices)."""
        if not self.shuffle:
            order = torch.arange(self.num_examples, device="cpu")
        else:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_examples, generator=generator, device="cpu")
        return to_device(order, self._indices_on, non_blocking=True)

    def transform_generator(self, batch: int) -> torch.Generator:
        """The generator of one batch's random transforms, seeded by (seed, epoch, rank,
        batch): a run that resumes mid-epoch draws exactly what it would have drawn."""
        return _seeded(self.seed, self.epoch, self.rank, batch)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        tensors = isinstance(self.dataset, TensorDataset) and self.collate_fn is None
        if tensors and not self.streaming:
            self._place_tensors()
        indices = self.numbered_batches()
        if self.streaming:
            batches = self._stream_batches(indices)
        else:
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
        # Indices and batches cross to a GPU without waiting for the steps queued before them
        # (a blocking copy would hold the host until the GPU drains, every step).
        for number, idx in indices:
            idx = to_device(idx, inputs.device, non_blocking=True)
            batch = inputs.index_select(0, idx)
            if self.transform is not None:
                batch = self.transform(batch, self.transform_generator(number))
            yield to_device(batch, self.device, True), to_device(targets.index_select(0, idx), self.device, True)

    def _place_tensors(self) -> None:
        """Move an in-memory data set to the device once instead of every batch (stored
        compactly, uint8, it is a quarter of its float size), where it fits; the epochs'
        index orders are then made there too."""
        inputs, targets = self.dataset.tensors[:2]
        if inputs.device != self.device and fits_on(self.device, inputs, targets):
            inputs, targets = inputs.to(self.device), targets.to(self.device)
            self.dataset = TensorDataset(inputs, targets)
        self._indices_on = inputs.device

    def _loader_batches(self, indices: Iterator[tuple[int, torch.Tensor]]) -> Iterator[tuple[Any, Any]]:
        # Lazily: a parameter-server worker's next batch number comes with the reply to its
        # last push, so the index lists cannot be drawn up front. DataLoader workers read
        # ahead from the lazy sampler; without workers each batch is read when it is due.
        numbers: queue.SimpleQueue[int] = queue.SimpleQueue()

        def sampler() -> Iterator[list[int]]:
            for number, idx in indices:
                numbers.put(number)
                yield idx.tolist()

        loader = DataLoader(
            self.dataset,
            batch_sampler=_LazySampler(sampler),
            num_workers=self.num_workers,
            collate_fn=self.collate_fn,
            pin_memory=self.device.type == "cuda",
            # A loader draws its workers' base seed as it starts, from the process's global
            # generator unless given one: the draw would move the generator a model's dropout
            # uses, one more time in a run resumed mid-epoch or at an epoch's end than in the
            # run never stopped, so the resumed run would not go on exactly.
            generator=_seeded(self.seed, self.epoch, self.rank, self.start, LOADER_SEED),
        )
        for item in loader:
            inputs, targets = as_pair(item, f"{type(self.dataset).__name__} (collated)")
            if self.transform is not None:
                inputs = self.transform(inputs, self.transform_generator(numbers.get()))
            yield to_device(inputs, self.device, True), to_device(targets, self.device, True)

    def _split_stream(self) -> bool:
        """Whether this stream's batches are for evaluation over replicas (data/streams.py)."""
        return not self.drop_last and self.num_replicas > 1

    def _stream_batches(self, numbered: Iterator[tuple[int, None]]) -> Iterator[tuple[Any, Any]]:
        where = f"{type(self.dataset).__name__} (a batch)"
        if self._split_stream():
            pairs = evaluation_batches(self.dataset, self.rank, self.num_replicas, where)  # type: ignore[arg-type]
        else:
            pairs = batches_at(self.dataset, (place for place, _ in numbered), where)  # type: ignore[arg-type]
        return ((to_device(x, self.device, True), to_device(y, self.device, True)) for x, y in pairs)


#: The fifth word of a loader's seed (``_seeded``): a transform's has four.
LOADER_SEED = 2**32 - 1


def _seeded(*words: int) -> torch.Generator:
    """A generator seeded by ``words`` through NumPy's SeedSequence (which takes no negative
    word: a negative seed counts as its two's complement)."""
    state = np.random.SeedSequence([w if w >= 0 else w % 2**64 for w in words]).generate_state(2)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


class _LazySampler:
    """A batch sampler drawn from a generator as the DataLoader asks (no length up front)."""

    def __init__(self, make: Callable[[], Iterator[list[int]]]):
        self.make = make

    def __iter__(self) -> Iterator[list[int]]:
        return self.make()


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


_END = object()


def fits_on(device: torch.device, *tensors: torch.Tensor) -> bool:
    """Whether ``tensors`` take at most a quarter of ``device``'s free memory (always on the
    CPU): a data set larger than that is gathered in host memory a batch at a time."""
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return sum(t.numel() * t.element_size() for t in tensors) <= free // 4


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
