"""Checkpoints below the strategies: the folder of checkpoints on disk (``store.py``), what
a checkpoint must match to be resumed (``signature.py``) and what every process's state
writer shares (``files.py``). The loop's ``Checkpoint`` callback (train/checkpoint.py)
asks the strategy for the writer of its process's role; the parameter server's writers
live in its folder (strategies/ps/checkpoint.py)."""
