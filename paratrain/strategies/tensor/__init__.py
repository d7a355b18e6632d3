"""``tensor``: tensor parallelism, each layer split over processes (strategy.py)."""
