"""``fsdp``: the strategy (strategy.py) and its options (config.py)."""
