"""Embedding tables on the parameter server, split by rows across the shards: the layout
(layout.py), what travels for them (sections.py), a shard's rows and their optimizer
(shard.py, optimizers.py) and a worker's tables that fetch the rows a batch touches
(remote.py)."""
