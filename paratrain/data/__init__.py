"""Data sets and their per-replica sharding."""

from paratrain.data.datasets import DataSpec, Splits, load_dataset
from paratrain.data.sharding import ShardedBatches, as_tensor_dataset

__all__ = ["DataSpec", "Splits", "ShardedBatches", "as_tensor_dataset", "load_dataset"]
