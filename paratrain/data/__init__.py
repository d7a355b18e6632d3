"""Data sets (datasets.py and one file per format), their per-replica sharding
(sharding.py) and batches of any structure (batch.py)."""
