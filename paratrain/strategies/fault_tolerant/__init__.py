"""``allreduce-ft`` and ``pipeline-ft``: the strategy (strategy.py) and its options (config.py)."""
