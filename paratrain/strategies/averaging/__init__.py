"""``local-sgd`` and ``diloco``: the strategy (strategy.py) and its options (config.py)."""
