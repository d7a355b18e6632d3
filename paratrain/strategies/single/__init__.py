"""``single``: one process, one device (strategy.py); the reference every other mode is tested against."""
