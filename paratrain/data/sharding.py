"""Per-replica batches: each replica reads its own disjoint slice of every global batch.

Training order for epoch ``e`` is one permutation drawn from ``seed + e``. Global batch
``s`` is ``perm[s*B*R : (s+1)*B*R]`` for ``R`` replicas of batch ``B``, and replica ``r``
reads the ``r``-th block of ``B`` examples in it. So the union of the replicas' batches
at step ``s`` is exactly the batch a single process with batch ``B*R`` reads at step
``s``: this is what makes synchronous data parallelism equal to the single-device run
(tests/distributed/test_allreduce_equivalence.py).

In-memory tensor data sets are indexed directly (no per-example collation); any other
map-style Dataset goes through a DataLoader with the same index lists.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from paratrain.errors import ConfigError


def as_tensor_dataset(data: object) -> Dataset:
    """Accept a Dataset, or an ``(inputs, targets)`` pair of tensors or NumPy arrays."""
    if isinstance(data, Dataset):
        return data
    if isinstance(data, (tuple, list)) and len(data) == 2:
        inputs, targets = (torch.as_tensor(np.asarray(a)) if not torch.is_tensor(a) else a for a in data)
        if len(inputs) != len(targets):
            raise ConfigError(f"inputs have {len(inputs)} examples but targets have {len(targets)}")
        return TensorDataset(inputs, targets)
    raise ConfigError(
        f"data must be a torch Dataset or an (inputs, targets) pair, got {type(data).__name__}"
    )


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
    ):
        self.dataset = as_tensor_dataset(dataset)
        self.batch_size = batch_size
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.seed = seed
        self.device = torch.device(device)
        self.num_workers = num_workers
        self.epoch = 0
        self.num_examples = len(self.dataset)
        if drop_last and len(self) == 0:
            raise ConfigError(
                f"the global batch ({batch_size} x {num_replicas} replicas = "
                f"{batch_size * num_replicas}) is larger than the data set "
                f"({self.num_examples} examples); lower --batch-size or --workers"
            )

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

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

    def _order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_examples)
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_examples, generator=generator)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        indices = self.batch_indices()
        if isinstance(self.dataset, TensorDataset):
            return self._tensor_batches(indices)
        return self._loader_batches(indices)

    def _tensor_batches(self, indices: Sequence[torch.Tensor]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        inputs, targets = self.dataset.tensors[:2]
        if inputs.device != self.device:
            # Move the whole (in-memory) data set once instead of every batch.
            inputs, targets = inputs.to(self.device), targets.to(self.device)
            self.dataset = TensorDataset(inputs, targets)
        for idx in indices:
            idx = idx.to(self.device)
            yield inputs.index_select(0, idx), targets.index_select(0, idx)

    def _loader_batches(self, indices: Sequence[torch.Tensor]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        loader = DataLoader(
            self.dataset,
            batch_sampler=[idx.tolist() for idx in indices],
            num_workers=self.num_workers,
            pin_memory=self.device.type == "cuda",
        )
        for inputs, targets in loader:
            yield inputs.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True)
